"""compress_forward: targeted semantics (malformed plans, out handling, dtypes) against the golden loops."""

from __future__ import annotations

import random

import pytest
import torch

import dsv4ops
from dsv4ops import CompressorDecodePlan, CompressorPrefillPlan

from _asserts import assert_same_bits
from _serving import ServingSim, random_trace
from golden.compress_loop import compress_decode_loop, compress_prefill_loop


def _sim(r, D=128, **kw):
    big = r == 128
    sim = ServingSim(r, D, swa_page_size=128 if big else 16, full_page_size=256 if big else 32,
                     max_seq_len=600 if big else 100, **kw)
    random_trace(sim, random.Random(3), 25)
    return sim


def _replay(sim, step, state, out=None, **kw):
    """Run one recorded step again on ``state`` through the public API."""
    return dsv4ops.compress_forward(state, step.kv_score_input, sim.ape, step.plan, head_dim=sim.head_dim,
                                    compress_ratio=sim.compress_ratio, out=out, **kw)


@pytest.mark.parametrize("r", [4, 128])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_user_out_every_row_written(r, out_dtype, device):
    sim = _sim(r, device=str(device))
    for step in sim.steps[-6:]:
        state = torch.randn_like(sim.state)
        ref_state = state.cpu().clone()
        out = torch.full((step.plan[1].shape[0], sim.head_dim), float("nan"), dtype=out_dtype, device=device)
        got = _replay(sim, step, state, out=out)
        assert got is out and not torch.isnan(out).any(), "every out row is written (zeros when nothing is emitted)"
        if step.plan.is_decode:
            want = compress_decode_loop(ref_state, step.kv_score_input.cpu(), sim.ape.cpu(), step.plan.plan_d.cpu(), sim.head_dim, r)
        else:
            want = compress_prefill_loop(ref_state, step.kv_score_input.cpu(), sim.ape.cpu(), step.plan.plan_c.cpu(),
                                         step.plan.plan_w.cpu(), sim.head_dim, r)
        tol = 2e-5 if out_dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.cpu().double(), want, rtol=tol, atol=tol)
        assert_same_bits(state.cpu(), ref_state, "state")


def _corrupt(plan_bytes: torch.Tensor, rng: random.Random, num_rows: int, num_inputs: int, write_word: int):
    """Overwrite random words of a third of the rows. The word holding a write location only
    gets out-of-range values (an in-range duplicate target would make the result order-dependent)."""
    words = plan_bytes.view(torch.int32).clone()
    n = words.shape[0]
    out_of_range = [-5, num_rows + 3, 1 << 20, 0x7FFF0000 + rng.randrange(5)]
    for k in rng.sample(range(n), max(1, n // 3)) if n else []:
        field = rng.randrange(words.shape[1])
        pool = out_of_range if field == write_word else out_of_range + [num_inputs + 2, rng.randrange(num_rows)]
        words[k, field] = rng.choice(pool)
    return words.view(torch.uint8).reshape(n, -1)


@pytest.mark.parametrize("r", [4, 128])
def test_malformed_plans_never_write_out_of_range(r, device):
    """Garbage plan words: rows needing data outside the state or input emit zeros and write nothing
    out of range; the rest behaves as the golden loop says."""
    sim = _sim(r, device=str(device))
    rng = random.Random(11)
    width = sim.state.shape[1]
    for step in sim.steps:
        rows = sim.state.shape[0]
        num_in = step.kv_score_input.shape[0]
        guard = torch.full((rows + 64, width), 1234.5, device=device)
        state = guard[:rows]  # the 64 rows after the state must survive
        state.copy_(torch.randn(rows, width))
        ref_state = state.cpu().clone()
        if step.plan.is_decode:
            bad = CompressorDecodePlan(r, _corrupt(step.plan.plan_d, rng, rows, num_in, write_word=1))
            got = dsv4ops.compress_forward(state, step.kv_score_input, sim.ape, bad, head_dim=sim.head_dim, compress_ratio=r)
            want = compress_decode_loop(ref_state, step.kv_score_input.cpu(), sim.ape.cpu(), bad.plan_d.cpu(), sim.head_dim, r)
        else:
            bad = CompressorPrefillPlan(r, _corrupt(step.plan.plan_c, rng, rows, num_in, write_word=-1),
                                        _corrupt(step.plan.plan_w, rng, rows, num_in, write_word=1))
            got = dsv4ops.compress_forward(state, step.kv_score_input, sim.ape, bad, head_dim=sim.head_dim, compress_ratio=r)
            want = compress_prefill_loop(ref_state, step.kv_score_input.cpu(), sim.ape.cpu(), bad.plan_c.cpu(),
                                         bad.plan_w.cpu(), sim.head_dim, r)
        assert (guard[rows:] == 1234.5).all(), "a write landed past the state buffer"
        assert_same_bits(state.cpu(), ref_state, "state")
        torch.testing.assert_close(got.cpu().double(), want, rtol=2e-5, atol=2e-5)


def test_state_views_are_equivalent():
    sim = _sim(4)
    step = [s for s in sim.steps if s.emitted][-1]
    a = torch.randn_like(sim.state)
    b = a.clone().view(-1, 4, a.shape[1])
    out_a = _replay(sim, step, a)
    out_b = _replay(sim, step, b)
    assert torch.equal(out_a, out_b) and torch.equal(a, b.view_as(a))


def test_deterministic_bits(device):
    sim = _sim(128, device=str(device))
    step = [s for s in sim.steps if s.emitted][-1]
    base = torch.randn_like(sim.state)
    outs = []
    for _ in range(2):
        state = base.clone()
        outs.append(_replay(sim, step, state))
    assert_same_bits(outs[0], outs[1], "out")


def test_bf16_ape_and_input_accepted():
    sim = _sim(4)
    step = [s for s in sim.steps if s.emitted][-1]
    state = torch.randn_like(sim.state)
    out = dsv4ops.compress_forward(state.clone(), step.kv_score_input.bfloat16(), sim.ape.bfloat16(), step.plan,
                                   head_dim=sim.head_dim, compress_ratio=4)
    ref = dsv4ops.compress_forward(state.clone(), step.kv_score_input.bfloat16().float(), sim.ape.bfloat16().float(),
                                   step.plan, head_dim=sim.head_dim, compress_ratio=4)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.bfloat16().float(), rtol=0, atol=0)
