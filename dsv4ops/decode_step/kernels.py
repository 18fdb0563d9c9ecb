"""Triton kernels of the fused decode step.

Ratio 4 (core D = 512 and indexer D = 128): **one launch**, one program per request
that owns the whole row: it plans the request (state-row lookups), writes the plan
row, writes the new token into the ring, pools the 8-row window, writes ``out[b]``,
then (after a block barrier, reading back what it wrote) RMS-norms, rotates,
quantizes and stores the compressed token. Every step runs exactly the code of the
unfused kernels (``planner.kernels._state_row``, ``compress.kernels.decode_row``,
``store.kernels._store_*_rows``), so the bytes are those of the unfused ops.

Ratio 128: the 128-row window is too much for one program per request on the decode
critical path, so pooling is split over channel blocks (one program per request and
channel block, planning included) and the store is a second launch (the standalone
store kernel, in decode mode, reading the plan the first launch wrote).
"""

from __future__ import annotations

import torch

from .._layout import CacheLayout, cache_format
from .._triton import HAVE_TRITON, cdiv, launch
from ..compress import kernels as compress_kernels
from ..planner.kernels import _lookup_args
from ..store import kernels as store_kernels
from ..store.quant import fp32

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ..compress.kernels import decode_row
    from ..planner.kernels import _page, _state_row
    from ..store.kernels import _store_indexer_rows, _store_main_rows, _store_targets

    @triton.jit
    def _plan_request(b, rpi_ptr, seq_ptr, plan_ptr, r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full,
                      sps, ring, RATIO: tl.constexpr, ADDRESSING: tl.constexpr, HAS_TABLE: tl.constexpr,
                      WRITE: tl.constexpr):
        """The DecodePlan row of request ``b`` (as ``plan_decode`` computes it); stored when ``WRITE``."""
        rid = tl.load(rpi_ptr + b).to(tl.int32)
        seq64 = tl.load(seq_ptr + b)
        live = seq64 >= 1
        seq = tl.where(live, seq64.to(tl.int32), 0)
        lookup = (r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full, sps, ring, RATIO, ADDRESSING, HAS_TABLE)
        write_loc = _state_row(rid, seq - 1, live, *lookup)
        page0 = _page(_state_row(rid, tl.maximum(seq - 1 - RATIO, 0), live, *lookup), RATIO)
        page1 = _page(write_loc, RATIO)
        if WRITE:
            tl.store(plan_ptr + b * 4, seq)
            tl.store(plan_ptr + b * 4 + 1, write_loc)
            tl.store(plan_ptr + b * 4 + 2, page0)
            tl.store(plan_ptr + b * 4 + 3, page1)
        return (seq.to(tl.int64) & 0xFFFFFFFF), write_loc.to(tl.int64), page0.to(tl.int64), page1.to(tl.int64)

    @triton.jit
    def _decode_step_c4_kernel(
        state_ptr, input_ptr, ape_ptr, rpi_ptr, seq_ptr, plan_ptr, out_ptr,
        weight_ptr, freqs_ptr, out_loc_ptr, cache_ptr,
        bs, num_state_rows, r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full, sps, ring,
        num_locs, num_freq_rows, num_pages, eps, log2_page, page_bytes,
        HEAD_DIM: tl.constexpr, ADDRESSING: tl.constexpr, HAS_TABLE: tl.constexpr, FLAG: tl.constexpr,
        SLOT_BYTES: tl.constexpr, SCALE_STRIDE: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        seq_len, write_loc, page0, page1 = _plan_request(
            b, rpi_ptr, seq_ptr, plan_ptr, r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full, sps, ring,
            4, ADDRESSING, HAS_TABLE, True)
        d = tl.arange(0, HEAD_DIM)
        decode_row(state_ptr, input_ptr, ape_ptr, out_ptr, b, d, seq_len, write_loc, page0, page1, num_state_rows,
                   HEAD_DIM, 4, HEAD_DIM, 8)
        if (seq_len % 4 == 0) & (seq_len >= 4):
            tl.debug_barrier()  # out[b] and the plan row, written by other threads of this program
            rows = b + tl.arange(0, 1)
            live, base, slot, pos = _store_targets(plan_ptr, out_loc_ptr, rows, bs, num_locs, num_freq_rows,
                                                   num_pages, log2_page, page_bytes, True, 4)
            if HEAD_DIM == 512:
                _store_main_rows(out_ptr, rows, live, base, slot, pos, weight_ptr, freqs_ptr, cache_ptr, eps,
                                 log2_page, FLAG, SLOT_BYTES, SCALE_STRIDE)
            else:
                _store_indexer_rows(out_ptr, rows, live, base, slot, pos, weight_ptr, freqs_ptr, cache_ptr, eps,
                                    log2_page, FLAG, SLOT_BYTES, SCALE_STRIDE, 1)

    @triton.jit
    def _decode_step_c128_pool_kernel(
        state_ptr, input_ptr, ape_ptr, rpi_ptr, seq_ptr, plan_ptr, out_ptr,
        num_state_rows, r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full, sps, ring,
        HEAD_DIM: tl.constexpr, ADDRESSING: tl.constexpr, HAS_TABLE: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        seq_len, write_loc, page0, page1 = _plan_request(
            b, rpi_ptr, seq_ptr, plan_ptr, r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full, sps, ring,
            128, ADDRESSING, HAS_TABLE, False)
        if block == 0:  # one writer per plan row
            tl.store(plan_ptr + b * 4, seq_len.to(tl.int32))
            tl.store(plan_ptr + b * 4 + 1, write_loc.to(tl.int32))
            tl.store(plan_ptr + b * 4 + 2, page0.to(tl.int32))
            tl.store(plan_ptr + b * 4 + 3, page1.to(tl.int32))
        d = block * BLOCK_D + tl.arange(0, BLOCK_D)
        decode_row(state_ptr, input_ptr, ape_ptr, out_ptr, b, d, seq_len, write_loc, page0, page1, num_state_rows,
                   HEAD_DIM, 128, BLOCK_D, 32)


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
            SLOT_BYTES=layout.slot_bytes, SCALE_STRIDE=layout.scale_stride, num_warps=8 if head_dim == 512 else 4,
        )
        return
    block_d = compress_kernels._channel_block(head_dim, compress_kernels.DECODE_BLOCK_D[128])
    launch(_decode_step_c128_pool_kernel)[(bs, head_dim // block_d)](
        kv_score_buffer, kv_score_input, ape, req_pool_indices, seq_lens, words, out, num_rows, *tables,
        HEAD_DIM=head_dim, **meta, BLOCK_D=block_d, num_warps=4,
    )
    store_kernels.norm_rope_store(out, plan, norm_weight, norm_eps, freqs, out_loc, kvcache, True, r, page_size,
                                  use_fp4, bf16_store)
