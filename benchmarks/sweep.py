"""Launch-parameter sweep: ``python -m benchmarks.run --only sweep [--out DIR]``.

Times each launch parameter of the Triton kernels (tiles, rows per program, channel blocks,
warps, grid order, the ratio-128 step's plan launch, tile-by-tile ratio-128 pooling, pipelined
ratio-4 pooling) with the kernel alone replayed in a CUDA graph, on the shapes of the benchmark
grid, and prints every candidate's time and, per group, the fastest. The grid's setups, byte
counts, timing and settings come from ``benchmarks/run.py``, passed in as it runs (``__main__``
under ``python -m``). Each candidate is set for its timing only, and the module constants are restored after.
A GPU session makes the winners the defaults (``docs/performance.md``, "The sweep").
"""

from __future__ import annotations

import contextlib
import types

import torch

from dsv4ops.compress import kernels as ck
from dsv4ops.decode_step import kernels as dk
from dsv4ops.store import kernels as sk

SWEEP_C4 = [(16, 64, 4), (8, 64, 4), (8, 128, 4), (8, 64, 2), (4, 128, 4), (16, 64, 8), (32, 64, 8), (8, 32, 2)]
SWEEP_C128 = [(32, 32, 32, 4), (32, 32, 64, 4), (32, 32, 128, 4), (32, 64, 32, 8), (16, 32, 32, 2), (32, 32, 32, 8),
              (64, 32, 32, 8), (32, 16, 32, 4)]
#: ratio-128 pooling: plan rows per program (``C128_ROWS_PER_PROGRAM``)
SWEEP_C128_ROWS_PER_PROGRAM = [128, 64, 256]
#: ratio-128 streaming pool (``C128_STREAM_STAGES`` > 0): (tile, stages); the whole-window path
#: (stages 0, ``C128_TILE``) is the first candidate, to compare against
SWEEP_C128_STREAM = [((16, 32, 64, 2), 3), ((16, 64, 32, 4), 2), ((16, 64, 32, 4), 3), ((32, 32, 32, 4), 2),
                     ((32, 32, 32, 4), 3), ((32, 64, 32, 8), 2), ((16, 32, 32, 2), 2), ((16, 128, 32, 8), 2),
                     ((16, 64, 64, 4), 2), ((16, 64, 128, 4), 2), ((8, 128, 64, 4), 3), ((16, 32, 128, 2), 3),
                     # deeper pipelines: the streaming pool is at 55% of copy bandwidth with 3 tiles in flight
                     # (4 stages of the default tile and 6 of (8, 32, 128, 2) spill on sm_90; these do not)
                     ((16, 32, 64, 2), 4), ((16, 32, 128, 4), 4), ((8, 32, 128, 2), 4), ((16, 64, 128, 4), 4),
                     # one warp per program: the default's 2 warps split the tile's rows, so each of a
                     # tile's three reductions over rows (max, sum of e, sum of e * kv) crosses warps
                     # through shared memory (32 bar.sync in its sm_90 PTX, 6 with one warp); and the
                     # wider tiles, with more warps, were the slower ones. None of these spills (fp32
                     # in and out; registers 126-190, 10-16 programs per SM against the default's 8)
                     ((16, 32, 128, 1), 3), ((8, 32, 128, 1), 3), ((16, 16, 128, 1), 3), ((8, 16, 128, 1), 4),
                     ((16, 16, 64, 1), 3),
                     # one warp across 128 channels: each thread holds whole columns of a tile, so its
                     # reductions over rows need no shuffle at all: 0.50-0.56 warp-instructions per tile
                     # element in the fast loop's SASS against 1.09 for the default (4-row tiles: 128-133
                     # registers, 7-11 programs per SM; 8-row tiles: 202-212, 5-9; no spills)
                     ((4, 128, 32, 1), 3), ((4, 128, 32, 1), 4), ((8, 128, 32, 1), 3), ((8, 128, 32, 1), 2),
                     # one warp across 128 channels for each group of the window's rows (a fifth field,
                     # ``c128_tile``): the same 0.55-0.66 instructions per element, and 2-4 warps per
                     # window's channels, for plans whose windows are too few to give every SM enough
                     # warps (16K tokens: 512 warps of one; 4K: 128). Only tiles that spill neither
                     # fp32 nor bf16 in either grid order
                     ((2, 128, 32, 2, 2), 4), ((2, 128, 32, 2, 2), 6), ((4, 128, 32, 4, 4), 2),
                     ((2, 128, 32, 4, 4), 3),
                     # narrower grouped tiles (fp32: no spills; 0.98-1.13 instructions per element, 7-10
                     # programs per SM): more channel blocks, for the small plans
                     ((4, 64, 32, 2, 2), 4), ((16, 16, 64, 2, 2), 3), ((8, 32, 128, 2, 2), 3)]
#: ratio-4 pooling with row blocks in a pipelined loop (``C4_STREAM`` stages > 0): ((events,
#: channels, warps), row blocks per program, stages), rows-fastest grid; the one-block kernel
#: (stages 0) at ``SWEEP_C4_ONE_BLOCK``'s tile is the first candidate, to compare against
SWEEP_C4_STREAM = [((8, 32, 2), 4, 2), ((8, 32, 2), 4, 3), ((8, 32, 2), 2, 2), ((8, 32, 2), 8, 2), ((4, 32, 2), 8, 3),
                   ((4, 32, 2), 4, 2), ((4, 64, 2), 4, 2), ((8, 64, 4), 4, 2), ((8, 32, 4), 4, 3), ((16, 32, 4), 2, 2)]
#: the one-block ratio-4 kernel's tile per head_dim (the H200 sweep's best, fifth session)
SWEEP_C4_ONE_BLOCK = {512: (8, 32, 2), 128: (8, 64, 4)}
#: the same with the channel blocks of one row block together (``C4_CHANNELS_FASTEST``): the H100's
#: fastest D 512 candidates (2026-12-05; (4, 64, 2) x 4 x 2 is the D 512 default) and the indexer's
SWEEP_C4_STREAM_CHANNELS_FASTEST = [((8, 32, 2), 4, 2), ((4, 64, 2), 4, 2), ((8, 32, 2), 2, 2), ((8, 64, 4), 2, 2)]
#: prefill write pass (``WRITE_TILE``): (rows per block, columns per step); a program owns every
#: ``WRITE_PROGRAMS``-th block and copies only the blocks with a live row
SWEEP_WRITE_TILE = [(4, 1024), (8, 1024), (2, 1024), (16, 512), (8, 256)]
SWEEP_DECODE_BLOCK_D = {128: [32, 64, 16], 4: [128, 64, 256]}
SWEEP_C4_WARPS = {512: [8, 4, 16, 2], 128: [4, 2, 8, 1]}
#: ratio-4 decode kernel (``compress_forward`` decode): warps per program (``DECODE_WARPS[4]``), at
#: batch 1, the step's batch and 512. At 4 warps its pool tile (8 window rows x 256 channels for D
#: 512, x 128 for D 128) has warps along the rows, so the reductions over the window cross warps
#: (18 bar.sync in its sm_90 PTX); at 2 warps for D 512 and 1 for D 128 they stay in a warp (none)
SWEEP_C4_DECODE_WARPS = [4, 2, 1, 8]
#: ratio-128 decode at batch 1 and at the step's batch: (``DECODE_BLOCK_D[128]``, ``DECODE_WARPS[128]``)
SWEEP_C128_DECODE_WARPS = [(32, 4), (32, 8), (32, 2), (16, 4), (16, 2), (8, 2), (64, 8)]
SWEEP_STORE_BLOCK_M = [2, 4, 8, 16, 32]
#: store, prefill: strided row blocks per program (``PREFILL_BLOCKS``; 16 spills the main kernel)
SWEEP_STORE_BLOCKS = [1, 2, 4, 8]
#: store, prefill: (rows per block, row blocks per program, warps) with more warps than the default 4
#: (``STORE_WARPS``): the same tile over more threads, fewer registers each (sm_90, fp32 kv: main
#: 8 x 2 at 8 warps 98 registers against 128 at 4; 16 x 1 at 8 warps 88; indexer 16 x 1 at 8 warps 46, 32 x 1 48)
SWEEP_STORE_WARPS = {"main": [(8, 2, 4), (8, 2, 8), (16, 1, 8), (16, 2, 8), (8, 1, 8)],
                     "indexer": [(16, 1, 4), (16, 1, 2), (16, 1, 8), (32, 1, 8), (32, 1, 4), (64, 1, 8)]}
#: store, prefill: token counts (32 requests)
SWEEP_STORE_TOKENS = (16384, 65536)


@contextlib.contextmanager
def _using(*settings):
    """Each ``(target, key, value)``: ``target.key`` (a module constant) or ``target[key]`` (a table
    entry) set to ``value`` for the duration, then restored."""
    def swap(target, key, value):
        """Set ``target.key`` / ``target[key]`` to ``value``; return the old value."""
        if isinstance(target, dict):
            old, target[key] = target[key], value
        else:
            old = getattr(target, key)
            setattr(target, key, value)
        return old

    undo = []
    try:
        for target, key, value in settings:
            undo.append((target, key, swap(target, key, value)))
        yield
    finally:
        for target, key, old in reversed(undo):
            swap(target, key, old)


def c128_stream_label(stages: int, tile: tuple, rows_per_program: int) -> str:
    """The label of a streaming ratio-128 candidate (``benchmarks.sweep_winners`` parses it back)."""
    return f"C128_STREAM_STAGES {stages} C128_STREAM_TILE {tile} C128_ROWS_PER_PROGRAM {rows_per_program}"


def _wanted(grid, *names) -> bool:
    """Whether ``--groups`` (``grid.SWEEP_GROUPS``) matches any of the group ``names``."""
    return grid.SWEEP_GROUPS is None or any(grid.SWEEP_GROUPS.search(name) for name in names)


def _sweep(grid, name, nbytes, fn, candidates):
    """Time ``fn`` under each candidate ``(label, [(target, key, value), ...])`` (see ``_using``);
    print every time and, last, the fastest candidate. Groups whose name ``--groups`` does not match
    are skipped."""
    if not _wanted(grid, name):
        return
    results = []
    for label, settings in candidates:
        try:
            with _using(*settings):
                us = grid.bench(fn, rep=100)
        except Exception as error:  # a candidate the compiler rejects (or that spills out of memory)
            print(f"sweep {name}: {label}: failed: {str(error).splitlines()[0] if str(error) else type(error).__name__}",
                  flush=True)
            continue
        results.append((us, label))
        print(f"sweep {name}: {label}: {us:8.2f} us {nbytes / us / 1e3:7.0f} GB/s "
              f"{100 * nbytes / us / 1e3 / grid.COPY_BW:5.1f}%", flush=True)
    if results:
        us, label = min(results)
        print(f"best  {name}: {label}: {us:8.2f} us", flush=True)


def _without_large_c128(fn):
    """``fn`` with the ratio-128 pool's large-plan tile off (``C128_LARGE`` None), so that the tile a
    candidate sets is the one that runs at every plan size (the large tile is among the candidates)."""
    def call():
        with _using((ck, "C128_LARGE", None)):
            fn()
    return call


def _grid_orders():
    return [(f"CHANNELS_FASTEST {fastest}", [(ck, "CHANNELS_FASTEST", fastest)]) for fastest in (False, True)]


def _pool_orders():
    """Decode: the window loaded before the ring write, or after it (``DECODE_POOL_FIRST``)."""
    return [(f"DECODE_POOL_FIRST {first}", [(ck, "DECODE_POOL_FIRST", first)]) for first in (True, False)]


def sweep_tiles(grid):
    """Kernel-only timings (replayed in a CUDA graph, as the benchmark rows) of the launch parameters:
    the prefill pooling tiles and ratio 128's plan rows per program (ratio 4 main and indexer, ratio
    128; 4K and 16K tokens; at 64K only the grid order and the pipelined ratio-4 pool), the store's
    rows and row blocks per program (prefill, 16K and 64K tokens), the decode channel blocks
    (compress_forward decode; for ratio 128 also the fused step), ratio 128's decode channels x
    warps at batch 1 and 128, whether decode loads the window before the ring write
    (``DECODE_POOL_FIRST``; batch 128, and batch 1 for ratio 128), the warps of the ratio-4 fused
    step (batch 128) and of the ratio-4 decode kernel (batch 1, 128 and 512), and the order of the
    pooling and decode grids (``CHANNELS_FASTEST``), and
    whether ratio 128's fused step plans in a launch of its own (``C128_PLAN_LAUNCH``), ratio 128's
    prefill pooling tile by tile (``C128_STREAM_STAGES``) and ratio 4's with row blocks in a
    pipelined loop (``C4_STREAM``), and the prefill write pass's tile (``WRITE_TILE``). Each group
    ends with its fastest candidate."""
    candidates = _candidates(grid)
    # each pooling candidate timed as it is, without the large plans' launch (C4_LARGE) replacing it
    with _using(*[(ck.C4_LARGE, key, None) for key in ck.C4_LARGE]):
        _sweep_prefill(grid, candidates)
    _sweep_store(grid, candidates)
    _sweep_decode(grid, candidates)
    _sweep_c128_decode_latency(grid, candidates)
    _sweep_c4_decode_warps(grid, candidates)


def _candidates(grid):
    """The candidate lists (module constants ``SWEEP_*``), cut to two each in a dry run."""
    c = types.SimpleNamespace(
        # 64K tokens: only the grid order and the pipelined ratio-4 pool, the choices that may change
        # with the input's footprint (512 MB at ratio 4, D 512): per token, the H100's ratio-4 pools
        # ran 18-19% (D 512) and 4-10% (D 128) slower at 64K than at 16K
        cases=((16384, 1), (16384, 32), (4096, 1), (65536, 32)),
        c4=SWEEP_C4, c128=SWEEP_C128, rpps=SWEEP_C128_ROWS_PER_PROGRAM, block_ms=SWEEP_STORE_BLOCK_M,
        store_blocks=SWEEP_STORE_BLOCKS, store_tokens=SWEEP_STORE_TOKENS, store_warps=SWEEP_STORE_WARPS,
        streams=SWEEP_C128_STREAM, c4_streams=SWEEP_C4_STREAM,
        c4_streams_fastest=SWEEP_C4_STREAM_CHANNELS_FASTEST, block_ds=SWEEP_DECODE_BLOCK_D, warps=SWEEP_C4_WARPS,
        write_tiles=SWEEP_WRITE_TILE, decode_warps=SWEEP_C128_DECODE_WARPS, c4_decode_warps=SWEEP_C4_DECODE_WARPS,
        c4_decode_batches=(1, grid.STEP_BATCH, 512))
    if grid.SWEEP_TOKENS:  # --tokens: every prefill group at these sizes
        c.cases = tuple((tokens, 32) for tokens in grid.SWEEP_TOKENS)
    if grid.DRY_RUN:  # tiny shapes and two candidates each: every code path once, under the interpreter
        c.cases = ((grid.PREFILL_TOKENS[0], 32),)
        c.store_tokens = (grid.PREFILL_TOKENS[0],)
        c.c4_decode_batches = (1,)
        c.store_warps = {kind: tiles[:2] for kind, tiles in c.store_warps.items()}
        for name in ("c4", "c128", "block_ms", "store_blocks", "write_tiles", "decode_warps", "c4_decode_warps"):
            setattr(c, name, getattr(c, name)[:2])
        c.rpps, c.streams, c.c4_streams, c.c4_streams_fastest = [8], c.streams[:1], c.c4_streams[:1], \
            c.c4_streams_fastest[:1]
        c.block_ds, c.warps = ({k: v[:2] for k, v in table.items()} for table in (c.block_ds, c.warps))
    return c


def _sweep_prefill(grid, c):
    """The prefill groups: pooling tiles, grid order, write tile, pipelined ratio 4, streaming ratio
    128, and (32 requests) the store's row blocks."""
    for config in grid.GRID_CONFIGS:
        for tokens, requests in c.cases:
            large = tokens > 16384 and not grid.SWEEP_TOKENS  # sizes asked for get every group
            if large and grid.CONFIGS[config][0] != 4:
                continue
            shape = f"{config} {tokens} tok / {requests} req"
            groups = ("", "grid order, ", "write tile, ", "pipelined, ", "grid order, pipelined, ", "streaming, ")
            if not _wanted(grid, *(f"{group}prefill {shape}" for group in groups)):  # the groups below
                continue  # before the setup (a 64K-token prefill's state and input are 1.4 GB at ratio 4)
            s = grid.prefill_setup(config, tokens, requests, 0)
            r, D = s["r"], s["D"]
            out = torch.empty(s["plan_c"].shape[0], D, device=grid.DEV)
            nbytes = grid.compress_prefill_bytes(s)
            run = lambda: ck.compress_forward(s["state"], s["x"], s["ape"], s["plan_c"], s["plan_w"], out, D, r)  # noqa: E731
            if r == 128:
                run = _without_large_c128(run)
            if not large:
                if r == 4:
                    tiles = [(f"C4_TILE[{D}] {tile}", [(ck.C4_TILE, D, tile)]) for tile in c.c4]
                else:
                    pairs = [(tile, c.rpps[0]) for tile in c.c128] + [(ck.C128_TILE, rpp) for rpp in c.rpps[1:]]
                    tiles = [(f"C128_TILE {tile} C128_ROWS_PER_PROGRAM {rpp}",
                              [(ck, "C128_TILE", tile), (ck, "C128_ROWS_PER_PROGRAM", rpp)])
                             for tile, rpp in pairs]
                _sweep(grid, f"prefill {shape}", nbytes, run, tiles)
            if r == 4:  # ratio-4 pooling has a grid order of its own, per head_dim
                key = ck.c4_key(D)
                _sweep(grid, f"grid order, prefill {shape}", nbytes, run,
                       [(f"C4_CHANNELS_FASTEST[{key}] {fastest}", [(ck.C4_CHANNELS_FASTEST, key, fastest)])
                        for fastest in (False, True)])
            else:
                _sweep(grid, f"grid order, prefill {shape}", nbytes, run, _grid_orders())
            if not large:
                _sweep(grid, f"write tile, prefill {shape}", nbytes, run,
                       [(f"WRITE_TILE {tile}", [(ck, "WRITE_TILE", tile)]) for tile in c.write_tiles])
            if r == 4:  # one block of rows per program, against blocks in a pipelined loop, in each grid order

                def pipelined(tile, blocks, stages, fastest):
                    return [(ck.C4_STREAM, key, (stages, blocks)), (ck.C4_TILE, key, tile),
                            (ck.C4_CHANNELS_FASTEST, key, fastest)]

                one_block = SWEEP_C4_ONE_BLOCK[key]
                _sweep(grid, f"pipelined, prefill {shape}", nbytes, run,
                       [(f"C4_STREAM[{key}] (0, -) C4_TILE[{key}] {one_block} (one block per program)",
                         pipelined(one_block, 1, 0, False))]
                       + [(f"C4_STREAM[{key}] ({stages}, {blocks}) C4_TILE[{key}] {tile}",
                           pipelined(tile, blocks, stages, False))
                          for tile, blocks, stages in c.c4_streams])
                _sweep(grid, f"grid order, pipelined, prefill {shape}", nbytes, run,
                       [(f"C4_STREAM[{key}] ({stages}, {blocks}) C4_TILE[{key}] {tile} C4_CHANNELS_FASTEST[{key}] True",
                         pipelined(tile, blocks, stages, True))
                        for tile, blocks, stages in c.c4_streams_fastest])
            if r == 128:  # the whole window in registers, against tile-by-tile pooling (online softmax)
                _sweep(grid, f"streaming, prefill {shape}", nbytes, run,
                       [("C128_STREAM_STAGES 0 (whole window)", [(ck, "C128_STREAM_STAGES", 0)])]
                       + [(c128_stream_label(stages, tile, rpp),
                           [(ck, "C128_STREAM_STAGES", stages), (ck, "C128_STREAM_TILE", tile),
                            (ck, "C128_ROWS_PER_PROGRAM", rpp)])
                          for (tile, stages), rpp in [(stream, c.rpps[0]) for stream in c.streams]
                          + [(c.streams[0], rpp) for rpp in c.rpps[1:]]])
            del s, out
            torch.cuda.empty_cache()


def _sweep_store(grid, c):
    """The prefill store's rows per block and row blocks per program (``BLOCK_M``,
    ``PREFILL_BLOCKS``), then those with more warps (``STORE_WARPS``), 32 requests at each of
    ``c.store_tokens``."""
    for config in grid.GRID_CONFIGS:
        for tokens in c.store_tokens:
            name = f"store {config} {tokens} tok"
            warps_name = f"store warps {config} {tokens} tok"
            if not _wanted(grid, name, warps_name):
                continue  # before the setup, which is most of a 64K group's time
            s = grid.prefill_setup(config, tokens, 32, 0)
            r, D = s["r"], s["D"]
            kv, cache, fmt, freqs, w = grid.store_setup(s, s["plan_c"].shape[0])
            args = grid.prefill_store_args(s, kv, cache, freqs, w)
            kind = "main" if D == 512 else "indexer"
            decode_rows = sk.BLOCK_M[kind][1]
            store_bytes = grid.store_bytes(grid.plan_counts(s)[0], kv.shape[0], D, fmt)
            _sweep(grid, name, store_bytes, lambda: sk.norm_rope_store(*args),
                   [(f"BLOCK_M[{kind!r}] prefill {m} PREFILL_BLOCKS[{kind!r}, {r}] {blocks}",
                     [(sk.BLOCK_M, kind, (m, decode_rows)), (sk.PREFILL_BLOCKS, (kind, r), blocks)])
                    for m in c.block_ms for blocks in c.store_blocks if m * blocks <= 128])
            decode_warps = sk.STORE_WARPS[kind][1]
            _sweep(grid, warps_name, store_bytes, lambda: sk.norm_rope_store(*args),
                   [(f"BLOCK_M[{kind!r}] prefill {m} PREFILL_BLOCKS[{kind!r}, {r}] {blocks} STORE_WARPS {warps}",
                     [(sk.BLOCK_M, kind, (m, decode_rows)), (sk.PREFILL_BLOCKS, (kind, r), blocks),
                      (sk.STORE_WARPS, kind, (warps, decode_warps))])
                    for m, blocks, warps in c.store_warps[kind]])
            del s, kv, cache, args
            torch.cuda.empty_cache()


def _decode_runs(grid, s, bs):
    """(bytes, unfused, fused) of a decode setup: its byte count, and compress_forward decode and
    the fused decode step as functions of no arguments."""
    r, D = s["r"], s["D"]
    out = torch.empty(bs, D, device=grid.DEV)
    plan_buf = torch.empty(bs, 16, dtype=torch.uint8, device=grid.DEV)
    step_args = grid.decode_step_args(s, plan_buf, out)
    return (grid.compress_decode_bytes(s, bs),
            lambda: ck.compress_forward(s["state"], s["x"], s["ape"], s["plan"], None, out, D, r),
            lambda: dk.decode_step(*step_args))


def _sweep_decode(grid, c):
    """The decode groups at the whole step's batch (``STEP_BATCH``): channel blocks, grid order,
    window order, the ratio-4 fused step's warps, ratio 128's plan launch."""
    for config in grid.GRID_CONFIGS:
        bs = grid.STEP_BATCH
        s = grid.decode_setup(config, bs)
        r, D = s["r"], s["D"]
        nbytes, unfused, fused = _decode_runs(grid, s, bs)
        shape = f"{config} bs {bs} ({s['boundary']} at a boundary)"
        # ratio 128 pools over channel blocks in both the decode kernel and the fused step; ratio 4's
        # fused step is one program per request, whose warps are swept instead
        for name, fn in [("compress_forward decode", unfused)] + ([("fused decode step", fused)] if r == 128 else []):
            _sweep(grid, f"{name} {shape}", nbytes, fn,
                   [(f"DECODE_BLOCK_D[{r}] {b}", [(ck.DECODE_BLOCK_D, r, b)]) for b in c.block_ds[r]])
            _sweep(grid, f"grid order, {name} {shape}", nbytes, fn, _grid_orders())
        for name, fn in (("compress_forward decode", unfused), ("fused decode step", fused)):
            _sweep(grid, f"pool order, {name} {shape}", nbytes, fn, _pool_orders())
        if r == 4:
            _sweep(grid, f"fused decode step {shape}", nbytes, fused,
                   [(f"C4_WARPS[{D}] {w}", [(dk.C4_WARPS, D, w)]) for w in c.warps[D]])
        else:  # ratio 128's fused step: plan inside the pool programs, or as a launch of its own
            _sweep(grid, f"plan launch, fused decode step {shape}", nbytes, fused,
                   [(f"C128_PLAN_LAUNCH {v}", [(dk, "C128_PLAN_LAUNCH", v)]) for v in (False, True)])
        del s, unfused, fused


def _sweep_c128_decode_latency(grid, c):
    """Ratio 128 at batch 1, its row at a boundary: ``head_dim / DECODE_BLOCK_D[128]`` programs (16 for
    D 512) each pool a 128-row window, a latency. Channels and warps per program against it, and the
    same candidates at the step's batch, where the boundary rows fill the GPU; the window order at
    batch 1."""
    for config in grid.GRID_CONFIGS:
        if grid.CONFIGS[config][0] != 128:
            continue
        for bs in (1, grid.STEP_BATCH):
            s = grid.decode_setup(config, bs, boundaries=1 if bs == 1 else None)
            nbytes, unfused, fused = _decode_runs(grid, s, bs)
            shape = f"{config} bs {bs} ({s['boundary']} at a boundary)"
            for name, fn in (("compress_forward decode", unfused), ("fused decode step", fused)):
                _sweep(grid, f"warps, {name} {shape}", nbytes, fn,
                       [(f"DECODE_BLOCK_D[128] {b} DECODE_WARPS[128] {w}",
                         [(ck.DECODE_BLOCK_D, 128, b), (ck.DECODE_WARPS, 128, w)]) for b, w in c.decode_warps])
                if bs == 1:
                    _sweep(grid, f"pool order, {name} {shape}", nbytes, fn, _pool_orders())
            del s, unfused, fused


def _sweep_c4_decode_warps(grid, c):
    """Ratio 4's decode kernel (``compress_forward`` decode, unfused) by warps per program
    (``DECODE_WARPS[4]``, per head_dim), at batch 1 (its row at a boundary), the step's
    batch and 512: one program per request and channel block, a chain of dependent loads."""
    for config in grid.GRID_CONFIGS:
        if grid.CONFIGS[config][0] != 4:
            continue
        for bs in c.c4_decode_batches:
            group = f"warps, compress_forward decode {config} bs {bs}"
            if not _wanted(grid, group):
                continue  # before the setup
            s = grid.decode_setup(config, bs, boundaries=1 if bs == 1 else None)
            key = ck.c4_key(s["D"])
            nbytes, unfused, _ = _decode_runs(grid, s, bs)
            _sweep(grid, f"{group} ({s['boundary']} at a boundary)", nbytes, unfused,
                   [(f"DECODE_WARPS[4][{key}] {w}", [(ck.DECODE_WARPS[4], key, w)]) for w in c.c4_decode_warps])
            del s, unfused
