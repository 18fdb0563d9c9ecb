"""PyTorch reference of ``compress_norm_rope_store``.

RMSNorm -> RoPE on the last 64 elements (interleaved pairs) -> Hadamard (indexer
only) -> quantize -> scatter into a paged uint8 cache. Traceable, static shapes,
no host sync. The arithmetic is pinned down so that every implementation writes
the same bytes (see ``docs/compress_norm_rope_store.md``, "Numerics"):

* ``sum(x**2)`` is accumulated in fp64; ``rstd = fp32(1 / sqrt(S / D + fp32(eps)))``
  is evaluated in fp64 and rounded once;
* ``y = fp32(fp32(x * rstd) * w)``;
* each rotated value is the fp64 evaluation of ``a*c - b*s`` / ``a*s + b*c``
  (exact products) rounded once to fp32;
* everything after that is exact fp32 arithmetic and integer bit manipulation.
"""

from __future__ import annotations

import torch

from .._indexing import in_range, masked_scatter_rows_, safe_index
from .._layout import INVALID_WORD, ROPE_DIM, CacheFormat, CacheLayout, cache_format
from . import quant


def rms_norm_rope(kv: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float, cos_sin: torch.Tensor) -> torch.Tensor:
    """``[n, D]`` rows -> RMS-normalized rows with the last 64 elements rotated (fp32).

    ``cos_sin`` is ``[n, 64]``: ``(cos t0, sin t0, cos t1, sin t1, ...)`` per row.
    """
    x = kv.float()
    D = x.shape[1]
    sum_sq = x.double().square().sum(dim=1)
    eps = quant.scalar_like(norm_eps, x).double()  # fp32(eps), widened
    rstd = (1.0 / torch.sqrt(sum_sq / D + eps)).float()
    y = (x * rstd[:, None]) * norm_weight.float()
    a = y[:, D - ROPE_DIM :: 2].double()
    b = y[:, D - ROPE_DIM + 1 :: 2].double()
    cos = cos_sin[:, 0::2].double()
    sin = cos_sin[:, 1::2].double()
    rotated = torch.stack([(a * cos - b * sin).float(), (a * sin + b * cos).float()], dim=2)
    return torch.cat([y[:, : D - ROPE_DIM], rotated.reshape(-1, ROPE_DIM)], dim=1)


def quantize_rows(y: torch.Tensor, fmt: CacheFormat):
    """Encode rotated rows ``[n, D]`` fp32 into (payload ``[n, P]``, scales ``[n, S]``) uint8."""
    n = y.shape[0]
    if fmt == CacheFormat.MAIN_BF16:
        return quant.bf16_bytes(y), y.new_zeros((n, 0), dtype=torch.uint8)
    if fmt == CacheFormat.MAIN_FP8:
        nope = quant.bf16_round(y[:, :448]).reshape(n, 7, 64)
        amax = nope.abs().amax(dim=2)
        exponent = quant.ue8m0_ceil(quant.div_rn(torch.clamp_min(amax, quant.SCALE_FLOOR), quant.E4M3_MAX))  # [n, 7]
        codes = quant.e4m3_bytes(nope * quant.pow2_from_biased(254 - exponent)[:, :, None]).reshape(n, 448)
        payload = torch.cat([codes, quant.bf16_bytes(y[:, 448:])], dim=1)
        return payload, exponent.to(torch.uint8)
    h = quant.hadamard128(y)
    if fmt == CacheFormat.INDEXER_FP8:
        scale = quant.div_rn(torch.clamp_min(h.abs().amax(dim=1), quant.SCALE_FLOOR), quant.E4M3_MAX)  # [n]
        codes = quant.e4m3_bytes(h * quant.reciprocal_rn(scale)[:, None])
        return codes, quant.fp32_bytes(scale[:, None])
    groups = h.reshape(n, 4, 32)
    exponent = quant.ue8m0_ceil(quant.div_rn(torch.clamp_min(groups.abs().amax(dim=2), quant.SCALE_FLOOR), quant.E2M1_MAX))
    codes = quant.e2m1_codes(groups * quant.pow2_from_biased(254 - exponent)[:, :, None]).reshape(n, 64, 2)
    packed = (codes[:, :, 0] | (codes[:, :, 1] << 4)).to(torch.uint8)
    return packed, exponent.to(torch.uint8)


def store_targets(
    plan: torch.Tensor,
    out_loc: torch.Tensor,
    num_freq_rows: int,
    num_pages,
    is_decode: bool,
    compress_ratio: int,
    page_size: int,
):
    """Which rows are stored, at which (page, slot), and their RoPE positions.

    Returns ``live [n] bool, page [n], slot [n], pos [n]`` (int64, safe to index
    with even where ``live`` is False).
    """
    words = plan.view(torch.int32).long()
    n = words.shape[0]
    seq_len = words[:, 0] & 0xFFFFFFFF
    if is_decode:
        live = (torch.remainder(seq_len, compress_ratio) == 0) & (seq_len >= compress_ratio)
        loc_index = torch.arange(n, device=plan.device)
    else:
        live = (words[:, 0] != INVALID_WORD) & (seq_len >= compress_ratio)
        loc_index = words[:, 1] & 0xFFFF
    live = live & in_range(loc_index, out_loc.shape[0])
    loc = out_loc[safe_index(loc_index, live)].long()
    pos = seq_len - compress_ratio
    shift = page_size.bit_length() - 1
    page = loc >> shift
    live = live & (loc >= 0) & (page < num_pages) & in_range(pos, num_freq_rows)
    return live, safe_index(page, live), safe_index(loc & (page_size - 1), live), safe_index(pos, live)


def norm_rope_store_reference(
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
    use_fp4: bool,
    bf16_store: bool,
) -> None:
    """Normalize, rotate, quantize and scatter ``kv`` rows; mutates only addressed cache bytes."""
    layout = CacheLayout(cache_format(kv.shape[1], use_fp4, bf16_store), page_size)
    cache = kvcache.view(-1)
    num_pages = cache.shape[0] // layout.page_bytes
    live, page, slot, pos = store_targets(
        plan, out_loc, freqs.shape[0], num_pages, is_decode, compress_ratio, page_size
    )
    y = rms_norm_rope(kv, norm_weight, norm_eps, freqs[pos])
    payload, scales = quantize_rows(y, layout.format)

    page_base = page * layout.page_bytes
    payload_at = (page_base + slot * layout.slot_bytes)[:, None] + torch.arange(payload.shape[1], device=kv.device)
    scale_at = (page_base + layout.scale_base + slot * layout.scale_stride)[:, None] + torch.arange(
        scales.shape[1], device=kv.device
    )
    index = torch.cat([payload_at, scale_at], dim=1)
    values = torch.cat([payload, scales], dim=1)
    mask = live[:, None].expand_as(index)
    masked_scatter_rows_(cache, index.reshape(-1), values.reshape(-1), mask.reshape(-1))
