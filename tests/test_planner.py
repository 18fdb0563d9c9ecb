"""Planner ops against the golden loop planner, byte for byte."""

from __future__ import annotations

import random

import pytest
import torch

import dsv4ops
from dsv4ops import Addressing, CompressorDecodePlan, CompressorPrefillPlan
from dsv4ops.testing import PagedPools

from golden.planner_loop import plan_decode_loop, plan_prefill_loop

NAMES = {Addressing.SWA_PAGED: "swa", Addressing.REQUEST: "request", Addressing.LEGACY: "legacy"}

# (ratio, ring, swa_page_size, full_page_size, addressing)
GEOMETRIES = [
    (4, 8, 16, 32, Addressing.SWA_PAGED),
    (4, 8, 128, 256, Addressing.SWA_PAGED),
    (4, 16, 32, 64, Addressing.SWA_PAGED),  # speculative ring
    (4, 8, 16, 32, Addressing.LEGACY),
    (128, 128, 128, 256, Addressing.SWA_PAGED),
    (128, 256, 256, 512, Addressing.SWA_PAGED),  # speculative ring: mtp pad of 4
    (128, 128, 128, 256, Addressing.REQUEST),
    (128, 256, 256, 256, Addressing.REQUEST),
    (128, 128, 128, 256, Addressing.LEGACY),
]


def _random_batch(rng: random.Random, pools: PagedPools, r: int, max_bs: int = 6):
    bs = rng.randint(0, max_bs)
    rids = rng.sample(range(pools.max_requests), bs)
    seqs, exts = [], []
    for _ in range(bs):
        seq = rng.randint(1, pools.max_seq_len)
        choice = rng.random()
        if choice < 0.2:
            ext = seq  # no prefix
        elif choice < 0.3:
            ext = 0
        elif choice < 0.4:
            ext = 1
        else:
            ext = rng.randint(1, min(seq, 3 * r + 9))
        seqs.append(seq)
        exts.append(ext)
    return rids, seqs, exts


def _t(values, device):
    return torch.tensor(values, dtype=torch.int64, device=device)


def _generate_prefill(r, ring, sps, addressing, rids, seqs, exts, num_q, pools, device):
    rpi, seq_lens, ext_lens = _t(rids, device), _t(seqs, "cpu"), _t(exts, "cpu")
    if addressing == Addressing.LEGACY:
        return CompressorPrefillPlan.generate_legacy(r, rpi, seq_lens, ext_lens, num_q)
    return CompressorPrefillPlan.generate(
        r, rpi, seq_lens, ext_lens, pools.req_to_token, pools.full_to_state, sps, ring, num_q,
        addressing=NAMES[addressing],
    )


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"r{g[0]}-ring{g[1]}-sps{g[2]}-{NAMES[g[4]]}")
def test_prefill_matches_loop(geometry, device):
    r, ring, sps, page, addressing = geometry
    rng = random.Random(r * 1000 + ring + sps + int(addressing))
    for trial in range(12):
        pools = PagedPools(max_requests=8, max_seq_len=600 if r == 128 else 150, swa_page_size=sps,
                           full_page_size=page, seed=trial, device=device)
        rids, seqs, exts = _random_batch(rng, pools, r)
        num_q = sum(exts) + rng.choice([0, 0, rng.randint(1, 9)])  # padded plans too
        plan = _generate_prefill(r, ring, sps, addressing, rids, seqs, exts, num_q, pools, device)
        r2t, f2s = (None, None) if addressing == Addressing.LEGACY else (pools.req_to_token.cpu(), pools.full_to_state.cpu())
        want_c, want_w = plan_prefill_loop(_t(rids, "cpu"), _t(seqs, "cpu"), _t(exts, "cpu"), r2t, f2s, num_q, r, sps, ring, NAMES[addressing])
        assert plan.plan_c.shape == (num_q, 16) and plan.plan_w.shape == (num_q, 8)
        assert torch.equal(plan.plan_c.cpu(), want_c), f"trial {trial}: CompressPlan"
        assert torch.equal(plan.plan_w.cpu(), want_w), f"trial {trial}: WritePlan"


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"r{g[0]}-ring{g[1]}-sps{g[2]}-{NAMES[g[4]]}")
def test_decode_matches_loop(geometry, device):
    r, ring, sps, page, addressing = geometry
    rng = random.Random(7 + r + ring)
    for trial in range(8):
        pools = PagedPools(max_requests=8, max_seq_len=600, swa_page_size=sps, full_page_size=page, seed=trial, device=device)
        bs = rng.randint(0, 8)
        rids = [rng.randrange(8) for _ in range(bs)]
        seqs = [rng.choice([0, 1, 2, 3, 4, 5, r, r + 1, 2 * r, rng.randint(1, 600)]) for _ in range(bs)]
        if addressing == Addressing.LEGACY:
            plan = CompressorDecodePlan.generate_legacy(r, _t(rids, device), _t(seqs, device))
            r2t = f2s = None
        else:
            plan = CompressorDecodePlan.generate(
                r, _t(rids, device), pools.req_to_token, pools.full_to_state, _t(seqs, device), sps, ring,
                addressing=NAMES[addressing],
            )
            r2t, f2s = pools.req_to_token.cpu(), pools.full_to_state.cpu()
        want = plan_decode_loop(_t(rids, "cpu"), _t(seqs, "cpu"), r2t, f2s, r, sps, ring, NAMES[addressing])
        assert torch.equal(plan.plan_d.cpu(), want), f"trial {trial}"


def test_spec_worked_example():
    """spec-compressor §6.2: r=4, ring 8, sps 16; A (seq 10, ext 10), B (seq 7, ext 3)."""
    r2t = torch.arange(128, dtype=torch.int32).view(2, 64)
    f2s = torch.arange(128)
    plan = CompressorPrefillPlan.generate(4, _t([0, 1], "cpu"), _t([10, 7], "cpu"), _t([10, 3], "cpu"), r2t, f2s, 16, 8, 13)
    c = plan.plan_c.view(torch.int32)
    events = [(w[0].item(), w[1].item() & 0xFFFF, w[1].item() >> 16) for w in c if w[0] != -1]
    assert events == [(4, 3, 4), (8, 7, 0)]
    writes = [w[0].item() for w in plan.plan_w.view(torch.int32) if w[0] != -1]
    assert writes == [4, 5, 6, 7, 8, 9, 10, 11, 12]
    single = CompressorPrefillPlan.generate(4, _t([0], "cpu"), _t([40], "cpu"), _t([40], "cpu"), r2t, f2s, 16, 8, 40)
    positions = [w[0].item() for w in single.plan_w.view(torch.int32) if w[0] != -1]
    assert positions == [12, 13, 14, 15, 28, 29, 30, 31, 36, 37, 38, 39]
    # sentinel bytes
    assert plan.plan_c[2].tolist() == [0xFF] * 4 + [0] * 4 + [0xFF] * 8
    assert plan.plan_w[-1].tolist() == [0xFF] * 8


@pytest.mark.parametrize("r", [4, 128])
def test_device_side_bad_lengths_produce_no_rows(r, device):
    """Lengths on the device cannot be checked without a sync: bad requests plan nothing, others are intact."""
    pools = PagedPools(max_requests=4, max_seq_len=512, swa_page_size=128, full_page_size=256, device=device)
    ring = 8 if r == 4 else 128
    rids, seqs, exts = [0, 1, 2, 3], [300, 5, 260, 40], [300, 9, -3, 40]  # request 1: ext > seq; 2: negative
    num_q = 300 + 9 + 40 - 20  # the last request's tail falls past num_q_tokens and is dropped
    plan_c, plan_w = torch.ops.dsv4ops.plan_prefill(
        _t(rids, device), pools.req_to_token, pools.full_to_state, _t(seqs, device), _t(exts, device), num_q,
        r, 128, ring, int(Addressing.SWA_PAGED),
    )
    want_c, want_w = plan_prefill_loop(_t(rids, "cpu"), _t(seqs, "cpu"), _t(exts, "cpu"), pools.req_to_token.cpu(),
                                       pools.full_to_state.cpu(), num_q, r, 128, ring, "swa")
    assert torch.equal(plan_c.cpu(), want_c) and torch.equal(plan_w.cpu(), want_w)
    ragged = plan_w.view(torch.int32)[:, 0].cpu()
    ragged = ragged[ragged >= 0]
    assert ragged.max() < num_q and not ((ragged >= 300) & (ragged < 309)).any()


def test_out_of_range_lookups_give_minus_one(device):
    pools = PagedPools(max_requests=2, max_seq_len=64, swa_page_size=16, full_page_size=32, device=device)
    f2s = pools.full_to_state.clone()
    f2s[pools.req_to_token[0, 5].long()] = -7  # a hole in the SWA mapping
    rids = _t([0, 5, 0], device)  # request 5 does not exist
    seqs = _t([6, 3, 100], device)  # position 99 is past req_to_token's width
    plan = CompressorDecodePlan.generate(4, rids, pools.req_to_token, f2s, seqs, 16, 8)
    words = plan.plan_d.view(torch.int32).cpu()
    assert words[0, 1] == -1 and words[1, 1] == -1 and words[2, 1] == -1
    want = plan_decode_loop(rids.cpu(), seqs.cpu(), pools.req_to_token.cpu(), f2s.cpu(), 4, 16, 8, "swa")
    assert torch.equal(plan.plan_d.cpu(), want)


def test_plans_copy_into_captured_buffers():
    r2t = torch.arange(128, dtype=torch.int32).view(2, 64)
    f2s = torch.arange(128)
    a = CompressorPrefillPlan.generate(4, _t([0], "cpu"), _t([9], "cpu"), _t([9], "cpu"), r2t, f2s, 16, 8, 12)
    b = CompressorPrefillPlan.generate(4, _t([1], "cpu"), _t([5], "cpu"), _t([5], "cpu"), r2t, f2s, 16, 8, 12)
    a.copy_(b)
    assert torch.equal(a.plan_c, b.plan_c) and torch.equal(a.plan_w, b.plan_w)
    d = CompressorDecodePlan.generate(4, _t([0], "cpu"), r2t, f2s, _t([9], "cpu"), 16, 8)
    with pytest.raises(ValueError, match="copy_"):
        d.copy_(a)
    assert d.is_decode and not a.is_decode and dsv4ops.CompressorDecodePlan._fields == ("compress_ratio", "plan_d")
    assert dsv4ops.CompressorPrefillPlan._fields == ("compress_ratio", "plan_c", "plan_w", "pin_buffer")
