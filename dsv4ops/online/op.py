"""Online ratio-128 ops: ``plan_online_decode``, ``plan_online_prefill``, ``compress_forward_online``."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch.library import triton_op

from .. import _checks
from .._triton import use_triton
from . import kernels
from .reference import (
    online_decode_reference,
    online_prefill_reference,
    plan_online_decode_reference,
    plan_online_prefill_reference,
)


def _check_lengths(op, req_pool_indices, seq_lens, extend_lens=None):
    dev = req_pool_indices.device if isinstance(req_pool_indices, torch.Tensor) else None
    _checks.check_tensor(op, "req_pool_indices", req_pool_indices, dtypes=_checks.INDEX_DTYPES, ndim=1)
    _checks.check_tensor(op, "seq_lens", seq_lens, dtypes=_checks.INDEX_DTYPES, ndim=1, device=dev)
    bs = req_pool_indices.shape[0]
    _checks.check(seq_lens.shape[0] == bs, op, lambda: f"`seq_lens` has {seq_lens.shape[0]} entries but `req_pool_indices` has {bs}")
    if extend_lens is not None:
        _checks.check_tensor(op, "extend_lens", extend_lens, dtypes=_checks.INDEX_DTYPES, ndim=1, device=dev)
        _checks.check(extend_lens.shape[0] == bs, op, lambda: f"`extend_lens` has {extend_lens.shape[0]} entries but `req_pool_indices` has {bs}")


@triton_op("dsv4ops::plan_online_decode", mutates_args=())
def plan_online_decode(req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, state_slot_offset: int) -> torch.Tensor:
    """DecodePlan ``[bs, 16]`` for the online ratio-128 compressor (request-scoped state slots)."""
    _check_lengths("plan_online_decode", req_pool_indices, seq_lens)
    if use_triton(req_pool_indices):
        return kernels.plan_online_decode(req_pool_indices, seq_lens, state_slot_offset)
    return plan_online_decode_reference(req_pool_indices, seq_lens, state_slot_offset)


@plan_online_decode.register_fake
def _(req_pool_indices, seq_lens, state_slot_offset):
    _check_lengths("plan_online_decode", req_pool_indices, seq_lens)
    return req_pool_indices.new_empty((req_pool_indices.shape[0], 16), dtype=torch.uint8)


@triton_op("dsv4ops::plan_online_prefill", mutates_args=())
def plan_online_prefill(
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor, num_q_tokens: int,
    state_slot_offset: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(close segments ``[num_q_tokens, 16]``, write segments ``[num_q_tokens, 16]``), padded."""
    _check_lengths("plan_online_prefill", req_pool_indices, seq_lens, extend_lens)
    _checks.check_num_q_tokens("plan_online_prefill", num_q_tokens)
    if use_triton(req_pool_indices):
        return kernels.plan_online_prefill(req_pool_indices, seq_lens, extend_lens, num_q_tokens, state_slot_offset)
    return plan_online_prefill_reference(req_pool_indices, seq_lens, extend_lens, num_q_tokens, state_slot_offset)


@plan_online_prefill.register_fake
def _(req_pool_indices, seq_lens, extend_lens, num_q_tokens, state_slot_offset):
    _check_lengths("plan_online_prefill", req_pool_indices, seq_lens, extend_lens)
    _checks.check_num_q_tokens("plan_online_prefill", num_q_tokens)
    new = lambda: req_pool_indices.new_empty((num_q_tokens, 16), dtype=torch.uint8)  # noqa: E731
    return new(), new()


def _validate(state, kv_score_input, ape, plan, write_plan, out, head_dim):
    op = "compress_forward_online"
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 64 or head_dim > 1024:
        _checks.fail(op, f"`head_dim` must be a positive multiple of 64 and at most 1024, got {head_dim!r}")
    dev = kv_score_input.device if isinstance(kv_score_input, torch.Tensor) else None
    _checks.check_tensor(op, "kv_score_input", kv_score_input, dtypes=_checks.FLOAT_DTYPES, ndim=2,
                         dims={1: 2 * head_dim}, contiguous=True)
    _checks.check_tensor(op, "kv_score_buffer", state, dtypes=(torch.float32,), device=dev, contiguous=True)
    if state.shape[-1] != 3 * head_dim or state.dim() not in (2, 3) or (state.dim() == 3 and state.shape[1] != 1):
        _checks.fail(op, f"`kv_score_buffer` must be [num_slots, {3 * head_dim}] or [num_slots, 1, {3 * head_dim}] "
                         f"(max | sum | kv), got shape {tuple(state.shape)}")
    _checks.check_tensor(op, "ape", ape, dtypes=_checks.FLOAT_DTYPES, ndim=2, dims={0: 128, 1: head_dim}, device=dev,
                         contiguous=True)
    _checks.check_tensor(op, "plan", plan, dtypes=(torch.uint8,), ndim=2, dims={1: 16}, device=dev, contiguous=True)
    _checks.check_tensor(op, "out", out, dtypes=_checks.FLOAT_DTYPES, ndim=2, dims={1: head_dim}, device=dev, contiguous=True)
    _checks.check(out.shape[0] == plan.shape[0], op, lambda: f"`out` has {out.shape[0]} rows but the plan has {plan.shape[0]}")
    if write_plan is None:
        _checks.check(kv_score_input.shape[0] == plan.shape[0], op,
                      lambda: f"decode: `kv_score_input` has {kv_score_input.shape[0]} rows but the plan has {plan.shape[0]}")
    else:
        _checks.check_tensor(op, "write_plan", write_plan, dtypes=(torch.uint8,), ndim=2, dims={1: 16}, device=dev,
                             contiguous=True)


@triton_op("dsv4ops::compress_forward_online", mutates_args={"kv_score_buffer", "out"})
def compress_forward_online(
    kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor, plan: torch.Tensor,
    write_plan: Optional[torch.Tensor], out: torch.Tensor, head_dim: int,
) -> None:
    """Online ratio-128 compression (decode when ``write_plan is None``). Mutates the state slots and ``out``."""
    _validate(kv_score_buffer, kv_score_input, ape, plan, write_plan, out, head_dim)
    state = kv_score_buffer.view(-1, 3 * head_dim)
    if use_triton(kv_score_input):
        kernels.compress_forward_online(state, kv_score_input, ape, plan, write_plan, out, head_dim)
    elif write_plan is None:
        online_decode_reference(state, kv_score_input, ape, plan, out, head_dim)
    else:
        online_prefill_reference(state, kv_score_input, ape, plan, write_plan, out, head_dim)


@compress_forward_online.register_fake
def _(kv_score_buffer, kv_score_input, ape, plan, write_plan, out, head_dim):
    _validate(kv_score_buffer, kv_score_input, ape, plan, write_plan, out, head_dim)
