"""Triton kernels for ``compress_forward`` (offline state, ratio 4 and 128).

Decode (one DecodePlan row per request): ``_decode_kernel``, one program per
(request, channel block). At a chunk boundary it pools the window, then it writes its
slice of the new row into the ring. The window's new row is taken from the input
(rounded to the state dtype), not from the ring: that is what the ring will hold, so
the window's loads need not wait behind the write.

Prefill, pass 1 (pooling, every CompressPlan row):

* ratio 4 (``_pool_c4_kernel``): one program per block of ``BLOCK_E`` consecutive
  plan rows x ``BLOCK_D`` channels (or, where ``C4_STREAM`` sets stages > 0 for the
  head_dim, per several such blocks in a software-pipelined loop; ``C4_LARGE`` may give
  large plans other settings, chosen without a guard under torch.compile). Each of the 8
  window rows is one 2-D tile ``[BLOCK_E, BLOCK_D]`` (contiguous channels of one input or
  state row per event);
  all 16 tiles (kv and score) are loaded before any arithmetic, so a program has all
  of its bytes in flight at once, and the softmax is a two-pass one over registers.
  Consecutive events of one request read consecutive input rows, so a program
  streams a contiguous slab of the input.
* ratio 128 (``_pool_c128_kernel``): a window is 128 rows, and a 16K-token prefill
  has only ~128 events among 16K plan rows (the rest is padding). A grid sized by
  plan rows would be mostly empty programs. So the grid has one program per
  ``C128_ROWS_PER_PROGRAM`` (128) plan rows x channel blocks: program ``g`` owns plan
  rows ``g, g + G, g + 2G, ...`` (about one event each: events are at most one plan row
  in 128 plus one per request, valid rows first); it reads their words in vectors of ``CHUNK``,
  writes zeros for the padding rows among them in one wide store, and pools each of
  its valid events tile by tile (``C128_STREAM_TILE`` rows x channels, an online
  softmax with a running max, ``C128_STREAM_STAGES`` tiles in flight in a
  software-pipelined loop), or, with ``C128_STREAM_STAGES = 0``, with all 128 x
  ``BLOCK_D`` window values in flight (kv, score and ape tiles for the whole window
  loaded before a two-pass softmax).

Prefill, pass 2 (``_write_kernel``, a second launch): copy the WritePlan rows into the
ring, with at most ``WRITE_PROGRAMS`` programs, each owning every ``WRITE_PROGRAMS``-th block of
plan rows and copying only the blocks with a live row. Launch order on the stream keeps every
pass-1 read ahead of every pass-2 write.

All pooling is fp32: ``out = sum_w exp(s_w - m) v_w / sum_w exp(s_w - m)`` per channel.
Rows that produce no compressed token are written as zeros.
"""

from __future__ import annotations

import torch

from .._layout import coff
from .._triton import HAVE_TRITON, at_least, cdiv, interpreting, launch, next_pow2

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .._triton_formats import cast_rne

    # ------------------------------------------------------------------ plan decoding
    @triton.jit
    def _compress_plan_fields(words, in_plan):
        """Fields of CompressPlan rows from their ``[N, 4]`` int32 words (loaded by the kernel body, where
        the index loads of a kernel must be, see ``decode_step.kernels``):
        (word0, seq_len int64, ragged, buffer_len, page0, page1); rows off ``in_plan`` read as padding."""
        even, odd = tl.split(tl.reshape(words, [words.shape[0], 2, 2]))
        word0, page0 = tl.split(even)
        word1, page1 = tl.split(odd)
        word0 = tl.where(in_plan, word0, -1)
        word1 = tl.where(in_plan, word1, 0)
        seq_len = word0.to(tl.int64) & 0xFFFFFFFF
        ragged = (word1 & 0xFFFF).to(tl.int64)
        buffer_len = ((word1 >> 16) & 0xFFFF).to(tl.int64)
        page0 = tl.where(in_plan, page0, -1).to(tl.int64)
        page1 = tl.where(in_plan, page1, -1).to(tl.int64)
        return word0, seq_len, ragged, buffer_len, page0, page1

    @triton.jit
    def _c4_event_valid(word0, seq_len, ragged, buffer_len, page0, page1, num_state_rows, num_inputs):
        """A ratio-4 CompressPlan row is pooled only if every window row it needs is in range.

        Window rows ``w < buffer_len`` come from the ring (page0 slots for w < 4, page1 slots
        for w >= 4), the others from input rows ``ragged - 7 + w``; rows 0..3 do not exist
        for the first chunk (``seq_len <= 4``).
        """
        has_overlap = seq_len > 4
        valid = (word0 != -1) & (seq_len >= 4) & (buffer_len <= 8)
        from_page0 = tl.minimum(buffer_len, 4)
        valid &= ~(has_overlap & (buffer_len > 0)) | ((page0 >= 0) & (page0 * 4 + from_page0 - 1 < num_state_rows))
        valid &= (buffer_len <= 4) | ((page1 >= 0) & (page1 * 4 + buffer_len - 5 < num_state_rows))
        first_input = tl.maximum(buffer_len, tl.where(has_overlap, 0, 4))
        valid &= (first_input >= 8) | ((ragged - 7 + first_input >= 0) & (ragged < num_inputs))
        return valid, has_overlap

    @triton.jit
    def _c128_event_valid(word0, seq_len, ragged, buffer_len, page1, num_state_rows, num_inputs):
        """Ratio 128: rows ``j < buffer_len`` from page1 of the ring, the rest from input rows ``ragged - 127 + j``."""
        valid = (word0 != -1) & (seq_len >= 128) & (buffer_len <= 128)
        valid &= (buffer_len == 0) | ((page1 >= 0) & (page1 * 128 + buffer_len - 1 < num_state_rows))
        valid &= (buffer_len >= 128) | ((ragged - 127 + buffer_len >= 0) & (ragged < num_inputs))
        return valid

    @triton.jit
    def _grid_position(NUM_CHANNEL_BLOCKS: tl.constexpr, CHANNELS_FASTEST: tl.constexpr):
        """(row block, channel block) of this program in a 1-D grid of row blocks x channel blocks.

        ``CHANNELS_FASTEST``: consecutive programs, which the GPU runs together, take the channel
        blocks of one row block, so between them they read whole rows; otherwise they take the same
        channels of consecutive row blocks."""
        pid = tl.program_id(0)
        if CHANNELS_FASTEST:
            return pid // NUM_CHANNEL_BLOCKS, pid % NUM_CHANNEL_BLOCKS
        num_row_blocks = tl.num_programs(0) // NUM_CHANNEL_BLOCKS
        return pid % num_row_blocks, pid // num_row_blocks

    # ------------------------------------------------------------------ decode
    @triton.jit
    def _pool_window_tiles(scores, values, STEPS: tl.constexpr):
        """Per-channel softmax pooling of a window held as ``STEPS`` tiles of ``[rows, channels]``
        (all loaded before this runs): the max, then one pass of exp-weighted sums. The max first
        combines the tiles element by element, so one reduction crosses threads for it instead of
        one per tile. (Summing element by element too would leave two such reductions in all, but
        at 32 channels the ratio-128 decode kernel then spills on sm_90.)"""
        top = scores[0]
        for step in tl.static_range(1, STEPS):
            top = tl.maximum(top, scores[step])
        m = tl.max(top, axis=0)
        num = tl.zeros_like(m)
        den = tl.zeros_like(m)
        for step in tl.static_range(STEPS):
            e = tl.exp(scores[step] - m[None, :])
            den += tl.sum(e, axis=0)
            num += tl.sum(e * values[step], axis=0)
        return num / den

    @triton.jit
    def decode_row(state_ptr, input_ptr, ape_ptr, out_ptr, b, d, seq_len, write_loc, page0, page1, num_state_rows,
                   HEAD_DIM: tl.constexpr, RATIO: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
                   POOL_FIRST: tl.constexpr):
        """Decode one request for channels ``d``: pool at a chunk end, write its new row into the ring.

        Writes ``out[b, d]`` (zeros when nothing is emitted). Shared by ``_decode_kernel``
        and the fused decode step (``dsv4ops/decode_step``). ``POOL_FIRST`` (``DECODE_POOL_FIRST``):
        the window is loaded before the ring write; otherwise after it (the same results).
        """
        D: tl.constexpr = HEAD_DIM
        PARTS: tl.constexpr = 4 if RATIO == 4 else 2
        WIDTH: tl.constexpr = PARTS * HEAD_DIM
        W: tl.constexpr = 8 if RATIO == 4 else RATIO
        STEPS: tl.constexpr = W // BLOCK_W
        num_pages = num_state_rows // RATIO
        live = (write_loc >= 0) & (write_loc < num_state_rows)
        dtype = state_ptr.dtype.element_ty

        # 1. this channel slice of every part of the new row, rounded to the state dtype
        new_row = input_ptr + b * WIDTH + d
        stored = ()  # as the ring will hold it
        parts = ()  # the same, in fp32
        for part in tl.static_range(PARTS):
            v = cast_rne(tl.load(new_row + part * D).to(tl.float32), dtype)
            stored = stored + (v,)
            parts = parts + (v.to(tl.float32),)
        if not POOL_FIRST:
            for part in tl.static_range(PARTS):
                tl.store(state_ptr + write_loc * WIDTH + part * D + d, stored[part], mask=(d < D) & live)

        # 2. pool the window when this token completes a chunk. Its loads never read the new row
        # from the ring (it is taken from ``parts``), so they may run before the write (step 3).
        has_overlap = seq_len > 4
        emits = live & (seq_len % RATIO == 0) & (seq_len >= RATIO) & (page1 >= 0) & (page1 < num_pages)
        if RATIO == 4:
            emits = emits & (~has_overlap | ((page0 >= 0) & (page0 < num_pages)))
        result = tl.zeros([BLOCK_D], tl.float32)
        if emits:
            scores = ()
            values = ()
            for step in tl.static_range(STEPS):
                w = step * BLOCK_W + tl.arange(0, BLOCK_W)
                if RATIO == 4:
                    row = tl.where(w < 4, page0 * 4 + w, page1 * 4 + (w - 4))
                    kv_col = tl.where(w < 4, 0, D)[:, None]
                    score_col = kv_col + 2 * D
                    present = ((w >= 4) | has_overlap)[:, None]
                else:
                    row = page1 * RATIO + w
                    kv_col = 0
                    score_col = D
                    present = (w >= 0)[:, None]
                is_new = (row == write_loc)[:, None]  # the row step 3 writes: use it as it will be stored
                at = state_ptr + row[:, None] * WIDTH + d[None, :]
                kv = tl.load(at + kv_col, mask=present & ~is_new, other=0.0).to(tl.float32)
                score = tl.load(at + score_col, mask=present & ~is_new, other=0.0).to(tl.float32)
                if RATIO == 4:
                    new_kv = tl.where((w < 4)[:, None], parts[0][None, :], parts[1][None, :])
                    new_score = tl.where((w < 4)[:, None], parts[2][None, :], parts[3][None, :])
                else:
                    new_kv = parts[0][None, :]
                    new_score = parts[1][None, :]
                kv = tl.where(is_new, new_kv, kv)
                score = tl.where(is_new, new_score, score)
                ape = tl.load(ape_ptr + w[:, None] * D + d[None, :]).to(tl.float32)
                scores = scores + (tl.where(present, score + ape, float("-inf")),)
                values = values + (kv,)
            result = _pool_window_tiles(scores, values, STEPS)

        # 3. write the new row into the ring
        if POOL_FIRST:
            for part in tl.static_range(PARTS):
                tl.store(state_ptr + write_loc * WIDTH + part * D + d, stored[part], mask=(d < D) & live)
        tl.store(out_ptr + b * D + d, cast_rne(result, out_ptr.dtype.element_ty), mask=d < D)

    @triton.jit
    def _decode_kernel(
        state_ptr, input_ptr, ape_ptr, plan_ptr, out_ptr, num_state_rows,
        HEAD_DIM: tl.constexpr, RATIO: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
        CHANNELS_FASTEST: tl.constexpr, POOL_FIRST: tl.constexpr,
    ):
        request, block = _grid_position(HEAD_DIM // BLOCK_D, CHANNELS_FASTEST)
        b = request.to(tl.int64)
        d = block * BLOCK_D + tl.arange(0, BLOCK_D)
        seq_len = tl.load(plan_ptr + b * 4).to(tl.int64) & 0xFFFFFFFF
        write_loc = tl.load(plan_ptr + b * 4 + 1).to(tl.int64)
        page0 = tl.load(plan_ptr + b * 4 + 2).to(tl.int64)
        page1 = tl.load(plan_ptr + b * 4 + 3).to(tl.int64)
        decode_row(state_ptr, input_ptr, ape_ptr, out_ptr, b, d, seq_len, write_loc, page0, page1, num_state_rows,
                   HEAD_DIM, RATIO, BLOCK_D, BLOCK_W, POOL_FIRST)

    # ------------------------------------------------------------------ prefill, ratio 4
    @triton.jit
    def _pool_c4_window(state_ptr, input_ptr, ape_ptr, d, valid, has_overlap, ragged, buffer_len, page0, page1,
                        HEAD_DIM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
        """The pooled ``[BLOCK_E, BLOCK_D]`` tile of a block of ratio-4 events (zeros where not ``valid``):
        all 16 window tiles (8 rows x kv, score) are loaded before any arithmetic, then a two-pass
        softmax in registers."""
        D: tl.constexpr = HEAD_DIM
        WIDTH: tl.constexpr = 4 * HEAD_DIM
        window_input = input_ptr + (ragged - 7)[:, None] * WIDTH + d[None, :]  # input row of window row 0
        ring0 = state_ptr + (page0 * 4)[:, None] * WIDTH + d[None, :]
        ring1 = state_ptr + (page1 * 4)[:, None] * WIDTH + d[None, :]
        scores = ()
        values = ()
        for w in tl.static_range(8):
            # window rows 0..3 use the A quarters [kv_A | . | score_A | .] of the previous chunk,
            # rows 4..7 the B quarters [. | kv_B | . | score_B] of the current one
            kv_col = 0 if w < 4 else D
            if w < 4:
                present = valid & has_overlap
                ring_row = ring0 + w * WIDTH
            else:
                present = valid
                ring_row = ring1 + (w - 4) * WIDTH
            from_ring = (buffer_len > w)[:, None]
            from_input = (present[:, None]) & ~from_ring
            from_ring = present[:, None] & from_ring
            at = window_input + w * WIDTH + kv_col
            kv = tl.where(from_ring, tl.load(ring_row + kv_col, mask=from_ring, other=0.0).to(tl.float32),
                          tl.load(at, mask=from_input, other=0.0).to(tl.float32))
            score = tl.where(from_ring, tl.load(ring_row + kv_col + 2 * D, mask=from_ring, other=0.0).to(tl.float32),
                             tl.load(at + 2 * D, mask=from_input, other=0.0).to(tl.float32))
            ape = tl.load(ape_ptr + w * D + d).to(tl.float32)
            scores = scores + (tl.where(present[:, None], score + ape[None, :], float("-inf")),)
            values = values + (kv,)
        m = scores[4]  # rows 4..7 always exist for a valid event
        for w in tl.static_range(8):
            if w != 4:
                m = tl.maximum(m, scores[w])
        m = tl.where(valid[:, None], m, 0.0)
        num = tl.zeros([BLOCK_E, BLOCK_D], tl.float32)
        den = tl.zeros([BLOCK_E, BLOCK_D], tl.float32)
        for w in tl.static_range(8):
            e = tl.exp(scores[w] - m)
            den += e
            num += e * values[w]
        return tl.where(valid[:, None], num / den, 0.0)

    @triton.jit
    def _c4_plan_block(plan_ptr, k, num_events, num_state_rows, num_inputs):
        """The plan fields of CompressPlan rows ``k`` (``in_plan``, ``valid``, and what the window needs)."""
        in_plan = k < num_events
        words = tl.load(plan_ptr + k[:, None] * 4 + tl.arange(0, 4)[None, :], mask=in_plan[:, None], other=-1)
        word0, seq_len, ragged, buffer_len, page0, page1 = _compress_plan_fields(words, in_plan)
        valid, has_overlap = _c4_event_valid(word0, seq_len, ragged, buffer_len, page0, page1,
                                             num_state_rows, num_inputs)
        return in_plan, valid, has_overlap, ragged, buffer_len, page0, page1

    @triton.jit
    def _pool_c4_kernel(
        state_ptr, input_ptr, ape_ptr, plan_ptr, out_ptr, num_events, num_state_rows, num_inputs,
        HEAD_DIM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, BLOCKS: tl.constexpr,
        STAGES: tl.constexpr, CHANNELS_FASTEST: tl.constexpr,
    ):
        """Pool ``BLOCKS`` consecutive blocks of ``BLOCK_E`` CompressPlan rows for one channel block.

        ``STAGES == 0`` (``BLOCKS`` 1): one block, its window tiles skipped when none of its rows is
        valid. ``STAGES > 0``: the blocks in a loop that Triton software-pipelines (the next
        blocks' plan and window loads in flight while one is pooled); a program whose rows are
        all invalid (plan padding) only stores zeros."""
        D: tl.constexpr = HEAD_DIM
        out_dtype = out_ptr.dtype.element_ty
        row_program, block = _grid_position(HEAD_DIM // BLOCK_D, CHANNELS_FASTEST)
        d = block * BLOCK_D + tl.arange(0, BLOCK_D)
        first = row_program.to(tl.int64) * (BLOCKS * BLOCK_E)
        if STAGES == 0:
            k = first + tl.arange(0, BLOCK_E)
            in_plan, valid, has_overlap, ragged, buffer_len, page0, page1 = _c4_plan_block(
                plan_ptr, k, num_events, num_state_rows, num_inputs)
            result = tl.zeros([BLOCK_E, BLOCK_D], tl.float32)
            # plans are padded to num_q_tokens rows, valid rows first: blocks of padding only write zeros
            if tl.max(valid.to(tl.int32), axis=0) > 0:
                result = _pool_c4_window(state_ptr, input_ptr, ape_ptr, d, valid, has_overlap, ragged, buffer_len,
                                         page0, page1, HEAD_DIM, BLOCK_E, BLOCK_D)
            tl.store(out_ptr + k[:, None] * D + d[None, :], cast_rne(result, out_dtype), mask=in_plan[:, None])
        else:
            ks = first + tl.arange(0, BLOCKS * BLOCK_E)
            in_program, any_valid, _, _, _, _, _ = _c4_plan_block(plan_ptr, ks, num_events, num_state_rows, num_inputs)
            if tl.max(any_valid.to(tl.int32), axis=0) > 0:
                for i in tl.range(0, BLOCKS, num_stages=STAGES):
                    k = first + i * BLOCK_E + tl.arange(0, BLOCK_E)
                    in_block, valid, has_overlap, ragged, buffer_len, page0, page1 = _c4_plan_block(
                        plan_ptr, k, num_events, num_state_rows, num_inputs)
                    result = _pool_c4_window(state_ptr, input_ptr, ape_ptr, d, valid, has_overlap, ragged,
                                             buffer_len, page0, page1, HEAD_DIM, BLOCK_E, BLOCK_D)
                    tl.store(out_ptr + k[:, None] * D + d[None, :], cast_rne(result, out_dtype),
                             mask=in_block[:, None])
            else:
                zero = tl.zeros([BLOCKS * BLOCK_E, BLOCK_D], tl.float32)
                tl.store(out_ptr + ks[:, None] * D + d[None, :], zero.to(out_dtype), mask=in_program[:, None])

    # ------------------------------------------------------------------ prefill, ratio 128
    @triton.jit
    def _c128_tile_with_ring_rows(state_ptr, at, page1, buffer_len, rows, cols, HEAD_DIM: tl.constexpr):
        """kv and score (fp32) of a tile of ratio-128 window rows ``rows`` and channels ``cols``
        (index tensors that broadcast to the tile's shape, as ``at`` has it): rows below
        ``buffer_len`` from the ring (page ``page1``), the others from the input rows ``at`` points to."""
        WIDTH: tl.constexpr = 2 * HEAD_DIM
        ring = state_ptr + (page1 * 128 + rows) * WIDTH + cols
        from_ring = rows < buffer_len
        kv = tl.where(from_ring, tl.load(ring, mask=from_ring, other=0.0).to(tl.float32),
                      tl.load(at, mask=~from_ring, other=0.0).to(tl.float32))
        score = tl.where(from_ring, tl.load(ring + HEAD_DIM, mask=from_ring, other=0.0).to(tl.float32),
                         tl.load(at + HEAD_DIM, mask=~from_ring, other=0.0).to(tl.float32))
        return kv, score

    @triton.jit
    def _pool_c128_event(state_ptr, input_ptr, ape_ptr, ragged, buffer_len, page1, d,
                         HEAD_DIM: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr):
        """Pool one ratio-128 window for channels ``d``: rows ``j < buffer_len`` from the ring, the rest from the input."""
        D: tl.constexpr = HEAD_DIM
        WIDTH: tl.constexpr = 2 * HEAD_DIM
        STEPS: tl.constexpr = 128 // BLOCK_W
        scores = ()
        values = ()
        for step in tl.static_range(STEPS):
            j = step * BLOCK_W + tl.arange(0, BLOCK_W)
            at = input_ptr + (ragged - 127 + j)[:, None] * WIDTH + d[None, :]
            if buffer_len > step * BLOCK_W:  # part of this tile was written by an earlier forward
                kv, score = _c128_tile_with_ring_rows(state_ptr, at, page1, buffer_len, j[:, None], d[None, :],
                                                      HEAD_DIM)
            else:
                kv = tl.load(at).to(tl.float32)
                score = tl.load(at + D).to(tl.float32)
            ape = tl.load(ape_ptr + j[:, None] * D + d[None, :]).to(tl.float32)
            scores = scores + (score + ape,)
            values = values + (kv,)
        return _pool_window_tiles(scores, values, STEPS)

    @triton.jit
    def _pool_c128_event_streaming(state_ptr, input_ptr, ape_ptr, ragged, buffer_len, page1, d,
                                   HEAD_DIM: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
                                   STAGES: tl.constexpr, ROW_GROUPS: tl.constexpr):
        """``_pool_c128_event`` one ``[BLOCK_W, BLOCK_D]`` tile at a time, in a software-pipelined
        loop (``STAGES`` tiles in flight), with an online softmax (``_stream_c128_window``), or, with
        ``ROW_GROUPS`` > 1, one such softmax per group of the window's rows (``_stream_c128_row_groups``).
        A window with no ring rows (every window of a prefill but a request's first) takes a loop that
        loads from the input alone: half the loads of the general one, no masks."""
        if ROW_GROUPS == 1:
            if buffer_len == 0:
                pooled = _stream_c128_window(state_ptr, input_ptr, ape_ptr, ragged, buffer_len, page1, d,
                                             HEAD_DIM, BLOCK_W, BLOCK_D, STAGES, False)
            else:
                pooled = _stream_c128_window(state_ptr, input_ptr, ape_ptr, ragged, buffer_len, page1, d,
                                             HEAD_DIM, BLOCK_W, BLOCK_D, STAGES, True)
        else:
            if buffer_len == 0:
                pooled = _stream_c128_row_groups(state_ptr, input_ptr, ape_ptr, ragged, buffer_len, page1, d,
                                                 HEAD_DIM, BLOCK_W, BLOCK_D, STAGES, False, ROW_GROUPS)
            else:
                pooled = _stream_c128_row_groups(state_ptr, input_ptr, ape_ptr, ragged, buffer_len, page1, d,
                                                 HEAD_DIM, BLOCK_W, BLOCK_D, STAGES, True, ROW_GROUPS)
        return pooled

    @triton.jit
    def _stream_c128_window(state_ptr, input_ptr, ape_ptr, ragged, buffer_len, page1, d,
                            HEAD_DIM: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
                            STAGES: tl.constexpr, FROM_RING: tl.constexpr):
        """The online softmax over a window's tiles: a running max ``m``, and the sums of
        ``exp(score - m)`` and ``exp(score - m) * kv`` rescaled by ``exp(m_old - m)`` when ``m``
        grows. It keeps one tile in registers instead of the whole window. ``FROM_RING``: rows
        ``j < buffer_len`` come from the ring; otherwise every row is an input row.

        (A version that kept the running max and sums per row slot, element by element, with no
        reduction across threads until the end, ran 5-6% slower at this tile on an H100,
        fifteenth session: ``docs/performance.md``.)"""
        D: tl.constexpr = HEAD_DIM
        WIDTH: tl.constexpr = 2 * HEAD_DIM
        m = tl.full([BLOCK_D], float("-inf"), tl.float32)
        num = tl.zeros([BLOCK_D], tl.float32)
        den = tl.zeros([BLOCK_D], tl.float32)
        for step in tl.range(0, 128 // BLOCK_W, num_stages=STAGES):
            j = step * BLOCK_W + tl.arange(0, BLOCK_W)
            at = input_ptr + (ragged - 127 + j)[:, None] * WIDTH + d[None, :]
            if FROM_RING:
                kv, score = _c128_tile_with_ring_rows(state_ptr, at, page1, buffer_len, j[:, None], d[None, :],
                                                      HEAD_DIM)
            else:
                kv = tl.load(at).to(tl.float32)
                score = tl.load(at + D).to(tl.float32)
            score += tl.load(ape_ptr + j[:, None] * D + d[None, :]).to(tl.float32)
            m_new = tl.maximum(m, tl.max(score, axis=0))
            rescale = tl.exp(m - m_new)  # 0 on the first tile (m = -inf)
            e = tl.exp(score - m_new[None, :])
            den = den * rescale + tl.sum(e, axis=0)
            num = num * rescale + tl.sum(e * kv, axis=0)
            m = m_new
        return num / den

    @triton.jit
    def _stream_c128_row_groups(state_ptr, input_ptr, ape_ptr, ragged, buffer_len, page1, d,
                                HEAD_DIM: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
                                STAGES: tl.constexpr, FROM_RING: tl.constexpr, ROW_GROUPS: tl.constexpr):
        """``_stream_c128_window`` over ``ROW_GROUPS`` groups of the window's rows at once, each group
        ``128 / ROW_GROUPS`` consecutive rows with its own running max and sums, combined once at the end.

        Tiles are ``[ROW_GROUPS, BLOCK_W, BLOCK_D]``: element ``(h, r, c)`` of step ``s`` is window row
        ``h * 128 / ROW_GROUPS + s * BLOCK_W + r``, channel ``d[c]``. Triton lays a program's warps along
        the leading (groups) axis (``warpsPerCTA [ROW_GROUPS, 1, 1]`` on sm_90; with the groups in the
        middle axis it laid them along the rows), so with ``ROW_GROUPS`` equal to the warps each warp
        pools its own rows: the reductions over a tile's rows never cross warps (with a warp across 128
        channels, not even threads), and only the final combine does. A window's channels then take
        ``ROW_GROUPS`` warps instead of one, for plans with too few windows to fill the GPU with one warp
        each. One group keeps ``_stream_c128_window``'s 2-D loop, whose sm_90 code the GPU sessions
        timed, rather than this loop with a size-1 axis."""
        D: tl.constexpr = HEAD_DIM
        WIDTH: tl.constexpr = 2 * HEAD_DIM
        GROUP_ROWS: tl.constexpr = 128 // ROW_GROUPS
        m = tl.full([ROW_GROUPS, BLOCK_D], float("-inf"), tl.float32)
        num = tl.zeros([ROW_GROUPS, BLOCK_D], tl.float32)
        den = tl.zeros([ROW_GROUPS, BLOCK_D], tl.float32)
        group_first = (tl.arange(0, ROW_GROUPS) * GROUP_ROWS)[:, None]
        cols = d[None, None, :]
        for step in tl.range(0, GROUP_ROWS // BLOCK_W, num_stages=STAGES):
            j = (group_first + step * BLOCK_W + tl.arange(0, BLOCK_W)[None, :])[:, :, None]  # [ROW_GROUPS, BLOCK_W, 1]
            at = input_ptr + (ragged - 127 + j) * WIDTH + cols
            if FROM_RING:
                kv, score = _c128_tile_with_ring_rows(state_ptr, at, page1, buffer_len, j, cols, HEAD_DIM)
            else:
                kv = tl.load(at).to(tl.float32)
                score = tl.load(at + D).to(tl.float32)
            score += tl.load(ape_ptr + j * D + cols).to(tl.float32)
            m_new = tl.maximum(m, tl.max(score, axis=1))
            rescale = tl.exp(m - m_new)  # 0 on the first tile (m = -inf)
            e = tl.exp(score - m_new[:, None, :])
            den = den * rescale + tl.sum(e, axis=1)
            num = num * rescale + tl.sum(e * kv, axis=1)
            m = m_new
        # combine the groups: each group's sums rescaled to the window's max
        m_window = tl.max(m, axis=0)
        to_window = tl.exp(m - m_window[None, :])
        return tl.sum(num * to_window, axis=0) / tl.sum(den * to_window, axis=0)

    @triton.jit
    def _pool_c128_kernel(
        state_ptr, input_ptr, ape_ptr, plan_ptr, out_ptr, num_events, num_state_rows, num_inputs, num_programs,
        HEAD_DIM: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
        CHANNELS_FASTEST: tl.constexpr, STAGES: tl.constexpr, ROW_GROUPS: tl.constexpr,
    ):
        """Pool every valid ratio-128 plan row for one channel block. ``STAGES == 0``: the whole
        window's tiles are loaded at once, then a max pass and a sum pass (``_pool_c128_event``);
        ``STAGES > 0``: tile by tile with an online softmax (``_pool_c128_event_streaming``), in
        ``ROW_GROUPS`` groups of the window's rows."""
        D: tl.constexpr = HEAD_DIM
        g, block = _grid_position(HEAD_DIM // BLOCK_D, CHANNELS_FASTEST)
        d = block * BLOCK_D + tl.arange(0, BLOCK_D)
        out_dtype = out_ptr.dtype.element_ty
        # this program's rows are g, g + G, g + 2G, ... below num_events
        for first in range(0, tl.cdiv(num_events, num_programs), CHUNK):
            t = first + tl.arange(0, CHUNK)
            k = g + t.to(tl.int64) * num_programs
            in_plan = k < num_events
            words = tl.load(plan_ptr + k[:, None] * 4 + tl.arange(0, 4)[None, :], mask=in_plan[:, None], other=-1)
            word0, seq_len, ragged, buffer_len, page0, page1 = _compress_plan_fields(words, in_plan)
            valid = in_plan & _c128_event_valid(word0, seq_len, ragged, buffer_len, page1, num_state_rows, num_inputs)
            zero = tl.zeros([CHUNK, BLOCK_D], tl.float32)
            tl.store(out_ptr + k[:, None] * D + d[None, :], zero.to(out_dtype), mask=(in_plan & ~valid)[:, None])
            # pool the valid rows of this chunk one after the other (the i-th valid row, by rank)
            rank = tl.cumsum(valid.to(tl.int32), axis=0) - 1
            for i in range(tl.sum(valid.to(tl.int32), axis=0)):
                pick = valid & (rank == i)
                row = tl.sum(tl.where(pick, k, 0), axis=0)
                event_ragged = tl.sum(tl.where(pick, ragged, 0), axis=0)
                event_buffer_len = tl.sum(tl.where(pick, buffer_len, 0), axis=0)
                event_page1 = tl.sum(tl.where(pick, page1, 0), axis=0)
                if STAGES == 0:
                    pooled = _pool_c128_event(state_ptr, input_ptr, ape_ptr, event_ragged, event_buffer_len,
                                              event_page1, d, HEAD_DIM, BLOCK_W, BLOCK_D)
                else:
                    pooled = _pool_c128_event_streaming(state_ptr, input_ptr, ape_ptr, event_ragged,
                                                        event_buffer_len, event_page1, d, HEAD_DIM, BLOCK_W,
                                                        BLOCK_D, STAGES, ROW_GROUPS)
                tl.store(out_ptr + row * D + d, cast_rne(pooled, out_dtype))

    # ------------------------------------------------------------------ prefill, pass 2
    @triton.jit
    def _write_kernel(
        state_ptr, input_ptr, plan_ptr, num_writes, num_state_rows, num_inputs, num_programs,
        WIDTH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK: tl.constexpr,
    ):
        """Copy every live WritePlan row's input row into the ring. The plan's rows are taken in
        blocks of ``BLOCK_R``; program ``g`` of ``num_programs`` owns the blocks ``g, g + G, g + 2G,
        ...``. It reads the plan words of ``CHUNK`` of its blocks in one vector, then, for each block
        that holds a live row, loads that block's words again (a cache hit; picking them out of the
        vector instead made ptxas spill at some widths; both loads stay in the kernel body, where
        Inductor's mutation analysis sees them as loads, not as a helper's pointer argument) and
        copies its rows. A WritePlan lists its valid rows first, so the valid blocks fall on
        different programs, and most programs find only padding and exit after one load."""
        g = tl.program_id(0)
        num_blocks = tl.cdiv(num_writes, BLOCK_R)
        for first in range(0, tl.cdiv(num_blocks, num_programs), CHUNK):
            block = g + (first + tl.arange(0, CHUNK)).to(tl.int64) * num_programs
            r = block[:, None] * BLOCK_R + tl.arange(0, BLOCK_R)[None, :]
            in_plan = r < num_writes
            src = tl.load(plan_ptr + r * 2, mask=in_plan, other=-1).to(tl.int64) & 0xFFFFFFFF
            dst = tl.load(plan_ptr + r * 2 + 1, mask=in_plan, other=-1).to(tl.int64)
            live = in_plan & (src < num_inputs) & (dst >= 0) & (dst < num_state_rows)
            block_live = tl.max(live.to(tl.int32), axis=1)
            rank = tl.cumsum(block_live, axis=0) - 1
            # copy the live blocks of this chunk one after the other (the i-th live block, by rank)
            for i in range(tl.sum(block_live, axis=0)):
                b = tl.sum(tl.where((block_live > 0) & (rank == i), block, 0), axis=0)
                rows = b * BLOCK_R + tl.arange(0, BLOCK_R)
                in_block = rows < num_writes
                row_src = tl.load(plan_ptr + rows * 2, mask=in_block, other=-1).to(tl.int64) & 0xFFFFFFFF
                row_dst = tl.load(plan_ptr + rows * 2 + 1, mask=in_block, other=-1).to(tl.int64)
                row_live = in_block & (row_src < num_inputs) & (row_dst >= 0) & (row_dst < num_state_rows)
                for c0 in tl.static_range(0, WIDTH, BLOCK_C):
                    c = c0 + tl.arange(0, BLOCK_C)
                    v = tl.load(input_ptr + row_src[:, None] * WIDTH + c[None, :], mask=row_live[:, None])
                    tl.store(state_ptr + row_dst[:, None] * WIDTH + c[None, :],
                             cast_rne(v.to(tl.float32), state_ptr.dtype.element_ty), mask=row_live[:, None])


# ---------------------------------------------------------------------- launch parameters
#: decode: channels per program. Ratio 128 holds the whole 128-row window of its channels in
#: registers (kv, score and ape tiles): at 64 channels that is 176 registers per thread on sm_90
#: (2 programs per SM), at 32 channels 106 (4 per SM) and twice the programs per boundary request.
#: H200 sweep, batch 128 (2026-12-03, fifth session): ratio 4 D 512 took 3.62 us at 256 channels,
#: 6.35 at 128; ratio 128 10.86 us at 32, 13.66 at 64, 14.33 at 16.
DECODE_BLOCK_D = {4: 256, 128: 32}
#: decode: warps per program: for ratio 4 per head_dim (keyed as ``C4_TILE``), for ratio 128 one
#: count. Ratio 4's window tile is 8 rows x the channels: with more warps than the channels need
#: (256 channels fill 2 warps, 128 one), the warps lie along the rows and each reduction over the
#: window crosses warps through shared memory and a barrier. H100 (twenty-first session,
#: ``benchmarks.ab_compress``, the same state): D 512 at 2 warps against 4, batch 1 / 128 / 512:
#: 2.20 / 2.56 / 3.94 us against 2.63 / 3.36 / 5.78; D 128 at 1 warp against 4: 2.11 / 2.28 /
#: 2.50 us against 2.72 / 2.92 / 5.79. At batch 1 a ratio-128 boundary row is pooled by
#: ``head_dim / DECODE_BLOCK_D[128]`` programs only (16 for D 512), each loading its 128 x 32
#: window, so the loads in flight per program (the warps) may set its latency. H100 sweep
#: (twelfth session), (channels, warps) for ratio 128: batch 1 (32, 4) 3.82 us, (8, 2) 3.96,
#: (16, 4) 4.00, (32, 2) 4.75, (32, 8) 6.57; batch 128 (32, 2) 10.67, (32, 4) 10.89, (16, 2) 10.90,
#: (32, 8) 24.99. (32, 4) stays: best at batch 1, within 2% at batch 128.
DECODE_WARPS = {4: {512: 2, 128: 1}, 128: 4}
#: decode: load the window before writing the new row into the ring (True) or after (False, the
#: order before the eleventh session, 2026-12-05). A thread's load after its own store to the same
#: buffer is ordered after it, and the store waits for the input load, so writing first puts one
#: more memory round trip into the decode's dependent chain. Both orders give the same results (the
#: window never reads the new row from the ring); the sweep times both. H100 sweep (2026-12-06,
#: twelfth session), True against False: ratio 128 at batch 1 3.82 against 4.11 us (fused step
#: 8.00 / 8.31), ratio 4 D 512 at batch 128 3.23 / 3.34 (fused 4.36 / 4.44); the other way round
#: for ratio 128 at batch 128 (10.83 / 10.50, fused 15.53 / 15.19) and the unfused indexer at
#: batch 128 (2.86 / 2.79). True helps the latency-bound rows that miss 5x; the rest is within 3%.
DECODE_POOL_FIRST = True
#: ratio-4 pooling tile per head_dim: (events per program, channels per program, warps). H200
#: sweep at 16K tokens, one block per program: D 512 62.6 us at (8, 32, 2), 68.4 at (8, 64, 4),
#: 80.1 at (16, 64, 4); D 128 14.7 us at (8, 64, 4), 21.4 at (16, 64, 4). D 512 now pools
#: pipelined (``C4_STREAM``) with (4, 64, 2), the H100's best there. Other head_dims take the
#: tile of the nearer of the two.
C4_TILE = {512: (4, 64, 2), 128: (8, 64, 4)}
#: ratio-4 pooling, pipelined, per head_dim (keyed as ``C4_TILE``): (stages, row blocks per
#: program). Stages 0 gives each block of ``BLOCK_E`` plan rows a program of its own (the blocks
#: entry is then unused); stages > 0 gives each program that many consecutive blocks in a loop
#: that Triton software-pipelines this many blocks deep, so that a program has the next blocks'
#: loads in flight while it pools one. The ncu profile (H200, 2026-12-04) shows the one-block
#: kernel latency-bound at 21.5% achieved occupancy and 58.9% of DRAM peak. H100 sweep
#: (2026-12-06, twelfth session; kernel alone, % of copy bandwidth), D 512: one block per
#: program 73.6 us (78%) at 16K tokens, 350.6 us (65.5%) at 64K, 22.4 us at 4K; 2 stages x 4
#: blocks at (4, 64, 2) with the channel blocks together (``C4_CHANNELS_FASTEST``) 67.0-67.2 us
#: (85-86%), 250.4 us (91.7%), 21.9 us. D 128 (ninth session): 20.65 us at one block per
#: program, 20.94 at best pipelined, so it stays at one block.
C4_STREAM = {512: (2, 4), 128: (0, 4)}
#: ratio-4 pooling: the grid order per head_dim (keyed as ``C4_TILE``; see ``CHANNELS_FASTEST``).
#: The pipelined D 512 pool runs 3-8% faster with the channel blocks of a row block together
#: (H100, twelfth session); the H200 sweep of the one-block kernels found no gain for D 512
#: (fifth session), and ratio 128 and the decode grids slower, so those keep ``CHANNELS_FASTEST``.
C4_CHANNELS_FASTEST = {512: True, 128: False}
#: ratio-4 pooling for large plans, per head_dim (keyed as ``C4_TILE``): ``(min plan rows, tile,
#: (stages, blocks), channels fastest)`` replaces the three entries above for plans of at least that
#: many rows (CompressPlans have one row per query token); None: one launch for every size. Both
#: launches are made, their grids scaled by ``at_least(plan rows, min)`` and its complement, so the
#: choice adds no guard under torch.compile. H100 sweep (ninth session), D 128, one block per program
#: at (8, 64, 4) against 2 stages x 4 blocks at (4, 64, 2) with the channel blocks together: 4K
#: tokens 6.08 us against 11.13 (the pipelined grid has 128 programs with rows for 132 SMs), 16K
#: 20.06-20.81 against 20.25-20.90, 64K 86.74 (66%) against 69.36 (83%). H200 (nineteenth session,
#: one block against pipelined, 32 requests): 8K tokens 8.28 / 8.17 us, 16K 15.35 / 18.78, 24K
#: 28.46 / 23.73, 32K 35.94 / 32.98, 48K 53.78 / 42.48: the pipelined launch from 20480 rows, between
#: the H200's 16K and 24K (the H100 is even at 16K).
C4_LARGE = {512: None, 128: (20480, (4, 64, 2), (2, 4), True)}
#: ratio-128 pooling, whole window in registers (``C128_STREAM_STAGES`` 0): (window rows per tile,
#: channels per program, plan rows read per vector, warps); the tile-by-tile tiles below may add a
#: fifth field, row groups (``c128_tile``)
C128_TILE = (32, 32, 32, 4)
#: ratio-128 pooling: 0 keeps the whole window in registers (``C128_TILE``); > 0 pools tile by tile
#: with an online softmax, this many tiles in flight, with ``C128_STREAM_TILE`` (same fields as
#: ``C128_TILE``): one tile in registers instead of four, so more programs fit on an SM, for a
#: rescale per tile. H200 sweep at 16K tokens (2026-12-04): 43.1 us streaming at (16, 32, 128, 2)
#: with 3 stages, 47.2 at (16, 32, 64, 2), 52.5 for the whole window at (32, 32, 128, 4), 55.7 at
#: (32, 32, 32, 4) (the default until then); at 4K tokens 14.9 us streaming against 13.1-17.6 for
#: the whole window (tile-dependent).
C128_STREAM_STAGES = 3
C128_STREAM_TILE = (16, 32, 128, 2)
#: ratio-128 pooling of large plans: (plan rows from which it applies, tile as ``C128_STREAM_TILE``,
#: stages), or None. One warp across 128 channels holds whole columns of each tile in its threads,
#: so the reductions over a tile's rows need no shuffle or barrier: its tile loop issues 0.56
#: warp-instructions per element against the default's 1.09 (``python -m benchmarks.static``), but
#: it has a quarter of the default's channel blocks, so small plans fill fewer SMs. H100
#: (twenty-first session, ``benchmarks.ab_compress``, 32 requests, the same state): 16K tokens
#: 43.01 us against 46.05 (77.7% of copy bandwidth), 64K 152.87 against 166.70 (87.4%), 4K 19.27
#: against 14.40. Chosen by plan rows without a guard under torch.compile, as ``C4_LARGE``.
C128_LARGE = (16384, (4, 128, 32, 1), 4)
#: ratio-128 pooling: plan rows per program. The grid has ``cdiv(plan rows, C128_ROWS_PER_PROGRAM)``
#: programs along the rows (times the channel blocks), a function of the shape alone; program ``g``
#: walks the plan rows ``g, g + G, ...``: at most one plan row in 128 (plus one per request) is an
#: event, valid rows first, so each program pools about one event. H200 sweep (streaming, 2026-12-04):
#: 16K tokens 45.1 us at 64 rows, 47.2 at 128, 43.3 at 256; 4K tokens 18.1, 15.3 and 22.7 us. One
#: pipelined loop over the tiles of all of a program's windows instead of one loop per window
#: (1e2460c) was no faster on an H100 at 128-512 rows (twentieth session) and was removed.
C128_ROWS_PER_PROGRAM = 128
if interpreting():
    # the interpreter runs programs one after the other: one program along the rows of a test's
    # plan keeps CI fast and takes the several-events-per-program path
    C128_ROWS_PER_PROGRAM = 1024
#: write pass: (rows per block, columns per step). H200 sweep (nineteenth session), ratio 128 at 16K
#: tokens: (2, 1024) 42.05 us, (4, 1024) 42.10, (8, 256) 42.09, (8, 1024) 43.02, (16, 512) 43.63.
WRITE_TILE = (4, 1024)
#: write pass: at most this many programs, each owning every ``WRITE_PROGRAMS``-th row block. With
#: one program per block (until the nineteenth session) a 16K-token plan launched 2048 programs of 4
#: warps and 91-102 registers, and a ratio-128 prefill, which writes no rows when its requests end on
#: a window boundary, still took 4.5 us in the write pass (ncu, H100): 3.1 waves of programs that
#: only read padding. On the H200: x1.00-1.05, e.g. ratio 4 D 512 at 64K tokens 200.4 -> 194.3 us.
WRITE_PROGRAMS = 1024
#: write pass: row blocks whose plan words a program reads in one vector
WRITE_CHUNK = 16
#: order of the decode grids and the ratio-128 pooling grid (1-D, row blocks x channel blocks;
#: ratio-4 pooling has ``C4_CHANNELS_FASTEST``): True runs the channel blocks of one row block
#: together (whole rows read at once), False the same channels of consecutive row blocks (the
#: order every H200 measurement so far used)
CHANNELS_FASTEST = False


def c4_key(head_dim: int) -> int:
    """The entry of the per-head_dim ratio-4 tables (``C4_TILE``, ``C4_STREAM``, ``C4_CHANNELS_FASTEST``)
    for ``head_dim``: the nearer of 512 and 128."""
    return 512 if head_dim > 256 else 128


def c4_tile(head_dim: int) -> tuple:
    """The ratio-4 pooling tile (``C4_TILE``) for ``head_dim``."""
    return C4_TILE[c4_key(head_dim)]


def c4_stream(head_dim: int) -> tuple:
    """The ratio-4 pooling's (stages, row blocks per program) (``C4_STREAM``) for ``head_dim``;
    one block per program, (0, 1), when stages is 0."""
    stages, blocks = C4_STREAM[c4_key(head_dim)]
    return (stages, blocks) if stages else (0, 1)


def _split_by_plan_rows(plan_rows, min_rows: int, small: tuple, large: tuple) -> list:
    """Launch settings ``small`` for plans under ``min_rows`` rows and ``large`` from there, as
    ``[(share, *settings), ...]``: each launch's grid is scaled by its share, ``at_least(plan_rows,
    min_rows)`` or its complement, so under torch.compile both launches are made with no guard and
    the one with an empty grid does nothing; a concrete size (eager, or a static shape) keeps only
    the launch it picks."""
    share = at_least(plan_rows, min_rows)
    launches = [(1 - share, *small), (share, *large)]
    return [launch for launch in launches if not isinstance(launch[0], int) or launch[0]]


def c4_launches(head_dim: int, plan_rows) -> list:
    """The ratio-4 pool's launches for a plan of ``plan_rows`` rows: ``(share, tile, (stages, blocks),
    channels fastest)`` each, its grid scaled by ``share`` (1 or 0; symbolic under torch.compile). One
    launch with ``C4_TILE``, ``C4_STREAM`` and ``C4_CHANNELS_FASTEST``, or, where ``C4_LARGE`` has an
    entry, that launch for plans below its row count and its own above."""
    key = c4_key(head_dim)
    default = (c4_tile(head_dim), c4_stream(head_dim), C4_CHANNELS_FASTEST[key])
    if C4_LARGE[key] is None:
        return [(1, *default)]
    min_rows, tile, (stages, blocks), channels_fastest = C4_LARGE[key]
    return _split_by_plan_rows(plan_rows, min_rows, default,
                               (tile, (stages, blocks) if stages else (0, 1), channels_fastest))


def c128_launches(head_dim: int, plan_rows) -> list:
    """The ratio-128 pool's launches for a plan of ``plan_rows`` rows: ``(share, tile, stages)`` each,
    its grid scaled by ``share`` (1 or 0; symbolic under torch.compile): ``C128_STREAM_TILE`` and
    ``C128_STREAM_STAGES`` (or ``C128_TILE`` where the stages are 0), or, where ``C128_LARGE`` is set
    and its channels divide ``head_dim``, that launch for plans below its row count and its own above.
    (At D 64 its tile would be one warp across 64 channels, which spills on sm_90.)"""
    default = (C128_STREAM_TILE if C128_STREAM_STAGES else C128_TILE, C128_STREAM_STAGES)
    if C128_LARGE is None or head_dim % C128_LARGE[1][1]:
        return [(1, *default)]
    min_rows, tile, stages = C128_LARGE
    return _split_by_plan_rows(plan_rows, min_rows, default, (tile, stages))


def c128_tile(tile: tuple) -> tuple:
    """A ratio-128 pooling tile with all five fields: (window rows per tile, channels per program, plan
    rows read per vector, warps, row groups). The row groups (``_stream_c128_row_groups``; 1 where the
    tile gives four fields) apply to the tile-by-tile pool only: the window's rows in that many groups
    of consecutive rows, one online softmax each, as many warps per window's channels as groups when
    the tile's warps equal them."""
    rows, channels, chunk, warps, *rest = tile
    groups = rest[0] if rest else 1
    if rows * groups > 128 or 128 % (rows * groups):
        raise ValueError(f"ratio-128 tile {tile}: rows x row groups must divide the window's 128 rows")
    return rows, channels, chunk, warps, groups


def decode_warps(ratio: int, head_dim: int) -> int:
    """Warps per program of the decode kernel (``DECODE_WARPS``)."""
    return DECODE_WARPS[4][c4_key(head_dim)] if ratio == 4 else DECODE_WARPS[ratio]


def _channel_block(head_dim: int, wanted: int) -> int:
    """Largest power of two <= ``wanted`` that divides ``head_dim`` (kernels need no channel masks)."""
    block = min(wanted, next_pow2(head_dim))
    while head_dim % block:
        block //= 2
    return block


def compress_forward(kv_score_buffer, kv_score_input, ape, plan, write_plan, out, head_dim, compress_ratio) -> None:
    """Launch the decode kernel, or the two prefill passes (arguments as the op)."""
    r = compress_ratio
    width = 2 * coff(r) * head_dim
    num_rows = kv_score_buffer.numel() // width
    words = plan.view(torch.int32)
    if write_plan is None:
        block_d = _channel_block(head_dim, DECODE_BLOCK_D[r])
        launch(_decode_kernel)[(plan.shape[0] * (head_dim // block_d),)](
            kv_score_buffer, kv_score_input, ape, words, out, num_rows,
            HEAD_DIM=head_dim, RATIO=r, BLOCK_D=block_d, BLOCK_W=8 if r == 4 else 32,
            CHANNELS_FASTEST=CHANNELS_FASTEST, POOL_FIRST=DECODE_POOL_FIRST, num_warps=decode_warps(r, head_dim),
        )
        return
    num_inputs = kv_score_input.shape[0]
    if r == 4:
        for share, (events, channels, warps), (stages, blocks), channels_fastest in c4_launches(head_dim,
                                                                                              plan.shape[0]):
            channels = _channel_block(head_dim, channels)
            launch(_pool_c4_kernel)[(cdiv(plan.shape[0], events * blocks) * (head_dim // channels) * share,)](
                kv_score_buffer, kv_score_input, ape, words, out, plan.shape[0], num_rows, num_inputs,
                HEAD_DIM=head_dim, BLOCK_E=events, BLOCK_D=channels, BLOCKS=blocks, STAGES=stages,
                CHANNELS_FASTEST=channels_fastest, num_warps=warps,
            )
    else:
        programs = cdiv(plan.shape[0], C128_ROWS_PER_PROGRAM)
        for share, tile, stages in c128_launches(head_dim, plan.shape[0]):
            rows, channels, chunk, warps, groups = c128_tile(tile)
            channels = _channel_block(head_dim, channels)
            launch(_pool_c128_kernel)[(programs * (head_dim // channels) * share,)](
                kv_score_buffer, kv_score_input, ape, words, out, plan.shape[0], num_rows, num_inputs, programs,
                HEAD_DIM=head_dim, BLOCK_W=rows, BLOCK_D=channels, CHUNK=chunk, CHANNELS_FASTEST=CHANNELS_FASTEST,
                STAGES=stages, ROW_GROUPS=groups if stages else 1, num_warps=warps,
            )
    block_r, block_c = WRITE_TILE
    programs = torch.sym_min(cdiv(write_plan.shape[0], block_r), WRITE_PROGRAMS)
    launch(_write_kernel)[(programs,)](
        kv_score_buffer, kv_score_input, write_plan.view(torch.int32), write_plan.shape[0], num_rows, num_inputs,
        programs, WIDTH=width, BLOCK_R=block_r, BLOCK_C=min(block_c, next_pow2(width)), CHUNK=WRITE_CHUNK,
        num_warps=4,
    )
