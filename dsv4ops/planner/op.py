"""``torch.ops.dsv4ops.plan_decode`` / ``plan_prefill``: registration and dispatch.

CPU tensors run the PyTorch reference (which Inductor can compile); CUDA tensors
launch the Triton planners through ``wrap_triton`` so that torch.compile and
AOTInductor see the kernels.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch.library import triton_op

from .. import _checks
from .._triton import use_triton
from . import kernels
from .reference import plan_decode_reference, plan_prefill_reference


def _validate_decode(req_pool_indices, req_to_token, full_to_state, seq_lens, compress_ratio, swa_page_size, ring_size,
                     addressing):
    _checks.check_plan_inputs("plan_decode", req_pool_indices, req_to_token, full_to_state, seq_lens, None,
                              compress_ratio, swa_page_size, ring_size, addressing)


def _validate_prefill(req_pool_indices, req_to_token, full_to_state, seq_lens, extend_lens, num_q_tokens,
                      compress_ratio, swa_page_size, ring_size, addressing):
    _checks.check_plan_inputs("plan_prefill", req_pool_indices, req_to_token, full_to_state, seq_lens, extend_lens,
                              compress_ratio, swa_page_size, ring_size, addressing)
    _checks.check_num_q_tokens("plan_prefill", num_q_tokens)


@triton_op("dsv4ops::plan_decode", mutates_args=())
def plan_decode(
    req_pool_indices: torch.Tensor,
    req_to_token: Optional[torch.Tensor],
    full_to_state: Optional[torch.Tensor],
    seq_lens: torch.Tensor,
    compress_ratio: int,
    swa_page_size: int,
    ring_size: int,
    addressing: int,
) -> torch.Tensor:
    """DecodePlan ``[bs, 16]`` uint8 for the token at ``seq_lens[b] - 1`` of every request."""
    _validate_decode(req_pool_indices, req_to_token, full_to_state, seq_lens, compress_ratio, swa_page_size, ring_size,
                     addressing)
    args = (req_pool_indices, req_to_token, full_to_state, seq_lens, compress_ratio, swa_page_size, ring_size, addressing)
    if use_triton(req_pool_indices):
        return kernels.plan_decode(*args)
    return plan_decode_reference(*args)


@plan_decode.register_fake
def _plan_decode_fake(req_pool_indices, req_to_token, full_to_state, seq_lens, compress_ratio, swa_page_size, ring_size, addressing):
    _validate_decode(req_pool_indices, req_to_token, full_to_state, seq_lens, compress_ratio, swa_page_size, ring_size,
                     addressing)
    return req_pool_indices.new_empty((req_pool_indices.shape[0], 16), dtype=torch.uint8)


@triton_op("dsv4ops::plan_prefill", mutates_args=())
def plan_prefill(
    req_pool_indices: torch.Tensor,
    req_to_token: Optional[torch.Tensor],
    full_to_state: Optional[torch.Tensor],
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    num_q_tokens: int,
    compress_ratio: int,
    swa_page_size: int,
    ring_size: int,
    addressing: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(CompressPlan ``[num_q_tokens, 16]``, WritePlan ``[num_q_tokens, 8]``), uint8, padded."""
    _validate_prefill(req_pool_indices, req_to_token, full_to_state, seq_lens, extend_lens, num_q_tokens,
                      compress_ratio, swa_page_size, ring_size, addressing)
    args = (
        req_pool_indices, req_to_token, full_to_state, seq_lens, extend_lens, num_q_tokens,
        compress_ratio, swa_page_size, ring_size, addressing,
    )
    if use_triton(req_pool_indices):
        return kernels.plan_prefill(*args)
    return plan_prefill_reference(*args)


@plan_prefill.register_fake
def _plan_prefill_fake(
    req_pool_indices, req_to_token, full_to_state, seq_lens, extend_lens, num_q_tokens,
    compress_ratio, swa_page_size, ring_size, addressing,
):
    _validate_prefill(req_pool_indices, req_to_token, full_to_state, seq_lens, extend_lens, num_q_tokens,
                      compress_ratio, swa_page_size, ring_size, addressing)
    plan_c = req_pool_indices.new_empty((num_q_tokens, 16), dtype=torch.uint8)
    plan_w = req_pool_indices.new_empty((num_q_tokens, 8), dtype=torch.uint8)
    return plan_c, plan_w
