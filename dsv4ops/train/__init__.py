"""Training support: stateless whole-sequence compression and RMSNorm + RoPE, with autograd.

    from dsv4ops.train import compress_train, norm_rope, ape_window_layout

    out = compress_train(kv_score, ape_window_layout(ape, 4), compress_ratio=4)   # [B, T // 4, D]
    y = norm_rope(out.flatten(0, 1), norm_weight, 1e-6, freqs, positions)

The ops are ``torch.ops.dsv4ops.compress_train`` / ``compress_train_backward`` and
``torch.ops.dsv4ops.norm_rope`` / ``norm_rope_backward``; see ``docs/training.md``.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import op as _op  # noqa: F401  (registers the ops)


def compress_train(kv_score: torch.Tensor, ape: torch.Tensor, *, compress_ratio: int,
                   head_dim: Optional[int] = None) -> torch.Tensor:
    """Pool every complete chunk of ``kv_score`` ``[B, T, 2cD]`` into ``[B, T // compress_ratio, D]``.

    ``ape`` is in kernel layout ``[W, D]`` (see :func:`ape_window_layout`). Differentiable
    in ``kv_score`` and ``ape``. Non-contiguous inputs are made contiguous first.
    """
    if head_dim is None:
        head_dim = ape.shape[-1]
    return torch.ops.dsv4ops.compress_train(kv_score.contiguous(), ape.contiguous(), head_dim, compress_ratio)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, freqs: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
    """RMSNorm of ``x`` ``[N, D]`` with ``weight``, then RoPE on the last 64 elements at ``positions``.

    ``freqs`` is the real ``[P, 64]`` table (cos, sin interleaved) of
    ``dsv4ops.layer.rope_freqs_table``. Differentiable in ``x`` and ``weight``.
    """
    return torch.ops.dsv4ops.norm_rope(x.contiguous(), weight.contiguous(), float(eps), freqs.contiguous(),
                                       positions.contiguous())


def ape_window_layout(ape: torch.Tensor, compress_ratio: int) -> torch.Tensor:
    """The checkpoint's ``ape`` parameter ``[r, c*D]`` in the kernels' ``[W, D]`` layout (differentiable).

    Ratio 4: ``[4, 2D]`` -> ``[8, D]``, rows 0..3 = ``ape[:, :D]`` (applied to the previous
    chunk's A halves), rows 4..7 = ``ape[:, D:]`` (the current chunk's B halves).
    Ratio 128: ``[128, D]`` unchanged.
    """
    if compress_ratio != 4:
        return ape
    D = ape.shape[1] // 2
    return torch.cat([ape[:, :D], ape[:, D:]], dim=0)


__all__ = ["compress_train", "norm_rope", "ape_window_layout"]
