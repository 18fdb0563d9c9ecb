"""``torch.ops.dsv4ops.compress_decode_step``: plan + compress_forward + norm_rope_store for one decode step.

The three sglang calls of a decode step (``CompressorDecodePlan.generate``,
``compress_forward``, ``compress_norm_rope_store``) as one op, so a compressor costs
one kernel launch (ratio 4) or two (ratio 128) on the decode critical path instead of
three. Its results are exactly those of the three ops run in order: the same plan
bytes, state, pooled rows and cache bytes.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.library import triton_op

from .. import _checks
from .._triton import use_triton
from ..store.op import _validate as _validate_store
from . import kernels
from .reference import decode_step_reference

OP = "compress_decode_step"


def _validate(kv_score_buffer, kv_score_input, ape, req_pool_indices, req_to_token, full_to_state, seq_lens,
              norm_weight, norm_eps, freqs, out_loc, kvcache, plan, out, head_dim, compress_ratio, swa_page_size,
              ring_size, addressing, page_size, use_fp4, bf16_store):
    _checks.check_plan_inputs(OP, req_pool_indices, req_to_token, full_to_state, seq_lens, None, compress_ratio,
                              swa_page_size, ring_size, addressing)
    _checks.check_compress_inputs(OP, kv_score_buffer, kv_score_input, ape, plan, None, out, head_dim, compress_ratio)
    _checks.check(kv_score_input.shape[0] == req_pool_indices.shape[0], OP,
                  lambda: f"`kv_score_input` has {kv_score_input.shape[0]} rows for {req_pool_indices.shape[0]} requests")
    _validate_store(out, plan, norm_weight, norm_eps, freqs, out_loc, kvcache, True, compress_ratio, page_size,
                    use_fp4, bf16_store)


@triton_op("dsv4ops::compress_decode_step", mutates_args={"kv_score_buffer", "kvcache", "plan", "out"})
def compress_decode_step(
    kv_score_buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    ape: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: Optional[torch.Tensor],
    full_to_state: Optional[torch.Tensor],
    seq_lens: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    freqs: torch.Tensor,
    out_loc: torch.Tensor,
    kvcache: torch.Tensor,
    plan: torch.Tensor,
    out: torch.Tensor,
    head_dim: int,
    compress_ratio: int,
    swa_page_size: int,
    ring_size: int,
    addressing: int,
    page_size: int,
    use_fp4: bool = False,
    bf16_store: bool = False,
) -> None:
    """One decode step of one compressor: writes ``plan`` (``[bs, 16]`` uint8 DecodePlan rows) and
    ``out`` (``[bs, head_dim]`` pooled rows, zeros where no chunk ends).

    Arguments are those of ``plan_decode``, ``compress_forward`` (decode) and
    ``compress_norm_rope_store`` (``is_decode=True``) together. Also mutates the state rows the
    plan writes and the cache slots of the requests that complete a chunk. (Outputs are passed in,
    as in ``compress_forward``, so the op stays out of autograd.)
    """
    args = (kv_score_buffer, kv_score_input, ape, req_pool_indices, req_to_token, full_to_state, seq_lens,
            norm_weight, norm_eps, freqs, out_loc, kvcache, plan, out, head_dim, compress_ratio, swa_page_size,
            ring_size, addressing, page_size, use_fp4, bf16_store)
    _validate(*args)
    if use_triton(kv_score_input):
        kernels.decode_step(*args)
    else:
        decode_step_reference(*args)


@compress_decode_step.register_fake
def _fake(kv_score_buffer, kv_score_input, ape, req_pool_indices, req_to_token, full_to_state, seq_lens,
          norm_weight, norm_eps, freqs, out_loc, kvcache, plan, out, head_dim, compress_ratio, swa_page_size, ring_size,
          addressing, page_size, use_fp4=False, bf16_store=False):
    _validate(kv_score_buffer, kv_score_input, ape, req_pool_indices, req_to_token, full_to_state, seq_lens,
              norm_weight, norm_eps, freqs, out_loc, kvcache, plan, out, head_dim, compress_ratio, swa_page_size,
              ring_size, addressing, page_size, use_fp4, bf16_store)
