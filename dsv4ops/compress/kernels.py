"""Triton kernels for ``compress_forward`` (offline state, ratio 4 and 128).

* decode: one program per (batch row, channel block). It writes its channel slice
  of the new row into the ring, then, at a chunk boundary, pools the window. The
  row it just wrote is taken from the input (rounded to the state dtype) instead of
  being read back, which is what reading it back would give and needs no barrier.
* prefill: pass 1 pools every CompressPlan row (window rows from the ring when
  ``w < buffer_len``, else from the input); pass 2, a second launch, copies the
  WritePlan rows into the ring. Launch order on the stream keeps every pass-1 read
  ahead of every pass-2 write.

Pooling is an online (streaming) softmax over window tiles, in fp32.
"""

from __future__ import annotations

import torch

from .._layout import coff
from .._triton import HAVE_TRITON, cdiv, launch, next_pow2

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .._triton_formats import cast_rne

    @triton.jit
    def _window_rows(w, page0, page1, RATIO: tl.constexpr):
        """State row of window rows ``w``: ratio 4 reads page0 (w < 4) then page1; ratio 128 page1."""
        if RATIO == 4:
            return tl.where(w < 4, page0 * 4 + w, page1 * 4 + (w - 4))
        else:
            return page1 * RATIO + w

    @triton.jit
    def _part_offsets(w, D: tl.constexpr, RATIO: tl.constexpr):
        """Column offsets of the kv and score parts used by window rows ``w``."""
        if RATIO == 4:  # rows 0..3: [kv_A | . | score_A | .], rows 4..7: [. | kv_B | . | score_B]
            kv_off = tl.where(w < 4, 0, D)
            return kv_off, kv_off + 2 * D
        else:
            return w * 0, w * 0 + D

    @triton.jit
    def _softmax_step(m, l, acc, score, kv, present):
        """Fold a tile ``[BLOCK_W, BLOCK_D]`` into the running (max, denominator, numerator)."""
        score = tl.where(present, score, float("-inf"))
        m_new = tl.maximum(m, tl.max(score, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.where(present, tl.exp(score - m_new[None, :]), 0.0)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p * tl.where(present, kv, 0.0), axis=0)
        return m_new, l, acc

    @triton.jit
    def _compress_decode_kernel(
        state_ptr, input_ptr, ape_ptr, plan_ptr, out_ptr, num_state_rows,
        HEAD_DIM: tl.constexpr, RATIO: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
    ):
        D: tl.constexpr = HEAD_DIM
        PARTS: tl.constexpr = 4 if RATIO == 4 else 2
        WIDTH: tl.constexpr = PARTS * HEAD_DIM
        W: tl.constexpr = 8 if RATIO == 4 else RATIO
        b = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = d < D
        seq_len = tl.load(plan_ptr + b * 4).to(tl.int64) & 0xFFFFFFFF
        write_loc = tl.load(plan_ptr + b * 4 + 1).to(tl.int64)
        page0 = tl.load(plan_ptr + b * 4 + 2).to(tl.int64)
        page1 = tl.load(plan_ptr + b * 4 + 3).to(tl.int64)
        num_pages = num_state_rows // RATIO
        live = (write_loc >= 0) & (write_loc < num_state_rows)

        # 1. write this channel slice of every part of the new row into the ring
        for part in tl.static_range(PARTS):
            v = tl.load(input_ptr + b * WIDTH + part * D + d, mask=d_ok)
            tl.store(state_ptr + write_loc * WIDTH + part * D + d, cast_rne(v.to(tl.float32), state_ptr.dtype.element_ty),
                     mask=d_ok & live)

        # 2. pool the window when this token completes a chunk
        emits = live & (seq_len % RATIO == 0) & (seq_len >= RATIO) & (page1 >= 0) & (page1 < num_pages)
        has_overlap = seq_len > 4
        if RATIO == 4:
            emits = emits & (~has_overlap | ((page0 >= 0) & (page0 < num_pages)))
        m = tl.full([BLOCK_D], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_D], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        if emits:
            for w0 in tl.static_range(0, W, BLOCK_W):
                w = w0 + tl.arange(0, BLOCK_W)
                row = _window_rows(w, page0, page1, RATIO)
                kv_off, score_off = _part_offsets(w, D, RATIO)
                exists = w < W
                if RATIO == 4:
                    exists = exists & ((w >= 4) | has_overlap)
                present = exists[:, None] & d_ok[None, :]
                is_new = (row == write_loc)[:, None]  # the row written above: use the input, rounded as stored
                at_state = state_ptr + row[:, None] * WIDTH + d[None, :]
                at_input = input_ptr + b * WIDTH + d[None, :]
                kv = tl.load(at_state + kv_off[:, None], mask=present & ~is_new, other=0.0).to(tl.float32)
                score = tl.load(at_state + score_off[:, None], mask=present & ~is_new, other=0.0).to(tl.float32)
                new_kv = tl.load(at_input + kv_off[:, None], mask=present & is_new, other=0.0)
                new_score = tl.load(at_input + score_off[:, None], mask=present & is_new, other=0.0)
                dtype = state_ptr.dtype.element_ty
                kv = tl.where(is_new, cast_rne(new_kv.to(tl.float32), dtype).to(tl.float32), kv)
                score = tl.where(is_new, cast_rne(new_score.to(tl.float32), dtype).to(tl.float32), score)
                ape = tl.load(ape_ptr + w[:, None] * D + d[None, :], mask=present, other=0.0).to(tl.float32)
                m, l, acc = _softmax_step(m, l, acc, score + ape, kv, present)
            result = acc / l
        else:
            result = tl.zeros([BLOCK_D], tl.float32)
        tl.store(out_ptr + b * D + d, cast_rne(result, out_ptr.dtype.element_ty), mask=d_ok)

    @triton.jit
    def _compress_prefill_pool_kernel(
        state_ptr, input_ptr, ape_ptr, plan_ptr, out_ptr, num_events, num_state_rows, num_inputs,
        HEAD_DIM: tl.constexpr, RATIO: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        """``BLOCK_E`` consecutive CompressPlan rows x ``BLOCK_D`` channels per program.

        Batching events amortizes the ape tile and the plan decoding, and for ratio 4
        lets one program stream a contiguous run of input rows (A and B halves of
        consecutive tokens belong to consecutive events).
        """
        D: tl.constexpr = HEAD_DIM
        PARTS: tl.constexpr = 4 if RATIO == 4 else 2
        WIDTH: tl.constexpr = PARTS * HEAD_DIM
        W: tl.constexpr = 8 if RATIO == 4 else RATIO
        k = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = d < D
        in_plan = k < num_events
        word0 = tl.load(plan_ptr + k * 4, mask=in_plan, other=-1)
        word1 = tl.load(plan_ptr + k * 4 + 1, mask=in_plan, other=0).to(tl.int64)
        page0 = tl.load(plan_ptr + k * 4 + 2, mask=in_plan, other=-1).to(tl.int64)
        page1 = tl.load(plan_ptr + k * 4 + 3, mask=in_plan, other=-1).to(tl.int64)
        seq_len = word0.to(tl.int64) & 0xFFFFFFFF
        ragged = word1 & 0xFFFF
        buffer_len = (word1 >> 16) & 0xFFFF
        has_overlap = seq_len > 4
        valid = (word0 != -1) & (seq_len >= RATIO) & (buffer_len <= W)

        # every window row must be readable: from the ring (w < buffer_len) or from the input
        w_all = tl.arange(0, W)[None, :]
        exists = w_all < W
        if RATIO == 4:
            exists = exists & ((w_all >= 4) | has_overlap[:, None])
        from_state = w_all < buffer_len[:, None]
        row = _window_rows(w_all, page0[:, None], page1[:, None], RATIO)
        src = ragged[:, None] - (W - 1) + w_all
        bad = exists & tl.where(from_state, (row < 0) | (row >= num_state_rows), (src < 0) | (src >= num_inputs))
        valid = valid & (tl.sum(bad.to(tl.int32), axis=1) == 0)

        result = tl.zeros([BLOCK_E, BLOCK_D], tl.float32)
        # plans are padded to num_q_tokens rows, valid rows first: blocks of padding only write zeros
        if tl.max(valid.to(tl.int32), axis=0) > 0:
            m = tl.full([BLOCK_E, BLOCK_D], float("-inf"), tl.float32)
            l = tl.zeros([BLOCK_E, BLOCK_D], tl.float32)
            acc = tl.zeros([BLOCK_E, BLOCK_D], tl.float32)
            for w0 in tl.static_range(0, W, BLOCK_W):
                w = w0 + tl.arange(0, BLOCK_W)
                present_w = valid[:, None] & (w < W)[None, :]
                if RATIO == 4:
                    present_w = present_w & ((w >= 4)[None, :] | has_overlap[:, None])
                present = present_w[:, :, None] & d_ok[None, None, :]
                in_state = (w[None, :] < buffer_len[:, None])[:, :, None]
                kv_off, score_off = _part_offsets(w, D, RATIO)
                state_row = _window_rows(w[None, :], page0[:, None], page1[:, None], RATIO)
                at_state = state_ptr + state_row[:, :, None] * WIDTH + d[None, None, :]
                at_input = input_ptr + (ragged[:, None] - (W - 1) + w[None, :])[:, :, None] * WIDTH + d[None, None, :]
                kv_off = kv_off[None, :, None]
                score_off = score_off[None, :, None]
                kv = tl.where(
                    in_state,
                    tl.load(at_state + kv_off, mask=present & in_state, other=0.0).to(tl.float32),
                    tl.load(at_input + kv_off, mask=present & ~in_state, other=0.0).to(tl.float32),
                )
                score = tl.where(
                    in_state,
                    tl.load(at_state + score_off, mask=present & in_state, other=0.0).to(tl.float32),
                    tl.load(at_input + score_off, mask=present & ~in_state, other=0.0).to(tl.float32),
                )
                ape = tl.load(ape_ptr + w[:, None] * D + d[None, :], mask=(w < W)[:, None] & d_ok[None, :], other=0.0)
                score = tl.where(present, score + ape.to(tl.float32)[None, :, :], float("-inf"))
                m_new = tl.maximum(m, tl.max(score, axis=1))
                alpha = tl.exp(m - m_new)
                p = tl.where(present, tl.exp(score - m_new[:, None, :]), 0.0)
                l = l * alpha + tl.sum(p, axis=1)
                acc = acc * alpha + tl.sum(p * kv, axis=1)
                m = m_new
            result = tl.where(valid[:, None], acc / l, 0.0)
        tl.store(out_ptr + k[:, None] * D + d[None, :], cast_rne(result, out_ptr.dtype.element_ty),
                 mask=in_plan[:, None] & d_ok[None, :])

    @triton.jit
    def _compress_prefill_write_kernel(
        state_ptr, input_ptr, plan_ptr, num_writes, num_state_rows, num_inputs,
        WIDTH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        in_plan = r < num_writes
        src = tl.load(plan_ptr + r * 2, mask=in_plan, other=-1).to(tl.int64) & 0xFFFFFFFF
        dst = tl.load(plan_ptr + r * 2 + 1, mask=in_plan, other=-1).to(tl.int64)
        live = in_plan & (src < num_inputs) & (dst >= 0) & (dst < num_state_rows)
        for c0 in tl.static_range(0, WIDTH, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            mask = live[:, None] & (c < WIDTH)[None, :]
            v = tl.load(input_ptr + src[:, None] * WIDTH + c[None, :], mask=mask)
            tl.store(state_ptr + dst[:, None] * WIDTH + c[None, :], cast_rne(v.to(tl.float32), state_ptr.dtype.element_ty), mask=mask)


def _block_d(head_dim: int) -> int:
    return min(128, next_pow2(head_dim))


#: prefill pooling tile per ratio: (events per program, window rows per step, channels, warps)
PREFILL_POOL_TILE = {4: (16, 8, 64, 4), 128: (1, 32, 128, 4)}


def compress_forward(kv_score_buffer, kv_score_input, ape, plan, write_plan, out, head_dim, compress_ratio) -> None:
    """Launch the decode kernel, or the two prefill passes (arguments as the op)."""
    r = compress_ratio
    width = 2 * coff(r) * head_dim
    num_rows = kv_score_buffer.numel() // width
    block_d = _block_d(head_dim)
    block_w = 8 if r == 4 else 32
    grid = (plan.shape[0], cdiv(head_dim, block_d))
    if write_plan is None:
        launch(_compress_decode_kernel)[grid](
            kv_score_buffer, kv_score_input, ape, plan.view(torch.int32), out, num_rows,
            HEAD_DIM=head_dim, RATIO=r, BLOCK_D=block_d, BLOCK_W=block_w, num_warps=4,
        )
        return
    events, rows, channels, warps = PREFILL_POOL_TILE[r]
    channels = min(channels, next_pow2(head_dim))
    launch(_compress_prefill_pool_kernel)[(cdiv(plan.shape[0], events), cdiv(head_dim, channels))](
        kv_score_buffer, kv_score_input, ape, plan.view(torch.int32), out, plan.shape[0], num_rows,
        kv_score_input.shape[0], HEAD_DIM=head_dim, RATIO=r, BLOCK_E=events, BLOCK_D=channels, BLOCK_W=rows,
        num_warps=warps,
    )
    block_r = 4
    launch(_compress_prefill_write_kernel)[(cdiv(write_plan.shape[0], block_r),)](
        kv_score_buffer, kv_score_input, write_plan.view(torch.int32), write_plan.shape[0], num_rows,
        kv_score_input.shape[0], WIDTH=width, BLOCK_R=block_r, BLOCK_C=min(1024, next_pow2(width)), num_warps=4,
    )
