"""Small helpers shared by the Triton launchers."""

from __future__ import annotations

import torch

try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401
    from torch.library import wrap_triton

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a Linux dependency
    HAVE_TRITON = False


def use_triton(t: torch.Tensor) -> bool:
    """Dispatch rule of every op: CUDA tensors run the Triton kernels, everything else the reference."""
    return HAVE_TRITON and t.device.type == "cuda"


def launch(kernel):
    """``kernel`` wrapped so that torch.compile / export trace it (a no-op wrapper in eager mode)."""
    return wrap_triton(kernel)


def cdiv(a, b):
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
