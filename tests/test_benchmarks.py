"""The benchmark script stays runnable: ``python -m benchmarks.run --dry-run`` runs every
timed call of the prefill, decode and whole-decode-step benchmarks once, on tiny shapes,
with the Triton kernels under the interpreter (so a GPU session never spends device time
on a broken script)."""

from __future__ import annotations

import ast
import csv
import io
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_benchmark_script_dry_run(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "benchmarks.run", "--dry-run", "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(tmp_path / "benchmarks.csv") as f:
        rows = list(csv.DictReader(f))
    ops = {(row["op"], row["config"]) for row in rows}
    for config in ("c4-main", "c4-indexer", "c128-main"):
        for op in ("compress_forward prefill", "norm_rope_store prefill", "compress_forward decode",
                   "norm_rope_store decode", "compress_decode_step (fused)"):
            assert (op, config) in ops, f"no {op} row for {config}"
    for config in ("c4-main", "c128-main"):
        assert ("plan_prefill", config) in ops and ("plan_decode", config) in ops
    assert any(row["op"].startswith("whole decode step") for row in rows)
    assert any(row["op"] == "launch floor (empty kernel)" for row in rows)
    unsized = ("whole decode step", "decode step", "launch floor")  # timed as wholes: no byte count
    assert all(int(row["bytes"]) > 0 for row in rows if not row["op"].startswith(unsized))


def test_tile_sweep_dry_run(tmp_path):
    """``--only sweep`` (the launch-parameter sweep a GPU session runs before tuning) runs every group."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "benchmarks.run", "--dry-run", "--only", "sweep", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    best = [line for line in done.stdout.splitlines() if line.startswith("best ")]
    for group in ("prefill c4-main", "prefill c4-indexer", "prefill c128-main", "store c4-main", "store c4-indexer",
                  "store c128-main", "compress_forward decode c128-main", "fused decode step c128-main",
                  "compress_forward decode c4-main", "fused decode step c4-main", "fused decode step c4-indexer",
                  "grid order, prefill c4-main", "grid order, compress_forward decode c128-main",
                  "plan launch, fused decode step c128-main", "streaming, prefill c128-main",
                  "warps, compress_forward decode c128-main bs 1", "warps, fused decode step c128-main bs 1",
                  "pool order, compress_forward decode c4-main", "pool order, fused decode step c4-main",
                  "pool order, fused decode step c128-main bs 1", "warps, compress_forward decode c4-main bs 1",
                  "warps, compress_forward decode c4-indexer bs 1"):
        assert any(line.startswith(f"best  {group}") for line in best), f"no result for {group}:\n{done.stdout}"


def test_profile_script_dry_run():
    """``benchmarks.profile`` (what the GPU session's ``profile`` stage runs under ncu) makes every
    profiled call once, on tiny shapes, under the interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "benchmarks.profile", "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    profiled = [line for line in done.stdout.splitlines() if line.startswith("profiled: ")]
    for config in ("c4-main", "c4-indexer", "c128-main"):
        for op in ("compress_forward prefill", "norm_rope_store prefill", "compress_forward decode",
                   "compress_decode_step (fused)"):
            assert any(line.startswith(f"profiled: {op} {config}") for line in profiled), f"{op} {config}"
    assert sum(line.startswith("profiled: plan_decode") for line in profiled) == 2


def test_static_sm90_report():
    """``benchmarks.static`` (the sweep candidates' registers, spills and barriers on sm_90, no GPU)
    compiles the ratio-4 decode kernel at every warp count of the sweep; the default is listed first
    and spills nothing, and one warp leaves no barrier in the pool."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-m", "benchmarks.static", "--kernels", "decode"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    if "needs Triton's bundled ptxas" in done.stderr:
        pytest.skip("Triton's bundled ptxas / cuobjdump not found")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 8, done.stdout
    for head_dim, first in ((512, lines[0]), (128, lines[4])):
        assert first.startswith(f"ratio-4 decode D {head_dim:3d}") and first.endswith("(default)"), first
        assert " spills   0 B" in first, first
    one_warp = next(line for line in lines if line.startswith("ratio-4 decode D 128") and ", 1 warps:" in line)
    assert "bar.sync  0" in one_warp, one_warp


def test_profile_summary_reads_ncu_details_csv():
    """The summary of an ncu ``--csv --page details`` log: the tool's own lines before the header are
    skipped, each kernel's key metrics come first and in order, and the rest follow."""
    from benchmarks.profile import read_ncu_csv, summarize

    header = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
              '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')

    def row(kid, kernel, section, name, unit, value):
        return (f'"{kid}","1","python3","h","{kernel}","1","7","(128, 1, 1)","(4096, 1, 1)","0","9.0",'
                f'"{section}","{name}","{unit}","{value}"')

    text = "\n".join([
        "==PROF== Connected to process 1",
        "profiled: compress_forward prefill c128-main",
        header,
        row(0, "_pool_c128_kernel(float *, ...)", "GPU Speed Of Light Throughput", "Memory Throughput", "%", "44.1"),
        row(0, "_pool_c128_kernel(float *, ...)", "GPU Speed Of Light Throughput", "Duration", "us", "45.2"),
        row(0, "_pool_c128_kernel(float *, ...)", "Occupancy", "Achieved Occupancy", "%", "17.3"),
        row(0, "_pool_c128_kernel(float *, ...)", "Launch Statistics", "Registers Per Thread", "register/thread", "163"),
        row(1, "_write_kernel(float *, ...)", "GPU Speed Of Light Throughput", "Duration", "us", "7.1"),
        row(1, "_write_kernel(float *, ...)", "Warp State Statistics", "Warp Cycles Per Issued Instruction", "cycle",
            "31.5"),
    ])
    kernels = read_ncu_csv(text)
    assert list(kernels) == [("0", "_pool_c128_kernel(float *, ...)"), ("1", "_write_kernel(float *, ...)")]
    assert kernels[("0", "_pool_c128_kernel(float *, ...)")]["Duration"] == "45.2 us"
    out = io.StringIO()
    assert summarize(text, out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0] == "== kernel 0: _pool_c128_kernel"
    assert [line.split()[0] for line in lines[1:5]] == ["Duration", "Memory", "Achieved", "Registers"]
    assert "Warp Cycles Per Issued Instruction" in out.getvalue() and "31.5 cycle" in out.getvalue()
    assert summarize("==PROF== no kernels were profiled", io.StringIO()) == 1


def test_compiled_reference_retried_with_tritons_launcher(monkeypatch, capsys):
    """A compiled reference that fails in a CUDA driver call (as the indexer's did at batch 1 on the
    GPU) is compiled again with Triton's launcher instead of Inductor's static one; the log says
    whether that ran. Other failures give NaN without a retry, and the settings come back."""
    import torch

    from benchmarks import run

    config = torch._inductor.config
    monkeypatch.setattr(run, "DRY_RUN", False)
    calls = []

    def fails_on_static_launcher(fn, rep, fallback):
        calls.append((config.use_static_cuda_launcher, config.fx_graph_cache))
        if config.use_static_cuda_launcher:
            raise RuntimeError("CUDA driver error: invalid argument")
        return 3.0

    monkeypatch.setattr(run, "median_us", fails_on_static_launcher)
    assert config.use_static_cuda_launcher
    assert run.bench_ref(lambda: None) == 3.0
    assert calls == [(True, config.fx_graph_cache), (False, False)]
    assert "ran" in capsys.readouterr().out
    assert config.use_static_cuda_launcher

    def always_fails(fn, rep, fallback):
        raise RuntimeError("CUDA driver error: invalid argument")

    monkeypatch.setattr(run, "median_us", always_fails)
    assert math.isnan(run.bench_ref(lambda: None))
    assert "failed too" in capsys.readouterr().out

    def inductor_error(fn, rep, fallback):
        calls.append("inductor")
        raise ValueError("LoweringException")

    calls.clear()
    monkeypatch.setattr(run, "median_us", inductor_error)
    assert math.isnan(run.bench_ref(lambda: None)) and calls == ["inductor"]  # no retry


@pytest.mark.parametrize("ratio,head_dim", [(128, 64), (4, 128)])
def test_chunked_prefill_reference_matches_one_call(ratio, head_dim):
    """The benchmark runs the compress prefill reference over chunks of plan rows where its window
    gather would not fit (64K-token ratio 128); chunked, it writes the same state and outputs."""
    from benchmarks.run import chunked_prefill_reference
    from dsv4ops.compress.reference import compress_prefill_reference
    from _serving import ServingSim, random_trace

    big = ratio == 128
    sim = ServingSim(ratio, head_dim, max_seq_len=300 if big else 90, full_page_size=256 if big else 32,
                     swa_page_size=128 if big else 16)
    random_trace(sim, random.Random(4), 8)
    prefills = [step for step in sim.steps if not step.plan.is_decode]
    assert prefills
    for step in prefills:
        plan_c, plan_w = step.plan.plan_c, step.plan.plan_w
        state = torch.randn(sim.state.shape)
        want_state, got_state = state.clone(), state.clone()
        want_out = torch.full((plan_c.shape[0], head_dim), float("nan"))
        got_out = want_out.clone()
        compress_prefill_reference(want_state, step.kv_score_input, sim.ape, plan_c, plan_w, want_out, head_dim, ratio)
        chunked_prefill_reference(compress_prefill_reference, got_state, step.kv_score_input, sim.ape, plan_c, plan_w,
                                  got_out, head_dim, ratio, rows_per_chunk=3)
        assert torch.equal(want_state, got_state)
        assert torch.equal(want_out, got_out)


def test_ab_store_loads_a_saved_kernels_file():
    """``benchmarks.ab_store`` imports a saved ``dsv4ops/store/kernels.py`` on its own (its relative
    imports made absolute); loaded from the working tree's file, it writes the package's bytes."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the loaded kernels run under the interpreter here")
    from benchmarks.ab_store import load_version
    from dsv4ops.store import kernels as store_kernels
    from test_store import _case

    saved = load_version(store_kernels.__file__, "store_kernels_saved_copy")
    assert saved is not store_kernels and saved._store_indexer_kernel is not store_kernels._store_indexer_kernel
    for fmt in ("main-fp8", "indexer-fp4"):
        c = _case(fmt, False, 12, 64, "cpu", seed=4)
        flags = (c["cfg"].get("use_fp4", False), c["cfg"].get("bf16_store", False))
        caches = []
        for module in (store_kernels, saved):
            cache = c["cache"].clone()
            module.norm_rope_store(c["kv"], c["plan"], c["weight"], 1e-6, c["freqs"], c["out_loc"], cache, False, 4, 64,
                                   *flags)
            caches.append(cache)
        assert torch.equal(caches[0], caches[1]) and not torch.equal(caches[0], c["cache"])


def test_ab_compress_dry_run(capsys, monkeypatch):
    """``benchmarks.ab_compress`` runs a saved ``dsv4ops/compress/kernels.py`` (here the working
    tree's own) against the package's on the ratio-128 prefill and decode setups: same state,
    same outputs."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the dry run runs the kernels under the interpreter")
    from benchmarks import ab_compress
    from benchmarks import run as grid
    from dsv4ops.compress import kernels as compress_kernels

    for name in ("DRY_RUN", "DEV", "DECODE_MAX_LEN", "DECODE_BATCHES", "PREFILL_TOKENS", "PREFILL_REQUESTS",
                 "PREFIXES", "STEP_BATCH", "REF_GATHER_LIMIT"):  # what the dry run sets, restored after
        monkeypatch.setattr(grid, name, getattr(grid, name))
    ab_compress.main([compress_kernels.__file__, "--dry-run", "--configs", "c128-main", "--tokens", "300",
                      "--requests", "2", "--batches", "3"])  # two ratio-128 events in the prefill
    lines = [line for line in capsys.readouterr().out.splitlines() if "c128-main" in line]
    assert len(lines) == 2, lines
    assert all("same state: True" in line and "out differs by 0.0e+00" in line for line in lines), lines


def test_sweep_skips_the_setups_of_unmatched_groups(monkeypatch):
    """``--groups`` skips a prefill or store shape before its setup when none of its groups match
    (a 64K-token setup is most of its groups' time on the device)."""
    import re

    from benchmarks import run as grid
    from benchmarks import sweep

    def no_setup(*args, **kwargs):
        raise AssertionError("a prefill setup for a shape none of whose groups match")

    monkeypatch.setattr(grid, "SWEEP_GROUPS", re.compile("^warps, compress_forward decode c4"))
    monkeypatch.setattr(grid, "prefill_setup", no_setup)
    candidates = sweep._candidates(grid)
    sweep._sweep_prefill(grid, candidates)
    sweep._sweep_store(grid, candidates)


def test_sweep_tokens_set_the_prefill_cases(monkeypatch):
    """``--tokens`` gives the sweep's prefill groups those sizes (32 requests each), ratio 128's
    streaming group included above 16K tokens, where the sweep's own cases time ratio 4 alone."""
    import re

    from benchmarks import run as grid
    from benchmarks import sweep

    for name in ("PREFILL_TOKENS", "SWEEP_TOKENS"):  # restored after the test
        monkeypatch.setattr(grid, name, getattr(grid, name))
    grid._select(None, None, [8192, 32768])
    assert grid.SWEEP_TOKENS == (8192, 32768)
    assert sweep._candidates(grid).cases == ((8192, 32), (32768, 32))
    shapes = []

    def record_setup(config, tokens, requests, prefix):
        shapes.append((config, tokens, requests))
        raise StopIteration  # the shape was reached; nothing to time here

    monkeypatch.setattr(grid, "SWEEP_GROUPS", re.compile("^streaming, prefill c128-main 32768"))
    monkeypatch.setattr(grid, "prefill_setup", record_setup)
    with pytest.raises(StopIteration):
        sweep._sweep_prefill(grid, sweep._candidates(grid))
    assert shapes == [("c128-main", 32768, 32)]


def test_sweep_winners_write_kernels_variants(tmp_path, monkeypatch):
    """``benchmarks.sweep_winners`` turns a ratio-128 sweep's winners into copies of kernels.py for
    ``benchmarks.ab_compress``: a small-plan tile, a lower cut for ``C128_LARGE``, a new large tile;
    nothing for a winner the working tree already runs, for the whole-window pool, or for plan rows
    per program the large tile cannot take."""
    pytest.importorskip("triton")
    from benchmarks import sweep, sweep_winners
    from benchmarks.ab_store import load_version
    from dsv4ops.compress import kernels as ck

    monkeypatch.setattr(ck, "C128_ROWS_PER_PROGRAM", 128)  # the GPU's value (the interpreter's is 1024)
    monkeypatch.setattr(ck, "C128_STREAM_STAGES", 3)
    monkeypatch.setattr(ck, "C128_STREAM_TILE", (16, 32, 128, 2))
    monkeypatch.setattr(ck, "C128_LARGE", (16384, (4, 128, 32, 1), 4))

    def best(tokens, label):
        return f"best  streaming, prefill c128-main {tokens} tok / 32 req: {label}:    12.61 us"

    def streaming(stages, tile, rpp=128):  # the sweep's own label, parsed back
        return sweep.c128_stream_label(stages, tile, rpp)

    log = "\n".join([
        "sweep streaming, prefill c128-main 2048 tok / 32 req: C128_STREAM_STAGES 0 (whole window):  9.0 us",
        best(2048, "C128_STREAM_STAGES 0 (whole window)"),
        best(4096, streaming(3, (16, 16, 64, 1))),
        best(8192, streaming(4, (2, 128, 32, 2, 2))),
        best(16384, streaming(4, (2, 128, 32, 2, 2))),
        best(32768, streaming(4, (4, 128, 32, 1))),  # the current large tile: nothing to try
        best(65536, streaming(3, (16, 32, 64, 2), 256)),
    ])
    source = open(ck.__file__).read()
    out = sweep_winners.variants(sweep_winners.read_winners(log), source)
    assert sorted(out) == ["variant-cut-8192.py", "variant-large-16384.py", "variant-small.py"]
    expected = {
        "variant-small.py": dict(C128_STREAM_STAGES=3, C128_STREAM_TILE=(16, 16, 64, 1), C128_ROWS_PER_PROGRAM=128,
                                 C128_LARGE=(16384, (4, 128, 32, 1), 4)),
        "variant-cut-8192.py": dict(C128_STREAM_TILE=(16, 32, 128, 2), C128_LARGE=(8192, (2, 128, 32, 2, 2), 4)),
        "variant-large-16384.py": dict(C128_STREAM_TILE=(16, 32, 128, 2), C128_LARGE=(16384, (2, 128, 32, 2, 2), 4)),
    }
    for name, text in out.items():
        (tmp_path / name).write_text(text)
        load_version(str(tmp_path / name), f"compress_kernels_{name[:-3].replace('-', '_')}")  # it imports
        # the module-level values as written (the interpreter's own plan rows per program overrides one)
        written = {node.targets[0].id: ast.literal_eval(node.value) for node in ast.parse(text).body
                   if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                   and node.targets[0].id.startswith("C128_")}
        for constant, value in expected[name].items():
            assert written[constant] == value, (name, constant)
        # one line differs from the source per changed constant, nothing else
        changed = [a for a, b in zip(source.splitlines(), text.splitlines()) if a != b]
        assert 1 <= len(changed) <= 3 and len(source.splitlines()) == len(text.splitlines()), name
