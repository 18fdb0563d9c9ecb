"""The CUDA path of the ops under torch.compile, traced on any machine: one graph for every size.

On a CPU the ops run their PyTorch references, so the other compile tests never trace the
Python code of the Triton launchers (plan and workspace allocations, grids, early returns).
Under torch.compile that code is traced too, and a size expression it branches on, or a
tensor dimension it sizes from the token count, adds guards of its own. The compiled
training block recompiled on the H200 because a workspace's leading dimension,
``cdiv(tokens, BLOCK)``, was 1 for the first token count ("a size-1 dimension's stride does
not count for contiguity" became a guard).

Here the launchers run under ``torch.compile(backend="aot_eager")`` on CPU tensors taken for
CUDA ones (``use_triton`` patched), with Triton's active driver an sm_90 target and kernel
launches made no-ops. The outputs are garbage, but the traced graphs and their guards are
the ones a GPU run gets. The kernels must be imported with ``TRITON_INTERPRET`` unset, so the
driver test runs this file's ``variant`` tests in a clean subprocess.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

from _sm90 import run_variants_in_subprocess, sm90_driver


def test_cuda_path_compiles_once():
    run_variants_in_subprocess(__file__)


@pytest.fixture
def cuda_path(monkeypatch):
    """The ops' CUDA launchers on CPU tensors, for an sm_90 target, with every launch a no-op."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter mode: the variants run in a subprocess without TRITON_INTERPRET")
    import triton

    import dsv4ops  # noqa: F401

    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", lambda self, *args, **kwargs: None)
    for name, module in list(sys.modules.items()):
        if name.startswith("dsv4ops.") and hasattr(module, "use_triton"):
            monkeypatch.setattr(module, "use_triton", lambda t: True)
    torch._dynamo.reset()
    with sm90_driver():
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize("r,D,large_from", [(4, 128, None), (4, 128, 1000), (128, 512, None)],
                         ids=["r4-D128", "r4-D128-C4_LARGE-1000", "r128-D512"])
def test_variant_layer_prefill_and_decode(cuda_path, monkeypatch, r, D, large_from):
    """Chunked prefills of different token counts, then decodes of batch 1 to 32: one graph each.
    ``large_from``: the ratio-4 pool takes ``C4_LARGE`` settings from plans of this many rows, so the
    prefills (about 190 to 2000 tokens) fall on both sides of it."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from dsv4ops.compress import kernels as compress_kernels
    from dsv4ops.layer import mark_dynamic_tokens
    from dsv4ops.testing import make_batch
    from test_compile import _layer_and_pools, _step_args

    if large_from is not None:
        monkeypatch.setitem(compress_kernels.C4_LARGE, 128, (large_from, (4, 64, 2), (2, 4), True))
    layer, pools = _layer_and_pools(r, D)
    gen = torch.Generator().manual_seed(0)
    prefill_counter = CompileCounterWithBackend("aot_eager")
    decode_counter = CompileCounterWithBackend("aot_eager")
    prefill = torch.compile(copy.deepcopy(layer), backend=prefill_counter, fullgraph=True)
    decode = torch.compile(copy.deepcopy(layer), backend=decode_counter, fullgraph=True)
    seq = {}

    def run(fn, batch):
        args = _step_args(pools, batch, r, gen)
        mark_dynamic_tokens(args[0], args[1], args[2], args[3], args[6])
        fn(*args)
        for rid, pos in batch.rows:
            seq[rid] = pos + 1

    for chunk in (37 if r == 4 else 150, 5, 61 if r == 4 else 120, 1):
        run(prefill, make_batch([(i, chunk + i % 3) for i in range(32)], seq, decode=False))
    for bs in (1, 3, 8, 17, 32):
        run(decode, make_batch([(i, 1) for i in range(bs)], seq, decode=True))
    assert prefill_counter.frame_count == 1, "prefill recompiled for a new token count"
    assert decode_counter.frame_count == 1, "decode recompiled for a new batch size"


@pytest.mark.parametrize("r", [4, 128])
def test_variant_training_block(cuda_path, r):
    """compress_train + norm_rope forward and backward over token counts whose workspace has one
    partial-sum row, then several (the recompile seen on the H200)."""
    from torch._dynamo.utils import counters

    from test_train import _Block, _inputs

    counters.clear()
    block = _Block(64, r, "cpu")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend="aot_eager")
    for T in ((2 * r + 3, 3 * r, 5 * r + 1, 40 * r + 2) if r == 4 else (256, 300, 390, 1100)):
        x, _ = _inputs(2, T, 64, r, torch.float32, "cpu", requires_grad=True, seed=T)
        compiled(x).backward(torch.randn(2 * (T // r), 64))
        block.zero_grad(set_to_none=True)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1
