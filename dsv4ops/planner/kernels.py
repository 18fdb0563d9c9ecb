"""Triton planners (CUDA). Filled in by the Triton-kernels work; CPU uses the reference."""

from __future__ import annotations

import torch


def use_triton(t: torch.Tensor) -> bool:
    return False


def plan_decode(*args):  # pragma: no cover - replaced by the Triton implementation
    raise NotImplementedError


def plan_prefill(*args):  # pragma: no cover
    raise NotImplementedError
