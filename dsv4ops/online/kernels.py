"""Triton kernels of the online ratio-128 compressor.

* planners: decode is elementwise; prefill is one launch built on the offline planner's
  ``walk_chunk`` and ``row_fields`` (per ragged row: its request and the segments of the requests before
  it). A segment ends at a chunk end (close, closed-form plan_c row) or at the
  request's last token (write, at most one per request), so both destinations are
  closed form too.
* decode: one program per (request, channel block) merges the token into the state.
* prefill: one program per (segment, channel block) pools up to 128 tokens with a
  streaming softmax and merges the stored prefix; close segments write ``out``,
  write segments store the state. The write launch follows the close launch.
"""

from __future__ import annotations

import torch

from .._triton import HAVE_TRITON, cdiv, launch, next_pow2
from ..planner.kernels import CHUNK, DECODE_BLOCK, ROWS

RATIO = 128

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .._triton_formats import cast_rne
    from ..planner.kernels import _words4, row_fields, walk_chunk

    @triton.jit
    def _plan_online_decode_kernel(rpi_ptr, seq_ptr, plan_ptr, bs, offset, BLOCK: tl.constexpr):
        b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        in_batch = b < bs
        rid = tl.load(rpi_ptr + b, mask=in_batch, other=0)
        seq = tl.load(seq_ptr + b, mask=in_batch, other=0)
        live = (seq >= 1) & (rid >= 0)
        slot = tl.where(live, rid.to(tl.int32) + offset, -1)
        words = _words4(tl.where(live, seq.to(tl.int32), 0), slot, slot, tl.full([BLOCK], -1, tl.int32))
        tl.store(plan_ptr + b[:, None] * 4 + tl.arange(0, 4)[None, :], words, mask=in_batch[:, None])

    @triton.jit
    def _plan_online_prefill_kernel(plan_c_ptr, plan_w_ptr, num_q_tokens, bs, rpi_ptr, seq_ptr, ext_ptr, offset,
                                    ROWS: tl.constexpr, CHUNK: tl.constexpr):
        """Segments in closed form: close segment of position p (a chunk end) -> plan_c row
        ``closes before the request + (p + 1) // 128 - prefix // 128 - 1``; the request's trailing write
        segment (its last position, not a chunk end) -> plan_w row ``write segments before the request``."""
        i0 = tl.program_id(0) * ROWS
        i = i0 + tl.arange(0, ROWS)
        lane = tl.arange(0, CHUNK)
        b = tl.zeros([ROWS], tl.int32)  # per row: requests that end at or before it
        begin = tl.zeros([ROWS], tl.int32)  # their rows, close and write segments
        close_base = tl.zeros([ROWS], tl.int32)
        write_base = tl.zeros([ROWS], tl.int32)
        done = tl.sum(b, 0)
        total_close = tl.sum(b, 0)
        total_write = tl.sum(b, 0)
        seq_next = tl.load(seq_ptr + lane, mask=lane < bs, other=0)
        ext_next = tl.load(ext_ptr + lane, mask=lane < bs, other=0)
        rid_next = tl.load(rpi_ptr + lane, mask=lane < bs, other=0)
        c0 = 0
        while c0 < bs:  # the walk of planner.kernels._plan_prefill_kernel, loads in the body (see walk_chunk)
            seq64 = seq_next
            ext64 = ext_next
            rid_ok = rid_next >= 0
            nxt = c0 + CHUNK + lane
            seq_next = tl.load(seq_ptr + nxt, mask=nxt < bs, other=0)
            ext_next = tl.load(ext_ptr + nxt, mask=nxt < bs, other=0)
            rid_next = tl.load(rpi_ptr + nxt, mask=nxt < bs, other=0)
            b, begin, close_base, write_base, done, total_close, total_write = walk_chunk(
                i, i0, c0, bs, seq64, ext64, rid_ok, b, begin, close_base, write_base, done, total_close, total_write,
                num_q_tokens, 0, 1, 128, 0, True, ROWS, CHUNK)
            c0 += CHUNK
        in_rows = i < num_q_tokens
        live = in_rows & (b < bs)
        ok, j, pos, prefix, seq, rid = row_fields(
            i, live, begin, tl.load(seq_ptr + b, mask=live, other=0), tl.load(ext_ptr + b, mask=live, other=0),
            tl.load(rpi_ptr + b, mask=live, other=0), True)
        start = tl.maximum(pos - pos % 128, prefix)  # first position of the segment
        ends_chunk = (pos + 1) % 128 == 0
        is_close = ok & ends_chunk
        is_write = ok & (pos == seq - 1) & ~ends_chunk
        slot = rid + offset
        words = _words4(pos + 1, i | ((pos + 1 - start) << 16), slot, tl.where(start % 128 != 0, slot, -1))
        col4 = tl.arange(0, 4)[None, :]
        close_dst = close_base + (pos + 1) // 128 - prefix // 128 - 1
        tl.store(plan_c_ptr + close_dst[:, None] * 4 + col4, words, mask=is_close[:, None])
        tl.store(plan_w_ptr + write_base[:, None] * 4 + col4, words, mask=is_write[:, None])
        sentinel = tl.broadcast_to(tl.where(col4 == 1, 0, -1), (ROWS, 4))
        tl.store(plan_c_ptr + i[:, None] * 4 + col4, sentinel, mask=(in_rows & (i >= total_close))[:, None])
        tl.store(plan_w_ptr + i[:, None] * 4 + col4, sentinel, mask=(in_rows & (i >= total_write))[:, None])

    @triton.jit
    def _merge(m1, s1, k1, m2, s2, k2):
        m = tl.maximum(m1, m2)
        w1 = s1 * tl.exp(m1 - m)
        w2 = s2 * tl.exp(m2 - m)
        total = w1 + w2
        return m, total, (k1 * w1 + k2 * w2) / total

    @triton.jit
    def _online_decode_kernel(state_ptr, input_ptr, ape_ptr, plan_ptr, out_ptr, num_slots,
                              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        D: tl.constexpr = HEAD_DIM
        b = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = d < D
        seq = tl.load(plan_ptr + b * 4).to(tl.int64) & 0xFFFFFFFF
        write_slot = tl.load(plan_ptr + b * 4 + 1).to(tl.int64)
        load_slot = tl.load(plan_ptr + b * 4 + 2).to(tl.int64)
        q = (seq - 1) % 128
        continues = q != 0
        valid = (seq >= 1) & (~continues | ((load_slot >= 0) & (load_slot < num_slots)))
        result = tl.zeros([BLOCK_D], tl.float32)
        if valid:
            kv = tl.load(input_ptr + b * 2 * D + d, mask=d_ok, other=0.0).to(tl.float32)
            m = tl.load(input_ptr + b * 2 * D + D + d, mask=d_ok, other=0.0).to(tl.float32) \
                + tl.load(ape_ptr + q * D + d, mask=d_ok, other=0.0).to(tl.float32)
            s = tl.full([BLOCK_D], 1.0, tl.float32)
            if continues:
                old = state_ptr + load_slot * 3 * D + d
                m, s, kv = _merge(tl.load(old, mask=d_ok), tl.load(old + D, mask=d_ok), tl.load(old + 2 * D, mask=d_ok),
                                  m, s, kv)
            if q == 127:
                result = kv
            else:
                store = d_ok & (write_slot >= 0) & (write_slot < num_slots)
                at = state_ptr + write_slot * 3 * D + d
                tl.store(at, m, mask=store)
                tl.store(at + D, s, mask=store)
                tl.store(at + 2 * D, kv, mask=store)
        tl.store(out_ptr + b * D + d, cast_rne(result, out_ptr.dtype.element_ty), mask=d_ok)

    @triton.jit
    def _online_prefill_kernel(state_ptr, input_ptr, ape_ptr, plan_ptr, out_ptr, num_rows, num_slots, num_inputs,
                               HEAD_DIM: tl.constexpr, IS_WRITE: tl.constexpr, BLOCK_D: tl.constexpr,
                               BLOCK_T: tl.constexpr):
        D: tl.constexpr = HEAD_DIM
        k = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = d < D
        word0 = tl.load(plan_ptr + k * 4)
        word1 = tl.load(plan_ptr + k * 4 + 1).to(tl.int64)
        slot = tl.load(plan_ptr + k * 4 + 2).to(tl.int64)
        load = tl.load(plan_ptr + k * 4 + 3).to(tl.int64)
        seq = word0.to(tl.int64) & 0xFFFFFFFF
        ragged = word1 & 0xFFFF
        length = (word1 >> 16) & 0xFFFF
        first = ragged - length + 1
        valid = (word0 != -1) & (length >= 1) & (length <= 128) & (seq >= length) & (first >= 0) \
            & (ragged < num_inputs) & ((load < 0) | (load < num_slots))
        if IS_WRITE:
            valid = valid & (slot >= 0) & (slot < num_slots)
        result = tl.zeros([BLOCK_D], tl.float32)
        if valid:
            m = tl.full([BLOCK_D], float("-inf"), tl.float32)
            s = tl.zeros([BLOCK_D], tl.float32)
            acc = tl.zeros([BLOCK_D], tl.float32)
            for t0 in tl.static_range(0, 128, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                present = (t < length)[:, None] & d_ok[None, :]
                row = input_ptr + (first + t)[:, None] * 2 * D + d[None, :]
                q = (seq - length + t) % 128
                kv = tl.load(row, mask=present, other=0.0).to(tl.float32)
                score = tl.load(row + D, mask=present, other=0.0).to(tl.float32) \
                    + tl.load(ape_ptr + q[:, None] * D + d[None, :], mask=present, other=0.0).to(tl.float32)
                score = tl.where(present, score, float("-inf"))
                m_new = tl.maximum(m, tl.max(score, axis=0))
                alpha = tl.exp(m - m_new)
                p = tl.where(present, tl.exp(score - m_new[None, :]), 0.0)
                s = s * alpha + tl.sum(p, axis=0)
                acc = acc * alpha + tl.sum(p * kv, axis=0)
                m = m_new
            kv = acc / s
            if load >= 0:
                old = state_ptr + load * 3 * D + d
                m, s, kv = _merge(tl.load(old, mask=d_ok), tl.load(old + D, mask=d_ok), tl.load(old + 2 * D, mask=d_ok),
                                  m, s, kv)
            if IS_WRITE:
                at = state_ptr + slot * 3 * D + d
                tl.store(at, m, mask=d_ok)
                tl.store(at + D, s, mask=d_ok)
                tl.store(at + 2 * D, kv, mask=d_ok)
            else:
                result = kv
        if not IS_WRITE:
            tl.store(out_ptr + k * D + d, cast_rne(result, out_ptr.dtype.element_ty), mask=d_ok)


def plan_online_decode(req_pool_indices, seq_lens, state_slot_offset) -> torch.Tensor:
    bs = req_pool_indices.shape[0]
    plan = torch.empty((bs, 4), dtype=torch.int32, device=req_pool_indices.device)
    launch(_plan_online_decode_kernel)[(cdiv(bs, DECODE_BLOCK),)](req_pool_indices, seq_lens, plan, bs,
                                                                   state_slot_offset, BLOCK=DECODE_BLOCK, num_warps=4)
    return plan.view(torch.uint8)


def plan_online_prefill(req_pool_indices, seq_lens, extend_lens, num_q_tokens, state_slot_offset):
    device = req_pool_indices.device
    plan_c = torch.empty((num_q_tokens, 4), dtype=torch.int32, device=device)
    plan_w = torch.empty((num_q_tokens, 4), dtype=torch.int32, device=device)
    launch(_plan_online_prefill_kernel)[(cdiv(num_q_tokens, ROWS),)](
        plan_c, plan_w, num_q_tokens, req_pool_indices.shape[0], req_pool_indices, seq_lens, extend_lens,
        state_slot_offset, ROWS=ROWS, CHUNK=CHUNK, num_warps=4)
    return plan_c.view(torch.uint8), plan_w.view(torch.uint8)


def compress_forward_online(state, kv_score_input, ape, plan, write_plan, out, head_dim) -> None:
    """``state`` is the ``[num_slots, 3 * head_dim]`` view of the buffer."""
    block_d = min(128, next_pow2(head_dim))
    grid = (plan.shape[0], cdiv(head_dim, block_d))
    num_slots = state.shape[0]
    if write_plan is None:
        launch(_online_decode_kernel)[grid](state, kv_score_input, ape, plan.view(torch.int32), out, num_slots,
                                            HEAD_DIM=head_dim, BLOCK_D=block_d, num_warps=4)
        return
    common = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_T=32, num_warps=4)
    launch(_online_prefill_kernel)[grid](state, kv_score_input, ape, plan.view(torch.int32), out, plan.shape[0],
                                         num_slots, kv_score_input.shape[0], IS_WRITE=False, **common)
    launch(_online_prefill_kernel)[(write_plan.shape[0], cdiv(head_dim, block_d))](
        state, kv_score_input, ape, write_plan.view(torch.int32), out, write_plan.shape[0], num_slots,
        kv_score_input.shape[0], IS_WRITE=True, **common)
