"""End-to-end golden tests: random serving workloads through the public API.

Every step is replayed through the golden loops (tests/golden): plan bytes must
match exactly, the state must match bit for bit, pooled rows to 2e-5, cache bytes
exactly. Every compressed token is also checked against the model-level formula,
which knows nothing about plans, rings or pages. The state starts as NaN and the
cache as 0xA5, so a read of an unwritten row or a stray write shows.
"""

from __future__ import annotations

import random

import pytest
import torch

from dsv4ops import Addressing

from _serving import ServingSim, random_trace

C4 = dict(compress_ratio=4, swa_page_size=16, full_page_size=32, max_seq_len=120)
C128 = dict(compress_ratio=128, swa_page_size=128, full_page_size=256, max_seq_len=600)

CONFIGS = {
    "c4-indexer-fp8": dict(C4, head_dim=128),
    "c4-indexer-fp4": dict(C4, head_dim=128, use_fp4=True),
    "c4-main-fp8": dict(C4, head_dim=512),
    "c4-main-bf16": dict(C4, head_dim=512, bf16_store=True),
    "c4-spec-ring16": dict(C4, head_dim=128, ring_size=16, swa_page_size=32, full_page_size=64),
    "c4-legacy": dict(C4, head_dim=128, addressing=Addressing.LEGACY),
    "c4-bf16-state": dict(C4, head_dim=128, state_dtype=torch.bfloat16),
    "c4-bf16-input": dict(C4, head_dim=128, input_dtype=torch.bfloat16),
    "c128-main-fp8": dict(C128, head_dim=512, max_seq_len=400),
    "c128-d128": dict(C128, head_dim=128),
    "c128-spec-ring256": dict(C128, head_dim=128, ring_size=256, swa_page_size=256, full_page_size=512),
    "c128-request": dict(C128, head_dim=128, addressing=Addressing.REQUEST),
    "c128-legacy": dict(C128, head_dim=128, addressing=Addressing.LEGACY),
    "c128-bf16-state": dict(C128, head_dim=128, state_dtype=torch.bfloat16),
}


def _run(config: dict, seed: int, steps: int, device="cpu") -> ServingSim:
    cfg = dict(config)
    r = cfg.pop("compress_ratio")
    sim = ServingSim(r, cfg.pop("head_dim"), seed=seed, golden=True, device=str(device), **cfg)
    # legacy addressing has no SWA pages to share
    random_trace(sim, random.Random(seed), steps, share_prefixes=sim.addressing == Addressing.SWA_PAGED)
    return sim


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_random_serving_trace(name, seed, device):
    sim = _run(CONFIGS[name], seed, 30, device)
    emitted = sum(len(s.emitted) for s in sim.steps)
    assert emitted > 0
    if sim.input_dtype != torch.float32:  # out has the input dtype
        assert sim.check_truth(rtol=1e-2, atol=1e-2) == emitted
    elif sim.state_dtype == torch.float32:
        assert sim.check_truth() == emitted
    else:  # bf16 state: rows read back from the ring carry bf16 rounding (exactness is the golden replay's job)
        sim.check_truth(rtol=0.1, atol=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", range(2, 8))
def test_random_serving_trace_long(name, seed, device):
    sim = _run(CONFIGS[name], seed, 80, device)
    if sim.state_dtype == torch.float32 and sim.input_dtype == torch.float32:
        sim.check_truth()


@pytest.mark.parametrize("r,chunks", [(4, [3, 5, 1, 7, 13, 2, 9]), (128, [100, 29, 1, 255, 127, 130])])
def test_chunked_prefill_unaligned_splits_then_decode(r, chunks, device):
    cfg = dict(C4 if r == 4 else C128, head_dim=128, max_seq_len=120 if r == 4 else 1024)
    cfg.pop("compress_ratio")
    sim = ServingSim(r, golden=True, device=str(device), **cfg)
    for n in chunks:
        sim.step([(0, n), (1, max(1, n // 2))], decode=False)
    for _ in range(2 * r + 3):  # decodes cross at least two chunk boundaries and wrap the ring
        sim.step([(0, 1), (1, 1)], decode=True)
    assert sim.check_truth() > 0


def test_prefix_cache_hit_reads_overlap_from_donor_ring(device):
    """Request 1 starts at a cached prefix of request 0 (two full pages): its first ratio-4
    window takes the overlap chunk from the ring of the donor's last SWA page."""
    sim = ServingSim(4, 128, swa_page_size=16, full_page_size=32, max_seq_len=128, golden=True, device=str(device))
    sim.step([(0, 29)], decode=False)
    sim.step([(0, 40)], decode=False)  # positions 29..68: the band rows of every SWA page are written
    sim.share_prefix(1, 0, 64)
    rec = sim.step([(1, 6)], decode=False)  # event at position 67, buffer_len 4
    words = rec.plan.plan_c.view(torch.int32)[0].cpu()
    assert (words[1].item() >> 16) == 4, "first event of the hit must take its overlap rows from the state"
    sim.step([(1, 1)] * 1 + [(0, 1)], decode=True)
    assert sim.check_truth() > 0


def test_mixed_extend_batch_with_single_token_rows(device):
    sim = ServingSim(4, 128, golden=True, device=str(device), **{k: v for k, v in C4.items() if k != "compress_ratio"})
    sim.step([(0, 11), (1, 6), (2, 3)], decode=False)
    for _ in range(9):  # sglang's mixed chunked prefill: decode requests ride along with extend 1
        sim.step([(0, 1), (1, 5), (2, 1)], decode=False)
    assert sim.check_truth() > 0


def test_padded_plans_and_padding_rows(device):
    sim = ServingSim(4, 128, golden=True, device=str(device), **{k: v for k, v in C4.items() if k != "compress_ratio"})
    rec = sim.step([(0, 9), (1, 4)], decode=False, pad=7)
    assert rec.plan.plan_c.shape == (20, 16) and rec.plan.plan_w.shape == (20, 8)
    words = rec.plan.plan_c.view(torch.int32).cpu()
    valid = words[:, 0] != -1
    assert valid.sum() == 3 and valid[:3].all(), "valid rows first (events at 3, 7 and 3), sentinels after"
    assert (rec.out[~valid.to(rec.out.device)] == 0).all(), "sentinel rows produce zero rows"
    for _ in range(4):
        sim.step([(0, 1), (1, 1)], decode=True, pad=3)
    assert sim.check_truth() > 0


def test_empty_batches(device):
    sim = ServingSim(4, 128, golden=True, device=str(device), **{k: v for k, v in C4.items() if k != "compress_ratio"})
    state, cache = sim.state.clone(), sim.cache.clone()
    rec = sim.step([], decode=False)
    assert rec.plan.plan_c.shape == (0, 16) and rec.out.shape == (0, 128)
    rec = sim.step([], decode=True)
    assert rec.plan.plan_d.shape == (0, 16)
    rec = sim.step([], decode=False, pad=5)  # all-padding prefill
    assert (rec.plan.plan_c.view(torch.int32)[:, 0] == -1).all()
    assert torch.equal(sim.state.view(torch.int32), state.view(torch.int32)) and torch.equal(sim.cache, cache)
