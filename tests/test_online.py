"""Online ratio-128 compressor: plans, serving traces against the model-level formula, kernels, opcheck."""

from __future__ import annotations

import os
import random

import pytest
import torch

import dsv4ops
from dsv4ops import CompressorDecodePlan, CompressorPrefillPlan
from dsv4ops.online import kernels as online_kernels
from dsv4ops.online.reference import (
    online_decode_reference,
    online_prefill_reference,
    plan_online_decode_reference,
    plan_online_prefill_reference,
)

from golden.compress_loop import compressed_token_truth

D = 64
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


class OnlineSim:
    """Requests served through the public API with ``is_online=True``; the state is poisoned with NaN."""

    def __init__(self, num_requests=5, max_len=800, device="cpu", seed=0, offset=0):
        g = torch.Generator().manual_seed(seed)
        self.device, self.offset = device, offset
        self.tokens = torch.randn(num_requests, max_len, 2 * D, generator=g) * 2
        self.ape = torch.randn(128, D, generator=g).to(device)
        self.state = torch.full((num_requests + offset + 2, 3 * D), float("nan"), device=device)
        self.seq = {}
        self.emitted = []  # (rid, n, pooled row)
        self.steps = []

    def step(self, requests, decode, pad=0):
        rids = torch.tensor([r for r, _ in requests], dtype=torch.int64)
        seqs = torch.tensor([self.seq.get(r, 0) + n for r, n in requests], dtype=torch.int64)
        rows = [(r, p) for r, n in requests for p in range(self.seq.get(r, 0), self.seq.get(r, 0) + n)]
        x = torch.stack([self.tokens[r, p] for r, p in rows]) if rows else torch.zeros(0, 2 * D)
        x = torch.cat([x, torch.randn(pad, 2 * D) * 100]).to(self.device)
        dev_rids = rids.to(self.device)
        if decode:
            plan = CompressorDecodePlan.generate_online(seqs.to(self.device), dev_rids, state_slot_offset=self.offset)
        else:
            ext = torch.tensor([n for _, n in requests], dtype=torch.int64)
            plan = CompressorPrefillPlan.generate_online(seqs, ext, dev_rids, num_q_tokens=len(rows) + pad,
                                                         state_slot_offset=self.offset)
        out = dsv4ops.compress_forward(self.state.view(-1, 1, 3 * D), x, self.ape, plan, head_dim=D,
                                       compress_ratio=128, is_online=True)
        if decode:
            for b, (r, p) in enumerate(rows):
                if (p + 1) % 128 == 0:
                    self.emitted.append((r, p // 128, out[b]))
        else:
            words = plan.plan_c.view(torch.int32).cpu()
            for k in range(words.shape[0]):
                if words[k, 0] == -1:
                    break
                r, p = rows[words[k, 1].item() & 0xFFFF]
                self.emitted.append((r, p // 128, out[k]))
        for r, n in requests:
            self.seq[r] = self.seq.get(r, 0) + n
        self.steps.append((plan, x, out))

    def check(self):
        ape = self.ape.cpu().double()
        for r, n, row in self.emitted:
            want = compressed_token_truth(self.tokens[r, : 128 * (n + 1)].double(), ape, n, 128, D)
            torch.testing.assert_close(row.cpu().double(), want, rtol=2e-5, atol=2e-5)
        # the state of every chunk in progress: (max, softmax denominator, normalized mean) of its tokens
        for r, s in self.seq.items():
            start = s - s % 128
            if s % 128 == 0:
                continue
            x = self.tokens[r, start:s].double()
            score = x[:, D:] + ape[: s - start]
            m = score.max(0).values
            e = torch.exp(score - m)
            want = torch.cat([m, e.sum(0), (e * x[:, :D]).sum(0) / e.sum(0)])
            torch.testing.assert_close(self.state[r + self.offset].cpu().double(), want, rtol=2e-5, atol=2e-5)
        return len(self.emitted)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_online_serving_trace_matches_formula(seed, device):
    rng = random.Random(seed)
    sim = OnlineSim(device=str(device), seed=seed, offset=seed)
    for _ in range(40):
        live = [r for r in range(5) if sim.seq.get(r, 0) < 640]
        chosen = rng.sample(live, rng.randint(1, min(3, len(live))))
        started = [r for r in chosen if sim.seq.get(r, 0) > 0]
        if started and rng.random() < 0.5:
            sim.step([(r, 1) for r in started], decode=True)
        else:
            sim.step([(r, min(640 - sim.seq.get(r, 0), rng.choice([1, rng.randint(1, 200)]))) for r in chosen],
                     decode=False, pad=rng.choice([0, 3]))
    for _ in range(130):  # decode across a chunk boundary for everyone
        sim.step([(r, 1) for r in range(5)], decode=True)
    assert sim.check() > 5


def test_online_matches_offline_ratio_128():
    """Same tokens through the offline (ring) and online (running state) compressors."""
    from _serving import ServingSim

    off = ServingSim(128, D, swa_page_size=128, full_page_size=256, max_seq_len=600, max_requests=2)
    on = OnlineSim(num_requests=2, max_len=off.tokens.shape[1])
    on.tokens[:1] = off.tokens[:1]
    on.ape = off.ape
    for n, decode in [(300, False), (1, True), (90, False)] + [(1, True)] * 100:
        off.step([(0, n)], decode=decode)
        on.step([(0, n)], decode=decode)
    offline = {(r, n): a.out[row] for a in off.steps for r, n, row in a.emitted}
    assert len(on.emitted) == len(offline) == 3
    for r, n, row in on.emitted:
        torch.testing.assert_close(row, offline[(r, n)], rtol=2e-5, atol=2e-5)


def test_online_layer_matches_offline_layer(device):
    """``DeepSeekV4Compressor(online=True)`` emits the offline layer's compressed tokens (same weights):
    chunked prefill ending inside, exactly at and past chunk ends, then decode steps across chunk
    ends; the pooled rows agree to float rounding and the caches hold the same tokens."""
    from _asserts import assert_caches_equivalent

    from dsv4ops._layout import CacheLayout, cache_format
    from dsv4ops.layer import DeepSeekV4Compressor
    from dsv4ops.testing import PagedPools, make_batch

    hidden, head_dim = 64, 512
    pools = PagedPools(max_requests=4, max_seq_len=1024, swa_page_size=128, full_page_size=256, device=device)
    common = dict(cache_pages=pools.cache_pages(), cache_page_size=2, swa_page_size=128, max_positions=1024,
                  device=device)
    offline = DeepSeekV4Compressor(hidden, head_dim, 128, state_rows=pools.state_rows(128, 128), **common)
    online = DeepSeekV4Compressor(hidden, head_dim, 128, state_rows=4, online=True, **common)
    with torch.no_grad():
        for name in ("wkv_gate.weight", "ape", "norm_weight"):
            online.get_parameter(name).copy_(offline.get_parameter(name))
    for layer in (offline, online):
        layer.state.fill_(float("nan"))  # nothing may read a row no step wrote
    gen = torch.Generator().manual_seed(0)
    seq, written = {}, []
    # request 0 ends a prefill exactly at a chunk end; the second prefill leaves every request one or
    # two tokens before a chunk end, so the decode steps cross one
    steps = [([(0, 128), (1, 150), (2, 40), (3, 300)], False), ([(0, 127), (1, 233), (2, 86), (3, 210)], False)]
    steps += [([(r, 1) for r in range(4)], True)] * 3
    emitted = 0
    for requests, decode in steps:
        batch = make_batch(requests, seq, decode=decode, device=device)
        x = torch.randn(batch.num_q_tokens, hidden, generator=gen).to(device)
        out_loc = pools.out_loc([a for a, _ in batch.rows], [b for _, b in batch.rows], 128)
        args = (x, batch.req_pool_indices, batch.seq_lens, batch.extend_lens, pools.req_to_token,
                pools.full_to_state, out_loc)
        want, got = offline(*args), online(*args)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        emitted += int((want != 0).any(dim=1).sum())
        written.append(out_loc)
        for rid, pos in batch.rows:
            seq[rid] = pos + 1
    assert emitted == 4 + 2 + 4  # chunk ends reached: first prefill 128 (r0, r1), 128 and 256 (r3); second
    # prefill 256 (r1), 384 (r3); decode 256 (r0), 384 (r1), 128 (r2), 512 (r3)
    layout = CacheLayout(cache_format(head_dim, False, False), 2)
    assert_caches_equivalent(offline.kvcache, online.kvcache, torch.cat(written), layout)


def test_online_layer_errors():
    from dsv4ops.layer import DeepSeekV4Compressor

    common = dict(state_rows=4, cache_pages=2, swa_page_size=128, max_positions=256)
    with pytest.raises(ValueError, match="`online=True` needs compress_ratio=128"):
        DeepSeekV4Compressor(64, 512, 4, cache_page_size=64, online=True, **common)
    with pytest.raises(ValueError, match="float32 state"):
        DeepSeekV4Compressor(64, 512, 128, cache_page_size=2, online=True, state_dtype=torch.bfloat16, **common)


def test_online_plan_rows():
    p = CompressorPrefillPlan.generate_online(torch.tensor([300, 70]), torch.tensor([170, 70]), torch.tensor([0, 1]),
                                              num_q_tokens=245)
    close = [(a, b & 0xFFFF, b >> 16, x, y) for a, b, x, y in p.plan_c.view(torch.int32).tolist() if a != -1]
    write = [(a, b & 0xFFFF, b >> 16, x, y) for a, b, x, y in p.plan_w.view(torch.int32).tolist() if a != -1]
    # request 0 extends positions 130..299: closes chunk 1 (126 tokens, merging the stored 2), then keeps 44
    assert close == [(256, 125, 126, 0, 0)]
    assert write == [(300, 169, 44, 0, -1), (70, 239, 70, 1, -1)]
    assert p.plan_c.shape == p.plan_w.shape == (245, 16)
    d = CompressorDecodePlan.generate_online(torch.tensor([5, 0]), torch.tensor([3, 4]), state_slot_offset=2)
    assert d.plan_d.view(torch.int32).tolist() == [[5, 5, 5, -1], [0, -1, -1, -1]]


def test_online_errors():
    with pytest.raises(ValueError, match="`is_online=True` needs compress_ratio=128"):
        dsv4ops.compress_forward(torch.zeros(4, 3 * D), torch.zeros(1, 2 * D), torch.zeros(128, D),
                                 CompressorDecodePlan(4, torch.zeros(1, 16, dtype=torch.uint8)), head_dim=D,
                                 compress_ratio=4, is_online=True)
    with pytest.raises(ValueError, match="`kv_score_buffer` must be"):
        torch.ops.dsv4ops.compress_forward_online(torch.zeros(4, 2 * D), torch.zeros(1, 2 * D), torch.zeros(128, D),
                                                  torch.zeros(1, 16, dtype=torch.uint8), None, torch.zeros(1, D), D)


def test_online_opcheck():
    sim = OnlineSim(num_requests=3)
    sim.step([(0, 200), (1, 77)], decode=False)
    sim.step([(0, 1), (1, 1)], decode=True)
    rpi, seqs, exts = torch.tensor([0, 1]), torch.tensor([300, 90]), torch.tensor([99, 12])
    torch.library.opcheck(torch.ops.dsv4ops.plan_online_prefill, (rpi, seqs, exts, 111, 0), test_utils=OPCHECK_UTILS)
    torch.library.opcheck(torch.ops.dsv4ops.plan_online_decode, (rpi, seqs, 1), test_utils=OPCHECK_UTILS)
    for plan, x, out in sim.steps:
        write_plan = None if plan.is_decode else plan.plan_w
        args = (torch.randn_like(sim.state), x, sim.ape, plan[1], write_plan, torch.empty_like(out), D)
        torch.library.opcheck(torch.ops.dsv4ops.compress_forward_online, args, test_utils=OPCHECK_UTILS)


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICE = "cpu" if INTERPRETED else "cuda"
needs_kernels = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                                   reason="needs CUDA or TRITON_INTERPRET=1")


@needs_kernels
def test_online_kernels_match_reference():
    rng = random.Random(4)
    for trial in range(4):
        bs = rng.randint(0, 4)
        rids = rng.sample(range(6), bs)
        seqs = [rng.randint(1, 500) for _ in range(bs)]
        exts = [rng.randint(0, s) if rng.random() < 0.7 else s for s in seqs]
        num_q = sum(exts) + rng.choice([0, 4])
        t = lambda v: torch.tensor(v, dtype=torch.int64, device=KERNEL_DEVICE)  # noqa: E731
        got = online_kernels.plan_online_prefill(t(rids), t(seqs), t(exts), num_q, 1)
        want = plan_online_prefill_reference(t(rids), t(seqs), t(exts), num_q, 1)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(online_kernels.plan_online_decode(t(rids), t(seqs), 1),
                           plan_online_decode_reference(t(rids), t(seqs), 1))
        # compress: prefill then two decodes from a random (finite) state
        state = torch.randn(8, 3 * D, device=KERNEL_DEVICE).abs() + 0.5
        x = torch.randn(num_q, 2 * D, device=KERNEL_DEVICE)
        ape = torch.randn(128, D, device=KERNEL_DEVICE)
        s_ref, s_got = state.clone(), state.clone()
        o_ref = torch.full((num_q, D), float("nan"), device=KERNEL_DEVICE)
        o_got = o_ref.clone()
        online_prefill_reference(s_ref, x, ape, want[0], want[1], o_ref, D)
        online_kernels.compress_forward_online(s_got, x, ape, want[0], want[1], o_got, D)
        torch.testing.assert_close(o_got, o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s_got, s_ref, rtol=1e-5, atol=1e-5)
        plan_d = plan_online_decode_reference(t(rids), t([s + 1 for s in seqs]), 1)
        xd = torch.randn(bs, 2 * D, device=KERNEL_DEVICE)
        od_ref, od_got = torch.full((bs, D), float("nan"), device=KERNEL_DEVICE), torch.full((bs, D), 7.0, device=KERNEL_DEVICE)
        online_decode_reference(s_ref, xd, ape, plan_d, od_ref, D)
        online_kernels.compress_forward_online(s_got, xd, ape, plan_d, None, od_got, D)
        torch.testing.assert_close(od_got, od_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s_got, s_ref, rtol=1e-5, atol=1e-5)
