"""The Triton kernels against the PyTorch reference, launched directly.

Without a GPU they run on CPU tensors under ``TRITON_INTERPRET=1`` (set by conftest);
with one they run natively on CUDA. Planner and store bytes must be identical,
compressed rows within 1e-5 of the row's scale, state bit-identical.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from dsv4ops import Addressing
from dsv4ops.compress import kernels as compress_kernels
from dsv4ops.compress.reference import compress_decode_reference, compress_prefill_reference
from dsv4ops.planner import kernels as planner_kernels
from dsv4ops.planner.reference import plan_decode_reference, plan_prefill_reference
from dsv4ops.store import kernels as store_kernels
from dsv4ops.store.reference import norm_rope_store_reference
from dsv4ops.testing import PagedPools

from _asserts import assert_same_bits
from _serving import ServingSim, random_trace
from test_planner import GEOMETRIES, NAMES, _random_batch, _t
from test_store import FORMATS, _case

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(
    not INTERPRETED and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1"
)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"r{g[0]}-ring{g[1]}-sps{g[2]}-{NAMES[g[4]]}")
def test_planner_kernels(geometry):
    r, ring, sps, page, addressing = geometry
    rng = random.Random(5 + r + ring)
    for trial in range(3):
        pools = PagedPools(max_requests=8, max_seq_len=600 if r == 128 else 150, swa_page_size=sps,
                           full_page_size=page, seed=trial, device=KERNEL_DEVICE)
        rids, seqs, exts = _random_batch(rng, pools, r)
        if trial == 2 and rids:
            exts[0] = seqs[0] + 3  # a bad request: plans nothing
        num_q = sum(max(e, 0) for e in exts) + rng.choice([0, 5])
        tables = (None, None) if addressing == Addressing.LEGACY else (pools.req_to_token, pools.full_to_state)
        common = (r, sps, ring, int(addressing))
        rpi, seq_lens, ext_lens = _t(rids, KERNEL_DEVICE), _t(seqs, KERNEL_DEVICE), _t(exts, KERNEL_DEVICE)
        got = planner_kernels.plan_prefill(rpi, *tables, seq_lens, ext_lens, num_q, *common)
        want = plan_prefill_reference(rpi, *tables, seq_lens, ext_lens, num_q, *common)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"trial {trial}"
        got = planner_kernels.plan_decode(rpi, *tables, seq_lens, *common)
        assert torch.equal(got, plan_decode_reference(rpi, *tables, seq_lens, *common)), f"trial {trial}"


def test_planner_kernels_empty():
    pools = PagedPools(max_requests=2, max_seq_len=64, swa_page_size=16, full_page_size=32, device=KERNEL_DEVICE)
    empty = torch.zeros(0, dtype=torch.int64, device=KERNEL_DEVICE)
    c, w = planner_kernels.plan_prefill(empty, pools.req_to_token, pools.full_to_state, empty, empty, 0, 4, 16, 8, 0)
    assert c.shape == (0, 16) and w.shape == (0, 8)
    c, w = planner_kernels.plan_prefill(empty, pools.req_to_token, pools.full_to_state, empty, empty, 7, 4, 16, 8, 0)
    assert (c.view(torch.int32)[:, 0] == -1).all() and (w == 255).all()
    d = planner_kernels.plan_decode(empty, pools.req_to_token, pools.full_to_state, empty, 4, 16, 8, 0)
    assert d.shape == (0, 16)


COMPRESS_CASES = [
    dict(r=4, D=128),
    dict(r=4, D=128, state_dtype=torch.bfloat16),
    dict(r=4, D=256, input_dtype=torch.bfloat16),
    dict(r=128, D=64),
    dict(r=128, D=64, state_dtype=torch.bfloat16),
]


def _close_rows(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5):
    scale = want.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    err = ((got.float() - want.float()).abs() / scale).max().item() if want.numel() else 0.0
    assert err <= rel, f"max error {err:.3g} of the row scale"


@pytest.mark.parametrize("case", COMPRESS_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_compress_kernels(case):
    c = dict(case)
    r, D = c.pop("r"), c.pop("D")
    big = r == 128
    sim = ServingSim(r, D, max_seq_len=300 if big else 90, full_page_size=256 if big else 32,
                     swa_page_size=128 if big else 16, **c)
    random_trace(sim, random.Random(2), 8 if big else 16)
    for out_dtype in (torch.float32, torch.bfloat16):
        for step in sim.steps:
            state = torch.randn(sim.state.shape).to(sim.state_dtype)
            x = step.kv_score_input
            plan, write_plan = (step.plan.plan_d, None) if step.plan.is_decode else (step.plan.plan_c, step.plan.plan_w)
            want_state, want_out = state.clone(), torch.full((plan.shape[0], D), float("nan"), dtype=out_dtype)
            if write_plan is None:
                compress_decode_reference(want_state, x, sim.ape, plan, want_out, D, r)
            else:
                compress_prefill_reference(want_state, x, sim.ape, plan, write_plan, want_out, D, r)
            dev = KERNEL_DEVICE
            got_state = state.to(dev)
            got_out = torch.full((plan.shape[0], D), float("nan"), dtype=out_dtype, device=dev)
            compress_kernels.compress_forward(got_state, x.to(dev), sim.ape.to(dev), plan.to(dev),
                                              None if write_plan is None else write_plan.to(dev), got_out, D, r)
            assert_same_bits(got_state.cpu(), want_state, "state")
            assert not torch.isnan(got_out).any(), "every out row is written"
            _close_rows(got_out.cpu(), want_out, 1e-5 if out_dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("is_decode", [True, False], ids=["decode", "extend"])
def test_store_kernels(fmt, is_decode):
    for page_size in (1, 64):
        c = _case(fmt, is_decode, 20, page_size, "cpu", seed=page_size + 1)
        flags = (c["cfg"].get("use_fp4", False), c["cfg"].get("bf16_store", False))
        want = c["cache"].clone()
        norm_rope_store_reference(c["kv"], c["plan"], c["weight"], 1e-6, c["freqs"], c["out_loc"], want,
                                  is_decode, 4, page_size, *flags)
        dev = KERNEL_DEVICE
        got = c["cache"].to(dev)
        store_kernels.norm_rope_store(c["kv"].to(dev), c["plan"].to(dev), c["weight"].to(dev), 1e-6, c["freqs"].to(dev),
                                      c["out_loc"].to(dev), got, is_decode, 4, page_size, *flags)
        diff = (got.cpu() != want).nonzero()
        assert diff.numel() == 0, f"page_size {page_size}: {diff.shape[0]} bytes differ, first {diff[:4].tolist()}"
