"""Static-shape indexing helpers for the PyTorch reference implementations.

The references must trace under ``torch.compile`` / ``torch.export`` with
symbolic (even unbacked) sizes, so they never drop rows with boolean masks.
Masked work is expressed with clamped indices and ``torch.where`` instead.
"""

from __future__ import annotations

import torch


def in_range(idx: torch.Tensor, upper) -> torch.Tensor:
    """``0 <= idx < upper`` elementwise."""
    return (idx >= 0) & (idx < upper)


def safe_index(idx: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """``idx`` where ``ok``, else 0: an index that is always legal to gather with."""
    return torch.where(ok, idx, torch.zeros_like(idx))


def masked_scatter_rows_(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor, mask: torch.Tensor) -> None:
    """``dst[index[i]] = src[i]`` for every ``i`` with ``mask[i]``; other rows of ``dst`` untouched.

    ``dst`` is ``[R, ...]`` with ``R >= 1``, ``index``/``mask`` are ``[n]`` (``n`` may be 0
    or symbolic), ``src`` is ``[n, ...]``. Rows whose mask is off are redirected to
    repeat the first live row's write (same target, same value), which keeps
    ``index_put_`` deterministic; when no row is live they rewrite ``dst[0]`` with
    its own current value. No branch depends on ``n`` or on data.
    """
    # One extra dead row makes argmax/indexing legal when n == 0.
    index = torch.cat([index, index.new_zeros(1)])
    mask = torch.cat([mask, mask.new_zeros(1)])
    src = torch.cat([src.to(dst.dtype), dst[:1]])
    # First live row. The key has a unique maximum, so every evaluation of this argmax
    # (a compiler may recompute it per consumer) picks the same row.
    order = torch.arange(mask.shape[0], 0, -1, device=mask.device)
    first = torch.argmax(torch.where(mask, order, torch.zeros_like(order))).view(1)
    any_live = mask.any()
    first_index = index.index_select(0, first)  # [1]
    fallback_index = torch.where(any_live, first_index, torch.zeros_like(first_index))
    fallback_value = torch.where(any_live, src.index_select(0, first), dst[:1])  # [1, ...]
    target = torch.where(mask, index, fallback_index)
    value_mask = mask.view((-1,) + (1,) * (src.dim() - 1))
    value = torch.where(value_mask, src, fallback_value)
    dst.index_put_((target,), value)
