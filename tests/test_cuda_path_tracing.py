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

from _sm90 import run_variants_in_subprocess

HIDDEN = 64


def test_cuda_path_compiles_once():
    run_variants_in_subprocess(__file__)


@pytest.fixture
def cuda_path(monkeypatch):
    """The ops' CUDA launchers on CPU tensors, for an sm_90 target, with every launch a no-op."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter mode: the variants run in a subprocess without TRITON_INTERPRET")
    import triton
    from triton.backends.compiler import GPUTarget

    import dsv4ops  # noqa: F401

    class _Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, *args):
            return 0

    driver = triton.runtime.driver
    active = driver.__dict__.get("_active")
    driver.set_active(_Sm90())
    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", lambda self, *args, **kwargs: None)
    for name, module in list(sys.modules.items()):
        if name.startswith("dsv4ops.") and hasattr(module, "use_triton"):
            monkeypatch.setattr(module, "use_triton", lambda t: True)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    driver._active = active


@pytest.mark.parametrize("r,D", [(4, 128), (128, 512)])
def test_variant_layer_prefill_and_decode(cuda_path, r, D):
    """Chunked prefills of different token counts, then decodes of batch 1 to 32: one graph each."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from dsv4ops.layer import DeepSeekV4Compressor, mark_dynamic_tokens
    from dsv4ops.testing import PagedPools, make_batch

    pools = PagedPools(max_requests=40, max_seq_len=1024, swa_page_size=128, full_page_size=256)
    layer = DeepSeekV4Compressor(
        HIDDEN, D, r, state_rows=pools.state_rows(r, 8 if r == 4 else 128), cache_pages=pools.cache_pages(),
        cache_page_size=256 // r, swa_page_size=128, max_positions=1024,
    )
    prefill_counter = CompileCounterWithBackend("aot_eager")
    decode_counter = CompileCounterWithBackend("aot_eager")
    prefill = torch.compile(copy.deepcopy(layer), backend=prefill_counter, fullgraph=True)
    decode = torch.compile(copy.deepcopy(layer), backend=decode_counter, fullgraph=True)
    seq = {}

    def run(fn, batch):
        out_loc = pools.out_loc([a for a, _ in batch.rows], [b for _, b in batch.rows], r)
        args = (torch.randn(batch.num_q_tokens, HIDDEN), batch.req_pool_indices, batch.seq_lens, batch.extend_lens,
                pools.req_to_token, pools.full_to_state, out_loc)
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
