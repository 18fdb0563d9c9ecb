"""A/B timing of ``compress_forward``'s kernels: another version of
``dsv4ops/compress/kernels.py`` against the working tree's, on the same inputs in the same run.

    git show f99ee71:dsv4ops/compress/kernels.py > .ab/compress_kernels_old.py   # any saved version
    python -m benchmarks.ab_compress .ab/compress_kernels_old.py [--tokens 16384 65536] [--batches 1 8 128]

For each compressor config (ratio 4 D 512 and indexer, ratio 128 D 512): the prefill (both
passes; ``--requests`` requests, 32 by default, no prefix) at each token count and the decode at
each batch (``benchmarks.run``'s setups). Both versions start from the same state; the line gives the ``do_bench_cudagraph``
medians, the % of the copy bandwidth measured in the run (bytes as ``benchmarks.run`` counts
them), the speedup, whether the new state is bit-identical, and the largest difference of the
outputs relative to each row's largest value (a rewrite that reorders the softmax sums differs by
rounding). Needs a GPU.
"""

from __future__ import annotations

import argparse

import torch

from dsv4ops.compress import kernels as current

from . import run as grid
from .ab_store import load_version


def _row_error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    return ((got - want).abs() / scale).max().item() if want.numel() else 0.0


def _compare(label, versions, launch, state, out, nbytes, bandwidth):
    """Run each version once from a copy of ``state`` (outputs compared), then time it."""
    states, outs, times = [], [], []
    for module in versions:
        st, o = state.clone(), torch.full_like(out, float("nan"))
        launch(module, st, o)
        states.append(st)
        outs.append(o)
        times.append(grid.bench(lambda m=module: launch(m, state, out)))
    pct = [nbytes / (t * 1e-6) / 1e9 / bandwidth * 100 for t in times]
    print(f"{label:44s} other {times[0]:8.2f} us ({pct[0]:4.1f}%)  current {times[1]:8.2f} us ({pct[1]:4.1f}%)  "
          f"x{times[0] / times[1]:.2f}  same state: {torch.equal(states[0], states[1])}  "
          f"out differs by {_row_error(outs[1], outs[0]):.1e}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", help="a saved dsv4ops/compress/kernels.py (e.g. from git show)")
    parser.add_argument("--tokens", nargs="+", type=int, default=[16384, 65536])
    parser.add_argument("--requests", type=int, default=32, help="requests per prefill")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 128])
    parser.add_argument("--configs", nargs="+", default=["c4-main", "c4-indexer", "c128-main"],
                        choices=list(grid.CONFIGS))
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on the CPU (run with TRITON_INTERPRET=1): checks the script, times nothing")
    args = parser.parse_args(argv)
    if args.dry_run:
        grid._configure_dry_run()
    versions = (load_version(args.other, "compress_kernels_other"), current)
    bandwidth = float("nan") if grid.DRY_RUN else grid.copy_bandwidth()
    print(f"{grid._device_name()} | torch {torch.__version__} | copy {bandwidth:.0f} GB/s", flush=True)
    for config in args.configs:
        for tokens in args.tokens:
            s = grid.prefill_setup(config, tokens, args.requests, 0)

            def prefill(module, state, out, s=s):
                module.compress_forward(state, s["x"], s["ape"], s["plan_c"], s["plan_w"], out, s["D"], s["r"])

            _compare(f"{config} prefill {tokens} tok / {args.requests} req", versions, prefill, s["state"],
                     torch.empty(s["plan_c"].shape[0], s["D"], device=grid.DEV), grid.compress_prefill_bytes(s), bandwidth)
            del s
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        for bs in args.batches:
            s = grid.decode_setup(config, bs)

            def decode(module, state, out, s=s):
                module.compress_forward(state, s["x"], s["ape"], s["plan"], None, out, s["D"], s["r"])

            _compare(f"{config} decode bs {bs} ({s['boundary']} at a boundary)", versions, decode, s["state"],
                     torch.empty(bs, s["D"], device=grid.DEV), grid.compress_decode_bytes(s, bs), bandwidth)


if __name__ == "__main__":
    main()
