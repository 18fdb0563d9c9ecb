"""``torch.ops.dsv4ops.compress_forward``: registration and dispatch.

One op for decode (``write_plan is None``) and prefill. It mutates the whole
state buffer and the whole ``out`` tensor it is given; the Python API allocates
``out`` when the caller does not pass one.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.library import triton_op

from .. import _checks
from .._triton import use_triton
from . import kernels
from .reference import compress_decode_reference, compress_prefill_reference


def _validate(kv_score_buffer, kv_score_input, ape, plan, write_plan, out, head_dim, compress_ratio):
    _checks.check_compress_inputs(
        "compress_forward", kv_score_buffer, kv_score_input, ape, plan, write_plan, out, head_dim, compress_ratio
    )


@triton_op("dsv4ops::compress_forward", mutates_args={"kv_score_buffer", "out"})
def compress_forward(
    kv_score_buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    ape: torch.Tensor,
    plan: torch.Tensor,
    write_plan: Optional[torch.Tensor],
    out: torch.Tensor,
    head_dim: int,
    compress_ratio: int,
) -> None:
    """Write new tokens into the ring state and softmax-pool every finished window into ``out``.

    Decode (``write_plan is None``): ``plan`` is a DecodePlan ``[bs, 16]``, one input row per
    plan row. Prefill: ``plan`` is a CompressPlan ``[n_c, 16]`` and ``write_plan`` a WritePlan
    ``[n_w, 8]``; ``out[k]`` belongs to ``plan[k]``. Rows that produce no compressed token are zero.
    """
    _validate(kv_score_buffer, kv_score_input, ape, plan, write_plan, out, head_dim, compress_ratio)
    if use_triton(kv_score_input):
        kernels.compress_forward(kv_score_buffer, kv_score_input, ape, plan, write_plan, out, head_dim, compress_ratio)
    elif write_plan is None:
        compress_decode_reference(kv_score_buffer, kv_score_input, ape, plan, out, head_dim, compress_ratio)
    else:
        compress_prefill_reference(kv_score_buffer, kv_score_input, ape, plan, write_plan, out, head_dim, compress_ratio)


@compress_forward.register_fake
def _compress_forward_fake(kv_score_buffer, kv_score_input, ape, plan, write_plan, out, head_dim, compress_ratio):
    _validate(kv_score_buffer, kv_score_input, ape, plan, write_plan, out, head_dim, compress_ratio)
