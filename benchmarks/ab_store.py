"""A/B timing of the prefill stores: another version of ``dsv4ops/store/kernels.py`` against the
working tree's, on the same inputs in the same run.

    git show 7098701:dsv4ops/store/kernels.py > .ab/store_kernels_old.py   # any saved version
    python -m benchmarks.ab_store .ab/store_kernels_old.py [--tokens 16384 65536]

For each compressor config (ratio 4 D 512 and indexer, ratio 128 D 512), token count (32 requests)
and format (FP8, and bf16 or FP4), it launches both versions on the same plan, rows and cache,
checks that they write the same bytes (a GPU check of a rewrite against a version that ran
there), and prints the ``do_bench_cudagraph`` medians, the % of the copy bandwidth measured in
the run (bytes as ``benchmarks.run.store_bytes`` counts them) and the speedup. Needs a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile

import torch

from dsv4ops._layout import CacheLayout, cache_format
from dsv4ops.store import kernels as current

from . import run as grid

#: a saved kernels.py (store or compress) imports its siblings relatively; loaded on its own, it
#: imports them by name
_ABSOLUTE = (("from .._layout", "from dsv4ops._layout"), ("from .quant", "from dsv4ops.store.quant"),
             ("from .._triton import", "from dsv4ops._triton import"),
             ("from .._triton_formats", "from dsv4ops._triton_formats"))


def load_version(path: str, name: str = "store_kernels_other"):
    """The kernels module saved at ``path`` (a ``dsv4ops/store/kernels.py`` or
    ``dsv4ops/compress/kernels.py``), imported under ``name``."""
    src = open(path).read()
    for relative, absolute in _ABSOLUTE:
        src = src.replace(relative, absolute)
    copy = os.path.join(tempfile.mkdtemp(), f"{name}.py")  # Triton's JIT reads the source from a file
    with open(copy, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(name, copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", help="a saved dsv4ops/store/kernels.py (e.g. from git show)")
    parser.add_argument("--tokens", nargs="+", type=int, default=[16384, 65536])
    args = parser.parse_args(argv)
    versions = (("other", load_version(args.other)), ("current", current))
    bandwidth = grid.copy_bandwidth()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | copy {bandwidth:.0f} GB/s", flush=True)
    for config in ("c4-main", "c4-indexer", "c128-main"):
        for tokens in args.tokens:
            s = grid.prefill_setup(config, tokens, 32, 0)
            r, D = s["r"], s["D"]
            n_live = grid.plan_counts(s)[0]
            kv, _, _, freqs, weight = grid.store_setup(s, s["plan_c"].shape[0])
            for second_format in (False, True):  # D 512: FP8 then bf16; indexer: FP8 then FP4
                fp4, bf16 = (False, second_format) if D == 512 else (second_format, False)
                fmt = cache_format(D, fp4, bf16)
                layout = CacheLayout(fmt, 256 // r)
                caches, times = [], []
                for _, module in versions:
                    cache = torch.full((s["pools"].cache_pages(), layout.page_bytes), 0xA5, dtype=torch.uint8,
                                       device=grid.DEV)
                    call = grid.prefill_store_args(s, kv, cache, freqs, weight, fp4, bf16)
                    module.norm_rope_store(*call)
                    caches.append(cache.clone())
                    times.append(grid.bench(lambda m=module, c=call: m.norm_rope_store(*c)))
                nbytes = grid.store_bytes(n_live, kv.shape[0], D, fmt)
                pct = [nbytes / (t * 1e-6) / 1e9 / bandwidth * 100 for t in times]
                print(f"{config:10s} {tokens:6d} tok {fmt.name:14s} other {times[0]:7.2f} us ({pct[0]:4.1f}%)  "
                      f"current {times[1]:7.2f} us ({pct[1]:4.1f}%)  x{times[0] / times[1]:.2f}  "
                      f"same bytes: {torch.equal(caches[0], caches[1])}", flush=True)
            del s, kv
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
