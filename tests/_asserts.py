"""Comparisons shared by the tests."""

from __future__ import annotations

import torch

from dsv4ops._layout import CacheFormat, CacheLayout
from dsv4ops.store.readback import dequantize_slots, slot_bytes


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, msg: str = "") -> None:
    """Bitwise equality (NaN payloads included)."""
    assert a.shape == b.shape and a.dtype == b.dtype, f"{msg}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    ia = a.contiguous().view(torch.uint8)
    ib = b.contiguous().view(torch.uint8)
    bad = (ia != ib).nonzero()
    assert bad.numel() == 0, f"{msg}: {bad.shape[0]} bytes differ, first at {bad[:5].tolist()}"


def assert_layer_states_match(a, b) -> None:
    """The ``state`` buffers of two ``DeepSeekV4Compressor`` runs (say eager and compiled) of the same steps.

    The ring holds copies of the input rows only: bit-exact, NaN poison included. The online
    state's running (max, sum, kv) rows are computed, so two backends may differ in the last ulp."""
    if a.online:
        torch.testing.assert_close(a.state, b.state, rtol=1e-5, atol=1e-6, equal_nan=True)
    else:
        assert_same_bits(a.state, b.state, "state")


def written_byte_mask(cache: torch.Tensor, locs: torch.Tensor, layout: CacheLayout) -> torch.Tensor:
    """Bool mask over the cache bytes that a store to ``locs`` may write."""
    mask = torch.zeros(cache.numel(), dtype=torch.bool, device=cache.device)
    locs = locs[locs >= 0].long()
    page, slot = locs // layout.page_size, locs % layout.page_size
    base = page * layout.page_bytes
    for start, stride, size in ((0, layout.slot_bytes, layout.slot_bytes), (layout.scale_base, layout.scale_stride, layout.scale_bytes)):
        if size:
            at = (base + start + slot * stride)[:, None] + torch.arange(size, device=cache.device)
            mask[at.reshape(-1)] = True
    return mask.view(cache.shape)


def assert_caches_equivalent(a: torch.Tensor, b: torch.Tensor, locs: torch.Tensor, layout: CacheLayout,
                             max_flipped_fraction: float = 0.01) -> None:
    """Two caches written from pooled rows that agree to ~1e-6 relative.

    Bytes outside the written slots must be identical; inside, a value may sit on
    the other side of a rounding boundary, so the dequantized rows must agree to
    one quantization step and at most ``max_flipped_fraction`` of the bytes differ.
    """
    written = written_byte_mask(a, locs, layout)
    assert torch.equal(a[~written], b[~written]), "bytes outside the written slots differ"
    locs = torch.unique(locs[locs >= 0])
    if locs.numel() == 0:
        return
    pa, sa = slot_bytes(a, locs, layout)
    pb, sb = slot_bytes(b, locs, layout)
    flipped = (pa != pb).float().mean().item()
    assert flipped <= max_flipped_fraction, f"{flipped:.2%} of payload bytes differ"
    va, vb = dequantize_slots(a, locs, layout), dequantize_slots(b, locs, layout)
    row_max = torch.maximum(va.abs().amax(1, keepdim=True), vb.abs().amax(1, keepdim=True))
    rtol = 0.5 if layout.format == CacheFormat.INDEXER_FP4 else 0.13
    atol = (0.12 if layout.format == CacheFormat.INDEXER_FP4 else 2e-3) * row_max
    excess = (va - vb).abs() - (atol + rtol * torch.maximum(va.abs(), vb.abs()))
    assert excess.max().item() <= 0, f"dequantized values differ by more than one step (excess {excess.max().item():.3g})"
