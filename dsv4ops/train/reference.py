"""PyTorch references of the training ops (``compress_train``, ``norm_rope`` and their backwards).

Vectorized and traceable (no loops over tokens, no host sync, static shapes): the
CPU implementation of ``torch.ops.dsv4ops.compress_train*`` / ``norm_rope*`` and the
oracle for the Triton kernels. Arithmetic is fp32 whatever the storage dtype (fp64
when an input is fp64, for gradcheck); results are rounded to the storage dtype once.

The backwards are written out explicitly (they are what the backward ops compute),
not obtained by differentiating the forwards.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from .._layout import ROPE_DIM, coff


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp64 if any input is fp64, else fp32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


# ---------------------------------------------------------------------------
# compress_train
# ---------------------------------------------------------------------------


def _windows(kv_score: torch.Tensor, ape: torch.Tensor, head_dim: int, compress_ratio: int):
    """Window values, biased scores and the overlap mask of every complete chunk.

    Returns ``kv, score`` ``[B, N, W, D]`` in the compute dtype (masked rows: value 0,
    score -inf) and ``N``. Ratio 4: rows 0..3 of output n are the A halves of chunk
    n-1 (masked for n = 0), rows 4..7 the B halves of chunk n.
    """
    cdt = compute_dtype(kv_score, ape)
    D, r = head_dim, compress_ratio
    B, T = kv_score.shape[0], kv_score.shape[1]
    N = T // r
    # the complete chunks; a gather rather than a slice, whose contiguity (T % r == 0 or not)
    # would otherwise be guarded on under dynamic shapes and recompile
    whole = kv_score.index_select(1, torch.arange(N * r, device=kv_score.device))
    rows = whole.to(cdt).reshape(B, N, r, 2 * coff(r) * D)
    a = ape.to(cdt)
    if r != 4:
        return rows[..., :D], rows[..., D:] + a, N
    kv_a, kv_b, s_a, s_b = rows[..., 0:D], rows[..., D : 2 * D], rows[..., 2 * D : 3 * D], rows[..., 3 * D :]
    # the previous chunk's A halves: chunk n reads chunk n-1 (a clamped gather; n = 0 is masked below).
    # Gathers, not shifted slices: slices of size N-1 get guarded on (size 1 or not) under dynamic shapes.
    chunk = torch.arange(N, device=kv_score.device)
    prev = torch.clamp(chunk - 1, min=0)
    kv = torch.cat([kv_a.index_select(1, prev), kv_b], dim=2)
    score = torch.cat([s_a.index_select(1, prev), s_b], dim=2) + a
    first = (chunk == 0)[:, None] & (torch.arange(8, device=kv_score.device) < 4)[None, :]
    first = first[None, :, :, None]
    score = torch.where(first, torch.full_like(score, float("-inf")), score)
    kv = torch.where(first, torch.zeros_like(kv), kv)
    return kv, score, N


def compress_train_reference(kv_score: torch.Tensor, ape: torch.Tensor, head_dim: int, compress_ratio: int) -> torch.Tensor:
    """``[B, T, 2cD]`` rows -> ``[B, T // r, D]`` compressed tokens (per-channel softmax pooling)."""
    kv, score, _ = _windows(kv_score, ape, head_dim, compress_ratio)
    p = torch.softmax(score, dim=2)
    return (p * kv).sum(dim=2).to(kv_score.dtype)


def compress_train_backward_reference(
    grad_out: torch.Tensor, kv_score: torch.Tensor, ape: torch.Tensor, head_dim: int, compress_ratio: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(grad_kv_score ``[B, T, 2cD]``, grad_ape ``[W, D]``), recomputing the softmax.

    With ``p_w`` the window weights, ``v_w`` the values and ``o`` the output of a
    compressed token: ``d v_w = p_w g``, ``d s_w = p_w (v_w - o) g``, and ``d ape[w]``
    sums ``d s_w`` over every (batch, token). Rows of the trailing partial chunk (and,
    for ratio 4, the A halves of the last complete chunk) feed no output: zero.
    """
    D, r = head_dim, compress_ratio
    B, T = kv_score.shape[0], kv_score.shape[1]
    kv, score, N = _windows(kv_score, ape, D, r)
    p = torch.softmax(score, dim=2)
    out = (p * kv).sum(dim=2, keepdim=True)
    g = grad_out.to(kv.dtype).unsqueeze(2)
    d_kv = p * g
    d_score = p * (kv - out) * g
    grad_ape = d_score.sum(dim=(0, 1)).to(ape.dtype)
    if r != 4:
        rows = torch.cat([d_kv, d_score], dim=3)
    else:
        # A halves of chunk c come from window rows 0..3 of output c + 1 (none for the last chunk)
        chunk = torch.arange(N, device=kv_score.device)
        nxt = torch.clamp(chunk + 1, max=N - 1)
        has_next = (chunk + 1 < N)[None, :, None, None]
        d_kv_a = torch.where(has_next, d_kv[:, :, :4].index_select(1, nxt), 0.0)
        d_s_a = torch.where(has_next, d_score[:, :, :4].index_select(1, nxt), 0.0)
        rows = torch.cat([d_kv_a, d_kv[:, :, 4:], d_s_a, d_score[:, :, 4:]], dim=3)
    rows = rows.reshape(B, N * r, 2 * coff(r) * D)
    grad_kv_score = F.pad(rows, (0, 0, 0, T - N * r)).to(kv_score.dtype)
    return grad_kv_score, grad_ape


# ---------------------------------------------------------------------------
# norm_rope
# ---------------------------------------------------------------------------


def _cos_sin(freqs: torch.Tensor, positions: torch.Tensor, cdt: torch.dtype):
    """cos, sin ``[N, 32]`` of every row; rows whose position is outside the table are not rotated."""
    pos = positions.long()
    ok = (pos >= 0) & (pos < freqs.shape[0])
    table = freqs[torch.where(ok, pos, torch.zeros_like(pos))].to(cdt)
    cos = torch.where(ok[:, None], table[:, 0::2], torch.ones_like(table[:, 0::2]))
    sin = torch.where(ok[:, None], table[:, 1::2], torch.zeros_like(table[:, 1::2]))
    return cos, sin


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x.square().mean(dim=1, keepdim=True) + eps)


def norm_rope_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, freqs: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """RMSNorm ``x * rsqrt(mean(x^2) + eps) * w``, then RoPE (interleaved pairs) on the last 64 elements."""
    cdt = compute_dtype(x, weight)
    xf = x.to(cdt)
    D = xf.shape[1]
    y = xf * _rstd(xf, eps) * weight.to(cdt)
    cos, sin = _cos_sin(freqs, positions, cdt)
    a, b = y[:, D - ROPE_DIM :: 2], y[:, D - ROPE_DIM + 1 :: 2]
    rotated = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=2).reshape(-1, ROPE_DIM)
    return torch.cat([y[:, : D - ROPE_DIM], rotated], dim=1).to(x.dtype)


def norm_rope_backward_reference(
    grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, freqs: torch.Tensor, positions: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(grad_x ``[N, D]``, grad_weight ``[D]``).

    The rotation is orthogonal, so the gradient before it is the rotated-back
    gradient: ``g_a = g0 c + g1 s``, ``g_b = g1 c - g0 s``. Then with ``h = g w``:
    ``grad_x = rstd h - x rstd^3 sum(h x) / D`` and ``grad_w = sum_rows g x rstd``.
    """
    cdt = compute_dtype(x, weight)
    xf = x.to(cdt)
    D = xf.shape[1]
    g = grad_y.to(cdt)
    cos, sin = _cos_sin(freqs, positions, cdt)
    g0, g1 = g[:, D - ROPE_DIM :: 2], g[:, D - ROPE_DIM + 1 :: 2]
    back = torch.stack([g0 * cos + g1 * sin, g1 * cos - g0 * sin], dim=2).reshape(-1, ROPE_DIM)
    g = torch.cat([g[:, : D - ROPE_DIM], back], dim=1)
    rstd = _rstd(xf, eps)
    h = g * weight.to(cdt)
    grad_x = rstd * h - xf * (rstd**3) * ((h * xf).sum(dim=1, keepdim=True) / D)
    grad_w = (g * xf * rstd).sum(dim=0)
    return grad_x.to(x.dtype), grad_w.to(weight.dtype)
