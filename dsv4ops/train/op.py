"""Training ops: registration, validation, fake kernels and autograd.

* ``torch.ops.dsv4ops.compress_train(kv_score, ape, head_dim, compress_ratio) -> out``
* ``torch.ops.dsv4ops.compress_train_backward(grad_out, kv_score, ape, head_dim, compress_ratio)
  -> (grad_kv_score, grad_ape)``
* ``torch.ops.dsv4ops.norm_rope(x, weight, eps, freqs, positions) -> y``
* ``torch.ops.dsv4ops.norm_rope_backward(grad_y, x, weight, eps, freqs, positions) -> (grad_x, grad_weight)``

The forward ops save only their inputs; the backward ops recompute the softmax
(compress_train) and the rstd (norm_rope). The backward ops have no autograd formula
of their own (no double backward). CUDA tensors run the Triton kernels, anything else
the PyTorch reference (which is also what Inductor compiles on CPU).
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch.library import triton_op

from .. import _checks
from .._layout import ROPE_DIM, SUPPORTED_RATIOS, coff, window_len
from .._triton import use_triton
from . import kernels
from .reference import (
    compress_train_backward_reference,
    compress_train_reference,
    norm_rope_backward_reference,
    norm_rope_reference,
)

#: storage dtypes of the training ops (fp64 additionally on CPU, for gradcheck)
TRAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: norm_rope row widths: the rotated part is the last 64 elements; the whole row sits in registers
NORM_ROPE_MAX_DIM = 4096


def _float_dtypes(device: torch.device):
    return TRAIN_DTYPES if device.type == "cuda" else TRAIN_DTYPES + (torch.float64,)


def _check_float(op: str, name: str, t, device=None, **kw) -> None:
    _checks.check_tensor(op, name, t, **kw)  # type / rank / dims first
    allowed = _float_dtypes(t.device)
    if t.dtype not in allowed:
        where = "" if t.device.type != "cuda" else " (float64 is CPU-only)"
        _checks.fail(op, f"`{name}` must have dtype {_checks._fmt_dtypes(allowed)}{where}, got "
                         f"{str(t.dtype).replace('torch.', '')}", TypeError)
    if device is not None and t.device != device:
        _checks.fail(op, f"`{name}` is on {t.device} but `kv_score`/`x` is on {device}")


def _check_same_shape(op: str, name: str, t, shape) -> None:
    """``t.shape == shape``, one (possibly symbolic) check per dim."""
    for got, want in zip(t.shape, shape):
        _checks.check(got == want, op, lambda: f"`{name}` must have shape {list(shape)}, got {list(t.shape)}")


def check_train_head_dim(op: str, head_dim, compress_ratio) -> None:
    if compress_ratio not in SUPPORTED_RATIOS:
        _checks.fail(op, f"`compress_ratio` must be 4 or 128, got {compress_ratio!r}")
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0 or head_dim % 64:
        _checks.fail(op, f"`head_dim` must be a positive multiple of 64, got {head_dim!r}")


def _validate_compress(op: str, kv_score, ape, head_dim, compress_ratio) -> None:
    check_train_head_dim(op, head_dim, compress_ratio)
    width = 2 * coff(compress_ratio) * head_dim
    _check_float(op, "kv_score", kv_score, ndim=3, contiguous=True)
    if kv_score.shape[2] != width:
        _checks.fail(op, f"`kv_score` rows must be 2 * {coff(compress_ratio)} * head_dim = {width} wide for ratio "
                         f"{compress_ratio}, got shape {tuple(kv_score.shape)}")
    W = window_len(compress_ratio)
    _check_float(op, "ape", ape, kv_score.device, ndim=2, contiguous=True)
    if tuple(ape.shape) != (W, head_dim):
        _checks.fail(op, f"`ape` must be [{W}, {head_dim}] (window rows x head_dim) for ratio {compress_ratio}, "
                         f"got shape {tuple(ape.shape)}")


def _validate_compress_backward(grad_out, kv_score, ape, head_dim, compress_ratio) -> None:
    op = "compress_train_backward"
    _validate_compress(op, kv_score, ape, head_dim, compress_ratio)
    _check_float(op, "grad_out", grad_out, kv_score.device, ndim=3, contiguous=True)
    B, T = kv_score.shape[0], kv_score.shape[1]
    _check_same_shape(op, "grad_out", grad_out, (B, T // compress_ratio, head_dim))


@triton_op("dsv4ops::compress_train", mutates_args=())
def compress_train(kv_score: torch.Tensor, ape: torch.Tensor, head_dim: int, compress_ratio: int) -> torch.Tensor:
    """Softmax-pool every complete chunk of ``kv_score`` ``[B, T, 2cD]`` into ``[B, T // r, D]``."""
    _validate_compress("compress_train", kv_score, ape, head_dim, compress_ratio)
    if use_triton(kv_score):
        return kernels.compress_train(kv_score, ape, head_dim, compress_ratio)
    return compress_train_reference(kv_score, ape, head_dim, compress_ratio)


@compress_train.register_fake
def _compress_train_fake(kv_score, ape, head_dim, compress_ratio):
    _validate_compress("compress_train", kv_score, ape, head_dim, compress_ratio)
    return kv_score.new_empty((kv_score.shape[0], kv_score.shape[1] // compress_ratio, head_dim))


@triton_op("dsv4ops::compress_train_backward", mutates_args=())
def compress_train_backward(
    grad_out: torch.Tensor, kv_score: torch.Tensor, ape: torch.Tensor, head_dim: int, compress_ratio: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(grad_kv_score like ``kv_score``, grad_ape like ``ape``); the softmax is recomputed."""
    _validate_compress_backward(grad_out, kv_score, ape, head_dim, compress_ratio)
    if use_triton(kv_score):
        return kernels.compress_train_backward(grad_out, kv_score, ape, head_dim, compress_ratio)
    return compress_train_backward_reference(grad_out, kv_score, ape, head_dim, compress_ratio)


@compress_train_backward.register_fake
def _compress_train_backward_fake(grad_out, kv_score, ape, head_dim, compress_ratio):
    _validate_compress_backward(grad_out, kv_score, ape, head_dim, compress_ratio)
    return torch.empty_like(kv_score), torch.empty_like(ape)


def _compress_setup_context(ctx, inputs, output):
    kv_score, ape, head_dim, compress_ratio = inputs
    ctx.save_for_backward(kv_score, ape)
    ctx.head_dim = head_dim
    ctx.compress_ratio = compress_ratio


def _compress_backward(ctx, grad):
    kv_score, ape = ctx.saved_tensors
    grad_kv, grad_ape = torch.ops.dsv4ops.compress_train_backward(
        grad.contiguous(), kv_score, ape, ctx.head_dim, ctx.compress_ratio
    )
    return (grad_kv if ctx.needs_input_grad[0] else None, grad_ape if ctx.needs_input_grad[1] else None, None, None)


compress_train.register_autograd(_compress_backward, setup_context=_compress_setup_context)


# ---------------------------------------------------------------------------
# norm_rope
# ---------------------------------------------------------------------------


def _validate_norm_rope(op: str, x, weight, eps, freqs, positions) -> None:
    _check_float(op, "x", x, ndim=2, contiguous=True)
    D = x.shape[1]
    if D < ROPE_DIM or D > NORM_ROPE_MAX_DIM:
        _checks.fail(op, f"`x` rows must have {ROPE_DIM} <= D <= {NORM_ROPE_MAX_DIM} (RoPE rotates the last "
                         f"{ROPE_DIM} elements), got shape {tuple(x.shape)}")
    _check_float(op, "weight", weight, x.device, ndim=1, contiguous=True)
    if weight.shape[0] != D:
        _checks.fail(op, f"`weight` must be [{D}], got shape {tuple(weight.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        _checks.fail(op, f"`eps` must be a finite float >= 0, got {eps!r}")
    _checks.check_tensor(op, "freqs", freqs, dtypes=(torch.float32,), ndim=2, dims={1: ROPE_DIM}, device=x.device,
                         contiguous=True)
    _checks.check_tensor(op, "positions", positions, dtypes=_checks.INDEX_DTYPES, ndim=1, device=x.device,
                         contiguous=True)
    _checks.check(positions.shape[0] == x.shape[0], op,
                  lambda: f"`positions` has {positions.shape[0]} entries but `x` has {x.shape[0]} rows")


def _validate_norm_rope_backward(grad_y, x, weight, eps, freqs, positions) -> None:
    op = "norm_rope_backward"
    _validate_norm_rope(op, x, weight, eps, freqs, positions)
    _check_float(op, "grad_y", grad_y, x.device, ndim=2, contiguous=True)
    _check_same_shape(op, "grad_y", grad_y, tuple(x.shape))


@triton_op("dsv4ops::norm_rope", mutates_args=())
def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, freqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RMSNorm then RoPE (interleaved pairs, last 64 elements) of ``x`` ``[N, D]``, in ``x``'s dtype."""
    _validate_norm_rope("norm_rope", x, weight, eps, freqs, positions)
    if use_triton(x):
        return kernels.norm_rope(x, weight, eps, freqs, positions)
    return norm_rope_reference(x, weight, eps, freqs, positions)


@norm_rope.register_fake
def _norm_rope_fake(x, weight, eps, freqs, positions):
    _validate_norm_rope("norm_rope", x, weight, eps, freqs, positions)
    return torch.empty_like(x)


@triton_op("dsv4ops::norm_rope_backward", mutates_args=())
def norm_rope_backward(
    grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, freqs: torch.Tensor, positions: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(grad_x like ``x``, grad_weight like ``weight``); rstd is recomputed."""
    _validate_norm_rope_backward(grad_y, x, weight, eps, freqs, positions)
    if use_triton(x):
        return kernels.norm_rope_backward(grad_y, x, weight, eps, freqs, positions)
    return norm_rope_backward_reference(grad_y, x, weight, eps, freqs, positions)


@norm_rope_backward.register_fake
def _norm_rope_backward_fake(grad_y, x, weight, eps, freqs, positions):
    _validate_norm_rope_backward(grad_y, x, weight, eps, freqs, positions)
    return torch.empty_like(x), torch.empty_like(weight)


def _norm_rope_setup_context(ctx, inputs, output):
    x, weight, eps, freqs, positions = inputs
    ctx.save_for_backward(x, weight, freqs, positions)
    ctx.eps = eps


def _norm_rope_backward(ctx, grad):
    x, weight, freqs, positions = ctx.saved_tensors
    grad_x, grad_w = torch.ops.dsv4ops.norm_rope_backward(grad.contiguous(), x, weight, ctx.eps, freqs, positions)
    return (grad_x if ctx.needs_input_grad[0] else None, grad_w if ctx.needs_input_grad[1] else None, None, None, None)


norm_rope.register_autograd(_norm_rope_backward, setup_context=_norm_rope_setup_context)
