"""Small helpers shared by the Triton launchers."""

from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401
    from torch.library import wrap_triton

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a Linux dependency
    HAVE_TRITON = False


def interpreting() -> bool:
    """Whether the Triton kernels run under the interpreter (``TRITON_INTERPRET=1``, on the CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def hardware_casts() -> bool:
    """Whether kernels round fp32 to bf16 and e4m3 with the GPU's conversion instructions
    (``HW_CAST``): on a GPU, yes; under the interpreter, whose fp32 -> fp8 cast does not round to
    nearest even (and whose bf16 cast truncates), no: the kernels then round with integer
    arithmetic, to the same bits."""
    return not interpreting()


def use_triton(t: torch.Tensor) -> bool:
    """Dispatch rule of every op: CUDA tensors run the Triton kernels, everything else the reference."""
    return HAVE_TRITON and t.device.type == "cuda"


def _plain_eager(args) -> bool:
    """True outside of any tracing: no Dynamo frame, no dispatch mode, only plain tensors."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    return all(type(a) is torch.Tensor for a in args if isinstance(a, torch.Tensor))


class _Launcher:
    """``launch(kernel)[grid](*args, **meta)``.

    While torch.compile, export or AOTInductor trace an op body, the kernel goes through
    ``torch.library.wrap_triton`` so that Inductor sees it as a user-defined Triton kernel.
    In plain eager mode it is launched directly, skipping the higher-order-op dispatch of
    ``wrap_triton``: on the H200 the two-launch prefill planner took 160-350 us of host time in
    eager against 2-8 us replayed in a CUDA graph (the direct path's gain is still to be measured).
    """

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            if _plain_eager(args):
                return self.kernel[grid](*args, **kwargs)
            return wrap_triton(self.kernel)[grid](*args, **kwargs)

        return run


def launch(kernel) -> _Launcher:
    """``kernel`` launched so that torch.compile / export can trace it (see ``_Launcher``)."""
    return _Launcher(kernel)


def cdiv(a, b):
    return (a + b - 1) // b


def at_least(n, threshold: int):
    """1 if ``n >= threshold``, else 0, by min/max arithmetic on ``n``.

    Under torch.compile a size ``n`` is symbolic, and a launcher that compares it (``if n >= t``)
    adds a guard: the graph is then specialized to one side of ``t`` and recompiles on the other.
    Scaling two launches' grids by ``at_least(n, t)`` and ``1 - at_least(n, t)`` picks one of two
    kernels by size without a guard (Triton skips a launch whose grid is empty)."""
    return torch.sym_min(1, torch.sym_max(0, n - threshold + 1))


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
