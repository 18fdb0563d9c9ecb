"""GPU acceptance: opcheck on CUDA, CUDA graphs, in-place buffers, long decode loops.

Run with ``tests/gpu/run_all.sh`` on a CUDA machine (skipped elsewhere). AOTInductor
packages on CUDA are tested by ``tests/test_deploy.py`` (its ``gpu``-marked cases), which
``run_all.sh`` runs as part of the suite.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

import dsv4ops  # noqa: F401
from dsv4ops._layout import CacheLayout, cache_format
from dsv4ops.layer import DeepSeekV4Compressor
from dsv4ops.testing import PagedPools, make_batch

from _asserts import assert_caches_equivalent, assert_layer_states_match
from _serving import ServingSim, random_trace

pytestmark = pytest.mark.gpu
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
HIDDEN = 256


@pytest.mark.parametrize("r,D,kw", [(4, 128, {}), (4, 128, {"use_fp4": True}), (4, 512, {}), (4, 512, {"bf16_store": True}),
                                    (128, 512, {}), (4, 128, {"state_dtype": torch.bfloat16})])
def test_opcheck_on_cuda(r, D, kw):
    big = r == 128
    sim = ServingSim(r, D, max_seq_len=600 if big else 96, swa_page_size=128 if big else 16,
                     full_page_size=256 if big else 32, device="cuda", **kw)
    random_trace(sim, random.Random(0), 14)
    p = sim.pools
    for kind in (True, False):
        steps = [s for s in sim.steps if s.batch.is_decode == kind and s.emitted][:1]
        for step in steps:
            b = step.batch
            mode = int(sim.addressing)
            dev = lambda t: t.to("cuda")  # noqa: E731
            if b.is_decode:
                args = (dev(b.req_pool_indices), p.req_to_token, p.full_to_state, dev(b.seq_lens), r, sim.swa_page_size, sim.ring_size, mode)
                torch.library.opcheck(torch.ops.dsv4ops.plan_decode, args, test_utils=OPCHECK_UTILS)
            else:
                args = (dev(b.req_pool_indices), p.req_to_token, p.full_to_state, dev(b.seq_lens), dev(b.extend_lens),
                        b.num_q_tokens, r, sim.swa_page_size, sim.ring_size, mode)
                torch.library.opcheck(torch.ops.dsv4ops.plan_prefill, args, test_utils=OPCHECK_UTILS)
            write_plan = None if step.plan.is_decode else step.plan.plan_w
            out = torch.empty_like(step.out)
            torch.library.opcheck(torch.ops.dsv4ops.compress_forward,
                                  (sim.state.clone(), step.kv_score_input, sim.ape, step.plan[1], write_plan, out, D, r),
                                  test_utils=OPCHECK_UTILS)
            torch.library.opcheck(torch.ops.dsv4ops.compress_norm_rope_store,
                                  (step.out, step.plan[1], sim.norm_weight, 1e-6, sim.freqs, step.out_loc, sim.cache.clone(),
                                   step.plan.is_decode, r, sim.layout.page_size, sim.use_fp4, sim.bf16_store),
                                  test_utils=OPCHECK_UTILS)


def _layer(r, D, pools, max_positions, **kw):
    layer = DeepSeekV4Compressor(
        HIDDEN, D, r, state_rows=pools.state_rows(r, 8 if r == 4 else 128), cache_pages=pools.cache_pages(),
        cache_page_size=256 // r, swa_page_size=128, max_positions=max_positions, device="cuda", **kw,
    )
    layer.state.fill_(float("nan"))
    return layer


def _args(pools, batch, r, gen):
    hidden = torch.randn(batch.num_q_tokens, HIDDEN, generator=gen).cuda()
    out_loc = pools.out_loc([a for a, _ in batch.rows], [b for _, b in batch.rows], r)
    return (hidden, batch.req_pool_indices.cuda(), batch.seq_lens.cuda(),
            None if batch.extend_lens is None else batch.extend_lens.cuda(), pools.req_to_token, pools.full_to_state, out_loc)


@pytest.mark.parametrize("r,D,kw", [(128, 512, {}), (4, 512, {}), (4, 128, {}), (4, 512, {"fused_decode": False}),
                                    (128, 512, {"fused_decode": False}), (128, 512, {"online": True})],
                         ids=["r128-D512", "r4-D512", "r4-D128", "r4-D512-unfused", "r128-D512-unfused",
                              "r128-D512-online"])
def test_reduce_overhead_decode_loop_matches_eager(r, D, kw):
    """CUDA graphs capture the whole compiled step (plans included); 300 decode steps cross
    several ratio-128 boundaries and agree with eager."""
    from torch._dynamo.utils import counters

    counters.clear()
    gen = torch.Generator().manual_seed(0)
    bs = 8
    pools = PagedPools(max_requests=bs, max_seq_len=1024, swa_page_size=128, full_page_size=256, device="cuda")
    eager = _layer(r, D, pools, 1024, **kw)
    graphed = copy.deepcopy(eager)
    prefill = torch.compile(graphed, fullgraph=True)
    decode = torch.compile(graphed, mode="reduce-overhead", fullgraph=True)
    seq, written = {}, []
    prompt = [(i, 200 + 37 * i) for i in range(bs)]  # unaligned prompts: boundaries at different steps
    batch = make_batch(prompt, seq, decode=False)
    args = _args(pools, batch, r, gen)
    torch.testing.assert_close(prefill(*args), eager(*args), rtol=1e-5, atol=1e-5)
    written.append(args[6])
    for rid, n in prompt:
        seq[rid] = n
    for step in range(300):
        batch = make_batch([(i, 1) for i in range(bs)], seq, decode=True)
        args = _args(pools, batch, r, gen)
        want = eager(*args)
        got = decode(*args).clone()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        written.append(args[6])
        for i in range(bs):
            seq[i] += 1
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert_layer_states_match(graphed, eager)
    layout = CacheLayout(cache_format(D, False, False), 256 // r)
    assert_caches_equivalent(graphed.kvcache, eager.kvcache, torch.cat(written), layout)


def _large_allocations(code: str, min_numel: int):
    """``empty_strided_cuda`` allocations in Inductor's output code with at least ``min_numel`` elements."""
    import math
    import re

    found = []
    for m in re.finditer(r"empty_strided_cuda\(\(([^)]*)\)", code):
        dims = [d.strip() for d in m.group(1).split(",") if d.strip()]
        if all(d.isdigit() for d in dims) and math.prod(int(d) for d in dims) >= min_numel:
            found.append(m.group(0))
    return found


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_compiled_layer_writes_buffers_in_place(decode):
    """A compiled step mutates the state ring and the cache (module buffers) in place: peak memory
    grows by far less than either buffer, and the generated code allocates nothing that large."""
    from torch._inductor.utils import run_and_get_code

    r, D = 4, 512
    pools = PagedPools(max_requests=64, max_seq_len=16384, swa_page_size=128, full_page_size=256, device="cuda")
    layer = _layer(r, D, pools, 16384)
    layer.state.normal_()  # a 537 MB ring and a 153 MB cache: a copy of either is obvious
    cache_bytes, state_bytes = layer.kvcache.numel(), layer.state.numel() * 4
    compiled = torch.compile(layer, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    if decode:
        batch = make_batch([(i, 1) for i in range(32)], {i: 1023 for i in range(32)}, decode=True)
    else:
        batch = make_batch([(i, 20 + i) for i in range(32)], {}, decode=False)  # 1.1K tokens: 9 MB of kv rows
    args = _args(pools, batch, r, gen)
    _, codes = run_and_get_code(compiled, *args)
    code = "\n".join(codes)
    args = _args(pools, batch, r, gen)  # new hidden states: a rerun of the same step would rewrite the same bytes
    torch.cuda.synchronize()
    state_before, cache_before = layer.state.clone(), layer.kvcache.clone()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    compiled(*args)
    torch.cuda.synchronize()
    growth = torch.cuda.max_memory_allocated() - base
    big = _large_allocations(code, min(cache_bytes, state_bytes // 4) // 8)
    print(f"peak growth {growth} B; cache {cache_bytes} B, state {state_bytes} B; large allocations: {big}")
    assert not torch.equal(layer.kvcache, cache_before) and not torch.equal(layer.state, state_before), \
        "the compiled step wrote the module buffers"
    assert not big, f"the generated code allocates buffer-sized tensors: {big}"
    assert growth < cache_bytes // 8, f"peak grew by {growth} B (cache {cache_bytes} B)"
    kernels = ("_decode_step_c4_kernel",) if decode else ("_pool_c4_kernel", "_write_kernel", "_store_main_kernel")
    assert all(k in code for k in kernels), "Inductor sees the Triton kernels"


def test_compiled_prefill_across_the_large_plan_size(monkeypatch):
    """Inductor on CUDA, dynamic token count, the indexer's ratio-4 pool switching launches at a
    plan size (``C4_LARGE``, here from 1000 rows): prefills on both sides of it compile once, and
    each step matches eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from dsv4ops.compress import kernels as compress_kernels
    from dsv4ops.layer import mark_dynamic_tokens

    monkeypatch.setitem(compress_kernels.C4_LARGE, 128, (1000, (4, 64, 2), (2, 4), True))
    r, D = 4, 128
    gen = torch.Generator().manual_seed(0)
    pools = PagedPools(max_requests=32, max_seq_len=1024, swa_page_size=128, full_page_size=256, device="cuda")
    eager = _layer(r, D, pools, 1024)
    compiled_layer = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(compiled_layer, backend=counter, fullgraph=True)
    seq, written = {}, []
    for step, chunk in enumerate((37, 5, 61, 3)):  # about 1200, 190, 1980 and 130 tokens
        batch = make_batch([(i, chunk + i % 3) for i in range(32)], seq, decode=False)
        args = _args(pools, batch, r, gen)
        mark_dynamic_tokens(args[0], args[1], args[2], args[3], args[6])
        want = eager(*args)
        torch.testing.assert_close(compiled(*args), want, rtol=1e-5, atol=1e-5)
        written.append(args[6])
        for rid, pos in batch.rows:
            seq[rid] = pos + 1
    assert counter.frame_count == 1, "recompiled for a token count on the other side of the plan size"
    assert_layer_states_match(compiled_layer, eager)
    layout = CacheLayout(cache_format(D, False, False), 256 // r)
    assert_caches_equivalent(compiled_layer.kvcache, eager.kvcache, torch.cat(written), layout)
