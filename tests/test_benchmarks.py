"""The benchmark script stays runnable: ``python -m benchmarks.run --dry-run`` runs every
timed call of the prefill, decode and whole-decode-step benchmarks once, on tiny shapes,
with the Triton kernels under the interpreter (so a GPU session never spends device time
on a broken script)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

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
                  "plan launch, fused decode step c128-main"):
        assert any(line.startswith(f"best  {group}") for line in best), f"no result for {group}:\n{done.stdout}"
