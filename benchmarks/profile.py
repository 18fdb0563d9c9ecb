"""Nsight Compute profile of the kernels the performance targets are about (issue 4: what limits them).

    tests/gpu/run_all.sh OUT with STAGES=profile         # on the GPU machine: the two steps below
    ncu --clock-control none --profile-from-start off --csv --page details --log-file OUT/ncu.csv \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section LaunchStats --section WarpStateStats python -m benchmarks.profile
    python -m benchmarks.profile --summarize OUT/ncu.csv  # per kernel: time, DRAM and L2, occupancy, stalls
    TRITON_INTERPRET=1 python -m benchmarks.profile --dry-run   # no GPU: every profiled launch once, tiny shapes

The script warms every launch up first (compiling the Triton kernels), then calls each op once
between ``cudaProfilerStart`` and ``cudaProfilerStop``, so ncu (``--profile-from-start off``)
profiles exactly one launch of each kernel, with NVTX-free names: the op and shape are printed
in launch order, and ncu's ``ID`` column counts the kernels in the same order. The shapes are
the benchmark grid's (``benchmarks/run.py``): prefill at 16K tokens in 32 requests for the
three compressors (pooling and write passes, and the store), and the decode ops at batch 8 and
128 whose ratio to the compiled reference misses 5x.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import sys
from collections import OrderedDict

import torch

#: the metrics the summary shows first for each kernel (ncu "details" page names), in this order
KEY_METRICS = (
    "Duration", "DRAM Throughput", "Memory Throughput", "L1/TEX Hit Rate", "L2 Hit Rate",
    "Achieved Occupancy", "Theoretical Occupancy", "Registers Per Thread", "Block Limit Registers",
    "Grid Size", "Block Size", "Waves Per SM", "Warp Cycles Per Issued Instruction", "Issue Slots Busy",
)


def launches(grid, dry_run):
    """``[(label, fn)]``: one call of each profiled op, on the grid's shapes."""
    from dsv4ops.compress import kernels as ck
    from dsv4ops.decode_step import kernels as dk
    from dsv4ops.planner import kernels as pk
    from dsv4ops.store import kernels as sk

    tokens, requests = (grid.PREFILL_TOKENS[0], 3) if dry_run else (16384, 32)
    batches = grid.DECODE_BATCHES[:1] if dry_run else (8, 128)
    calls = []
    for config in grid.CONFIGS:
        s = grid.prefill_setup(config, tokens, requests, 0)
        r, D = s["r"], s["D"]
        out = torch.empty(s["plan_c"].shape[0], D, device=grid.DEV)
        calls.append((f"compress_forward prefill {config} {tokens} tok / {requests} req (pool, then write)",
                      lambda s=s, out=out, r=r, D=D: ck.compress_forward(s["state"], s["x"], s["ape"], s["plan_c"],
                                                                         s["plan_w"], out, D, r)))
        if r == 128:  # the whole-window pool (C128_STREAM_STAGES 0) beside the default tile-by-tile one
            calls.append((f"compress_forward prefill {config} {tokens} tok / {requests} req, C128_STREAM_STAGES 0",
                          lambda s=s, out=out, r=r, D=D: _whole_window(ck, lambda: ck.compress_forward(
                              s["state"], s["x"], s["ape"], s["plan_c"], s["plan_w"], out, D, r))))
        kv, cache, _, freqs, w = grid.store_setup(s, s["plan_c"].shape[0])
        args = grid.prefill_store_args(s, kv, cache, freqs, w)
        calls.append((f"norm_rope_store prefill {config} {tokens} tok", lambda args=args: sk.norm_rope_store(*args)))
    for config in grid.CONFIGS:
        for bs in batches:
            s = grid.decode_setup(config, bs)
            r, D = s["r"], s["D"]
            out = torch.empty(bs, D, device=grid.DEV)
            shape = f"{config} bs {bs} ({s['boundary']} at a boundary)"
            calls.append((f"compress_forward decode {shape}",
                          lambda s=s, out=out, r=r, D=D: ck.compress_forward(s["state"], s["x"], s["ape"], s["plan"],
                                                                             None, out, D, r)))
            if config != "c4-indexer":
                pargs = grid.plan_decode_args(s)
                calls.append((f"plan_decode {shape}", lambda pargs=pargs: pk.plan_decode(*pargs)))
            plan_buf = torch.empty(bs, 16, dtype=torch.uint8, device=grid.DEV)
            step = grid.decode_step_args(s, plan_buf, out)
            calls.append((f"compress_decode_step (fused) {shape}", lambda step=step: dk.decode_step(*step)))
    return calls


def _whole_window(ck, fn):
    """``fn()`` with the ratio-128 prefill pool holding the whole window in registers
    (``C128_STREAM_STAGES`` 0, ``C128_TILE``) instead of the default tile-by-tile pool."""
    old = ck.C128_STREAM_STAGES, ck.C128_LARGE
    ck.C128_STREAM_STAGES, ck.C128_LARGE = 0, None  # the large plans' tile off too
    try:
        fn()
    finally:
        ck.C128_STREAM_STAGES, ck.C128_LARGE = old


def profile(dry_run):
    """Warm every call up, then make each once inside the profiler's range (see the module doc)."""
    from benchmarks import run as grid

    if dry_run:
        grid._configure_dry_run()
    torch.manual_seed(0)
    calls = launches(grid, dry_run)
    for _, fn in calls:  # compile and warm up every kernel outside the profiled range
        fn()
    if not dry_run:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    for label, fn in calls:
        print(f"profiled: {label}", flush=True)
        fn()
    if not dry_run:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def read_ncu_csv(text):
    """ncu ``--csv --page details`` output -> ``OrderedDict[(id, kernel name)] -> {metric: "value unit"}``
    (lines before the CSV header, such as ``==PROF==`` messages, are skipped)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    kernels = OrderedDict()
    if start is None:
        return kernels
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        key = (row.get("ID", ""), row.get("Kernel Name", ""))
        metrics = kernels.setdefault(key, OrderedDict())
        name = row.get("Metric Name", "")
        if name and name not in metrics:
            metrics[name] = f"{row.get('Metric Value', '')} {row.get('Metric Unit', '')}".strip()
    return kernels


def summarize(text, out=sys.stdout):
    """Print each profiled kernel's key metrics first, then every other metric ncu reported."""
    kernels = read_ncu_csv(text)
    if not kernels:
        print("no ncu CSV rows found", file=out)
        return 1
    for (kid, name), metrics in kernels.items():
        short = name.split("(")[0]
        print(f"== kernel {kid}: {short}", file=out)
        for metric in KEY_METRICS:
            if metric in metrics:
                print(f"   {metric:40s} {metrics[metric]}", file=out)
        rest = [m for m in metrics if m not in KEY_METRICS]
        print("   " + "; ".join(f"{m} {metrics[m]}" for m in rest), file=out)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--summarize", metavar="CSV", help="summarize an ncu --csv --page details log")
    args = parser.parse_args(argv)
    if args.summarize:
        with open(args.summarize) as f:
            return summarize(f.read())
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--dry-run runs the Triton kernels on the CPU: set TRITON_INTERPRET=1")
    profile(args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
