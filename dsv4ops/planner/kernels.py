"""Triton planners: decode (elementwise) and prefill (deterministic compaction in three launches).

Prefill: (1) ``torch.cumsum`` turns ``extend_lens`` into per-request ragged end offsets;
(2) programs over ragged-row blocks classify every row (compress event? written to
the ring?) and count per block; (3) the same programs recompute their rows, add the
counts of the blocks before them and scatter valid rows to their final place, then
fill their share of the padding rows. Rows land in ragged order (batch-major,
position-ascending), exactly as the reference and the host planner order them.
No host sync: every size the kernels need is a tensor or a static bound.
"""

from __future__ import annotations

import torch

from .._layout import MAX_Q_TOKENS
from .._triton import HAVE_TRITON, cdiv, launch, next_pow2

ROWS_PER_BLOCK = 1024
MAX_BLOCKS = next_pow2(cdiv(MAX_Q_TOKENS, ROWS_PER_BLOCK))  # 64

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _state_row(rid, pos, ok, r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full,
                   sps, ring, RATIO: tl.constexpr, ADDRESSING: tl.constexpr,
                   HAS_TABLE: tl.constexpr):
        """State row of (rid, pos) (int64), -1 where ``ok`` is off or a lookup is out of range."""
        ok = ok & (rid >= 0) & (pos >= 0)
        if ADDRESSING == 2:  # legacy
            if RATIO == 4:
                row = (2 * rid + (pos // 4) % 2) * 4 + pos % 4
            else:
                row = rid * RATIO + pos % RATIO
        elif ADDRESSING == 1:  # request-scoped ring
            row = rid * ring + pos % ring
            if HAS_TABLE:
                ok = ok & (rid < num_reqs) & (pos < max_len)
        else:  # SWA-paged
            ok = ok & (rid < num_reqs) & (pos < max_len)
            token = tl.load(r2t_ptr + rid * r2t_stride + pos, mask=ok, other=0).to(tl.int64)
            ok = ok & (token >= 0) & (token < num_full)
            swa = tl.load(f2s_ptr + token, mask=ok, other=0).to(tl.int64)
            ok = ok & (swa >= 0)
            row = (swa // sps) * ring + swa % ring
        return tl.where(ok, row, -1)

    @triton.jit
    def _page(row, RATIO: tl.constexpr):
        return tl.where(row >= 0, row // RATIO, -1)

    @triton.jit
    def _plan_decode_kernel(
        rpi_ptr, seq_ptr, plan_ptr, bs, r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full,
        sps, ring, RATIO: tl.constexpr, ADDRESSING: tl.constexpr,
        HAS_TABLE: tl.constexpr, BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_batch = b < bs
        rid = tl.load(rpi_ptr + b, mask=in_batch, other=0).to(tl.int64)
        seq = tl.load(seq_ptr + b, mask=in_batch, other=0).to(tl.int64)
        live = in_batch & (seq >= 1)
        lookup = (r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full, sps, ring, RATIO, ADDRESSING, HAS_TABLE)
        write_loc = _state_row(rid, seq - 1, live, *lookup)
        page0 = _page(_state_row(rid, tl.maximum(seq - 1 - RATIO, 0), live, *lookup), RATIO)
        out = plan_ptr + b * 4
        tl.store(out, tl.where(live, seq, 0).to(tl.int32), mask=in_batch)
        tl.store(out + 1, write_loc.to(tl.int32), mask=in_batch)
        tl.store(out + 2, page0.to(tl.int32), mask=in_batch)
        tl.store(out + 3, _page(write_loc, RATIO).to(tl.int32), mask=in_batch)

    @triton.jit
    def ragged_rows(block, num_q_tokens, ends_ptr, bs, rpi_ptr, seq_ptr, ext_ptr,
                    LOG2_MAX_BS: tl.constexpr, BLOCK: tl.constexpr):
        """Ragged rows ``i`` of one block -> (i, in range, belongs to a valid request, seq_len, request id,
        index inside the request's extend, position). ``ends`` are the requests' ragged end offsets."""
        i = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        in_rows = i < num_q_tokens
        # request of each row: the number of request ends <= i (a branch-free binary search)
        lo = tl.zeros([BLOCK], tl.int64)
        hi = tl.zeros([BLOCK], tl.int64) + bs
        for _ in tl.static_range(LOG2_MAX_BS):
            active = lo < hi
            mid = (lo + hi) // 2
            end = tl.load(ends_ptr + mid, mask=active, other=0)
            right = end <= i
            lo = tl.where(active & right, mid + 1, lo)
            hi = tl.where(active & ~right, mid, hi)
        b = lo
        in_batch = in_rows & (b < bs)
        seq = tl.load(seq_ptr + b, mask=in_batch, other=0).to(tl.int64)
        ext = tl.load(ext_ptr + b, mask=in_batch, other=0).to(tl.int64)
        rid = tl.load(rpi_ptr + b, mask=in_batch, other=0).to(tl.int64)
        end = tl.load(ends_ptr + b, mask=in_batch, other=0)
        ok = in_batch & (ext >= 0) & (ext <= seq)
        j = i - (end - ext)
        return i, in_rows, ok, seq, rid, j, seq - ext + j

    @triton.jit
    def block_offset(counts_ptr, which, block, num_q_tokens, BLOCK: tl.constexpr, MAX_BLOCKS: tl.constexpr):
        """(rows counted by the blocks before ``block``, rows counted by all blocks) for count ``which``."""
        blocks = tl.arange(0, MAX_BLOCKS)
        counts = tl.load(counts_ptr + blocks * 2 + which, mask=blocks < tl.cdiv(num_q_tokens, BLOCK), other=0)
        return tl.sum(tl.where(blocks < block, counts, 0), axis=0), tl.sum(counts, axis=0)

    @triton.jit
    def _classify_rows(
        block, num_q_tokens, ends_ptr, bs, rpi_ptr, seq_ptr, ext_ptr,
        r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full,
        sps, ring, RATIO: tl.constexpr, ADDRESSING: tl.constexpr,
        HAS_TABLE: tl.constexpr, LOG2_MAX_BS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """Per ragged row of one block: event/write flags and the words of their plan rows."""
        W: tl.constexpr = 8 if RATIO == 4 else RATIO
        i, in_rows, ok, seq, rid, j, pos = ragged_rows(
            block, num_q_tokens, ends_ptr, bs, rpi_ptr, seq_ptr, ext_ptr, LOG2_MAX_BS, BLOCK)
        lookup = (r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full, sps, ring, RATIO, ADDRESSING, HAS_TABLE)

        is_event = ok & ((pos + 1) % RATIO == 0)
        buffer_len = W - tl.minimum(j + 1, W)
        row = _state_row(rid, pos, ok, *lookup)
        page0 = _page(_state_row(rid, tl.maximum(pos - RATIO, 0), ok, *lookup), RATIO)

        last_complete = (seq // RATIO) * RATIO
        if ADDRESSING == 2:
            first_write = last_complete - (4 if RATIO == 4 else 0)
            keep = pos >= first_write
        else:
            spec_pad = tl.minimum(ring - RATIO, 4)
            first_write = tl.minimum(last_complete - (4 if RATIO == 4 else 0), seq - spec_pad)
            keep = pos >= first_write
            if RATIO == 4 and ADDRESSING == 0:
                keep = keep | (pos % sps >= sps - 4)
        is_write = ok & keep
        return i, in_rows, is_event, is_write, pos, buffer_len, page0, _page(row, RATIO), row

    @triton.jit
    def _count_rows_kernel(
        counts_ptr, num_q_tokens, ends_ptr, bs, rpi_ptr, seq_ptr, ext_ptr,
        r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full,
        sps, ring, RATIO: tl.constexpr, ADDRESSING: tl.constexpr,
        HAS_TABLE: tl.constexpr, LOG2_MAX_BS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        block = tl.program_id(0)
        _, _, is_event, is_write, _, _, _, _, _ = _classify_rows(
            block, num_q_tokens, ends_ptr, bs, rpi_ptr, seq_ptr, ext_ptr, r2t_ptr, r2t_stride, num_reqs, max_len,
            f2s_ptr, num_full, sps, ring, RATIO, ADDRESSING, HAS_TABLE, LOG2_MAX_BS, BLOCK)
        tl.store(counts_ptr + block * 2, tl.sum(is_event.to(tl.int32), axis=0))
        tl.store(counts_ptr + block * 2 + 1, tl.sum(is_write.to(tl.int32), axis=0))

    @triton.jit
    def _emit_rows_kernel(
        plan_c_ptr, plan_w_ptr, counts_ptr, num_q_tokens, ends_ptr, bs, rpi_ptr, seq_ptr, ext_ptr,
        r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full,
        sps, ring, RATIO: tl.constexpr, ADDRESSING: tl.constexpr,
        HAS_TABLE: tl.constexpr, LOG2_MAX_BS: tl.constexpr, BLOCK: tl.constexpr, MAX_BLOCKS: tl.constexpr,
    ):
        block = tl.program_id(0)
        i, in_rows, is_event, is_write, pos, buffer_len, page0, page1, row = _classify_rows(
            block, num_q_tokens, ends_ptr, bs, rpi_ptr, seq_ptr, ext_ptr, r2t_ptr, r2t_stride, num_reqs, max_len,
            f2s_ptr, num_full, sps, ring, RATIO, ADDRESSING, HAS_TABLE, LOG2_MAX_BS, BLOCK)
        event_base, total_events = block_offset(counts_ptr, 0, block, num_q_tokens, BLOCK, MAX_BLOCKS)
        write_base, total_writes = block_offset(counts_ptr, 1, block, num_q_tokens, BLOCK, MAX_BLOCKS)

        ev = is_event.to(tl.int32)
        dst = (event_base + tl.cumsum(ev, axis=0) - ev).to(tl.int64)
        out = plan_c_ptr + dst * 4
        tl.store(out, (pos + 1).to(tl.int32), mask=is_event)
        tl.store(out + 1, (i | (buffer_len << 16)).to(tl.int32), mask=is_event)
        tl.store(out + 2, page0.to(tl.int32), mask=is_event)
        tl.store(out + 3, page1.to(tl.int32), mask=is_event)
        wr = is_write.to(tl.int32)
        dst = (write_base + tl.cumsum(wr, axis=0) - wr).to(tl.int64)
        tl.store(plan_w_ptr + dst * 2, i.to(tl.int32), mask=is_write)
        tl.store(plan_w_ptr + dst * 2 + 1, row.to(tl.int32), mask=is_write)

        # padding: output rows of this block's range past the valid ones
        pad_c = in_rows & (i >= total_events)
        tl.store(plan_c_ptr + i * 4, tl.full([BLOCK], -1, tl.int32), mask=pad_c)
        tl.store(plan_c_ptr + i * 4 + 1, tl.zeros([BLOCK], tl.int32), mask=pad_c)
        tl.store(plan_c_ptr + i * 4 + 2, tl.full([BLOCK], -1, tl.int32), mask=pad_c)
        tl.store(plan_c_ptr + i * 4 + 3, tl.full([BLOCK], -1, tl.int32), mask=pad_c)
        pad_w = in_rows & (i >= total_writes)
        tl.store(plan_w_ptr + i * 2, tl.full([BLOCK], -1, tl.int32), mask=pad_w)
        tl.store(plan_w_ptr + i * 2 + 1, tl.full([BLOCK], -1, tl.int32), mask=pad_w)


def _lookup_args(req_to_token, full_to_state, compress_ratio, swa_page_size, ring_size, addressing, device):
    """Kernel arguments of ``_state_row``; absent tables become never-read one-element placeholders."""
    has_table = req_to_token is not None
    r2t = req_to_token if has_table else torch.empty(1, 1, dtype=torch.int32, device=device)
    f2s = full_to_state if full_to_state is not None else torch.empty(1, dtype=torch.int64, device=device)
    tensors = (r2t, r2t.stride(0), r2t.shape[0], r2t.shape[1], f2s, f2s.shape[0], max(swa_page_size, 1),
               max(ring_size, 1))
    meta = dict(RATIO=compress_ratio, ADDRESSING=int(addressing), HAS_TABLE=has_table)
    return tensors, meta


def plan_decode(req_pool_indices, req_to_token, full_to_state, seq_lens, compress_ratio, swa_page_size, ring_size,
                addressing) -> torch.Tensor:
    bs = req_pool_indices.shape[0]
    plan = torch.empty((bs, 4), dtype=torch.int32, device=req_pool_indices.device)
    tensors, meta = _lookup_args(req_to_token, full_to_state, compress_ratio, swa_page_size, ring_size, addressing,
                                 req_pool_indices.device)
    block = 128
    launch(_plan_decode_kernel)[(cdiv(bs, block),)](
        req_pool_indices, seq_lens, plan, bs, *tensors, BLOCK=block, **meta, num_warps=4,
    )
    return plan.view(torch.uint8)


def plan_prefill(req_pool_indices, req_to_token, full_to_state, seq_lens, extend_lens, num_q_tokens, compress_ratio,
                 swa_page_size, ring_size, addressing):
    device = req_pool_indices.device
    bs = req_pool_indices.shape[0]
    plan_c = torch.empty((num_q_tokens, 4), dtype=torch.int32, device=device)
    plan_w = torch.empty((num_q_tokens, 2), dtype=torch.int32, device=device)
    ends = torch.cumsum(torch.clamp_min(extend_lens.to(torch.int64), 0), 0)  # ragged end offset of each request
    num_blocks = cdiv(num_q_tokens, ROWS_PER_BLOCK)
    counts = torch.empty((MAX_BLOCKS * 2,), dtype=torch.int32, device=device)
    tensors, meta = _lookup_args(req_to_token, full_to_state, compress_ratio, swa_page_size, ring_size, addressing,
                                 device)
    meta.update(LOG2_MAX_BS=MAX_Q_TOKENS.bit_length() + 1, BLOCK=ROWS_PER_BLOCK)
    rows = (num_q_tokens, ends, bs, req_pool_indices, seq_lens, extend_lens, *tensors)
    launch(_count_rows_kernel)[(num_blocks,)](counts, *rows, **meta, num_warps=4)
    launch(_emit_rows_kernel)[(num_blocks,)](plan_c, plan_w, counts, *rows, **meta, MAX_BLOCKS=MAX_BLOCKS, num_warps=4)
    return plan_c.view(torch.uint8), plan_w.view(torch.uint8)
