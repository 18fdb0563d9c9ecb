"""Compiler contract: opcheck, torch.compile(fullgraph) without recompiles, torch.export round trip."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.export import Dim

import dsv4ops  # noqa: F401  (registers torch.ops.dsv4ops)
from dsv4ops._layout import CacheLayout, cache_format
from dsv4ops.layer import DeepSeekV4Compressor, mark_dynamic_tokens
from dsv4ops.testing import PagedPools, make_batch

from _asserts import assert_caches_equivalent, assert_layer_states_match, assert_same_bits
from _serving import ServingSim, random_trace

OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _sim_steps(r, D, seed, **kw):
    big = r == 128
    sim = ServingSim(
        r, D, max_seq_len=300 if big else 96, swa_page_size=128 if big else 16,
        full_page_size=256 if big else 32, seed=seed, **kw,
    )
    random_trace(sim, random.Random(seed), 12 if big else 20)
    return sim


SIM_CASES = [
    dict(r=4, D=128, seed=0),
    dict(r=4, D=128, seed=1, state_dtype=torch.bfloat16, use_fp4=True),
    dict(r=128, D=128, seed=2),
    dict(r=4, D=512, seed=3),
    dict(r=4, D=512, seed=4, bf16_store=True),
]


@pytest.fixture(scope="module", params=SIM_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def sim(request):
    c = dict(request.param)
    return _sim_steps(c.pop("r"), c.pop("D"), c.pop("seed"), **c)


def _pick_steps(sim):
    """One decode and one prefill step with at least one compressed token, plus one without."""
    decode = [s for s in sim.steps if s.batch.is_decode]
    prefill = [s for s in sim.steps if not s.batch.is_decode]
    picks = []
    for group in (decode, prefill):
        with_tokens = [s for s in group if s.emitted]
        picks += with_tokens[:1] + [s for s in group if not s.emitted][:1]
    return picks


def test_opcheck_planners(sim):
    p = sim.pools
    for step in _pick_steps(sim):
        b = step.batch
        mode = int(sim.addressing)
        if b.is_decode:
            args = (b.req_pool_indices, p.req_to_token, p.full_to_state, b.seq_lens, sim.compress_ratio, sim.swa_page_size, sim.ring_size, mode)
            torch.library.opcheck(torch.ops.dsv4ops.plan_decode, args, test_utils=OPCHECK_UTILS)
        else:
            args = (b.req_pool_indices, p.req_to_token, p.full_to_state, b.seq_lens, b.extend_lens, b.num_q_tokens,
                    sim.compress_ratio, sim.swa_page_size, sim.ring_size, mode)
            torch.library.opcheck(torch.ops.dsv4ops.plan_prefill, args, test_utils=OPCHECK_UTILS)


def test_opcheck_compress_forward(sim):
    for step in _pick_steps(sim):
        plan = step.plan
        write_plan = None if plan.is_decode else plan.plan_w
        out = torch.full_like(step.out, float("nan"))
        args = (sim.state.clone(), step.kv_score_input, sim.ape, plan[1], write_plan, out, sim.head_dim, sim.compress_ratio)
        torch.library.opcheck(torch.ops.dsv4ops.compress_forward, args, test_utils=OPCHECK_UTILS)


def test_opcheck_norm_rope_store(sim):
    for step in _pick_steps(sim):
        args = (step.out, step.plan[1], sim.norm_weight, 1e-6, sim.freqs, step.out_loc, sim.cache.clone(),
                step.plan.is_decode, sim.compress_ratio, sim.layout.page_size, sim.use_fp4, sim.bf16_store)
        torch.library.opcheck(torch.ops.dsv4ops.compress_norm_rope_store, args, test_utils=OPCHECK_UTILS)


def test_opcheck_empty_batch():
    p = PagedPools(max_requests=2, max_seq_len=64, swa_page_size=16, full_page_size=32)
    empty = torch.zeros(0, dtype=torch.int64)
    torch.library.opcheck(torch.ops.dsv4ops.plan_decode, (empty, p.req_to_token, p.full_to_state, empty, 4, 16, 8, 0), test_utils=OPCHECK_UTILS)
    torch.library.opcheck(torch.ops.dsv4ops.plan_prefill, (empty, p.req_to_token, p.full_to_state, empty, empty, 0, 4, 16, 8, 0), test_utils=OPCHECK_UTILS)
    state = torch.randn(64, 512)
    plan_c = torch.zeros(0, 16, dtype=torch.uint8)
    plan_w = torch.zeros(0, 8, dtype=torch.uint8)
    args = (state, torch.zeros(0, 512), torch.randn(8, 128), plan_c, plan_w, torch.zeros(0, 128), 128, 4)
    torch.library.opcheck(torch.ops.dsv4ops.compress_forward, args, test_utils=OPCHECK_UTILS)


# ---------------------------------------------------------------------------
# DeepSeekV4Compressor under torch.compile and torch.export
# ---------------------------------------------------------------------------

HIDDEN = 64


def _layer_and_pools(r=4, D=128, **kw):
    pools = PagedPools(max_requests=40, max_seq_len=1024, swa_page_size=128, full_page_size=256)
    layer = DeepSeekV4Compressor(
        HIDDEN, D, r, state_rows=pools.state_rows(r, 8 if r == 4 else 128), cache_pages=pools.cache_pages(),
        cache_page_size=256 // r, swa_page_size=128, max_positions=1024, **kw,
    )
    layer.state.fill_(float("nan"))  # nothing may read a row no step wrote
    return layer, pools


def _step_args(pools, batch, r, gen):
    hidden = torch.randn(batch.num_q_tokens, HIDDEN, generator=gen)
    out_loc = pools.out_loc([a for a, _ in batch.rows], [b for _, b in batch.rows], r)
    return hidden, batch.req_pool_indices, batch.seq_lens, batch.extend_lens, pools.req_to_token, pools.full_to_state, out_loc


def _assert_same_state(a: DeepSeekV4Compressor, b: DeepSeekV4Compressor, locs: torch.Tensor):
    assert_layer_states_match(a, b)
    # the cache is computed from pooled rows that may differ in the last ulp between eager and Inductor
    layout = CacheLayout(cache_format(a.head_dim, a.use_fp4, a.bf16_store), a.cache_page_size)
    assert_caches_equivalent(a.kvcache, b.kvcache, locs, layout)


@pytest.mark.parametrize(
    "r,D,kw",
    [
        (4, 128, {}),
        (128, 512, {}),
        (128, 512, {"online": True}),
        pytest.param(4, 128, {"use_fp4": True}, marks=pytest.mark.slow),
        pytest.param(4, 512, {"bf16_store": True}, marks=pytest.mark.slow),
    ],
)
def test_layer_compiles_without_breaks_or_recompiles(r, D, kw):
    gen = torch.Generator().manual_seed(0)
    eager, pools = _layer_and_pools(r, D, **kw)
    compiled_layer = copy.deepcopy(eager)
    prefill_counter = CompileCounterWithBackend("inductor")
    decode_counter = CompileCounterWithBackend("inductor")
    prefill = torch.compile(compiled_layer, backend=prefill_counter, fullgraph=True)
    decode = torch.compile(compiled_layer, backend=decode_counter, fullgraph=True)
    seq, written = {}, []

    def run(fn, batch):
        args = _step_args(pools, batch, r, gen)
        mark_dynamic_tokens(args[0], args[1], args[2], args[3], args[6])
        expected = eager(*args)
        got = fn(*args)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        written.append(args[6])
        _assert_same_state(eager, compiled_layer, torch.cat(written))
        for rid, pos in batch.rows:
            seq[rid] = pos + 1

    # chunked prefill of 32 requests at unaligned split points, different token counts each step
    for chunk in (37 if r == 4 else 150, 5, 61 if r == 4 else 120):
        run(prefill, make_batch([(i, chunk + i % 3) for i in range(32)], seq, decode=False))
    for bs in (1, 3, 8, 17, 32):
        run(decode, make_batch([(i, 1) for i in range(bs)], seq, decode=True))
    assert prefill_counter.frame_count == 1, "prefill recompiled for a new token count"
    assert decode_counter.frame_count == 1, "decode recompiled for a new batch size"


class _PrefillStep(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, hidden, req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_state, out_loc):
        return self.layer(hidden, req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_state, out_loc)


class _DecodeStep(_PrefillStep):
    def forward(self, hidden, req_pool_indices, seq_lens, req_to_token, full_to_state, out_loc):
        return self.layer(hidden, req_pool_indices, seq_lens, None, req_to_token, full_to_state, out_loc)


@pytest.mark.parametrize("r,D,kw", [(4, 128, {}), (128, 512, {}), (128, 512, {"online": True})],
                         ids=["r4-D128", "r128-D512", "r128-D512-online"])
def test_export_save_load_run(tmp_path, r, D, kw):
    gen = torch.Generator().manual_seed(1)
    layer, pools = _layer_and_pools(r, D, **kw)
    tokens, batch_dim = Dim("tokens", min=0, max=65535), Dim("batch", min=0, max=1024)
    seq = {}
    example = make_batch([(i, 9 + i) for i in range(3)], {}, decode=False)
    prefill_ep = torch.export.export(
        _PrefillStep(copy.deepcopy(layer)), _step_args(pools, example, r, gen),
        dynamic_shapes=({0: tokens}, {0: batch_dim}, {0: batch_dim}, {0: batch_dim}, None, None, {0: tokens}),
    )
    dec_example = make_batch([(i, 1) for i in range(3)], {i: 9 for i in range(3)}, decode=True)
    hidden, rpi, seq_lens, _, r2t, f2s, out_loc = _step_args(pools, dec_example, r, gen)
    decode_ep = torch.export.export(
        _DecodeStep(copy.deepcopy(layer)), (hidden, rpi, seq_lens, r2t, f2s, out_loc),
        dynamic_shapes=({0: batch_dim}, {0: batch_dim}, {0: batch_dim}, None, None, {0: batch_dim}),
    )
    torch.export.save(prefill_ep, tmp_path / "prefill.pt2")
    torch.export.save(decode_ep, tmp_path / "decode.pt2")
    prefill_mod = torch.export.load(tmp_path / "prefill.pt2").module()
    decode_mod = torch.export.load(tmp_path / "decode.pt2").module()
    # the loaded programs share one state/cache: point the decode program at the prefill program's buffers
    exported_state = dict(prefill_mod.named_buffers())
    for name, buf in decode_mod.named_buffers():
        exported_state[name].copy_(buf)  # identical initial buffers
    eager = layer
    rng = random.Random(0)
    for step in range(6):
        if step < 3:
            batch = make_batch([(i, rng.randint(1, 2 * r + 3)) for i in range(1 + step * 2)], seq, decode=False)
            args = _step_args(pools, batch, r, gen)
            torch.testing.assert_close(prefill_mod(*args), eager(*args), rtol=1e-5, atol=1e-5)
        else:
            batch = make_batch([(i, 1) for i in range(5)], seq, decode=True)
            hidden, rpi, seq_lens, _, r2t, f2s, out_loc = _step_args(pools, batch, r, gen)
            # decode reads the state the prefill program wrote
            for name, buf in decode_mod.named_buffers():
                buf.copy_(exported_state[name])
            got = decode_mod(hidden, rpi, seq_lens, r2t, f2s, out_loc)
            torch.testing.assert_close(got, eager(hidden, rpi, seq_lens, None, r2t, f2s, out_loc), rtol=1e-5, atol=1e-5)
            for name, buf in decode_mod.named_buffers():
                exported_state[name].copy_(buf)
        for rid, pos in batch.rows:
            seq[rid] = pos + 1
    assert_same_bits(exported_state["layer.state"], eager.state, "state")
    assert torch.equal(exported_state["layer.kvcache"], eager.kvcache)
