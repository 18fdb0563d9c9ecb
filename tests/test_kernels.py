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
from dsv4ops._triton import HAVE_TRITON
from dsv4ops.compress import kernels as compress_kernels
from dsv4ops.compress.reference import compress_decode_reference, compress_prefill_reference
from dsv4ops.online import kernels as online_kernels
from dsv4ops.online.reference import plan_online_decode_reference, plan_online_prefill_reference
from dsv4ops.planner import kernels as planner_kernels
from dsv4ops.planner.reference import plan_decode_reference, plan_prefill_reference
from dsv4ops.store import kernels as store_kernels
from dsv4ops.store.reference import norm_rope_store_reference
from dsv4ops.testing import PagedPools

from _asserts import assert_same_bits
from _serving import ServingSim, random_trace
from test_planner import GEOMETRIES, NAMES, _random_batch, _t
from test_store import FORMATS, _case, kernel_and_reference_bytes

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


def _stress_batch(rng: random.Random, pools: PagedPools, r: int, bs: int, long_extend: bool):
    """Many requests (more than the planner's request chunk): prefixes, ext = 0, ext = 1, bad requests
    (ext > seq, ext < 0) and request ids outside the pool; optionally one long extend spanning row blocks."""
    rids, seqs, exts = [], [], []
    for b in range(bs):
        rids.append(rng.randrange(pools.max_requests) if rng.random() < 0.9 else rng.choice([-1, pools.max_requests + 3]))
        seq = rng.randint(1, pools.max_seq_len)
        choice = rng.random()
        if long_extend and b == bs // 2:
            ext = min(seq, 300 if r == 4 else 700)
        elif choice < 0.15:
            ext = 0
        elif choice < 0.25:
            ext = 1
        elif choice < 0.3:
            ext = seq + rng.randint(1, 4)  # bad: plans nothing, still occupies ext ragged rows
        elif choice < 0.35:
            ext = -rng.randint(1, 4)  # bad: occupies no ragged rows
        elif choice < 0.45:
            ext = min(seq, rng.randint(1, 2 * r + 9))
        else:
            ext = min(seq, rng.randint(1, 12))
        seqs.append(seq)
        exts.append(ext)
    return rids, seqs, exts


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"r{g[0]}-ring{g[1]}-sps{g[2]}-{NAMES[g[4]]}")
def test_planner_kernels_stress(geometry):
    """bs past the kernels' request chunk, truncation at num_q_tokens, padding, int32 lengths, long extends."""
    r, ring, sps, page, addressing = geometry
    rng = random.Random(11 * r + ring + int(addressing))
    for trial in range(3):
        pools = PagedPools(max_requests=24, max_seq_len=900 if r == 128 else 400, swa_page_size=sps,
                           full_page_size=page, seed=trial, device=KERNEL_DEVICE)
        bs = rng.randint(planner_kernels.CHUNK + 1, 2 * planner_kernels.CHUNK + 9)
        rids, seqs, exts = _stress_batch(rng, pools, r, bs, long_extend=trial != 1)
        total = sum(max(e, 0) for e in exts)
        num_q = [total, total + 7, rng.randint(0, total)][trial]  # exact, padded, truncated mid-batch
        dtype = torch.int32 if trial == 1 else torch.int64
        rpi, seq_lens, ext_lens = (torch.tensor(v, dtype=dtype, device=KERNEL_DEVICE) for v in (rids, seqs, exts))
        tables = (None, None) if addressing == Addressing.LEGACY else (pools.req_to_token, pools.full_to_state)
        common = (r, sps, ring, int(addressing))
        got = planner_kernels.plan_prefill(rpi, *tables, seq_lens, ext_lens, num_q, *common)
        want = plan_prefill_reference(rpi, *tables, seq_lens, ext_lens, num_q, *common)
        assert torch.equal(got[0], want[0]), f"trial {trial}: CompressPlan"
        assert torch.equal(got[1], want[1]), f"trial {trial}: WritePlan"
        dec = seq_lens - torch.tensor([rng.randint(0, 2) for _ in seqs], dtype=dtype, device=KERNEL_DEVICE)
        got = planner_kernels.plan_decode(rpi, *tables, dec, *common)
        assert torch.equal(got, plan_decode_reference(rpi, *tables, dec, *common)), f"trial {trial}: DecodePlan"


def test_online_planner_kernels_stress():
    rng = random.Random(8)
    pools = PagedPools(max_requests=24, max_seq_len=900, device=KERNEL_DEVICE)
    for trial in range(3):
        bs = rng.randint(planner_kernels.CHUNK + 1, 2 * planner_kernels.CHUNK + 9)
        rids, seqs, exts = _stress_batch(rng, pools, 128, bs, long_extend=trial != 1)
        total = sum(max(e, 0) for e in exts)
        num_q = [total, total + 7, rng.randint(0, total)][trial]
        dtype = torch.int32 if trial == 1 else torch.int64
        rpi, seq_lens, ext_lens = (torch.tensor(v, dtype=dtype, device=KERNEL_DEVICE) for v in (rids, seqs, exts))
        offset = [0, 5, 1000][trial]
        got = online_kernels.plan_online_prefill(rpi, seq_lens, ext_lens, num_q, offset)
        want = plan_online_prefill_reference(rpi, seq_lens, ext_lens, num_q, offset)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"trial {trial}"
        assert torch.equal(online_kernels.plan_online_decode(rpi, seq_lens, offset),
                           plan_online_decode_reference(rpi, seq_lens, offset)), f"trial {trial}"


def test_planner_kernels_empty():
    pools = PagedPools(max_requests=2, max_seq_len=64, swa_page_size=16, full_page_size=32, device=KERNEL_DEVICE)
    empty = torch.zeros(0, dtype=torch.int64, device=KERNEL_DEVICE)
    c, w = planner_kernels.plan_prefill(empty, pools.req_to_token, pools.full_to_state, empty, empty, 0, 4, 16, 8, 0)
    assert c.shape == (0, 16) and w.shape == (0, 8)
    c, w = planner_kernels.plan_prefill(empty, pools.req_to_token, pools.full_to_state, empty, empty, 7, 4, 16, 8, 0)
    assert (c.view(torch.int32)[:, 0] == -1).all() and (w == 255).all()
    d = planner_kernels.plan_decode(empty, pools.req_to_token, pools.full_to_state, empty, 4, 16, 8, 0)
    assert d.shape == (0, 16)
    # requests but no ragged rows (num_q_tokens = 0), and requests with nothing to plan (ext = 0)
    rpi, seq, ext = (torch.tensor(v, device=KERNEL_DEVICE) for v in ([0, 1], [9, 20], [0, 0]))
    c, w = planner_kernels.plan_prefill(rpi, pools.req_to_token, pools.full_to_state, seq, seq, 0, 4, 16, 8, 0)
    assert c.shape == (0, 16) and w.shape == (0, 8)
    c, w = planner_kernels.plan_prefill(rpi, pools.req_to_token, pools.full_to_state, seq, ext, 3, 4, 16, 8, 0)
    assert (c.view(torch.int32)[:, 0] == -1).all() and (w == 255).all()
    c, w = online_kernels.plan_online_prefill(empty, empty, empty, 0, 0)
    assert c.shape == (0, 16) and w.shape == (0, 16)
    c, w = online_kernels.plan_online_prefill(rpi, seq, ext, 3, 0)
    assert (c.view(torch.int32)[:, 0] == -1).all() and (w.view(torch.int32)[:, 0] == -1).all()


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


def _case_id(case: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in case.items())


@pytest.mark.parametrize("case", COMPRESS_CASES, ids=_case_id)
def test_compress_kernels(case):
    c = dict(case)
    r, D = c.pop("r"), c.pop("D")
    big = r == 128
    sim = ServingSim(r, D, max_seq_len=300 if big else 90, full_page_size=256 if big else 32,
                     swa_page_size=128 if big else 16, **c)
    random_trace(sim, random.Random(2), 8 if big else 16)
    _check_compress_kernels(sim, r, D)


def _check_compress_kernels(sim: ServingSim, r: int, D: int, reorder=None) -> None:
    """Replay every step of ``sim`` through the kernels (NaN-poisoned outputs, a random state) and
    hold them to the reference: state bit-identical, every out row written and within tolerance.
    ``reorder``, if given, rearranges each prefill's CompressPlan rows first (kernels and reference
    take the same plan)."""
    for out_dtype in (torch.float32, torch.bfloat16):
        for step in sim.steps:
            state = torch.randn(sim.state.shape).to(sim.state_dtype)
            x = step.kv_score_input
            plan, write_plan = (step.plan.plan_d, None) if step.plan.is_decode else (step.plan.plan_c, step.plan.plan_w)
            if reorder is not None and write_plan is not None:
                plan = reorder(plan)
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


@pytest.mark.parametrize("case", [COMPRESS_CASES[0], COMPRESS_CASES[3]], ids=_case_id)
def test_compress_kernels_channels_fastest_grid(case, monkeypatch):
    """The other order of the pooling and decode grids (the channel blocks of one row block run
    together) pools and writes exactly the same."""
    monkeypatch.setattr(compress_kernels, "CHANNELS_FASTEST", not compress_kernels.CHANNELS_FASTEST)
    monkeypatch.setattr(compress_kernels, "C4_CHANNELS_FASTEST",
                        {key: not fastest for key, fastest in compress_kernels.C4_CHANNELS_FASTEST.items()})
    test_compress_kernels(case)


@pytest.mark.parametrize("case", [COMPRESS_CASES[1], COMPRESS_CASES[4]], ids=_case_id)
@pytest.mark.parametrize("programs", [1, 3])
def test_compress_kernels_write_pass_strided(case, programs, monkeypatch):
    """The prefill write pass with fewer programs than row blocks: each program owns every
    ``WRITE_PROGRAMS``-th block, reads their plan words ``WRITE_CHUNK`` blocks at a time (several
    chunks per program here) and copies the live ones; the ring comes out bit-identical."""
    monkeypatch.setattr(compress_kernels, "WRITE_PROGRAMS", programs)
    monkeypatch.setattr(compress_kernels, "WRITE_CHUNK", 2)
    monkeypatch.setattr(compress_kernels, "WRITE_TILE", (2, 64))
    test_compress_kernels(case)


@pytest.mark.parametrize("case", COMPRESS_CASES[:3], ids=_case_id)
def test_compress_kernels_ratio4_d512_settings(case, monkeypatch):
    """The test cases' head_dims (<= 256) take the D 128 entries of the ratio-4 tables; this runs them
    with the D 512 entries (its tile, pipelined blocks and grid order), the settings DeepSeek-V4's main
    compressor runs with."""
    for table in ("C4_TILE", "C4_STREAM", "C4_CHANNELS_FASTEST", "C4_LARGE"):
        entries = getattr(compress_kernels, table)
        monkeypatch.setattr(compress_kernels, table, {512: entries[512], 128: entries[512]})
    test_compress_kernels(case)


@pytest.mark.parametrize("case", [COMPRESS_CASES[0], COMPRESS_CASES[3]], ids=_case_id)
def test_compress_kernels_decode_order(case, monkeypatch):
    """Decode with the other ``DECODE_POOL_FIRST`` (the window loaded after the ring write instead of
    before, or the reverse): the same state bits and outputs."""
    monkeypatch.setattr(compress_kernels, "DECODE_POOL_FIRST", not compress_kernels.DECODE_POOL_FIRST)
    test_compress_kernels(case)


# 2 x 2 rows for every ratio-4 case (dtypes, head_dims); 8 x 4 rows (the H100's blocks) for one
@pytest.mark.parametrize("case,events,blocks", [(case, 2, 2) for case in COMPRESS_CASES[:3]] + [(COMPRESS_CASES[0], 8, 4)],
                         ids=lambda v: _case_id(v) if isinstance(v, dict) else str(v))
@pytest.mark.parametrize("channels_fastest", [False, True], ids=["rows-fastest", "channels-fastest"])
def test_compress_kernels_ratio4_pipelined(case, events, blocks, channels_fastest, monkeypatch):
    """Ratio-4 prefill pooling with several row blocks per program in a pipelined loop
    (``C4_STREAM`` stages > 0; the D 512 default) pools and writes as the one-block kernel, in
    either grid order; programs whose rows are all plan padding store zeros without pooling (the
    NaN-poisoned output shows any row left unwritten), and the trace has such programs."""
    monkeypatch.setattr(compress_kernels, "C4_STREAM", {512: (2, blocks), 128: (2, blocks)})
    monkeypatch.setattr(compress_kernels, "C4_TILE", {512: (events, 32, 2), 128: (events, 64, 4)})
    monkeypatch.setattr(compress_kernels, "C4_CHANNELS_FASTEST", {512: channels_fastest, 128: channels_fastest})
    test_compress_kernels(case)
    # the same trace as test_compress_kernels: some program's rows are all padding, some mix both
    sim = ServingSim(4, case["D"], max_seq_len=90, full_page_size=32, swa_page_size=16)
    random_trace(sim, random.Random(2), 16)
    kinds = set()
    for step in sim.steps:
        if not step.plan.is_decode:
            padding = step.plan.plan_c.view(torch.int32)[:, 0] == -1
            rows = events * blocks
            padding = torch.cat([padding, torch.ones(-len(padding) % rows, dtype=torch.bool)]).view(-1, rows)
            kinds |= {"all padding" if p.all() else "mixed" if p.any() else "no padding" for p in padding}
    assert {"all padding", "mixed"} <= kinds, kinds


@pytest.mark.parametrize("min_rows", [0, 40], ids=["every-plan", "split"])
def test_compress_kernels_ratio4_large_plans(min_rows, monkeypatch):
    """Ratio-4 prefill with ``C4_LARGE``: plans of at least ``min_rows`` rows pool with its settings
    (here the one-block D 128 default below and 2 x 2 pipelined blocks, channel blocks together,
    above), the smaller ones with the defaults, and every plan of the trace gets the same bits from
    both launches together as from one. The split runs plans on both sides of the size."""
    monkeypatch.setattr(compress_kernels, "C4_LARGE", {512: None, 128: (min_rows, (2, 64, 4), (2, 2), True)})
    case = COMPRESS_CASES[0]
    test_compress_kernels(case)
    sim = ServingSim(4, case["D"], max_seq_len=90, full_page_size=32, swa_page_size=16)
    random_trace(sim, random.Random(2), 16)
    sizes = {step.plan.plan_c.shape[0] >= min_rows for step in sim.steps if not step.plan.is_decode}
    assert sizes == ({True} if min_rows == 0 else {False, True}), sizes


def test_c4_launches_pick_by_plan_size(monkeypatch):
    """``c4_launches``: one launch where ``C4_LARGE`` has no entry; else, for a concrete size, only
    the launch its side of the threshold takes, and for a symbolic one both, shares summing to 1."""
    monkeypatch.setattr(compress_kernels, "C4_LARGE", {512: None, 128: (1000, (4, 64, 2), (2, 4), True)})
    default = (compress_kernels.c4_tile(128), compress_kernels.c4_stream(128), compress_kernels.C4_CHANNELS_FASTEST[128])
    assert compress_kernels.c4_launches(512, 5000) == [(1, compress_kernels.c4_tile(512),
                                                        compress_kernels.c4_stream(512),
                                                        compress_kernels.C4_CHANNELS_FASTEST[512])]
    assert compress_kernels.c4_launches(128, 999) == [(1, *default)]
    assert compress_kernels.c4_launches(128, 1000) == [(1, (4, 64, 2), (2, 4), True)]
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    rows = env.create_unbacked_symint()
    launches = compress_kernels.c4_launches(128, rows)
    assert [launch[1:] for launch in launches] == [default, ((4, 64, 2), (2, 4), True)]
    assert not env.guards, env.guards
    shares = [launch[0] for launch in launches]
    for n, want in ((0, [1, 0]), (999, [1, 0]), (1000, [0, 1]), (70000, [0, 1])):
        got = [int(share.node.expr.subs(rows.node.expr, n)) for share in shares]
        assert got == want, (n, got)


@pytest.mark.parametrize("case", [COMPRESS_CASES[3], COMPRESS_CASES[4]], ids=_case_id)
def test_compress_kernels_ratio128_streaming(case, monkeypatch):
    """Ratio-128 prefill pooling tile by tile with an online softmax (``C128_STREAM_STAGES``, the
    default) at a tile of 16 rows, 8 tiles per window, pools within the same tolerance of the
    reference, and writes the same state bits. (The stage count only changes the GPU's software
    pipelining, which the interpreter does not model.)"""
    monkeypatch.setattr(compress_kernels, "C128_STREAM_STAGES", 2)
    monkeypatch.setattr(compress_kernels, "C128_STREAM_TILE", (16, 32, 8, 4))  # 8 tiles per window at D 64
    test_compress_kernels(case)


#: ratio-128 tiles in row groups (``c128_tile``'s fifth field) at D 64: 2 groups of 64 rows, 4 of
#: 32 (one warp each), and 128 groups of one row (the combine alone does the softmax)
ROW_GROUP_TILES = [(16, 32, 8, 2, 2), (8, 64, 8, 4, 4), (1, 64, 8, 1, 128)]


@pytest.mark.parametrize("stages,tile", [(0, (16, 32, 8, 4)), (2, (16, 32, 8, 4)), (2, (16, 32, 8, 2, 2)),
                                         (2, (1, 64, 8, 1, 128))],
                         ids=["whole-window", "streaming", "streaming-2-row-groups", "streaming-128-row-groups"])
def test_compress_kernels_ratio128_score_orders(stages, tile, monkeypatch):
    """Ratio-128 pooling where the order of the scores matters to an online softmax: per channel,
    scores rising through the window (the running max grows at every row), falling, all equal, and
    spread over +-60 (most terms underflow next to the max), in a prefill split at unaligned points
    (windows partly in the ring) and the decode steps after it; in row groups, each group's maximum
    differs from the window's, so the final combine rescales every group but one."""
    monkeypatch.setattr(compress_kernels, "C128_STREAM_STAGES", stages)
    monkeypatch.setattr(compress_kernels, "C128_STREAM_TILE", tile)
    D = 64
    sim = ServingSim(128, D, max_seq_len=300, full_page_size=256, swa_page_size=128)
    pos = torch.arange(sim.tokens.shape[1], dtype=torch.float32)
    spread = 30 * torch.randn(pos.shape[0], generator=torch.Generator().manual_seed(4))
    pattern = torch.stack([0.4 * pos, -0.4 * pos, torch.full_like(pos, 3.0), spread], dim=1)
    channel = torch.arange(D)
    sim.tokens[:, :, D:] = pattern[:, channel % 4].to(sim.input_dtype).float()
    sim.step([(0, 100), (1, 200)], decode=False)
    sim.step([(0, 155), (1, 60)], decode=False, pad=5)  # request 0 ends one short of a window
    for _ in range(3):
        sim.step([(0, 1), (1, 1)], decode=True)
    assert any(step.emitted for step in sim.steps[2:]), "a decode step pools a window"
    _check_compress_kernels(sim, 128, D)


@pytest.mark.parametrize("case,tile", list(zip([COMPRESS_CASES[3], COMPRESS_CASES[4], COMPRESS_CASES[3]],
                                                ROW_GROUP_TILES)),
                         ids=["2-row-groups-fp32-state", "4-row-groups-bf16-state", "128-row-groups-fp32-state"])
def test_compress_kernels_ratio128_row_groups(case, tile, monkeypatch):
    """The tile-by-tile ratio-128 pool in row groups (``_stream_c128_row_groups``): each group of the
    window's rows keeps its own running max and sums, combined at the end; it pools within the
    reference's tolerance (ring rows, from unaligned chunk splits, in the first group or across
    several) and writes the same state bits."""
    monkeypatch.setattr(compress_kernels, "C128_STREAM_STAGES", 2)
    monkeypatch.setattr(compress_kernels, "C128_STREAM_TILE", tile)
    test_compress_kernels(case)


def test_c128_tile_fields():
    """``c128_tile``: four fields take one row group; five give it; rows x groups must divide 128."""
    assert compress_kernels.c128_tile((16, 32, 128, 2)) == (16, 32, 128, 2, 1)
    assert compress_kernels.c128_tile((4, 128, 32, 2, 2)) == (4, 128, 32, 2, 2)
    for bad in ((4, 128, 32, 2, 64), (16, 32, 128, 2, 3)):
        with pytest.raises(ValueError, match="row groups"):
            compress_kernels.c128_tile(bad)


@pytest.mark.parametrize("case", [COMPRESS_CASES[3], COMPRESS_CASES[4]], ids=_case_id)
@pytest.mark.parametrize("rows_per_program", [1024, 8], ids=["one-row-program", "many-row-programs"])
def test_compress_kernels_ratio128_whole_window(case, rows_per_program, monkeypatch):
    """Ratio-128 prefill pooling with the whole window in registers (``C128_STREAM_STAGES`` 0, the
    non-default path) pools and writes as the streaming one; and with few plan rows per program the
    grid has many programs along the rows, each walking its own strided rows."""
    monkeypatch.setattr(compress_kernels, "C128_STREAM_STAGES", 0)
    monkeypatch.setattr(compress_kernels, "C128_ROWS_PER_PROGRAM", rows_per_program)
    test_compress_kernels(case)


@pytest.mark.parametrize("min_rows", [0, 400], ids=["every-plan", "split"])
def test_compress_kernels_ratio128_large_plans(min_rows, monkeypatch):
    """Ratio-128 prefill with ``C128_LARGE``: plans of at least ``min_rows`` rows pool with its tile
    (one warp across 128 channels, so at D 128 one channel block and whole columns per thread), the
    smaller ones with the default tile; every step pools within the reference's tolerance and
    writes the same state bits. The split runs plans on both sides of the size."""
    monkeypatch.setattr(compress_kernels, "C128_LARGE", (min_rows, (4, 128, 32, 1), 4))
    D = 128
    sim = ServingSim(128, D, max_seq_len=300, full_page_size=256, swa_page_size=128)
    random_trace(sim, random.Random(2), 8)
    sizes = {step.plan.plan_c.shape[0] >= min_rows for step in sim.steps if not step.plan.is_decode}
    assert sizes == ({True} if min_rows == 0 else {False, True}), sizes
    _check_compress_kernels(sim, 128, D)


def test_c128_launches_pick_by_plan_size(monkeypatch):
    """``c128_launches``: one launch without ``C128_LARGE`` or where its channels do not divide D; else,
    for a concrete size, only the launch its side of the threshold takes, and for a symbolic one both,
    shares summing to 1, with no guard."""
    default = (compress_kernels.C128_STREAM_TILE, compress_kernels.C128_STREAM_STAGES)
    monkeypatch.setattr(compress_kernels, "C128_LARGE", None)
    assert compress_kernels.c128_launches(512, 70000) == [(1, *default)]
    monkeypatch.setattr(compress_kernels, "C128_LARGE", (1000, (4, 128, 32, 1), 4))
    assert compress_kernels.c128_launches(512, 999) == [(1, *default)]
    assert compress_kernels.c128_launches(512, 1000) == [(1, (4, 128, 32, 1), 4)]
    assert compress_kernels.c128_launches(64, 70000) == [(1, *default)]  # channels that do not divide D
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    rows = env.create_unbacked_symint()
    launches = compress_kernels.c128_launches(512, rows)
    assert [launch[1:] for launch in launches] == [default, ((4, 128, 32, 1), 4)]
    assert not env.guards, env.guards
    for n, want in ((0, [1, 0]), (999, [1, 0]), (1000, [0, 1]), (70000, [0, 1])):
        got = [int(launch[0].node.expr.subs(rows.node.expr, n)) for launch in launches]
        assert got == want, (n, got)


def test_compress_kernels_ratio128_any_row_order():
    """The ratio-128 pool finds the valid rows wherever they are in the plan: in the planner's order
    (valid rows first) and reversed (padding first, valid rows last), it pools as the reference."""
    sim = ServingSim(128, 64, max_seq_len=300, full_page_size=256, swa_page_size=128)
    random_trace(sim, random.Random(5), 8)
    assert any(not step.plan.is_decode and step.emitted for step in sim.steps), "a prefill pools windows"
    _check_compress_kernels(sim, 128, 64)
    _check_compress_kernels(sim, 128, 64, reorder=lambda plan: plan.flip(0))


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("is_decode", [True, False], ids=["decode", "extend"])
def test_store_kernels(fmt, is_decode):
    for page_size in (1, 64):
        got, want, _, _ = kernel_and_reference_bytes(store_kernels.norm_rope_store, fmt, is_decode, page_size,
                                                     KERNEL_DEVICE)
        diff = (got != want).nonzero()
        assert diff.numel() == 0, f"page_size {page_size}: {diff.shape[0]} bytes differ, first {diff[:4].tolist()}"


@pytest.mark.parametrize("r", [4, 128])
def test_compress_kernels_malformed_plans(r):
    """Garbage plan words straight into the kernels: nothing is written outside the state buffer and
    the result (state bits, out rows) is the reference's, which skips what it cannot read."""
    from test_compress import _corrupt, _sim

    sim = _sim(r)
    rng = random.Random(13)
    width = sim.state.shape[1]
    dev = KERNEL_DEVICE
    steps = sim.steps[-8:] if INTERPRETED else sim.steps
    for step in steps:
        rows = sim.state.shape[0]
        x = step.kv_score_input
        num_in = x.shape[0]
        state = torch.randn(rows, width)
        if step.plan.is_decode:
            plan, write_plan = _corrupt(step.plan.plan_d, rng, rows, num_in, write_word=1), None
        else:
            plan = _corrupt(step.plan.plan_c, rng, rows, num_in, write_word=-1)
            write_plan = _corrupt(step.plan.plan_w, rng, rows, num_in, write_word=1)
        want_state, want_out = state.clone(), torch.empty(plan.shape[0], sim.head_dim)
        if write_plan is None:
            compress_decode_reference(want_state, x, sim.ape, plan, want_out, sim.head_dim, r)
        else:
            compress_prefill_reference(want_state, x, sim.ape, plan, write_plan, want_out, sim.head_dim, r)
        guard = torch.full((rows + 64, width), 1234.5, device=dev)
        got_state = guard[:rows]
        got_state.copy_(state)
        got_out = torch.full((plan.shape[0], sim.head_dim), float("nan"), device=dev)
        compress_kernels.compress_forward(got_state, x.to(dev), sim.ape.to(dev), plan.to(dev),
                                          None if write_plan is None else write_plan.to(dev), got_out, sim.head_dim, r)
        assert (guard[rows:] == 1234.5).all(), "a write landed past the state buffer"
        assert_same_bits(got_state.cpu(), want_state, "state")
        _close_rows(got_out.cpu(), want_out)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_store_kernels_malformed_inputs(fmt):
    """Garbage plan words and slots (negative, past the cache, past out_loc / freqs): the kernel
    writes exactly the reference's bytes and nothing past the cache."""
    rng = random.Random(17)
    for is_decode in (True, False):
        c = _case(fmt, is_decode, 24, 64, "cpu", seed=3)
        flags = (c["cfg"].get("use_fp4", False), c["cfg"].get("bf16_store", False))
        words = c["plan"].view(torch.int32).clone()
        # only values that make a row unreadable: an in-range duplicate slot would make the result order-dependent
        for k in rng.sample(range(words.shape[0]), 8):
            field = rng.randrange(2)
            words[k, field] = rng.choice([-7, 1 << 30, 0x7FFF0000] if field == 0 else [-7, 0xFFFF])
        plan = words.view(torch.uint8).reshape(words.shape[0], 16)
        out_loc = c["out_loc"].clone()
        out_loc[rng.sample(range(out_loc.shape[0]), 6)] = torch.tensor([-1, -5, 1 << 40, 10 ** 6, 64 * 1000, -(1 << 40)])
        want = c["cache"].clone()
        norm_rope_store_reference(c["kv"], plan, c["weight"], 1e-6, c["freqs"], out_loc, want, is_decode, 4, 64, *flags)
        dev = KERNEL_DEVICE
        guard = torch.full((want.numel() + 4096,), 0x5A, dtype=torch.uint8, device=dev)
        got = guard[: want.numel()].view(want.shape)
        got.copy_(c["cache"])
        store_kernels.norm_rope_store(c["kv"].to(dev), plan.to(dev), c["weight"].to(dev), 1e-6, c["freqs"].to(dev),
                                      out_loc.to(dev), got, is_decode, 4, 64, *flags)
        assert (guard[want.numel():] == 0x5A).all(), "a write landed past the cache"
        diff = (got.cpu() != want).nonzero()
        assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first {diff[:4].tolist()}"


def _format_edges() -> torch.Tensor:
    """Every e2m1 threshold and value, both signs, with their fp32 neighbours, zeros, the clamp and
    infinities, then random values over every exponent the scaled codes meet."""
    from dsv4ops.store.quant import E2M1_THRESHOLDS, E2M1_VALUES

    points = torch.tensor(E2M1_THRESHOLDS + E2M1_VALUES + (7.0, 1e30, float("inf")), dtype=torch.float32)
    points = torch.cat([points, -points])
    near = torch.cat([points, torch.nextafter(points, points + 1), torch.nextafter(points, points - 1),
                      torch.tensor([0.0, -0.0])])
    g = torch.Generator().manual_seed(5)
    spread = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-12, 4, (20000,), generator=g).float())
    return torch.cat([near, spread]).contiguous()


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _e2m1_probe_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n, other=0.0)
        tl.store(out_ptr + i, store_kernels._e2m1_code(x), mask=i < n)


    @triton.jit
    def _scale_exponent_probe_kernel(x_ptr, e4m3_ptr, e2m1_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n, other=0.0)
        tl.store(e4m3_ptr + i, store_kernels._scale_exponent(x, 8, 0x600000), mask=i < n)
        tl.store(e2m1_ptr + i, store_kernels._scale_exponent(x, 2, 0x400000), mask=i < n)


def _amax_values() -> torch.Tensor:
    """Non-negative fp32 values for a group's amax: every exponent with mantissas 0, 1, the largest
    and random ones; the mantissas of 1.75 and 1.5 (the format maxima's) and their neighbours at
    every exponent; the 1e-4 floor and its neighbours, zero, the largest finite value, infinity."""
    g = torch.Generator().manual_seed(11)
    fields = torch.arange(0, 255, dtype=torch.int32)
    mantissas = torch.cat([torch.tensor([0, 1, 2, 0x7FFFFF, 0x600000, 0x5FFFFF, 0x600001, 0x400000, 0x3FFFFF, 0x400001],
                                        dtype=torch.int32), torch.randint(0, 1 << 23, (200,), generator=g, dtype=torch.int32)])
    bits = (fields[:, None] << 23) | mantissas[None, :]
    x = bits.flatten().view(torch.float32)
    floor = torch.tensor(1e-4, dtype=torch.float32)
    edges = torch.stack([floor, torch.nextafter(floor, torch.tensor(0.0)), torch.nextafter(floor, torch.tensor(1.0)),
                         torch.tensor(0.0), torch.tensor(torch.finfo(torch.float32).max), torch.tensor(float("inf"))])
    return torch.cat([x, edges, torch.rand(20000, generator=g) * torch.exp2(torch.randint(-30, 30, (20000,), generator=g).float())])


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_scale_exponent_matches_the_division():
    """The stores' power-of-two group scales, from the amax's exponent and mantissa bits, are the
    reference's ``ue8m0_ceil(fp32(max(amax, 1e-4) / fmt_max))`` for e4m3 (448) and e2m1 (6) at every
    exponent, at the mantissas where the quotient crosses a power of two, the floor and infinity."""
    from dsv4ops.store import quant

    x = _amax_values()
    e4m3 = torch.empty(x.shape, dtype=torch.int32, device=KERNEL_DEVICE)
    e2m1 = torch.empty_like(e4m3)
    _scale_exponent_probe_kernel[(triton.cdiv(x.numel(), 4096),)](x.to(KERNEL_DEVICE), e4m3, e2m1, x.numel(), BLOCK=4096)
    clamped = torch.clamp_min(x, quant.SCALE_FLOOR)
    for got, fmt_max in ((e4m3, quant.E4M3_MAX), (e2m1, quant.E2M1_MAX)):
        want = quant.ue8m0_ceil(quant.div_rn(clamped, fmt_max))
        bad = (got.cpu() != want).nonzero().flatten()
        assert bad.numel() == 0, [(x[k].item(), got[k].item(), want[k].item()) for k in bad[:8]]


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_e2m1_code_matches_thresholds():
    """The kernels' e2m1 rounding (exponent bits from 1 up, two thresholds under 1) gives the
    reference's threshold codes at every threshold and value, their fp32 neighbours, the clamp,
    infinities and signed zero."""
    from dsv4ops.store.quant import e2m1_codes

    x = _format_edges()
    out = torch.empty(x.shape, dtype=torch.int32, device=KERNEL_DEVICE)
    _e2m1_probe_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(KERNEL_DEVICE), out, x.numel(), BLOCK=1024)
    want = e2m1_codes(x)
    bad = (out.cpu() != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[k].item(), out[k].item(), want[k].item()) for k in bad[:8]]
