"""The fused decode step (``compress_decode_step``) against the three unfused ops, and its kernels.

Its contract is "exactly plan_decode, then compress_forward, then compress_norm_rope_store":
the same plan bytes, the same state bits, the same pooled rows (within fp32 rounding for
the kernels) and the cache bytes that the store writes for those pooled rows.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import dsv4ops
from dsv4ops.compress.reference import compress_decode_reference
from dsv4ops.decode_step import kernels as step_kernels
from dsv4ops.planner.reference import plan_decode_reference
from dsv4ops.store.reference import norm_rope_store_reference

from _asserts import assert_same_bits
from _serving import ServingSim, random_trace

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICE = "cpu" if INTERPRETED else "cuda"
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")

CASES = [
    dict(r=4, D=512),
    dict(r=4, D=512, bf16_store=True, state_dtype=torch.bfloat16),
    dict(r=4, D=128),
    dict(r=4, D=128, use_fp4=True),
    dict(r=128, D=512),
    dict(r=128, D=128, state_dtype=torch.bfloat16),
]


def _sim(case):
    c = dict(case)
    r, D = c.pop("r"), c.pop("D")
    big = r == 128
    sim = ServingSim(r, D, max_seq_len=400 if big else 90, full_page_size=256 if big else 32,
                     swa_page_size=128 if big else 16, **c)
    random_trace(sim, random.Random(7), 10 if big else 18)
    return sim


def _decode_steps(sim, n=3):
    steps = [s for s in sim.steps if s.batch.is_decode]
    with_tokens = [s for s in steps if s.emitted]
    return (with_tokens[:n] + [s for s in steps if not s.emitted][:1]) or steps[:1]


def _args(sim, step, state, cache, device):
    """The op's arguments; ``plan`` and ``out`` poisoned (0xA5 bytes, NaN)."""
    b, p = step.batch, sim.pools
    dev = lambda t: t.to(device)  # noqa: E731
    bs = b.req_pool_indices.shape[0]
    plan = torch.full((bs, 16), 0xA5, dtype=torch.uint8, device=device)
    out = torch.full((bs, sim.head_dim), float("nan"), dtype=step.kv_score_input.dtype, device=device)
    return (dev(state), dev(step.kv_score_input), dev(sim.ape), dev(b.req_pool_indices), dev(p.req_to_token),
            dev(p.full_to_state), dev(b.seq_lens), dev(sim.norm_weight), 1e-6, dev(sim.freqs), dev(step.out_loc),
            dev(cache), plan, out, sim.head_dim, sim.compress_ratio, sim.swa_page_size, sim.ring_size, int(sim.addressing),
            sim.layout.page_size, sim.use_fp4, sim.bf16_store)


def _unfused(args):
    """The three ops of a decode step in order (CPU references), on copies of the state and cache."""
    (state, x, ape, rpi, r2t, f2s, seq, w, eps, freqs, out_loc, cache, _, _, D, r, sps, ring, mode, page, fp4,
     bf16) = args
    state, cache = state.clone(), cache.clone()
    plan = plan_decode_reference(rpi, r2t, f2s, seq, r, sps, ring, mode)
    out = torch.full((rpi.shape[0], D), float("nan"), dtype=x.dtype)
    compress_decode_reference(state, x, ape, plan, out, D, r)
    norm_rope_store_reference(out, plan, w, eps, freqs, out_loc, cache, True, r, page, fp4, bf16)
    return plan, out, state, cache


def _random_state(sim, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sim.state.shape, generator=g).to(sim.state_dtype), sim.cache.clone()


def _case_id(case: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in case.items())


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_op_equals_the_three_ops(case, device):
    sim = _sim(case)
    for k, step in enumerate(_decode_steps(sim)):
        state, cache = _random_state(sim, k)
        want_plan, want_out, want_state, want_cache = _unfused(_args(sim, step, state, cache, "cpu"))
        args = _args(sim, step, state, cache, device)
        torch.ops.dsv4ops.compress_decode_step(*args)
        plan, out = args[12], args[13]
        assert torch.equal(plan.cpu(), want_plan), "plan bytes"
        assert_same_bits(args[0].cpu(), want_state, "state")
        torch.testing.assert_close(out.cpu(), want_out, rtol=1e-5, atol=1e-5)
        # the cache holds exactly what the store writes for these pooled rows
        stored = cache.clone()
        norm_rope_store_reference(out.cpu(), plan.cpu(), sim.norm_weight, 1e-6, sim.freqs, step.out_loc, stored, True,
                                  sim.compress_ratio, sim.layout.page_size, sim.use_fp4, sim.bf16_store)
        diff = (args[11].cpu() != stored).nonzero()
        assert diff.numel() == 0, f"{diff.shape[0]} cache bytes differ, first {diff[:4].tolist()}"


@pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernels(case):
    """The Triton launcher directly (under the interpreter in CI), outputs poisoned first."""
    sim = _sim(case)
    for k, step in enumerate(_decode_steps(sim)):
        state, cache = _random_state(sim, k)
        want_plan, want_out, want_state, _ = _unfused(_args(sim, step, state, cache, "cpu"))
        args = _args(sim, step, state, cache, KERNEL_DEVICE)
        step_kernels.decode_step(*args)
        plan, out = args[12], args[13]
        assert torch.equal(plan.cpu(), want_plan), "plan bytes"
        assert_same_bits(args[0].cpu(), want_state, "state")
        assert not torch.isnan(out).any(), "every out row is written"
        scale = want_out.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
        assert ((out.cpu() - want_out).abs() / scale).max().item() <= 1e-5
        stored = cache.clone()
        norm_rope_store_reference(out.cpu(), want_plan, sim.norm_weight, 1e-6, sim.freqs, step.out_loc, stored, True,
                                  sim.compress_ratio, sim.layout.page_size, sim.use_fp4, sim.bf16_store)
        diff = (args[11].cpu() != stored).nonzero()
        assert diff.numel() == 0, f"{diff.shape[0]} cache bytes differ, first {diff[:4].tolist()}"


def test_kernels_ratio128_channels_fastest_grid(monkeypatch):
    """The ratio-128 pool launches (fused with the plan, and after a plan launch) in the other grid
    order give the same results."""
    from dsv4ops.compress import kernels as compress_kernels

    monkeypatch.setattr(compress_kernels, "CHANNELS_FASTEST", not compress_kernels.CHANNELS_FASTEST)
    for plan_launch in (False, True):
        monkeypatch.setattr(step_kernels, "C128_PLAN_LAUNCH", plan_launch)
        test_kernels(CASES[4])


@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=_case_id)
def test_kernels_decode_order(case, monkeypatch):
    """The fused step with the other ``DECODE_POOL_FIRST`` (the window loaded after the ring write
    instead of before, or the reverse): the same results."""
    from dsv4ops.compress import kernels as compress_kernels

    monkeypatch.setattr(compress_kernels, "DECODE_POOL_FIRST", not compress_kernels.DECODE_POOL_FIRST)
    monkeypatch.setattr(step_kernels, "C128_PLAN_LAUNCH", False)  # ratio 128: the pool with the plan fused in
    test_kernels(case)


@pytest.mark.parametrize("case", [c for c in CASES if c["r"] == 128], ids=_case_id)
def test_kernels_ratio128_plan_launch(case, monkeypatch):
    """Ratio 128 with the other ``C128_PLAN_LAUNCH`` (plan fused into the pool launch, or a launch of
    its own) than the default: the same results."""
    monkeypatch.setattr(step_kernels, "C128_PLAN_LAUNCH", not step_kernels.C128_PLAN_LAUNCH)
    test_kernels(case)


@pytest.mark.parametrize("case", CASES[::2], ids=_case_id)
def test_opcheck(case):
    sim = _sim(case)
    step = _decode_steps(sim)[0]
    state, cache = _random_state(sim, 0)
    torch.library.opcheck(torch.ops.dsv4ops.compress_decode_step, _args(sim, step, state, cache, "cpu"),
                          test_utils=OPCHECK_UTILS)


def test_api_and_errors():
    sim = _sim(CASES[2])
    step = _decode_steps(sim)[0]
    state, cache = _random_state(sim, 0)
    b, p = step.batch, sim.pools
    assert b.seq_lens.numel() > 1
    kwargs = dict(req_pool_indices=b.req_pool_indices, req_to_token=p.req_to_token, full_to_state=p.full_to_state,
                  seq_lens=b.seq_lens, swa_page_size=sim.swa_page_size, ring_size=sim.ring_size, head_dim=128,
                  compress_ratio=4, norm_weight=sim.norm_weight, norm_eps=1e-6,
                  freq_cis=torch.view_as_complex(sim.freqs.view(-1, 32, 2).contiguous()), out_loc=step.out_loc,
                  kvcache=cache, page_size=sim.layout.page_size)
    plan, out = dsv4ops.compress_decode_step(state, step.kv_score_input, sim.ape, **kwargs)
    want_plan, want_out, _, want_cache = _unfused(_args(sim, step, _random_state(sim, 0)[0], sim.cache.clone(), "cpu"))
    assert isinstance(plan, dsv4ops.CompressorDecodePlan) and plan.compress_ratio == 4
    assert torch.equal(plan.plan_d, want_plan) and torch.equal(out, want_out) and torch.equal(cache, want_cache)
    before = (state.clone(), cache.clone())
    with pytest.raises(ValueError, match="head_dim"):
        dsv4ops.compress_decode_step(state, step.kv_score_input, sim.ape, **dict(kwargs, head_dim=192))
    with pytest.raises(TypeError, match="`kv_score_input`"):
        dsv4ops.compress_decode_step(state, step.kv_score_input.long(), sim.ape, **kwargs)
    with pytest.raises(ValueError, match="`kv_score_input` has"):
        dsv4ops.compress_decode_step(state, step.kv_score_input[:-1], sim.ape, **kwargs)
    with pytest.raises(ValueError, match="`kvcache`"):
        dsv4ops.compress_decode_step(state, step.kv_score_input, sim.ape, **dict(kwargs, kvcache=cache.view(-1)[:-1]))
    assert torch.equal(state, before[0]) and torch.equal(cache, before[1]), "errors come before any write"
