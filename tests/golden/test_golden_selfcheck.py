"""Self-checks of the golden loops on their own (no dsv4ops code involved)."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from .compress_loop import compress_decode_loop, compress_prefill_loop, compressed_token_truth
from .planner_loop import (
    compress_plan_rows,
    decode_plan_rows,
    plan_decode_loop,
    plan_prefill_loop,
    write_plan_rows,
)
from .store_loop import (
    E4M3_MAGNITUDES,
    bf16_encode,
    decode_cache_slot,
    e2m1_encode,
    e4m3_encode,
    e4m3_value,
    f32,
    page_bytes_of,
    store_loop,
    ue8m0_ceil,
)

INV = 0xFFFFFFFF


def _identity_ctx(num_req, stride):
    req_to_token = torch.arange(num_req * stride, dtype=torch.int32).reshape(num_req, stride)
    full_to_state = torch.arange(num_req * stride, dtype=torch.int64)
    return req_to_token, full_to_state


def _swa_row(token, sps, ring):
    return (token // sps) * ring + token % ring


# ---------------------------------------------------------------------------
# planner
# ---------------------------------------------------------------------------

def test_spec_worked_example_two_requests():
    r, ring, sps, stride = 4, 8, 16, 64
    r2t, f2s = _identity_ctx(2, stride)
    plan_c, plan_w = plan_prefill_loop(
        torch.tensor([0, 1]), torch.tensor([10, 7]), torch.tensor([10, 3]), r2t, f2s,
        13, r, sps, ring, "swa")
    assert plan_c.shape == (13, 16) and plan_w.shape == (13, 8)
    assert plan_c.dtype == torch.uint8 and plan_w.dtype == torch.uint8
    c = compress_plan_rows(plan_c)
    assert c[0] == (4, 3, 4, 0, 0)
    assert c[1] == (8, 7, 0, 0, 1)
    assert all(row == (INV, 0, 0, -1, -1) for row in c[2:])
    assert bytes(plan_c[2].tolist()) == bytes.fromhex("FFFFFFFF00000000FFFFFFFFFFFFFFFF")
    w = write_plan_rows(plan_w)
    expect = [(4 + j, _swa_row(4 + j, sps, ring)) for j in range(6)]
    expect += [(10 + j, _swa_row(stride + 4 + j, sps, ring)) for j in range(3)]
    assert w[:9] == expect
    assert all(bytes(plan_w[i].tolist()) == b"\xff" * 8 for i in range(9, 13))


def test_spec_worked_example_single_request_page_tail_band():
    r, ring, sps = 4, 8, 16
    r2t, f2s = _identity_ctx(1, 64)
    _, plan_w = plan_prefill_loop(torch.tensor([0]), torch.tensor([40]), torch.tensor([40]), r2t, f2s,
                                  40, r, sps, ring, "swa")
    w = [row for row in write_plan_rows(plan_w) if row[0] != INV]
    positions = [rg for rg, _ in w]
    assert positions == list(range(12, 16)) + list(range(28, 32)) + list(range(36, 40))
    assert [loc for _, loc in w] == [_swa_row(t, sps, ring) for t in positions]
    # the band is SWA-only: legacy writes only the tail
    _, plan_w = plan_prefill_loop(torch.tensor([0]), torch.tensor([40]), torch.tensor([40]), None, None,
                                  40, r, sps, ring, "legacy")
    assert [rg for rg, _ in write_plan_rows(plan_w) if rg != INV] == list(range(36, 40))


@pytest.mark.parametrize("r,ring", [(4, 8), (128, 128)])
def test_hip_padding_example(r, ring):
    r2t, f2s = _identity_ctx(2, 256)
    _, plan_w = plan_prefill_loop(torch.tensor([0, 1]), torch.tensor([1, 3]), torch.tensor([1, 2]), r2t, f2s,
                                  4, r, 256, ring, "swa")
    assert [rg for rg, _ in write_plan_rows(plan_w)] == [0, 1, 2, INV]


def test_prefill_invalid_requests_and_dropped_rows():
    r2t, f2s = _identity_ctx(3, 64)
    # request 0 invalid (ext > seq) still occupies its 2 ragged rows; request 2 is cut at num_q_tokens
    plan_c, plan_w = plan_prefill_loop(torch.tensor([0, 1, 2]), torch.tensor([1, 4, 8]), torch.tensor([2, 4, 8]),
                                       r2t, f2s, 10, 4, 16, 8, "swa")
    c = [row for row in compress_plan_rows(plan_c) if row[0] != INV]
    assert c == [(4, 5, 4, _swa_row(64, 16, 8) // 4, _swa_row(67, 16, 8) // 4),
                 (4, 9, 4, _swa_row(128, 16, 8) // 4, _swa_row(131, 16, 8) // 4)]
    w = [row for row in write_plan_rows(plan_w) if row[0] != INV]
    # request 2 (ragged 6..13) would write positions 4..7 = ragged 10..13: all past num_q_tokens
    assert [rg for rg, _ in w] == [2, 3, 4, 5]
    # a negative extend length occupies no ragged rows
    plan_c, _ = plan_prefill_loop(torch.tensor([0, 1]), torch.tensor([4, 4]), torch.tensor([-3, 4]),
                                  r2t, f2s, 4, 4, 16, 8, "swa")
    assert compress_plan_rows(plan_c)[0][:3] == (4, 3, 4)
    # out-of-range lookups give -1
    plan_c, plan_w = plan_prefill_loop(torch.tensor([5]), torch.tensor([4]), torch.tensor([4]), r2t, f2s,
                                       4, 4, 16, 8, "swa")
    assert compress_plan_rows(plan_c)[0] == (4, 3, 4, -1, -1)
    assert all(loc == -1 for _, loc in write_plan_rows(plan_w))


def test_decode_plan():
    r2t, f2s = _identity_ctx(2, 64)
    plan = plan_decode_loop(torch.tensor([0, 1, 1, 0]), torch.tensor([5, 0, 12, 100]), r2t, f2s, 4, 16, 8, "swa")
    rows = decode_plan_rows(plan)
    assert rows[0] == (5, 4, 0, 1)
    assert rows[1] == (0, -1, -1, -1)
    t1, t0 = 64 + 11, 64 + 7
    assert rows[2] == (12, _swa_row(t1, 16, 8), _swa_row(t0, 16, 8) // 4, _swa_row(t1, 16, 8) // 4)
    assert rows[3] == (100, -1, -1, -1)  # position 99 is past req_to_token's width
    legacy = decode_plan_rows(plan_decode_loop(torch.tensor([3]), torch.tensor([6]), None, None, 4, 16, 8, "legacy"))
    assert legacy[0] == (6, (2 * 3 + 1) * 4 + 1, (2 * 3 + 0), 2 * 3 + 1)
    req = decode_plan_rows(plan_decode_loop(torch.tensor([2]), torch.tensor([300]), None, None, 128, 256, 128,
                                            "request"))
    assert req[0] == (300, 2 * 128 + 299 % 128, (2 * 128 + 171 % 128) // 128, 2)


# ---------------------------------------------------------------------------
# number formats
# ---------------------------------------------------------------------------

def _f32_edge_values():
    vals = [0.0, -0.0, 448.0, -448.0, 464.0, -464.0, 480.0, 500.0, 1e6, -1e6, 2.0 ** -9, 2.0 ** -10,
            3 * 2.0 ** -11, 2.0 ** -11, -1e-10, -2.0 ** -12, 1e-30, float("inf"), float("-inf")]
    mags = E4M3_MAGNITUDES
    for a, b in zip(mags, mags[1:]):
        mid = (a + b) / 2
        vals += [a, b, mid, -mid, np.nextafter(np.float32(mid), np.float32(0)).item(),
                 np.nextafter(np.float32(mid), np.float32(1e9)).item()]
    for k in range(-20, 12):
        vals += [2.0 ** k, -(2.0 ** k), 1.5 * 2.0 ** k]
    return [f32(v) for v in vals]


def test_e4m3_encode_matches_torch():
    rng = np.random.default_rng(0)
    rand = (np.sign(rng.standard_normal(4000)) * 2.0 ** rng.uniform(-14, 10, 4000)).astype(np.float32)
    vals = _f32_edge_values() + [float(v) for v in rand]
    t = torch.tensor(vals, dtype=torch.float32)
    ref = t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    got = [e4m3_encode(v) for v in vals]
    bad = [(v, g, e) for v, g, e in zip(vals, got, ref) if g != e]
    assert not bad, bad[:10]
    # the decode table agrees with torch for every finite code
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    assert codes.view(torch.float8_e4m3fn).to(torch.float64).tolist() == [e4m3_value(int(c)) for c in codes]
    assert e4m3_encode(-0.0) == 0x80 and e4m3_encode(-1e-10) == 0x80 and e4m3_encode(1e-10) == 0x00


def test_bf16_encode_matches_torch():
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2 ** 32, 4000, dtype=np.uint64).astype(np.uint32)
    rand = [float(v) for v in bits.view(np.float32) if not np.isnan(v)]
    # exact midpoints between neighbouring bf16 values (ties) and their f32 neighbours
    ties = []
    for hi in rng.integers(0, 0x7F7F, 500):
        base = int(hi) << 16
        for low in (0x8000, 0x7FFF, 0x8001):
            ties.append(struct.unpack("<f", struct.pack("<I", base | low))[0])
    vals = _f32_edge_values() + rand + ties + [3.3895313892515355e38, -3.4028234663852886e38]
    ref = (torch.tensor(vals, dtype=torch.float32).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF).tolist()
    got = [bf16_encode(v) for v in vals]
    bad = [(v, hex(g), hex(e)) for v, g, e in zip(vals, got, ref) if g != e]
    assert not bad, bad[:10]
    assert bf16_encode(float("nan")) & 0x7FC0 == 0x7FC0


def test_e2m1_threshold_rule():
    # pairs, not a dict: 0.0 and -0.0 are equal keys and one of them would be dropped
    cases = [(0.0, 0), (-0.0, 0), (0.25, 0), (-0.25, 0), (0.2500001, 1), (-0.26, 0x9), (0.75, 1), (0.76, 2),
             (1.25, 2), (1.75, 3), (2.5, 4), (2.51, 5), (3.5, 5), (5.0, 6), (5.01, 7), (6.0, 7), (100.0, 7),
             (-100.0, 0xF), (-0.75, 0x9), (-2.5, 0xC)]
    for v, code in cases:
        assert e2m1_encode(v) == code, (v, e2m1_encode(v), code)


def test_ue8m0_ceil():
    for k in range(-126, 128):
        assert ue8m0_ceil(2.0 ** k) == 127 + k
        assert ue8m0_ceil(f32(2.0 ** k * (1 + 2.0 ** -23))) == 128 + k
    assert ue8m0_ceil(2.0 ** -149) == 1
    assert ue8m0_ceil(1.5) == 128 and ue8m0_ceil(0.75) == 127


def test_f32_arithmetic_matches_numpy():
    rng = np.random.default_rng(2)
    a = (rng.standard_normal(2000) * 2.0 ** rng.uniform(-30, 30, 2000)).astype(np.float32)
    b = (rng.standard_normal(2000) * 2.0 ** rng.uniform(-30, 30, 2000)).astype(np.float32)
    for x, y in zip(a, b):
        fx, fy = float(x), float(y)
        assert f32(fx * fy) == float(x * y)
        assert f32(fx + fy) == float(x + y)
        assert f32(fx - fy) == float(x - y)
        assert f32(fx / fy) == float(x / y)


# ---------------------------------------------------------------------------
# compress_forward: plans + loops reproduce the model-level formula
# ---------------------------------------------------------------------------

def _simulate(r, D, ring, sps, addressing, lengths, schedule, seed):
    """Run a schedule of prefill/decode steps for several requests and check every emitted
    compressed token against compressed_token_truth."""
    torch.manual_seed(seed)
    c = 2 if r == 4 else 1
    W = 8 if r == 4 else r
    B = len(lengths)
    stride = max(lengths) + sps
    stride = -(-stride // sps) * sps
    tokens = [torch.randn(L, 2 * c * D, dtype=torch.float32) * 2 for L in lengths]
    ape = torch.randn(W, D, dtype=torch.float32)
    rids = list(range(10, 10 + B))  # request pool slots differ from batch indices
    if addressing == "swa":
        r2t = torch.zeros(max(rids) + 1, stride, dtype=torch.int32)
        for b, rid in enumerate(rids):
            r2t[rid] = torch.arange(b * stride, (b + 1) * stride, dtype=torch.int32)
        f2s = torch.arange(B * stride, dtype=torch.int64)
        rows = (B * stride // sps) * ring
    else:
        r2t, f2s = None, None
        rows = (max(rids) + 1) * (ring if addressing == "request" else 8 if r == 4 else 128)
    state = torch.full((rows, 2 * c * D), float("nan"), dtype=torch.float32)

    done = [0] * B
    checked = [set() for _ in range(B)]
    for kind, ext in schedule:
        batch = sorted(ext)
        seqs = [done[b] + ext[b] for b in batch]
        if kind == "decode":
            assert all(ext[b] == 1 for b in batch)
            plan = plan_decode_loop(torch.tensor([rids[b] for b in batch]), torch.tensor(seqs), r2t, f2s, r, sps,
                                    ring, addressing)
            inp = torch.stack([tokens[b][s - 1] for b, s in zip(batch, seqs)])
            out = compress_decode_loop(state, inp, ape, plan, D, r)
            for i, (b, s) in enumerate(zip(batch, seqs)):
                if s % r == 0:
                    truth = compressed_token_truth(tokens[b].double(), ape, s // r - 1, r, D)
                    torch.testing.assert_close(out[i], truth, rtol=1e-12, atol=1e-12)
                    checked[b].add(s // r - 1)
                else:
                    assert torch.all(out[i] == 0)
        else:
            n_q = sum(ext.values()) + 3  # trailing padding rows
            parts, owner = [], []
            for b in batch:
                parts.append(tokens[b][done[b]:done[b] + ext[b]])
                owner += [b] * ext[b]
            parts.append(torch.randn(3, 2 * c * D))
            inp = torch.cat(parts)
            plan_c, plan_w = plan_prefill_loop(
                torch.tensor([rids[b] for b in batch]), torch.tensor(seqs), torch.tensor([ext[b] for b in batch]),
                r2t, f2s, n_q, r, sps, ring, addressing)
            out = compress_prefill_loop(state, inp, ape, plan_c, plan_w, D, r)
            for k, (s, rg, bl, _, _) in enumerate(compress_plan_rows(plan_c)):
                if s == INV:
                    assert torch.all(out[k] == 0)
                    continue
                b = owner[rg]
                truth = compressed_token_truth(tokens[b].double(), ape, s // r - 1, r, D)
                torch.testing.assert_close(out[k], truth, rtol=1e-12, atol=1e-12)
                checked[b].add(s // r - 1)
        for b in batch:
            done[b] += ext[b]
    assert done == list(lengths)
    for b, L in enumerate(lengths):
        assert checked[b] == set(range(L // r)), (b, sorted(checked[b]))


def _decodes(n, *reqs):
    return [("decode", {b: 1 for b in reqs})] * n


@pytest.mark.parametrize("addressing,ring,sps", [("swa", 8, 16), ("swa", 16, 32), ("legacy", 8, 16)])
def test_compress_c4_matches_truth(addressing, ring, sps):
    schedule = ([("prefill", {0: 6, 1: 3}), ("prefill", {0: 13})] + _decodes(5, 0, 1)
                + [("prefill", {0: 9, 1: 10})] + _decodes(5, 0, 1) + _decodes(7, 0)
                + [("prefill", {0: 1})])
    _simulate(4, 128, ring, sps, addressing, [46, 23], schedule, seed=3)


@pytest.mark.parametrize("addressing,ring,sps", [("swa", 256, 256), ("request", 128, 128), ("legacy", 128, 128)])
def test_compress_c128_matches_truth(addressing, ring, sps):
    schedule = ([("prefill", {0: 70, 1: 127})] + _decodes(1, 0, 1) + [("prefill", {0: 100})]
                + _decodes(12, 0, 1) + [("prefill", {0: 100})] + _decodes(19, 0))
    _simulate(128, 64, ring, sps, addressing, [302, 140], schedule, seed=4)


def test_compress_decode_bf16_state_rounds_written_token():
    D, r = 128, 4
    state = torch.zeros(8, 4 * D, dtype=torch.bfloat16)
    x = torch.randn(4, 4 * D)
    ape = torch.zeros(8, D)
    for s in range(1, 5):
        plan = plan_decode_loop(torch.tensor([0]), torch.tensor([s]), None, None, r, 16, 8, "legacy")
        out = compress_decode_loop(state, x[s - 1:s], ape, plan, D, r)
    truth = compressed_token_truth(x.to(torch.bfloat16).double(), ape, 0, r, D)
    torch.testing.assert_close(out[0], truth, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------
# store: value-space round trip, skip rules, untouched bytes
# ---------------------------------------------------------------------------

def _freqs(max_pos):
    k = np.arange(32)
    f = 10000.0 ** (-2 * k / 64)
    theta = np.arange(max_pos)[:, None] * f[None, :]
    out = np.empty((max_pos, 64), dtype=np.float32)
    out[:, 0::2], out[:, 1::2] = np.cos(theta), np.sin(theta)
    return torch.from_numpy(out)


def _reference_f64(x, w, eps, frow, D):
    x = np.asarray(x, dtype=np.float64)
    y = x / np.sqrt(np.mean(x * x) + eps) * np.asarray(w, dtype=np.float64)
    a, b = y[D - 64::2].copy(), y[D - 63::2].copy()
    c, s = np.asarray(frow[0::2], dtype=np.float64), np.asarray(frow[1::2], dtype=np.float64)
    y[D - 64::2], y[D - 63::2] = a * c - b * s, a * s + b * c
    if D == 128:
        idx = np.arange(128)
        H = np.array([[(-1) ** bin(i & j).count("1") for j in idx] for i in idx], dtype=np.float64)
        y = H @ y / math.sqrt(128)
    return y


@pytest.mark.parametrize("D,use_fp4,bf16_store,P", [(512, False, False, 64), (512, False, False, 2),
                                                   (512, False, True, 1), (128, False, False, 64),
                                                   (128, True, False, 64)])
def test_store_roundtrip_and_skips(D, use_fp4, bf16_store, P):
    torch.manual_seed(5)
    r = 4 if P != 2 else 128
    eps = 1e-6
    n_pages = 3
    pb = page_bytes_of(D, P, use_fp4, bf16_store)
    cache = torch.full((n_pages, pb), 0xA5, dtype=torch.uint8)
    freqs = _freqs(1024)
    w = torch.rand(D) + 0.5
    # decode rows: boundary, non-boundary (skip), negative loc (skip), page past the cache (skip)
    seqs = [r * 3, r * 3 + 1, r * 5, r * 2, r * 7]
    locs = [1, 2, -1, n_pages * P + 1, min(3, n_pages * P - 1) if P > 1 else 2]
    kv = torch.randn(len(seqs), D) * 3
    kv[4, :64] *= 1e-7  # a near-zero group
    plan = plan_decode_loop(torch.zeros(len(seqs), dtype=torch.int64), torch.tensor(seqs), None, None, r, 16,
                            8 if r == 4 else 128, "legacy")
    store_loop(kv, plan, w, eps, freqs, torch.tensor(locs), cache, True, r, P, use_fp4, bf16_store)
    written = {0: locs[0], 4: locs[4]}
    flat = bytes(cache.reshape(-1).tolist())
    touched = set()
    for i, loc in written.items():
        vals, raw = decode_cache_slot(cache, loc, D, P, use_fp4, bf16_store)
        ref = _reference_f64(kv[i].tolist(), w.tolist(), eps, freqs[seqs[i] - r].tolist(), D)
        vals = vals.numpy()
        if bf16_store:
            np.testing.assert_allclose(vals, ref, rtol=2 ** -8, atol=1e-6)
        elif D == 512:
            np.testing.assert_allclose(vals[448:], ref[448:], rtol=2 ** -8, atol=1e-6)
            for g in range(7):
                amax = np.abs(ref[64 * g:64 * g + 64]).max()
                assert np.abs(vals[64 * g:64 * g + 64] - ref[64 * g:64 * g + 64]).max() <= 0.07 * amax + 1e-6
        elif not use_fp4:
            assert np.abs(vals - ref).max() <= 0.07 * np.abs(ref).max()
        else:
            for g in range(4):
                amax = np.abs(ref[32 * g:32 * g + 32]).max()
                assert np.abs(vals[32 * g:32 * g + 32] - ref[32 * g:32 * g + 32]).max() <= 0.26 * amax + 1e-6
        page, off = loc // P, loc % P
        if D == 512 and not bf16_store:
            spans = [(576 * off, 576), (576 * P + 8 * off, 7)]
        elif bf16_store:
            spans = [(1024 * off, 1024)]
        elif not use_fp4:
            spans = [(128 * off, 128), (128 * P + 4 * off, 4)]
        else:
            spans = [(64 * off, 64), (64 * P + 4 * off, 4)]
        assert raw == b"".join(flat[page * pb + o:page * pb + o + n] for o, n in spans)
        for o, n in spans:
            touched.update(range(page * pb + o, page * pb + o + n))
    # every other byte (skipped rows, main-layout scale byte 7, page tails) is untouched
    assert all(flat[i] == 0xA5 for i in range(len(flat)) if i not in touched)
