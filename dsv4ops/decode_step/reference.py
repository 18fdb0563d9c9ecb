"""PyTorch reference of the fused decode step: the three unfused references, in order."""

from __future__ import annotations

import torch

from ..compress.reference import compress_decode_reference
from ..planner.reference import plan_decode_reference
from ..store.reference import norm_rope_store_reference


def decode_step_reference(
    kv_score_buffer, kv_score_input, ape, req_pool_indices, req_to_token, full_to_state, seq_lens,
    norm_weight, norm_eps, freqs, out_loc, kvcache, plan, out,
    head_dim, compress_ratio, swa_page_size, ring_size, addressing, page_size, use_fp4, bf16_store,
) -> None:
    """``plan = plan_decode(...)``; ``compress_forward(decode)`` into ``out``; store ``out`` into ``kvcache``."""
    plan.copy_(plan_decode_reference(req_pool_indices, req_to_token, full_to_state, seq_lens, compress_ratio,
                                     swa_page_size, ring_size, addressing))
    compress_decode_reference(kv_score_buffer, kv_score_input, ape, plan, out, head_dim, compress_ratio)
    norm_rope_store_reference(out, plan, norm_weight, norm_eps, freqs, out_loc, kvcache, True, compress_ratio,
                              page_size, use_fp4, bf16_store)
