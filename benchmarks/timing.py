"""Median timings shared by the benchmark scripts (``run`` and ``train``)."""

from __future__ import annotations

import torch
from triton.testing import do_bench, do_bench_cudagraph


def first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else ""


def median_us(fn, rep: int = 150, graph: bool = True, fallback: bool = False, warmup: int = 25) -> float:
    """Median microseconds of ``fn``.

    ``graph``: GPU time, ``fn`` replayed in a CUDA graph (``do_bench_cudagraph``), so the host's
    Python, dispatch and autograd work are left out, as in a captured serving or training step.
    Otherwise ``do_bench`` of the plain call (after its L2 flush), host time included whenever it
    outlasts the GPU work. ``fallback``: a ``fn`` that cannot be captured (a host sync, say) is
    timed with ``do_bench`` instead, and a line says so; without it the capture error propagates
    (the dsv4ops launches must be capturable)."""
    if graph and fallback:
        fn()  # compile and warm up outside the capture
        try:
            return do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3
        except Exception as e:  # noqa: BLE001 -- reported, then timed without a graph
            torch.cuda.synchronize()
            print(f"  not capturable ({type(e).__name__}: {first_line(e)[:120]}): timed with do_bench", flush=True)
    elif graph:
        return do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3
