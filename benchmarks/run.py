"""H200 benchmarks of every dsv4ops op: Triton kernel vs PyTorch reference (eager and torch.compile).

    python -m benchmarks.run [--quick] [--only prefill|decode|step|train|sweep] [--configs c4-main ...] [--batches 1 8 ...] [--tokens 65536 ...] [--out docs]
    python -m benchmarks.run --replot CSV --out DIR      # the plot again from a saved CSV (no GPU)

For every row: median time of the dsv4ops kernels with ``do_bench_cudagraph`` (GPU time of
the launches replayed in a CUDA graph: the host's Python launch cost is left out, as in a
captured serving step; the first H200 prefill rows, 2026-12-03, used ``do_bench``), and of
the eager reference and the compiled reference the same way (``bench_ref``; a reference that
cannot be captured falls back to ``do_bench`` and the log says so; before the fourth session
of 2026-12-03 the eager references and the compiled prefill references were timed with
``do_bench``, host launch cost included); the bytes the op must move (each
input read once, each output written once, counted below per op), effective GB/s, % of the
device-to-device copy bandwidth measured in the same run, and the speedup over the eager
reference and over ``torch.compile`` of the reference. Rows are appended to
``<out>/benchmarks.csv`` as they are measured (a run cut short keeps what it measured);
``<out>/bandwidth.png`` plots GB/s against tokens / batch size.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

import dsv4ops  # noqa: F401
from dsv4ops._layout import CacheLayout, cache_format, state_row_width, window_len
from dsv4ops.compress import kernels as ck
from dsv4ops.compress.reference import compress_decode_reference, compress_prefill_reference
from dsv4ops.decode_step import kernels as dk
from dsv4ops.decode_step.reference import decode_step_reference
from dsv4ops.layer import rope_freqs_table
from dsv4ops.planner import kernels as pk
from dsv4ops.planner.reference import plan_decode_reference, plan_prefill_reference
from dsv4ops.store import kernels as sk
from dsv4ops.store.reference import norm_rope_store_reference
from dsv4ops.testing import PagedPools, fix_triton_interpreter

from .timing import first_line, median_us

DEV = "cuda"
DECODE_MAX_LEN = 131072  # decode positions go up to 128K
DECODE_BATCHES = (1, 8, 32, 128, 512)
STEP_BATCH = 128  # the whole decode step under one CUDA graph
PREFILL_TOKENS = (4096, 16384, 65536)
PREFILL_REQUESTS = (1, 32)
PREFIXES = (0, 1000)
CONFIGS = {  # name: (ratio, head_dim, ring)
    "c4-main": (4, 512, 8),
    "c4-indexer": (4, 128, 8),
    "c128-main": (128, 512, 128),
}
GRID_CONFIGS = tuple(CONFIGS)  # the configs of the prefill and decode grids (--configs narrows them)
#: the compress reference gathers every window of every (padded) plan row, ``[rows, W, width]`` fp32;
#: above this many bytes (64K-token ratio 128: 34 GB) it runs over chunks of plan rows that fit
REF_GATHER_LIMIT = 12 << 30
PER_TOKEN_CACHE_BYTES = {0: 584, 1: 1024, 2: 132, 3: 68}
CSV_FIELDS = ["op", "config", "shape", "tokens_or_bs", "time_us", "bytes", "GBps", "pct_copy_bw",
              "ref_eager_us", "ref_compiled_us", "speedup_vs_eager", "speedup_vs_compiled"]


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


COPY_BW = float("nan")
OUT_DIR = "docs"
ROWS: list = []


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s), median of do_bench."""
    n = 1 << 28  # 1 GiB of fp32
    a = torch.empty(n, device=DEV)
    b = torch.empty(n, device=DEV)
    a.normal_()
    ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    return 2 * a.numel() * 4 / ms / 1e6


#: --groups: the sweep times only the groups whose name this pattern matches (``re.search``)
SWEEP_GROUPS = None
#: --tokens: the sweep's prefill groups at these token counts (32 requests), every group at each
SWEEP_TOKENS = None
DRY_RUN = False  # --dry-run: tiny shapes on the CPU, every timed call run once (checks the script, times nothing)


def bench(fn, rep=150):
    """Median microseconds of a dsv4ops launch replayed in a CUDA graph (``timing.median_us``)."""
    if DRY_RUN:
        fn()
        return 1.0
    return median_us(fn, rep)


def bench_ref(fn, rep=150):
    """GPU time of a reference (eager or compiled), replayed in a CUDA graph as the dsv4ops launches
    are, so the speedups compare GPU work with GPU work, not kernels with Python. A reference that
    cannot be captured is timed with ``do_bench`` (its host launch cost included) and the run says
    so. A failure (e.g. an Inductor error compiling it) prints one line and gives NaN, so one broken
    comparison does not end the run (its whole traceback goes to stderr); the dry run still raises."""
    if DRY_RUN:
        return bench(fn)
    try:
        return median_us(fn, rep, fallback=True)
    except Exception as e:  # noqa: BLE001 -- reported, then the row goes on without this comparison
        print(f"  reference failed: {type(e).__name__}: {first_line(e)[:200]}", flush=True)
        traceback.print_exc()
        torch._dynamo.reset()
        if "CUDA driver error" in str(e) and torch._inductor.config.use_static_cuda_launcher:
            return _retry_with_triton_launcher(fn, rep)
        return float("nan")


def _retry_with_triton_launcher(fn, rep):
    """A compiled reference that failed in a CUDA driver call (the indexer's at batch 1 on the GPU:
    "CUDA driver error: invalid argument", a launch error, which leaves the context usable), compiled
    again with Triton's own launcher instead of Inductor's static one, its generated code logged to
    stderr: whether it then runs tells which launcher refused which kernel's launch."""
    torch._logging.set_logs(output_code=True)
    try:
        # no FX graph cache: a hit would bring back the kernels of the failed compile
        with torch._inductor.config.patch(use_static_cuda_launcher=False, fx_graph_cache=False):
            us = median_us(fn, rep, fallback=True)
        print("  reference retried with Triton's launcher (use_static_cuda_launcher=False): ran", flush=True)
        return us
    except Exception as e:  # noqa: BLE001 -- reported, then the row goes on without this comparison
        print(f"  reference retried with Triton's launcher: failed too: {type(e).__name__}: {first_line(e)[:200]}",
              flush=True)
        traceback.print_exc()
        return float("nan")
    finally:
        torch._logging.set_logs()
        torch._dynamo.reset()


_compiled = {}
torch._inductor.config.compile_threads = max(1, os.cpu_count() or 1)
torch._dynamo.config.cache_size_limit = 64


def compiled(fn):
    if DRY_RUN:
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=True)
    return _compiled[fn]


def record(row: Row):
    ROWS.append(row)
    pct = 100 * row.gbps() / COPY_BW if row.bytes else float("nan")
    print(f"{row.op:28s} {row.config:11s} {row.shape:36s} {row.time_us:9.2f} us {row.bytes / 1e6:8.2f} MB "
          f"{row.gbps():7.0f} GB/s {pct:5.1f}%  x{row.ref_eager_us / row.time_us:7.1f} eager "
          f"x{row.ref_compiled_us / row.time_us:6.1f} compiled", flush=True)
    path = os.path.join(OUT_DIR, "benchmarks.csv")
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(CSV_FIELDS)
        w.writerow([row.op, row.config, row.shape, row.tokens, f"{row.time_us:.3f}", row.bytes, f"{row.gbps():.1f}",
                    f"{pct:.1f}", f"{row.ref_eager_us:.3f}", f"{row.ref_compiled_us:.3f}",
                    f"{row.ref_eager_us / row.time_us:.2f}", f"{row.ref_compiled_us / row.time_us:.2f}"])


# ---------------------------------------------------------------------- prefill
def prefill_setup(config, tokens, requests, prefix, seed=0):
    r, D, ring = CONFIGS[config]
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
    return dict(r=r, D=D, ring=ring, pools=pools, state=state, x=x, ape=ape, rpi=rpi, seq=seq_t, ext=ext_t,
                plan_c=plan_c, plan_w=plan_w, out_loc=out_loc, tokens=tokens)


def plan_counts(s):
    words_c = s["plan_c"].view(torch.int32)
    valid = words_c[:, 0] != -1
    n_w = int((s["plan_w"].view(torch.int32)[:, 0] != -1).sum())
    return int(valid.sum()), int(((words_c[:, 1] >> 16) & 0xFFFF)[valid].sum()), n_w


def compress_prefill_bytes(s):
    """Input rows once, ring rows the windows need (half a row for ratio 4: one quarter each of
    kv and score), the write set (written to the ring), every output row (padding rows are zeros
    by contract), and both plans."""
    r, D = s["r"], s["D"]
    width = state_row_width(D, r)
    n_c, buffer_rows, n_w = plan_counts(s)
    ring_row = width // 2 if r == 4 else width
    return (s["tokens"] * width * 4 + buffer_rows * ring_row * 4 + n_w * width * 4 + s["plan_c"].shape[0] * D * 4
            + s["plan_c"].numel() + s["plan_w"].numel())


def store_bytes(n_live, n_rows, D, fmt):
    """Plan rows, then per stored row: its kv row, out_loc entry, cos/sin (256 B) and the cache slot."""
    return n_rows * 16 + n_live * (D * 4 + 8 + 256 + PER_TOKEN_CACHE_BYTES[int(fmt)]) + D * 4


def store_setup(s, rows):
    r, D = s["r"], s["D"]
    fmt = cache_format(D, False, False)
    layout = CacheLayout(fmt, 256 // r)
    cache = torch.zeros(s["pools"].cache_pages(), layout.page_bytes, dtype=torch.uint8, device=DEV)
    kv = torch.randn(rows, D, device=DEV)
    return kv, cache, fmt, rope_freqs_table(s["pools"].max_seq_len + 8).to(DEV), torch.randn(D, device=DEV)


def prefill_store_args(s, kv, cache, freqs, weight, use_fp4=False, bf16_store=False):
    """``norm_rope_store``'s arguments for a prefill setup: its compress plan, FP8 formats unless told."""
    r = s["r"]
    return (kv, s["plan_c"], weight, 1e-6, freqs, s["out_loc"], cache, False, r, 256 // r, use_fp4, bf16_store)


def reference_rows_per_chunk(plan_rows: int, D: int, r: int) -> int:
    """Plan rows per call of the compress prefill reference: all of them, or as many as keep its
    window gather within ``REF_GATHER_LIMIT``."""
    per_row = window_len(r) * state_row_width(D, r) * 4
    return max(1, min(plan_rows, REF_GATHER_LIMIT // per_row))


def chunked_prefill_reference(fn, state, x, ape, plan_c, plan_w, out, D, r, rows_per_chunk):
    """``fn`` (the compress prefill reference, eager or compiled) over chunks of ``rows_per_chunk``
    plan rows: the same pooling and writes as one call. Each plan row pools on its own, and every
    chunk's pass 1 must read the ring before pass 2 writes it, so the write plan goes with the last
    chunk and the others get none."""
    rows = plan_c.shape[0]
    for start in range(0, rows, rows_per_chunk):
        end = min(start + rows_per_chunk, rows)
        fn(state, x, ape, plan_c[start:end], plan_w if end == rows else plan_w[:0], out[start:end], D, r)


def run_prefill(quick):
    tokens_list = PREFILL_TOKENS[:2] if quick else PREFILL_TOKENS
    for config in GRID_CONFIGS:
        for tokens in tokens_list:
            for requests in PREFILL_REQUESTS:
                for prefix in (PREFIXES[:1] if quick and tokens != 16384 else PREFIXES):
                    s = prefill_setup(config, tokens, requests, prefix)
                    r, D = s["r"], s["D"]
                    out = torch.empty(s["plan_c"].shape[0], D, device=DEV)
                    state = s["state"]
                    shape = f"{tokens} tok / {requests} req / prefix {prefix}"

                    rows_per_chunk = reference_rows_per_chunk(s["plan_c"].shape[0], D, r)

                    def ref(fn=compress_prefill_reference):
                        chunked_prefill_reference(fn, state, s["x"], s["ape"], s["plan_c"], s["plan_w"], out, D, r,
                                                  rows_per_chunk)

                    row = Row("compress_forward prefill", config, shape, tokens,
                              bench(lambda: ck.compress_forward(state, s["x"], s["ape"], s["plan_c"], s["plan_w"],
                                                                out, D, r)),
                              compress_prefill_bytes(s))
                    if rows_per_chunk < s["plan_c"].shape[0]:
                        print(f"  reference in {-(-s['plan_c'].shape[0] // rows_per_chunk)} calls of "
                              f"{rows_per_chunk} plan rows (its window gather)", flush=True)
                    row.ref_eager_us = bench_ref(ref)
                    row.ref_compiled_us = bench_ref(lambda: ref(compiled(compress_prefill_reference)))
                    record(row)

                    kv, cache, fmt, freqs, w = store_setup(s, s["plan_c"].shape[0])
                    n_live = plan_counts(s)[0]
                    args = prefill_store_args(s, kv, cache, freqs, w)
                    row = Row("norm_rope_store prefill", config, shape, tokens,
                              bench(lambda: sk.norm_rope_store(*args)),
                              store_bytes(n_live, kv.shape[0], D, fmt))
                    row.ref_eager_us = bench_ref(lambda: norm_rope_store_reference(*args))
                    row.ref_compiled_us = bench_ref(lambda: compiled(norm_rope_store_reference)(*args))
                    record(row)
                    if config != "c4-indexer":
                        pargs = (s["rpi"], s["pools"].req_to_token, s["pools"].full_to_state, s["seq"], s["ext"],
                                 tokens, r, 128, s["ring"], 0)
                        n_c, _, n_w = plan_counts(s)
                        # lengths and ids in, the state-row lookups of every event / write, both plans out
                        nbytes = requests * 24 + (2 * n_c + n_w) * 12 + tokens * 24
                        row = Row("plan_prefill", config, shape, tokens, bench(lambda: pk.plan_prefill(*pargs)),
                                  nbytes)
                        row.ref_eager_us = bench_ref(lambda: plan_prefill_reference(*pargs))
                        row.ref_compiled_us = bench_ref(lambda: compiled(plan_prefill_reference)(*pargs))
                        record(row)
                    del s, out, kv, cache
                    torch.cuda.empty_cache()


# ---------------------------------------------------------------------- decode
def compact_swa(pools: PagedPools, swa_pages_per_request: int = 4) -> int:
    """Give each request a small ring of SWA pages (as sglang's SWA pool does by evicting old
    pages) instead of one SWA page per 128 tokens, so 128K-token contexts fit; returns the page count."""
    slot = torch.arange(pools.num_full_pages * pools.full_page_size, device=pools.device)
    page = slot // pools.full_page_size
    rid = (page - 1).clamp_min(0) // pools.pages_per_request
    block = ((page - 1).clamp_min(0) % pools.pages_per_request) * (pools.full_page_size // pools.swa_page_size) \
        + (slot % pools.full_page_size) // pools.swa_page_size
    swa_page = rid * swa_pages_per_request + block % swa_pages_per_request
    pools.full_to_state = swa_page * pools.swa_page_size + slot % pools.swa_page_size
    return pools.max_requests * swa_pages_per_request


def decode_setup(config, bs, seed=0, boundary_fraction=0.25, boundaries=None):
    """bs requests at positions up to 128K; about a quarter of them complete a chunk this step (about
    ``boundary_fraction`` of them; exactly the first ``boundaries`` when that is given)."""
    r, D, ring = CONFIGS[config]
    g = torch.Generator().manual_seed(seed)
    pools = PagedPools(max_requests=bs, max_seq_len=DECODE_MAX_LEN, swa_page_size=128, full_page_size=256, seed=seed,
                       device=DEV, shuffle=False)
    swa_pages = compact_swa(pools)
    seq = torch.randint(1, DECODE_MAX_LEN // r - 1, (bs,), generator=g) * r
    off = torch.randint(1, r, (bs,), generator=g)
    if boundaries is None:
        at_boundary = torch.rand(bs, generator=g) < boundary_fraction
    else:
        at_boundary = torch.arange(bs) < boundaries
    seq = torch.where(at_boundary, seq, seq - off)
    width = state_row_width(D, r)
    state = torch.randn(swa_pages * ring, width, device=DEV)
    rpi = torch.arange(bs, device=DEV)
    seq_t = seq.to(DEV)
    plan = pk.plan_decode(rpi, pools.req_to_token, pools.full_to_state, seq_t, r, 128, ring, 0)
    out_loc = pools.out_loc(list(range(bs)), (seq - 1).tolist(), r)
    fmt = cache_format(D, False, False)
    layout = CacheLayout(fmt, 256 // r)
    cache = torch.zeros(pools.cache_pages(), layout.page_bytes, dtype=torch.uint8, device=DEV)
    return dict(r=r, D=D, ring=ring, pools=pools, state=state, x=torch.randn(bs, width, device=DEV),
                ape=torch.randn(window_len(r), D, device=DEV), rpi=rpi, seq=seq_t, plan=plan, out_loc=out_loc,
                boundary=int((seq % r == 0).sum()), fmt=fmt, cache=cache, freqs=rope_freqs_table(DECODE_MAX_LEN).to(DEV),
                weight=torch.randn(D, device=DEV))


def compress_decode_bytes(s, bs):
    r, D = s["r"], s["D"]
    width = state_row_width(D, r)
    ring_row = width // 2 if r == 4 else width
    return bs * width * 4 * 2 + s["boundary"] * (window_len(r) - 1) * ring_row * 4 + bs * D * 4 + bs * 16


def plan_decode_args(s):
    """``plan_decode``'s arguments for a decode setup."""
    return (s["rpi"], s["pools"].req_to_token, s["pools"].full_to_state, s["seq"], s["r"], 128, s["ring"], 0)


def decode_step_args(s, plan, out):
    """``compress_decode_step``'s arguments for a decode setup, with ``plan`` ``[bs, 16]`` uint8 and
    ``out`` ``[bs, D]`` as its output buffers."""
    r = s["r"]
    return (s["state"], s["x"], s["ape"], s["rpi"], s["pools"].req_to_token, s["pools"].full_to_state, s["seq"],
            s["weight"], 1e-6, s["freqs"], s["out_loc"], s["cache"], plan, out, s["D"], r, 128, s["ring"], 0,
            256 // r, False, False)


def run_decode(quick):
    for config in GRID_CONFIGS:
        for bs in (DECODE_BATCHES[1::2] if quick else DECODE_BATCHES):
            s = decode_setup(config, bs)
            r, D = s["r"], s["D"]
            out = torch.empty(bs, D, device=DEV)
            shape = f"bs {bs} ({s['boundary']} at a boundary)"

            def ref(fn=compress_decode_reference):
                fn(s["state"], s["x"], s["ape"], s["plan"], out, D, r)

            row = Row("compress_forward decode", config, shape, bs,
                      bench(lambda: ck.compress_forward(s["state"], s["x"], s["ape"], s["plan"], None, out, D, r)),
                      compress_decode_bytes(s, bs))
            row.ref_eager_us = bench_ref(ref)
            row.ref_compiled_us = bench_ref(lambda: ref(compiled(compress_decode_reference)))
            record(row)

            args = (torch.randn(bs, D, device=DEV), s["plan"], s["weight"], 1e-6, s["freqs"], s["out_loc"], s["cache"],
                    True, r, 256 // r, False, False)
            row = Row("norm_rope_store decode", config, shape, bs,
                      bench(lambda: sk.norm_rope_store(*args)),
                      store_bytes(s["boundary"], bs, D, s["fmt"]))
            row.ref_eager_us = bench_ref(lambda: norm_rope_store_reference(*args))
            row.ref_compiled_us = bench_ref(lambda: compiled(norm_rope_store_reference)(*args))
            record(row)

            if config != "c4-indexer":
                pargs = plan_decode_args(s)
                row = Row("plan_decode", config, f"bs {bs}", bs, bench(lambda: pk.plan_decode(*pargs)),
                          bs * (8 + 8 + 2 * (4 + 8) + 16))
                row.ref_eager_us = bench_ref(lambda: plan_decode_reference(*pargs))
                row.ref_compiled_us = bench_ref(lambda: compiled(plan_decode_reference)(*pargs))
                record(row)

            plan_buf = torch.empty(bs, 16, dtype=torch.uint8, device=DEV)
            fargs = decode_step_args(s, plan_buf, out)
            row = Row("compress_decode_step (fused)", config, shape, bs,
                      bench(lambda: dk.decode_step(*fargs)),
                      compress_decode_bytes(s, bs) + store_bytes(s["boundary"], 0, D, s["fmt"]) + bs * 48)
            row.ref_eager_us = bench_ref(lambda: decode_step_reference(*fargs))
            row.ref_compiled_us = bench_ref(lambda: compiled(decode_step_reference)(*fargs))
            record(row)
            del s, out
            torch.cuda.empty_cache()


@triton.jit
def _floor_kernel(ptr):
    tl.store(ptr + tl.program_id(0), tl.program_id(0))


def launch_floor(bs):
    """The floor of one launch in a CUDA graph: a kernel that stores one int per program and reads
    nothing (the decode rows cannot go below it, whatever their bytes)."""
    sink = torch.empty(bs, dtype=torch.int32, device=DEV)
    for programs in (1, bs):
        record(Row("launch floor (empty kernel)", "-", f"{programs} programs", programs,
                   bench(lambda: _floor_kernel[(programs,)](sink)), 0))


def whole_decode_step(bs=None):
    """Plans + compress + store for core c4, indexer c4 and core c128 under one CUDA graph, then the
    launch floor. Variants: sglang's unfused calls (8 launches); the fused ops (one
    ``compress_decode_step`` per compressor); the two ratio-4 compressors of a layer on two streams
    (they are independent, so a serving stack can overlap them; captured, the graph has two
    branches); and three ratio-128 setups after them (it belongs to another layer): the 128-row ring
    with a quarter of the rows at a chunk boundary (the decode grid's mix), the ring with 1 in 128
    rows at a boundary (what a serving step sees at ratio 128), and sglang's online state
    (``is_online``, spec section 8: one running (max, sum, kv) row per request, so a boundary reads
    one row, not 128; plan, pool and store: 3 launches)."""
    bs = bs or STEP_BATCH
    parts = {name: decode_setup(name, bs, seed=1) for name in CONFIGS}
    p4, p128 = parts["c4-main"], parts["c128-main"]
    rare = decode_setup("c128-main", bs, seed=1, boundaries=max(1, bs // 128))
    kvs = {name: torch.empty(bs, s["D"], device=DEV) for name, s in parts.items()}
    plans = {name: torch.empty(bs, 16, dtype=torch.uint8, device=DEV) for name in parts}

    def unfused():
        plan4 = torch.ops.dsv4ops.plan_decode(p4["rpi"], p4["pools"].req_to_token, p4["pools"].full_to_state, p4["seq"],
                                              4, 128, 8, 0)
        plan128 = torch.ops.dsv4ops.plan_decode(p128["rpi"], p128["pools"].req_to_token, p128["pools"].full_to_state,
                                                p128["seq"], 128, 128, 128, 0)
        for name, plan in (("c4-main", plan4), ("c4-indexer", plan4), ("c128-main", plan128)):
            s = parts[name]
            torch.ops.dsv4ops.compress_forward(s["state"], s["x"], s["ape"], plan, None, kvs[name], s["D"], s["r"])
            torch.ops.dsv4ops.compress_norm_rope_store(kvs[name], plan, s["weight"], 1e-6, s["freqs"], s["out_loc"],
                                                       s["cache"], True, s["r"], 256 // s["r"], False, False)

    def step(name, s=None):
        s = s or parts[name]
        dk.decode_step(*decode_step_args(s, plans[name], kvs[name]))

    side = None if DRY_RUN else torch.cuda.Stream()

    def ratio4_pair(two_streams):
        if not two_streams:
            step("c4-main")
            step("c4-indexer")
            return
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            step("c4-indexer")
        step("c4-main")
        main.wait_stream(side)

    D128 = p128["D"]
    online_state = torch.cat([torch.randn(bs, D128), torch.rand(bs, D128) + 0.5, torch.randn(bs, D128)], 1).to(DEV)

    def online_c128():
        plan = torch.ops.dsv4ops.plan_online_decode(p128["rpi"], p128["seq"], 0)
        torch.ops.dsv4ops.compress_forward_online(online_state, p128["x"], p128["ape"], plan, None,
                                                  kvs["c128-main"], D128)
        torch.ops.dsv4ops.compress_norm_rope_store(kvs["c128-main"], plan, p128["weight"], 1e-6, p128["freqs"],
                                                   p128["out_loc"], p128["cache"], True, 128, 256 // 128, False, False)

    ratio128 = {  # name, config column, launch
        "ring": ("c4+indexer+c128", lambda: step("c128-main")),
        f"ring, {rare['boundary']} of {bs} at a boundary": ("c4+indexer+c128 rare", lambda: step("c128-main", rare)),
        "online": ("c4+indexer+c128 online", online_c128),
    }
    variants = [("whole decode step, unfused (8 launches)", "c4+indexer+c128", unfused)]
    for kind, (config, run128) in ratio128.items():
        for two_streams in (False,) if DRY_RUN else (False, True):
            name = f"whole decode step, fused, c128 {kind}" + (", indexer on a 2nd stream" if two_streams else "")
            variants.append((name, config, lambda two=two_streams, run128=run128: (ratio4_pair(two), run128())))
    variants.append(("decode step, c128 online alone (3 launches)", "c128-main online", online_c128))
    for name, config, fn in variants:
        try:
            us = bench(fn, rep=300)
        except Exception as e:  # noqa: BLE001 -- one variant failing (e.g. its capture) costs its row only
            if DRY_RUN:
                raise
            print(f"  {name} failed: {type(e).__name__}: {first_line(e)[:200]}", flush=True)
            torch.cuda.synchronize()
            continue
        record(Row(name, config, f"bs {bs}", bs, us, 0))
    launch_floor(bs)


def _sweep_tiles():
    from benchmarks import sweep

    # this module as it runs (``__main__`` under ``python -m``): its settings (DRY_RUN, COPY_BW, ...)
    sweep.sweep_tiles(sys.modules[__name__])


def run_train(quick):
    from benchmarks import train

    for r in train.run(quick):
        print(train._fmt(r), flush=True)
        ROWS.append(Row(r["op"], f"r{r['ratio']} D{r['D']} {r['dtype']}", f"{r['B']}x{r['T']}", r["B"] * r["T"],
                        r["triton_us"], r["bytes"], r["ref_eager_us"], r["ref_compiled_us"]))


def plot(out_dir):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    for ax, kind in zip(axes, ("prefill", "decode")):
        for op in sorted({r.op for r in ROWS if kind in r.op and r.bytes}):
            for config in CONFIGS:
                pts = sorted((r.tokens, r.gbps()) for r in ROWS if r.op == op and r.config == config
                             and (kind == "decode" or ("prefix 0" in r.shape and "/ 32 req" in r.shape)))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{op.split()[0]} {config}")
        ax.axhline(COPY_BW, color="k", linestyle="--", label=f"D2D copy {COPY_BW:.0f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens (32 requests, no prefix)" if kind == "prefill" else "batch size")
        ax.set_ylabel("effective GB/s (counted bytes / median time)")
        ax.set_title(f"{kind} on {_device_name()}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bandwidth.png"), dpi=110)


def replot(csv_path: str, out_dir: str, device_name: str) -> None:
    """``bandwidth.png`` from a CSV this script wrote (e.g. one fetched back from a GPU machine)."""
    global COPY_BW, _DEVICE_NAME
    with open(csv_path) as f:
        for r in csv.DictReader(f):
            ROWS.append(Row(r["op"], r["config"], r["shape"], int(r["tokens_or_bs"]), float(r["time_us"]),
                            int(r["bytes"])))
            if int(r["bytes"]) and float(r["pct_copy_bw"]) > 0:
                COPY_BW = float(r["GBps"]) * 100 / float(r["pct_copy_bw"])
    _DEVICE_NAME = device_name
    plot(out_dir)


_DEVICE_NAME = None


def _device_name() -> str:
    if _DEVICE_NAME:
        return _DEVICE_NAME
    return torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)"


def _configure_dry_run():
    global DRY_RUN, DEV, DECODE_MAX_LEN, DECODE_BATCHES, PREFILL_TOKENS, PREFILL_REQUESTS, PREFIXES, STEP_BATCH
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--dry-run runs the Triton kernels on the CPU: set TRITON_INTERPRET=1")
    fix_triton_interpreter()
    DRY_RUN, DEV = True, "cpu"
    DECODE_MAX_LEN, DECODE_BATCHES = 4096, (5,)
    PREFILL_TOKENS, PREFILL_REQUESTS, PREFIXES = (300,), (1, 3), (0, 10)
    STEP_BATCH = 4
    global REF_GATHER_LIMIT
    REF_GATHER_LIMIT = 64 << 19  # 64 plan rows of ratio 128 at D 512 (512 KB each): the chunked reference runs too


def _select(configs, batches, tokens):
    """Narrow the prefill and decode grids (``--configs``, ``--batches``, ``--tokens``), e.g. to spend
    a short device call on the rows a previous run did not reach; the sweep takes ``--configs`` too,
    the whole step keeps its shapes. ``--quick`` then thins what is left."""
    global GRID_CONFIGS, DECODE_BATCHES, PREFILL_TOKENS, SWEEP_TOKENS
    if configs:
        GRID_CONFIGS = tuple(configs)
    if batches:
        DECODE_BATCHES = tuple(batches)
    if tokens:
        PREFILL_TOKENS = SWEEP_TOKENS = tuple(tokens)


def main(argv=None):
    global COPY_BW, OUT_DIR, SWEEP_GROUPS
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a reduced grid that fits one 10-minute device call")
    parser.add_argument("--out", default="docs")
    parser.add_argument("--only", nargs="*", choices=["prefill", "decode", "step", "train", "sweep"], default=None)
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on the CPU (run with TRITON_INTERPRET=1): checks the script, times nothing")
    parser.add_argument("--replot", metavar="CSV", help="only draw <out>/bandwidth.png from a saved CSV")
    parser.add_argument("--device-name", default="NVIDIA H200", help="plot title with --replot")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), help="only these compressor configs")
    parser.add_argument("--batches", nargs="+", type=int, help=f"decode batch sizes (default {DECODE_BATCHES})")
    parser.add_argument("--tokens", nargs="+", type=int,
                        help=f"prefill token counts (default {PREFILL_TOKENS}); for the sweep, its prefill groups "
                             "at these counts with 32 requests instead of its own cases")
    parser.add_argument("--groups", metavar="REGEX",
                        help="sweep only the groups whose name matches, e.g. 'pipelined' or '^store'")
    args = parser.parse_args(argv)
    if args.replot:
        os.makedirs(args.out, exist_ok=True)
        return replot(args.replot, args.out, args.device_name)
    if args.dry_run:
        _configure_dry_run()
    _select(args.configs, args.batches, args.tokens)
    SWEEP_GROUPS = re.compile(args.groups) if args.groups else None
    OUT_DIR = args.out
    os.makedirs(OUT_DIR, exist_ok=True)
    csv_path = os.path.join(OUT_DIR, "benchmarks.csv")
    if os.path.exists(csv_path):
        os.remove(csv_path)
    torch.manual_seed(0)
    COPY_BW = float("nan") if DRY_RUN else copy_bandwidth()
    print(f"{_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"D2D copy {COPY_BW:.0f} GB/s (read + write)", flush=True)
    only = set(args.only or (["step", "prefill", "decode"] if DRY_RUN else ["step", "prefill", "decode", "train"]))
    t0 = time.time()
    for name, fn in (("sweep", _sweep_tiles), ("step", whole_decode_step), ("prefill", lambda: run_prefill(args.quick)),
                     ("decode", lambda: run_decode(args.quick)), ("train", lambda: run_train(args.quick))):
        if name in only:
            fn()
            print(f"[{name} done at {time.time() - t0:.0f} s]", flush=True)
    plot(OUT_DIR)
    print("saved", csv_path)


if __name__ == "__main__":
    main()
