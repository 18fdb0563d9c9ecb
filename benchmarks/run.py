"""H200 benchmarks of every dsv4ops op: Triton kernel vs PyTorch reference (eager and torch.compile).

    python -m benchmarks.run [--quick] [--out docs]

For every row: median time (``triton.testing.do_bench``; ``do_bench_cudagraph`` for
decode), the bytes the op must move (each input read once, each output written once,
counted below), effective GB/s, % of the device-to-device copy bandwidth measured in
the same run, and the speedup over the eager reference and over ``torch.compile`` of
the reference. Writes ``<out>/benchmarks.csv`` and ``<out>/bandwidth.png``.
"""

from __future__ import annotations

import argparse
import csv
import os
from dataclasses import dataclass, field

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

import dsv4ops  # noqa: F401
from dsv4ops._layout import CacheLayout, cache_format, state_row_width, window_len
from dsv4ops.compress import kernels as ck
from dsv4ops.compress.reference import compress_decode_reference, compress_prefill_reference
from dsv4ops.layer import rope_freqs_table
from dsv4ops.planner import kernels as pk
from dsv4ops.planner.reference import plan_decode_reference, plan_prefill_reference
from dsv4ops.store import kernels as sk
from dsv4ops.store.reference import norm_rope_store_reference
from dsv4ops.testing import PagedPools

DEV = "cuda"
DECODE_MAX_LEN = 131072  # decode positions go up to 128K
DECODE_BATCHES = (1, 8, 32, 128, 512)
PREFILL_TOKENS = (4096, 16384, 65536)
CONFIGS = {  # name: (ratio, head_dim, ring, cache flags)
    "c4-main": (4, 512, 8, {}),
    "c4-indexer": (4, 128, 8, {}),
    "c128-main": (128, 512, 128, {}),
}


@dataclass
class Row:
    op: str
    config: str
    shape: str
    tokens: int
    time_us: float
    bytes: int
    ref_eager_us: float = float("nan")
    ref_compiled_us: float = float("nan")
    extra: dict = field(default_factory=dict)

    def gbps(self):
        return self.bytes / self.time_us / 1e3


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s), median of do_bench."""
    n = 1 << 28  # 1 GiB of fp32
    a = torch.empty(n, device=DEV)
    b = torch.empty(n, device=DEV)
    a.normal_()
    ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    return 2 * a.numel() * 4 / ms / 1e6


def bench(fn, cudagraph=False):
    if cudagraph:
        return do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3
    return do_bench(fn, warmup=25, rep=150, return_mode="median") * 1e3


_compiled = {}
torch._inductor.config.compile_threads = max(1, os.cpu_count() or 1)
torch._dynamo.config.cache_size_limit = 64


def compiled(fn):
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=True)
    return _compiled[fn]


def prefill_setup(config, tokens, requests, prefix, seed=0):
    r, D, ring, flags = CONFIGS[config]
    ext = [tokens // requests] * requests
    ext[-1] += tokens - sum(ext)
    seqs = [prefix + e for e in ext]
    pools = PagedPools(max_requests=requests, max_seq_len=max(seqs) + 1, swa_page_size=128, full_page_size=256,
                       seed=seed, device=DEV)
    width = state_row_width(D, r)
    state = torch.randn(pools.state_rows(r, ring), width, device=DEV)
    x = torch.randn(tokens, width, device=DEV)
    ape = torch.randn(window_len(r), D, device=DEV)
    rpi = torch.arange(requests, device=DEV)
    seq_t = torch.tensor(seqs, device=DEV)
    ext_t = torch.tensor(ext, device=DEV)
    plan_c, plan_w = pk.plan_prefill(rpi, pools.req_to_token, pools.full_to_state, seq_t, ext_t, tokens, r, 128, ring, 0)
    rows = [(b, p) for b in range(requests) for p in range(prefix, seqs[b])]
    out_loc = pools.out_loc([a for a, _ in rows], [b for _, b in rows], r)
    return dict(r=r, D=D, ring=ring, flags=flags, pools=pools, state=state, x=x, ape=ape, rpi=rpi, seq=seq_t, ext=ext_t,
                plan_c=plan_c, plan_w=plan_w, out_loc=out_loc, tokens=tokens)


def compress_prefill_bytes(s, out_elem=4):
    r, D = s["r"], s["D"]
    width = state_row_width(D, r)
    words_c = s["plan_c"].view(torch.int32)
    valid = words_c[:, 0] != -1
    n_c = int(valid.sum())
    buffer_rows = int(((words_c[:, 1] >> 16) & 0xFFFF)[valid].sum())
    n_w = int((s["plan_w"].view(torch.int32)[:, 0] != -1).sum())
    half = width // 2 if r == 4 else width  # a ratio-4 window row uses half of a state row
    return (s["tokens"] * width * 4 + n_w * width * 4 + n_c * D * out_elem + buffer_rows * half * 4
            + s["plan_c"].numel() + s["plan_w"].numel())


def store_setup(s):
    """The store's inputs for a prefill: one row per CompressPlan row."""
    r, D, flags = s["r"], s["D"], s["flags"]
    fmt = cache_format(D, flags.get("use_fp4", False), flags.get("bf16_store", False))
    layout = CacheLayout(fmt, 256 // r)
    cache = torch.zeros(s["pools"].cache_pages(), layout.page_bytes, dtype=torch.uint8, device=DEV)
    kv = torch.randn(s["plan_c"].shape[0], D, device=DEV)
    return kv, cache, layout, rope_freqs_table(s["pools"].max_seq_len).to(DEV), torch.randn(D, device=DEV)


def store_bytes(n_live, n_rows, D, layout):
    per_token = {0: 584, 1: 1024, 2: 132, 3: 68}[int(layout.format)]
    return n_rows * (D * 4 + 16 + 8) + n_live * (per_token + 256) + D * 4


def sweep_prefill_tiles():
    """Kernel-only timings of the prefill pooling tile choices (16K tokens, 32 requests)."""
    candidates = {4: [(4, 8, 128, 4), (8, 8, 64, 4), (16, 8, 64, 4), (32, 8, 32, 4), (16, 8, 128, 8)],
                  128: [(1, 32, 128, 4), (1, 16, 64, 4), (1, 64, 64, 8), (2, 32, 64, 4), (1, 128, 32, 8)]}
    default = dict(ck.PREFILL_POOL_TILE)
    for config in CONFIGS:
        s = prefill_setup(config, PREFILL_TOKENS[1], 32, 0)
        r, D = s["r"], s["D"]
        out = torch.empty(s["plan_c"].shape[0], D, device=DEV)
        nbytes = compress_prefill_bytes(s)
        for tile in candidates[r]:
            ck.PREFILL_POOL_TILE[r] = tile
            us = bench(lambda: ck.compress_forward(s["state"], s["x"], s["ape"], s["plan_c"], s["plan_w"], out, D, r))
            print(f"sweep {config:11s} tile (events, rows, channels, warps) = {tile}: {us:8.2f} us "
                  f"{nbytes / us / 1e3:7.1f} GB/s", flush=True)
        ck.PREFILL_POOL_TILE.update(default)


def run_prefill(rows, quick):
    token_counts = PREFILL_TOKENS[1:2] if quick else PREFILL_TOKENS
    for config in (("c4-main", "c128-main") if quick else CONFIGS):
        for tokens in token_counts:
            for requests in ((32,) if quick else (1, 32)):
                for prefix in (0, 1000):
                    s = prefill_setup(config, tokens, requests, prefix)
                    r, D = s["r"], s["D"]
                    out = torch.empty(s["plan_c"].shape[0], D, device=DEV)
                    state = s["state"]

                    def kernel():
                        ck.compress_forward(state, s["x"], s["ape"], s["plan_c"], s["plan_w"], out, D, r)

                    def ref(fn=compress_prefill_reference):
                        fn(state, s["x"], s["ape"], s["plan_c"], s["plan_w"], out, D, r)

                    shape = f"{tokens} tok / {requests} req / prefix {prefix}"
                    row = Row("compress_forward prefill", config, shape, tokens, bench(kernel), compress_prefill_bytes(s))
                    row.ref_eager_us = bench(ref)
                    row.ref_compiled_us = bench(lambda: ref(compiled(compress_prefill_reference)))
                    rows.append(row)
                    print_row(row)

                    kv, cache, layout, freqs, w = store_setup(s)
                    n_live = int((s["plan_c"].view(torch.int32)[:, 0] != -1).sum())
                    args = (kv, s["plan_c"], w, 1e-6, freqs, s["out_loc"], cache, False, r, 256 // r,
                            s["flags"].get("use_fp4", False), s["flags"].get("bf16_store", False))
                    row = Row("norm_rope_store prefill", config, shape, tokens, bench(lambda: sk.norm_rope_store(*args)),
                              store_bytes(n_live, kv.shape[0], D, layout))
                    row.ref_eager_us = bench(lambda: norm_rope_store_reference(*args))
                    row.ref_compiled_us = bench(lambda: compiled(norm_rope_store_reference)(*args))
                    rows.append(row)
                    print_row(row)
                    if config == "c4-main":
                        pargs = (s["rpi"], s["pools"].req_to_token, s["pools"].full_to_state, s["seq"], s["ext"], tokens,
                                 r, 128, s["ring"], 0)
                        row = Row("plan_prefill", config, shape, tokens, bench(lambda: pk.plan_prefill(*pargs)),
                                  tokens * 24 + requests * 24 + tokens * 16)
                        row.ref_eager_us = bench(lambda: plan_prefill_reference(*pargs))
                        row.ref_compiled_us = bench(lambda: compiled(plan_prefill_reference)(*pargs))
                        rows.append(row)
                        print_row(row)


def compact_swa(pools: PagedPools, swa_pages_per_request: int = 4) -> int:
    """Give each request a small ring of SWA pages (as sglang's SWA pool does by evicting old
    pages) instead of one SWA page per 128 tokens, so 128K-token contexts fit; returns the page count."""
    assert not bool((pools.request_pages[:, 1:] != pools.request_pages[:, :1] + torch.arange(1, pools.pages_per_request)).any())
    slot = torch.arange(pools.num_full_pages * pools.full_page_size, device=pools.device)
    page = slot // pools.full_page_size
    rid = (page - 1).clamp_min(0) // pools.pages_per_request
    block = ((page - 1).clamp_min(0) % pools.pages_per_request) * (pools.full_page_size // pools.swa_page_size) \
        + (slot % pools.full_page_size) // pools.swa_page_size
    swa_page = rid * swa_pages_per_request + block % swa_pages_per_request
    pools.full_to_state = swa_page * pools.swa_page_size + slot % pools.swa_page_size
    return pools.max_requests * swa_pages_per_request


def decode_setup(config, bs, seed=0):
    """bs requests at positions up to 128K; about a quarter of them complete a chunk this step."""
    r, D, ring, flags = CONFIGS[config]
    g = torch.Generator().manual_seed(seed)
    max_len = DECODE_MAX_LEN
    pools = PagedPools(max_requests=bs, max_seq_len=max_len, swa_page_size=128, full_page_size=256, seed=seed,
                       device=DEV, shuffle=False)
    swa_pages = compact_swa(pools)
    seq = torch.randint(1, max_len // r - 1, (bs,), generator=g) * r
    seq = torch.where(torch.rand(bs, generator=g) < 0.25, seq, seq - torch.randint(1, r, (bs,), generator=g).clamp(max=r - 1))
    width = state_row_width(D, r)
    state = torch.randn(swa_pages * ring, width, device=DEV)
    rpi = torch.arange(bs, device=DEV)
    seq_t = seq.to(DEV)
    plan = pk.plan_decode(rpi, pools.req_to_token, pools.full_to_state, seq_t, r, 128, ring, 0)
    out_loc = pools.out_loc(list(range(bs)), (seq - 1).tolist(), r)
    return dict(r=r, D=D, ring=ring, flags=flags, pools=pools, state=state, x=torch.randn(bs, width, device=DEV),
                ape=torch.randn(window_len(r), D, device=DEV), rpi=rpi, seq=seq_t, plan=plan, out_loc=out_loc,
                boundary=int((seq % r == 0).sum()))


def run_decode(rows, quick):
    for config in (("c4-main", "c128-main") if quick else CONFIGS):
        for bs in (DECODE_BATCHES[1::2] if quick else DECODE_BATCHES):
            s = decode_setup(config, bs)
            r, D = s["r"], s["D"]
            width = state_row_width(D, r)
            out = torch.empty(bs, D, device=DEV)
            W = window_len(r)
            half = width // 2 if r == 4 else width
            nbytes = bs * width * 4 * 2 + s["boundary"] * (W - 1) * half * 4 + bs * D * 4 + bs * 16

            def kernel():
                ck.compress_forward(s["state"], s["x"], s["ape"], s["plan"], None, out, D, r)

            def ref(fn=compress_decode_reference):
                fn(s["state"], s["x"], s["ape"], s["plan"], out, D, r)

            shape = f"bs {bs} ({s['boundary']} at a boundary)"
            row = Row("compress_forward decode", config, shape, bs, bench(kernel, cudagraph=True), nbytes)
            row.ref_eager_us = bench(ref)
            row.ref_compiled_us = bench(lambda: ref(compiled(compress_decode_reference)), cudagraph=True)
            rows.append(row)
            print_row(row)

            fmt = cache_format(D, False, False)
            layout = CacheLayout(fmt, 256 // r)
            cache = torch.zeros(s["pools"].cache_pages(), layout.page_bytes, dtype=torch.uint8, device=DEV)
            args = (torch.randn(bs, D, device=DEV), s["plan"], torch.randn(D, device=DEV), 1e-6,
                    rope_freqs_table(DECODE_MAX_LEN).to(DEV), s["out_loc"], cache, True, r, 256 // r, False, False)
            row = Row("norm_rope_store decode", config, shape, bs, bench(lambda: sk.norm_rope_store(*args), cudagraph=True),
                      store_bytes(s["boundary"], bs, D, layout))
            row.ref_eager_us = bench(lambda: norm_rope_store_reference(*args))
            row.ref_compiled_us = bench(lambda: compiled(norm_rope_store_reference)(*args), cudagraph=True)
            rows.append(row)
            print_row(row)
            if config != "c4-indexer":
                pargs = (s["rpi"], s["pools"].req_to_token, s["pools"].full_to_state, s["seq"], r, 128, s["ring"], 0)
                row = Row("plan_decode", config, f"bs {bs}", bs, bench(lambda: pk.plan_decode(*pargs), cudagraph=True),
                          bs * (8 + 8 + 16 + 4 * 2 + 8 * 2))
                row.ref_eager_us = bench(lambda: plan_decode_reference(*pargs))
                row.ref_compiled_us = bench(lambda: compiled(plan_decode_reference)(*pargs), cudagraph=True)
                rows.append(row)
                print_row(row)


def whole_decode_step(rows, bs=128):
    """Plans + compress + store for core c4, indexer c4 (shared plan) and core c128, under one CUDA graph."""
    parts = {name: decode_setup(name, bs, seed=1) for name in CONFIGS}
    freqs = rope_freqs_table(DECODE_MAX_LEN).to(DEV)
    caches, weights, kvs = {}, {}, {}
    for name, s in parts.items():
        layout = CacheLayout(cache_format(s["D"], False, False), 256 // s["r"])
        caches[name] = torch.zeros(s["pools"].cache_pages(), layout.page_bytes, dtype=torch.uint8, device=DEV)
        weights[name] = torch.randn(s["D"], device=DEV)
        kvs[name] = torch.empty(bs, s["D"], device=DEV)
    p4, p128 = parts["c4-main"], parts["c128-main"]

    def step():
        plan4 = torch.ops.dsv4ops.plan_decode(p4["rpi"], p4["pools"].req_to_token, p4["pools"].full_to_state, p4["seq"], 4, 128, 8, 0)
        plan128 = torch.ops.dsv4ops.plan_decode(p128["rpi"], p128["pools"].req_to_token, p128["pools"].full_to_state,
                                                p128["seq"], 128, 128, 128, 0)
        for name, plan in (("c4-main", plan4), ("c4-indexer", plan4), ("c128-main", plan128)):
            s = parts[name]
            torch.ops.dsv4ops.compress_forward(s["state"], s["x"], s["ape"], plan, None, kvs[name], s["D"], s["r"])
            torch.ops.dsv4ops.compress_norm_rope_store(kvs[name], plan, weights[name], 1e-6, freqs, s["out_loc"],
                                                       caches[name], True, s["r"], 256 // s["r"], False, False)

    us = bench(step, cudagraph=True)
    row = Row("whole decode step (8 launches)", "c4+indexer+c128", f"bs {bs}", bs, us, 0)
    rows.append(row)
    print(f"whole decode step, bs {bs}, one CUDA graph: {us:.2f} us")


COPY_BW = None


def print_row(row: Row):
    print(f"{row.op:26s} {row.config:11s} {row.shape:34s} {row.time_us:9.2f} us {row.bytes / 1e6:9.2f} MB "
          f"{row.gbps():8.1f} GB/s {100 * row.gbps() / COPY_BW:5.1f}%  x{row.ref_eager_us / row.time_us:7.1f} eager "
          f"x{row.ref_compiled_us / row.time_us:6.1f} compiled", flush=True)


def save(rows, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "benchmarks.csv")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["op", "config", "shape", "tokens_or_bs", "time_us", "bytes", "GBps", "pct_copy_bw",
                    "ref_eager_us", "ref_compiled_us", "speedup_vs_eager", "speedup_vs_compiled"])
        for r in rows:
            w.writerow([r.op, r.config, r.shape, r.tokens, f"{r.time_us:.3f}", r.bytes, f"{r.gbps():.1f}",
                        f"{100 * r.gbps() / COPY_BW:.1f}", f"{r.ref_eager_us:.3f}", f"{r.ref_compiled_us:.3f}",
                        f"{r.ref_eager_us / r.time_us:.2f}", f"{r.ref_compiled_us / r.time_us:.2f}"])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        for ax, kind in zip(axes, ("prefill", "decode")):
            for op in sorted({r.op for r in rows if kind in r.op}):
                for config in CONFIGS:
                    pts = sorted((r.tokens, r.gbps()) for r in rows if r.op == op and r.config == config
                                 and ("prefix 0" in r.shape or kind == "decode") and ("/ 32 req" in r.shape or kind == "decode"))
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{op.split()[0]} {config}")
            ax.axhline(COPY_BW, color="k", linestyle="--", label=f"D2D copy {COPY_BW:.0f} GB/s")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens" if kind == "prefill" else "batch size")
            ax.set_ylabel("effective GB/s")
            ax.set_title(f"{kind} on {torch.cuda.get_device_name()}")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "bandwidth.png"), dpi=110)
    except ImportError:
        print("matplotlib not available: no plot")
    return path


def main(argv=None):
    global COPY_BW
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="docs")
    parser.add_argument("--only", choices=["prefill", "decode", "step"], default=None)
    parser.add_argument("--sweep", action="store_true", help="time the prefill pooling tile choices first")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    COPY_BW = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"D2D copy {COPY_BW:.0f} GB/s (read + write)")
    rows = []
    if args.sweep:
        sweep_prefill_tiles()
    if args.only in (None, "step"):
        whole_decode_step(rows)
    if args.only in (None, "prefill"):
        run_prefill(rows, args.quick)
    if args.only in (None, "decode"):
        run_decode(rows, args.quick)
    print("saved", save(rows, args.out))


if __name__ == "__main__":
    main()
