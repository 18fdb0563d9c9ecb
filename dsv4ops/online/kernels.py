"""Triton kernels of the online ratio-128 compressor.

* planners: decode is elementwise; prefill is one launch of the offline planner's kernel
  (``planner.kernels._plan_prefill_kernel`` with ``ONLINE``: per ragged row, its request and the
  segments of the requests before it). A segment ends at a chunk end (close, closed-form plan_c
  row) or at the request's last token (write, at most one per request), so both destinations are
  closed form too.
* decode: one program per (request, channel block) merges the token into the state.
* prefill: one program per (segment, channel block) pools up to 128 tokens with a
  streaming softmax and merges the stored prefix; close segments write ``out``,
  write segments store the state. The write launch follows the close launch.
"""

from __future__ import annotations

import torch

from .._triton import HAVE_TRITON, cdiv, launch, next_pow2
from ..planner.kernels import CHUNK, DECODE_BLOCK, ROWS, _lookup_args

RATIO = 128

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .._triton_formats import cast_rne
    from ..planner.kernels import _plan_prefill_kernel, _words4

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
    tensors, meta = _lookup_args(None, None, RATIO, 1, 1, 0, device)  # never read online
    launch(_plan_prefill_kernel)[(cdiv(num_q_tokens, ROWS),)](
        plan_c, plan_w, num_q_tokens, req_pool_indices.shape[0], req_pool_indices, seq_lens, extend_lens, 0,
        state_slot_offset, *tensors, **meta, ONLINE=True, ROWS=ROWS, CHUNK=CHUNK, num_warps=4)
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
