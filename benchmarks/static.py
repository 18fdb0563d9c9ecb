"""What the sweep's candidates compile to on sm_90 (H100/H200), without a GPU: registers, spills,
``bar.sync`` barriers in the PTX, shared memory, the programs per SM that registers and shared
memory allow, and for the ratio-128 pool the warp-instructions its tile loops issue per element.
A reduction over a tile's rows whose warps lie along the rows (Triton's ``warpsPerCTA``, in the
``ttgir``) crosses warps, through shared memory and a barrier: fewer barriers, fewer such waits.

    python -m benchmarks.static                    # all: ratio-128 prefill tiles, ratio-4 decode warps,
                                                   # the fused ratio-4 decode step's warps
    python -m benchmarks.static --kernels decode   # one of them (c128, decode, fused)

fp32 state, input, ape and output (the benchmark's tensors), D 512 (and D 128 for ratio-4 decode).
The candidates are the sweep's (``SWEEP_C128_STREAM``, ``SWEEP_C4_DECODE_WARPS``,
``SWEEP_C4_WARPS``), after the current default; the fused step with FP8 caches (main and indexer)
and SWA-paged addressing. Uses Triton's bundled ptxas and cuobjdump, as ``tests/test_kernels_compile.py``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from dsv4ops._layout import Addressing, CacheFormat, CacheLayout
from dsv4ops.compress import kernels as ck
from dsv4ops.decode_step import kernels as dk

from . import sweep

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from _sm90 import compile_for_sm90, innermost_loops, resource_usage  # noqa: E402

REGISTERS_PER_SM = 65536
#: shared memory an SM can give its programs on sm_90, and what the driver reserves per program
SHARED_PER_SM, SHARED_PER_PROGRAM = 233472, 1024
FP32 = dict(state_ptr="*fp32", input_ptr="*fp32", ape_ptr="*fp32", plan_ptr="*i32", out_ptr="*fp32")


def describe(compiled, num_warps: int) -> str:
    usage = resource_usage(compiled)
    if usage is None:
        raise SystemExit("needs Triton's bundled ptxas and cuobjdump")
    allocated = -(-usage["reg"] // 8) * 8 * 32 * num_warps  # registers are allocated 8 per thread at a time
    by_shared = SHARED_PER_SM // (compiled.metadata.shared + SHARED_PER_PROGRAM)
    return (f"registers {usage['reg']:3d}  spills {usage['spill_stores']:3d} B  bar.sync "
            f"{len(re.findall(r'bar[.]sync', compiled.asm['ptx'])):2d}  shared {compiled.metadata.shared:6d} B  "
            f"programs/SM {min(REGISTERS_PER_SM // allocated, by_shared):2d}")


def ratio128_tiles():
    types = dict(FP32, num_events="i32", num_state_rows="i64", num_inputs="i32", num_programs="i32")
    default = (ck.C128_STREAM_TILE, ck.C128_STREAM_STAGES)
    for tile, stages in [default] + [c for c in sweep.SWEEP_C128_STREAM if c != default]:
        rows, channels, chunk, warps, groups = ck.c128_tile(tile)
        compiled = compile_for_sm90(ck._pool_c128_kernel, types, dict(
            HEAD_DIM=512, BLOCK_W=rows, BLOCK_D=channels, CHUNK=chunk, CHANNELS_FASTEST=ck.CHANNELS_FASTEST,
            STAGES=stages, ROW_GROUPS=groups), warps)
        large = ck.C128_LARGE and (tile, stages) == (ck.C128_LARGE[1], ck.C128_LARGE[2])
        mark = "  (default)" if (tile, stages) == default else f"  (from {ck.C128_LARGE[0]} plan rows)" if large else ""
        # the two tile loops, input only (most windows) and with ring rows, as warp-instructions
        # per tile element: each warp issues the loop's instructions once per tile
        per_element = "/".join(f"{n * warps / (rows * channels * groups):.2f}"
                               for n in innermost_loops(compiled)[:2])
        print(f"ratio-128 pool {str(tile):21s} x {stages} stages: {describe(compiled, warps)}  "
              f"tile loops {per_element} instr/element{mark}", flush=True)


def ratio4_decode_warps():
    types = dict(FP32, num_state_rows="i64")
    for head_dim in (512, 128):
        default = ck.decode_warps(4, head_dim)
        block_d = ck._channel_block(head_dim, ck.DECODE_BLOCK_D[4])
        for warps in [default] + [w for w in sweep.SWEEP_C4_DECODE_WARPS if w != default]:
            compiled = compile_for_sm90(ck._decode_kernel, types, dict(
                HEAD_DIM=head_dim, RATIO=4, BLOCK_D=block_d, BLOCK_W=8, CHANNELS_FASTEST=ck.CHANNELS_FASTEST,
                POOL_FIRST=ck.DECODE_POOL_FIRST), warps)
            mark = "  (default)" if warps == default else ""
            print(f"ratio-4 decode D {head_dim:3d}, {block_d} channels, {warps} warps: {describe(compiled, warps)}{mark}",
                  flush=True)


def fused_ratio4_step_warps():
    types = dict(FP32, rpi_ptr="*i64", seq_ptr="*i64", weight_ptr="*fp32", freqs_ptr="*fp32", out_loc_ptr="*i64",
                 cache_ptr="*u8", bs="i32", num_state_rows="i64", num_locs="i32", num_freq_rows="i32",
                 num_pages="i32", eps="fp32", log2_page="i32", page_bytes="i32", r2t_ptr="*i32", r2t_stride="i32",
                 num_reqs="i32", max_len="i32", f2s_ptr="*i64", num_full="i32", sps="i32", ring="i32")
    for head_dim, fmt in ((512, CacheFormat(0)), (128, CacheFormat(2))):
        layout = CacheLayout(fmt, 64)
        default = dk.C4_WARPS[head_dim]
        for warps in [default] + [w for w in sweep.SWEEP_C4_WARPS[head_dim] if w != default]:
            compiled = compile_for_sm90(dk._decode_step_c4_kernel, types, dict(
                HEAD_DIM=head_dim, ADDRESSING=int(Addressing.SWA_PAGED), HAS_TABLE=True, FLAG=False,
                SLOT_BYTES=layout.slot_bytes, SCALE_STRIDE=layout.scale_stride, POOL_FIRST=ck.DECODE_POOL_FIRST,
                HW_CAST=True), warps, multiples_of_16=("page_bytes",))
            mark = "  (default)" if warps == default else ""
            print(f"fused ratio-4 step D {head_dim:3d}, {warps:2d} warps: {describe(compiled, warps)}{mark}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", choices=["c128", "decode", "fused", "all"], default="all")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("compiles for sm_90: run it without TRITON_INTERPRET=1")
    if args.kernels in ("c128", "all"):
        ratio128_tiles()
    if args.kernels in ("decode", "all"):
        ratio4_decode_warps()
    if args.kernels in ("fused", "all"):
        fused_ratio4_step_warps()


if __name__ == "__main__":
    main()
