"""Triton kernels of the fused decode step.

Ratio 4 (core D = 512 and indexer D = 128): **one launch**, one program per request
that owns the whole row: it plans the request (state-row lookups), writes the plan
row, writes the new token into the ring, pools the 8-row window, writes ``out[b]``,
then (after a block barrier, reading back what it wrote) RMS-norms, rotates,
quantizes and stores the compressed token. Every step runs exactly the code of the
unfused kernels (``planner.kernels._state_row``, ``compress.kernels.decode_row``,
``store.kernels._store_*_rows``), so the bytes are those of the unfused ops.

Ratio 128: the 128-row window is too much for one program per request on the decode
critical path, so pooling is split over channel blocks, and the store is a launch of its
own (the standalone store kernel, in decode mode, reading the plan). By default
(``C128_PLAN_LAUNCH``) the plan is a launch of its own too, the decode planner's kernel,
and the pool is the unfused decode kernel: 3 launches. Otherwise every (request, channel
block) program plans its request in the pool launch: 2 launches, but measured slower.
"""

from __future__ import annotations

import torch

from .._layout import CacheLayout, cache_format
from .._triton import HAVE_TRITON, cdiv, hardware_casts, launch
from ..compress import kernels as compress_kernels
from ..planner import kernels as planner_kernels
from ..planner.kernels import _lookup_args
from ..store import kernels as store_kernels
from ..store.quant import fp32

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ..compress.kernels import _grid_position, decode_row
    from ..planner.kernels import _page, _state_row
    from ..store.kernels import _store_indexer_rows, _store_main_rows, _store_position, _store_rows, _store_slots

    @triton.jit
    def _plan_request(b, rpi_ptr, seq_ptr, plan_ptr, r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full,
                      sps, ring, RATIO: tl.constexpr, ADDRESSING: tl.constexpr, HAS_TABLE: tl.constexpr):
        """Write the DecodePlan row of request ``b`` (as ``plan_decode`` computes it)."""
        rid = tl.load(rpi_ptr + b).to(tl.int32)
        seq64 = tl.load(seq_ptr + b)
        live = seq64 >= 1
        seq = tl.where(live, seq64.to(tl.int32), 0)
        lookup = (r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full, sps, ring, RATIO, ADDRESSING, HAS_TABLE)
        write_loc = _state_row(rid, seq - 1, live, *lookup)
        page0 = _page(_state_row(rid, tl.maximum(seq - 1 - RATIO, 0), live, *lookup), RATIO)
        tl.store(plan_ptr + b * 4, seq)
        tl.store(plan_ptr + b * 4 + 1, write_loc)
        tl.store(plan_ptr + b * 4 + 2, page0)
        tl.store(plan_ptr + b * 4 + 3, _page(write_loc, RATIO))

    # The plan row is written, then read back after a block barrier rather than returned: every
    # address a kernel stores to must come from a tl.load in the kernel body. Inductor's mutation
    # analysis of user Triton kernels follows a store address back through helper calls and
    # counts every pointer handed to a helper that returns it as written (req_to_token, seq_lens,
    # ...), and CUDA graphs are then skipped for a graph whose inputs look mutated.

    @triton.jit
    def _decode_step_c4_kernel(
        state_ptr, input_ptr, ape_ptr, rpi_ptr, seq_ptr, plan_ptr, out_ptr,
        weight_ptr, freqs_ptr, out_loc_ptr, cache_ptr,
        bs, num_state_rows, r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full, sps, ring,
        num_locs, num_freq_rows, num_pages, eps, log2_page, page_bytes,
        HEAD_DIM: tl.constexpr, ADDRESSING: tl.constexpr, HAS_TABLE: tl.constexpr, FLAG: tl.constexpr,
        SLOT_BYTES: tl.constexpr, SCALE_STRIDE: tl.constexpr, POOL_FIRST: tl.constexpr, HW_CAST: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        _plan_request(b, rpi_ptr, seq_ptr, plan_ptr, r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full, sps,
                      ring, 4, ADDRESSING, HAS_TABLE)
        tl.debug_barrier()  # the plan row, written by other threads of this program
        word0 = tl.load(plan_ptr + b * 4)
        seq_len = word0.to(tl.int64) & 0xFFFFFFFF
        write_loc = tl.load(plan_ptr + b * 4 + 1).to(tl.int64)
        page0 = tl.load(plan_ptr + b * 4 + 2).to(tl.int64)
        page1 = tl.load(plan_ptr + b * 4 + 3).to(tl.int64)
        # the cache slot is looked up before pooling, so its load is not one more step at the end of the
        # dependent chain (plan, window, pool, store) that sets this kernel's latency
        rows = b + tl.arange(0, 1)
        words0 = word0 + tl.zeros([1], tl.int32)
        live, loc_index = _store_rows(words0, words0, rows, bs, num_locs, True, 4)
        live, pos = _store_position(words0, live, num_freq_rows, 4)
        loc = tl.load(out_loc_ptr + loc_index, mask=live, other=-1).to(tl.int64)
        live, base, slot = _store_slots(loc, live, num_pages, log2_page, page_bytes)
        d = tl.arange(0, HEAD_DIM)
        decode_row(state_ptr, input_ptr, ape_ptr, out_ptr, b, d, seq_len, write_loc, page0, page1, num_state_rows,
                   HEAD_DIM, 4, HEAD_DIM, 8, POOL_FIRST)
        if (seq_len % 4 == 0) & (seq_len >= 4):
            tl.debug_barrier()  # out[b], written by other threads of this program
            if HEAD_DIM == 512:
                _store_main_rows(out_ptr, rows, live, live, base, slot, pos, weight_ptr, freqs_ptr, cache_ptr, eps,
                                 log2_page, FLAG, SLOT_BYTES, SCALE_STRIDE, HW_CAST)
            else:
                _store_indexer_rows(out_ptr, rows, live, live, base, slot, pos, weight_ptr, freqs_ptr, cache_ptr, eps,
                                    log2_page, FLAG, SLOT_BYTES, SCALE_STRIDE, 1, HW_CAST)

    @triton.jit
    def _decode_step_c128_pool_kernel(
        state_ptr, input_ptr, ape_ptr, rpi_ptr, seq_ptr, plan_ptr, out_ptr,
        num_state_rows, r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full, sps, ring,
        HEAD_DIM: tl.constexpr, ADDRESSING: tl.constexpr, HAS_TABLE: tl.constexpr, BLOCK_D: tl.constexpr,
        CHANNELS_FASTEST: tl.constexpr, POOL_FIRST: tl.constexpr,
    ):
        request, block = _grid_position(HEAD_DIM // BLOCK_D, CHANNELS_FASTEST)
        b = request.to(tl.int64)
        # every channel block of request b writes the same 16 bytes of its plan row, then reads back
        # its own write (no program waits for another)
        _plan_request(b, rpi_ptr, seq_ptr, plan_ptr, r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full, sps,
                      ring, 128, ADDRESSING, HAS_TABLE)
        tl.debug_barrier()
        seq_len = tl.load(plan_ptr + b * 4).to(tl.int64) & 0xFFFFFFFF
        write_loc = tl.load(plan_ptr + b * 4 + 1).to(tl.int64)
        page0 = tl.load(plan_ptr + b * 4 + 2).to(tl.int64)
        page1 = tl.load(plan_ptr + b * 4 + 3).to(tl.int64)
        d = block * BLOCK_D + tl.arange(0, BLOCK_D)
        decode_row(state_ptr, input_ptr, ape_ptr, out_ptr, b, d, seq_len, write_loc, page0, page1, num_state_rows,
                   HEAD_DIM, 128, BLOCK_D, 32, POOL_FIRST)


#: ratio 4: warps of the one program per request (it holds the whole row: D 512 or D 128 channels).
#: H200 sweep, batch 128 (2026-12-03, fifth session): D 512 4.76 us at 4 warps, 5.67 at 8, 9.34 at
#: 16; D 128 4.68 us at 2, 5.13 at 4, 7.68 at 8. H100 sweep (twenty-first session), batch 128: D 512
#: 4.08 us at 4, 4.48 at 2, 5.60 at 8; D 128 3.95 us at 1 (no barrier left in its PTX), 4.36 at 2.
C4_WARPS = {512: 4, 128: 1}
#: ratio 128: plan in a launch of its own (the decode planner's kernel), then pool with the
#: unfused decode kernel, instead of every (request, channel block) program planning its request.
#: 3 launches instead of 2, but each request's window lookups run once instead of once per channel
#: block. H200 sweep, batch 128, 32 of 128 rows at a boundary, one CUDA graph (2026-12-03, sixth
#: session): ratio-128 step 15.67 us with the plan launch, 17.58 us fused.
C128_PLAN_LAUNCH = True


def decode_step(kv_score_buffer, kv_score_input, ape, req_pool_indices, req_to_token, full_to_state, seq_lens,
                norm_weight, norm_eps, freqs, out_loc, kvcache, plan, out,
                head_dim, compress_ratio, swa_page_size, ring_size, addressing, page_size, use_fp4, bf16_store) -> None:
    """Launch the fused decode step (arguments as ``torch.ops.dsv4ops.compress_decode_step``)."""
    r = compress_ratio
    bs = req_pool_indices.shape[0]
    width = (4 if r == 4 else 2) * head_dim
    num_rows = kv_score_buffer.numel() // width
    words = plan.view(torch.int32)
    tables, meta = _lookup_args(req_to_token, full_to_state, r, swa_page_size, ring_size, addressing,
                                req_pool_indices.device)
    meta.pop("RATIO")
    layout = CacheLayout(cache_format(head_dim, use_fp4, bf16_store), page_size)
    store_args = (out_loc.shape[0], freqs.shape[0], kvcache.numel() // layout.page_bytes, fp32(norm_eps),
                  page_size.bit_length() - 1, layout.page_bytes)
    if r == 4:
        launch(_decode_step_c4_kernel)[(bs,)](
            kv_score_buffer, kv_score_input, ape, req_pool_indices, seq_lens, words, out,
            norm_weight, freqs, out_loc, kvcache, bs, num_rows, *tables, *store_args,
            HEAD_DIM=head_dim, **meta, FLAG=bool(bf16_store if head_dim == 512 else use_fp4),
            SLOT_BYTES=layout.slot_bytes, SCALE_STRIDE=layout.scale_stride,
            POOL_FIRST=compress_kernels.DECODE_POOL_FIRST, HW_CAST=hardware_casts(), num_warps=C4_WARPS[head_dim],
        )
        return
    if C128_PLAN_LAUNCH:
        planner_kernels.plan_decode(req_pool_indices, req_to_token, full_to_state, seq_lens, r, swa_page_size,
                                    ring_size, addressing, plan=plan)
        compress_kernels.compress_forward(kv_score_buffer, kv_score_input, ape, plan, None, out, head_dim, r)
    else:
        block_d = compress_kernels._channel_block(head_dim, compress_kernels.DECODE_BLOCK_D[128])
        launch(_decode_step_c128_pool_kernel)[(bs * (head_dim // block_d),)](
            kv_score_buffer, kv_score_input, ape, req_pool_indices, seq_lens, words, out, num_rows, *tables,
            HEAD_DIM=head_dim, **meta, BLOCK_D=block_d, CHANNELS_FASTEST=compress_kernels.CHANNELS_FASTEST,
            POOL_FIRST=compress_kernels.DECODE_POOL_FIRST, num_warps=compress_kernels.DECODE_WARPS[128],
        )
    store_kernels.norm_rope_store(out, plan, norm_weight, norm_eps, freqs, out_loc, kvcache, True, r, page_size,
                                  use_fp4, bf16_store)
