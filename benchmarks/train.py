"""H200 benchmark of the training ops: forward + backward, Triton vs PyTorch reference (eager, torch.compile).

    python -m benchmarks.train [--quick] [--sweep] [--csv PATH]

For every configuration (ratio 128 and 4, D = 512, B x T = 1 x 8192 and 4 x 8192, fp32 and
bf16 ``kv_score``/``ape``) it times the median GPU time, replayed in a CUDA graph with
``triton.testing.do_bench_cudagraph``, of:

* ``fwd+bwd`` (column ``triton``): ``torch.autograd.grad(op(x, ape), (x, ape), g)`` -- the
  training step as autograd runs it, for the dsv4ops op (Triton kernels), the PyTorch
  reference through aten autograd (``ref_eager``) and ``torch.compile`` of that reference
  (``ref_compiled``: Inductor compiles the forward and, through AOTAutograd, the backward);
* ``fwd`` and ``bwd`` alone for the Triton kernels (direct launches, no autograd);
* ``triton_host``: the dsv4ops ``fwd+bwd`` with ``do_bench`` and no graph, i.e. what an eager
  training loop pays when the host (custom-op dispatch, autograd) is slower than the GPU.

The first H200 run (2026-12-03) timed everything with ``do_bench``: every fwd+bwd figure
(dsv4ops 550-921 us, references 507-1864 us) was dominated by host work, against 19-26 us forward and
57-146 us backward for the kernels alone.

Bytes moved (each tensor read or written once): forward reads the complete chunks of
``kv_score`` and ``ape`` and writes ``out``; backward reads ``kv_score``, ``ape`` and
``grad_out`` and writes ``grad_kv_score`` (every row) and ``grad_ape``. Effective GB/s =
bytes / median time. The ordered ``d ape`` workspace is not counted (it is overhead).

Published anchor: cuDNN-frontend's fused compressor kernel on a B200 does ratio 128,
1 x 8192 tokens, d 512 forward + backward in 33 us (fp32 would be 2 x 32 MiB read
+ 32 MiB written there, i.e. ~3 TB/s; the H200's HBM3e peaks at 4.8 TB/s).

Importing this module needs no GPU; ``run`` does.
"""

from __future__ import annotations

import argparse
import csv
import itertools

import torch

RATIOS = (128, 4)
SHAPES = ((1, 8192), (4, 8192))
DTYPES = (torch.float32, torch.bfloat16)
HEAD_DIM = 512
ANCHOR = "cuDNN-frontend fused kernel, B200, ratio 128, 1x8192, d 512: 33 us fwd+bwd"


def _bench(fn, quick: bool, graph: bool = True) -> float:
    """Median microseconds of ``fn`` (``timing.median_us``): replayed in a CUDA graph (autograd's
    backward included, captured as ``make_graphed_callables`` captures it), falling back to
    ``do_bench`` with a note if it cannot be captured; ``graph=False``: ``do_bench`` of the plain call."""
    from .timing import median_us

    return median_us(fn, rep=50 if quick else 200, graph=graph, fallback=True, warmup=10 if quick else 25)


def compress_bytes(B: int, T: int, D: int, r: int, dtype: torch.dtype) -> dict:
    es = torch.empty((), dtype=dtype).element_size()
    c = 2 if r == 4 else 1
    W = 8 if r == 4 else r
    N = T // r
    x_used = B * N * r * 2 * c * D * es
    x_all = B * T * 2 * c * D * es
    ape = W * D * es
    out = B * N * D * es
    fwd = x_used + ape + out
    bwd = x_used + ape + out + x_all + ape
    return dict(fwd=fwd, bwd=bwd, total=fwd + bwd)


def _inputs(B, T, D, r, dtype, device="cuda"):
    c = 2 if r == 4 else 1
    W = 8 if r == 4 else r
    x = torch.randn(B, T, 2 * c * D, device=device, dtype=torch.float32)
    x[..., c * D :] *= 2
    x = x.to(dtype).requires_grad_(True)
    ape = torch.randn(W, D, device=device).to(dtype).requires_grad_(True)
    g = torch.randn(B, T // r, D, device=device).to(dtype)
    return x, ape, g


def _compress_rows(quick: bool) -> list:
    from dsv4ops.train import compress_train
    from dsv4ops.train import kernels as tk
    from dsv4ops.train.reference import compress_train_reference

    compiled_ref = torch.compile(compress_train_reference, dynamic=False)
    rows = []
    for r, (B, T), dtype in itertools.product(RATIOS, SHAPES, DTYPES):
        if quick and (B, T) != (1, 8192):
            continue
        D = HEAD_DIM
        x, ape, g = _inputs(B, T, D, r, dtype)
        nbytes = compress_bytes(B, T, D, r, dtype)

        def step(fn):
            return lambda: torch.autograd.grad(fn(x, ape), (x, ape), g)

        op = step(lambda a, b: compress_train(a, b, compress_ratio=r))
        eager = step(lambda a, b: compress_train_reference(a, b, D, r))
        comp = step(lambda a, b: compiled_ref(a, b, D, r))
        xd, ad = x.detach(), ape.detach()
        times = dict(
            triton=_bench(op, quick),
            triton_host=_bench(op, quick, graph=False),
            fwd=_bench(lambda: tk.compress_train(xd, ad, D, r), quick),
            bwd=_bench(lambda: tk.compress_train_backward(g, xd, ad, D, r), quick),
            ref_eager=_bench(eager, quick),
            ref_compiled=_bench(comp, quick),
        )
        row = _row("compress_train", r, B, T, D, dtype, nbytes["total"], times)
        row["fwd_GBps"] = nbytes["fwd"] / times["fwd"] / 1e3
        row["bwd_GBps"] = nbytes["bwd"] / times["bwd"] / 1e3
        rows.append(row)
        print(_fmt(row), flush=True)
    return rows


def _norm_rope_rows(quick: bool) -> list:
    from dsv4ops.layer import rope_freqs_table
    from dsv4ops.train import norm_rope
    from dsv4ops.train.reference import norm_rope_reference

    compiled_ref = torch.compile(norm_rope_reference, dynamic=False)
    freqs = rope_freqs_table(65536).cuda()
    rows = []
    for n, dtype in itertools.product((2048, 8192, 65536), DTYPES):
        if quick and n != 8192:
            continue
        D = HEAD_DIM
        x = torch.randn(n, D, device="cuda").to(dtype).requires_grad_(True)
        w = torch.randn(D, device="cuda").to(dtype).requires_grad_(True)
        pos = torch.randint(0, 65536, (n,), device="cuda")
        g = torch.randn(n, D, device="cuda").to(dtype)
        es = x.element_size()
        # fwd: read x, w, freqs rows, positions, write y; bwd: read grad_y, x, w, freqs rows, positions,
        # write grad_x, grad_w
        nbytes = (5 * n * D + 3 * D) * es + 2 * n * (64 * 4 + 8)

        def step(fn):
            return lambda: torch.autograd.grad(fn(x, w, 1e-6, freqs, pos), (x, w), g)

        times = dict(triton=_bench(step(norm_rope), quick), triton_host=_bench(step(norm_rope), quick, graph=False),
                     ref_eager=_bench(step(norm_rope_reference), quick),
                     ref_compiled=_bench(step(compiled_ref), quick))
        row = _row("norm_rope", 0, 1, n, D, dtype, nbytes, times)
        rows.append(row)
        print(_fmt(row), flush=True)
    return rows


def _row(op: str, ratio: int, B: int, T: int, D: int, dtype, nbytes: int, times: dict) -> dict:
    """One result row: times (``<name>_us``), forward + backward GB/s and speedups over the references."""
    row = dict(op=op, ratio=ratio, B=B, T=T, D=D, dtype=str(dtype).replace("torch.", ""), bytes=nbytes,
               **{f"{k}_us": v for k, v in times.items()})
    row["triton_GBps"] = nbytes / times["triton"] / 1e3
    row["speedup_vs_eager"] = times["ref_eager"] / times["triton"]
    row["speedup_vs_compiled"] = times["ref_compiled"] / times["triton"]
    return row


def _fmt(row: dict) -> str:
    head = f"{row['op']:15s} r{row['ratio']:<3d} {row['B']}x{row['T']:<6d} D{row['D']} {row['dtype']:8s}"
    parts = [f"{k[:-3]} {v:8.1f} us" for k, v in row.items() if k.endswith("_us")]
    return head + " | " + " | ".join(parts) + f" | {row['triton_GBps']:7.0f} GB/s fwd+bwd"


def sweep(quick: bool = True) -> list:
    """Time the Triton kernels (fwd, bwd) for a few tile choices per ratio; prints the best."""
    from dsv4ops.train import kernels as tk

    fwd_tiles = {4: [(8, 8, 64, 4), (16, 8, 64, 4), (32, 8, 64, 8), (16, 8, 32, 2), (16, 8, 64, 8), (4, 8, 64, 2)],
                 128: [(1, 32, 64, 4), (1, 16, 64, 2), (1, 32, 32, 2), (1, 32, 128, 4), (2, 16, 64, 4), (1, 32, 64, 8)]}
    bwd_tiles = {4: [(8, 8, 64, 4), (16, 8, 64, 8), (16, 8, 64, 4), (32, 8, 64, 8), (8, 8, 32, 2), (8, 8, 64, 8)],
                 128: [(4, 16, 32, 4), (2, 16, 64, 4), (2, 32, 64, 8), (1, 32, 64, 4), (2, 32, 32, 4), (4, 16, 64, 8)]}
    out = []
    saved = dict(tk.POOL_FWD_TILE), dict(tk.POOL_BWD_TILE)
    try:
        for r, (B, T), dtype in itertools.product(RATIOS, SHAPES, DTYPES):
            x, ape, g = _inputs(B, T, HEAD_DIM, r, dtype)
            x, ape = x.detach(), ape.detach()
            nb = compress_bytes(B, T, HEAD_DIM, r, dtype)
            for tile in fwd_tiles[r]:
                tk.POOL_FWD_TILE[r] = tile
                us = _bench(lambda: tk.compress_train(x, ape, HEAD_DIM, r), quick)
                out.append(dict(kind="fwd", ratio=r, B=B, dtype=str(dtype), tile=tile, us=us, GBps=nb["fwd"] / us / 1e3))
                print(out[-1], flush=True)
            for tile in bwd_tiles[r]:
                tk.POOL_BWD_TILE[r] = tile
                us = _bench(lambda: tk.compress_train_backward(g, x, ape, HEAD_DIM, r), quick)
                out.append(dict(kind="bwd", ratio=r, B=B, dtype=str(dtype), tile=tile, us=us, GBps=nb["bwd"] / us / 1e3))
                print(out[-1], flush=True)
            tk.POOL_FWD_TILE.update(saved[0])
            tk.POOL_BWD_TILE.update(saved[1])
    finally:
        tk.POOL_FWD_TILE.update(saved[0])
        tk.POOL_BWD_TILE.update(saved[1])
    return out


def run(quick: bool) -> list:
    """All benchmark rows (list of dicts); needs CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("benchmarks.train needs a CUDA device")
    import dsv4ops.train  # noqa: F401

    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | anchor: {ANCHOR}")
    return _compress_rows(quick) + _norm_rope_rows(quick)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="time tile choices of the compress kernels instead")
    parser.add_argument("--csv", default=None, help="write the rows to this CSV file")
    args = parser.parse_args(argv)
    rows = sweep(args.quick) if args.sweep else run(args.quick)
    if args.csv and rows:
        keys = list(dict.fromkeys(k for row in rows for k in row))
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
        print("saved", args.csv)


if __name__ == "__main__":
    main()
