"""Read compressed tokens back out of a paged cache (the inverse of the store formats).

Used by tests and debugging tools; it is the reader-side view of the layouts in
``docs/compress_norm_rope_store.md`` (sglang's dequant path does the same).
"""

from __future__ import annotations

import torch

from .._layout import CacheFormat, CacheLayout
from .quant import E2M1_VALUES


def slot_bytes(kvcache: torch.Tensor, locs: torch.Tensor, layout: CacheLayout):
    """(payload ``[n, slot_bytes]``, scales ``[n, scale_bytes]``) uint8 of cache slots ``locs``."""
    cache = kvcache.reshape(-1, layout.page_bytes)
    locs = locs.long()
    page, slot = locs // layout.page_size, locs % layout.page_size
    rows = cache[page]
    payload_at = (slot * layout.slot_bytes)[:, None] + torch.arange(layout.slot_bytes, device=locs.device)
    scale_at = (layout.scale_base + slot * layout.scale_stride)[:, None] + torch.arange(layout.scale_bytes, device=locs.device)
    return rows.gather(1, payload_at), rows.gather(1, scale_at)


def _pow2(exponent_bytes: torch.Tensor) -> torch.Tensor:
    return torch.exp2(exponent_bytes.float() - 127)


def dequantize_slots(kvcache: torch.Tensor, locs: torch.Tensor, layout: CacheLayout) -> torch.Tensor:
    """The stored rows at ``locs`` as fp32 ``[n, D]`` (after norm, RoPE and, for the indexer, Hadamard)."""
    payload, scales = slot_bytes(kvcache, locs, layout)
    n = payload.shape[0]
    fmt = layout.format
    if fmt == CacheFormat.MAIN_BF16:
        return payload.contiguous().view(torch.bfloat16).float()
    if fmt == CacheFormat.MAIN_FP8:
        nope = payload[:, :448].contiguous().view(torch.float8_e4m3fn).float().view(n, 7, 64)
        nope = nope * _pow2(scales)[:, :, None]
        rope = payload[:, 448:].contiguous().view(torch.bfloat16).float()
        return torch.cat([nope.reshape(n, 448), rope], dim=1)
    if fmt == CacheFormat.INDEXER_FP8:
        scale = scales.contiguous().view(torch.float32)  # [n, 1]
        return payload.contiguous().view(torch.float8_e4m3fn).float() * scale
    table = torch.tensor(E2M1_VALUES, device=payload.device)
    codes = torch.stack([payload & 0xF, payload >> 4], dim=2).reshape(n, 128).long()
    values = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    return (values.view(n, 4, 32) * _pow2(scales)[:, :, None]).reshape(n, 128)
