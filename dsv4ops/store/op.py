"""``torch.ops.dsv4ops.compress_norm_rope_store``: registration and dispatch."""

from __future__ import annotations

import torch
from torch.library import triton_op

from .. import _checks
from .._layout import CacheLayout, cache_format
from .._triton import use_triton
from . import kernels
from .reference import norm_rope_store_reference


def _validate(kv, plan, norm_weight, norm_eps, freqs, out_loc, kvcache, is_decode, compress_ratio, page_size, use_fp4, bf16_store):
    op = "compress_norm_rope_store"
    _checks.check_store_inputs(
        op, kv, plan, norm_weight, freqs, out_loc, kvcache, is_decode, compress_ratio, page_size, use_fp4, bf16_store
    )
    layout = CacheLayout(cache_format(kv.shape[1], use_fp4, bf16_store), page_size)
    if kvcache.numel() % layout.page_bytes:
        _checks.fail(
            op,
            f"`kvcache` must hold whole pages of {layout.page_bytes} bytes "
            f"({layout.format.name}, page_size={page_size}), got {kvcache.numel()} bytes (shape {tuple(kvcache.shape)})",
        )


@triton_op("dsv4ops::compress_norm_rope_store", mutates_args={"kvcache"})
def compress_norm_rope_store(
    kv: torch.Tensor,
    plan: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    freqs: torch.Tensor,
    out_loc: torch.Tensor,
    kvcache: torch.Tensor,
    is_decode: bool,
    compress_ratio: int,
    page_size: int,
    use_fp4: bool = False,
    bf16_store: bool = False,
) -> None:
    """RMSNorm + RoPE (+ Hadamard for the indexer) + quantize + paged scatter of compressed rows.

    ``kv`` ``[n, D]`` (D = 512 or 128), ``plan`` ``[n, 16]`` (DecodePlan if ``is_decode`` else
    CompressPlan), ``freqs`` ``[max_pos, 64]`` fp32 (cos, sin interleaved), ``out_loc`` int32/int64
    cache slots, ``kvcache`` uint8 holding whole pages. Mutates only the addressed bytes of ``kvcache``.
    """
    args = (kv, plan, norm_weight, norm_eps, freqs, out_loc, kvcache, is_decode, compress_ratio, page_size, use_fp4, bf16_store)
    _validate(*args)
    if use_triton(kv):
        kernels.norm_rope_store(*args)
    else:
        norm_rope_store_reference(*args)


@compress_norm_rope_store.register_fake
def _store_fake(kv, plan, norm_weight, norm_eps, freqs, out_loc, kvcache, is_decode, compress_ratio, page_size, use_fp4=False, bf16_store=False):
    _validate(kv, plan, norm_weight, norm_eps, freqs, out_loc, kvcache, is_decode, compress_ratio, page_size, use_fp4, bf16_store)
