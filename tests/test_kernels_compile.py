"""Every Triton kernel variant compiles for sm_90 (H100/H200), checked on any machine.

The Triton interpreter accepts programs the GPU compiler rejects (non-constexpr
globals, reassigned constexprs, ...). Compiling to cubin with Triton's bundled
ptxas needs no GPU, so CI catches those without one; every variant must also compile
without spills (``tests/_sm90.py``). The kernels must be imported with ``TRITON_INTERPRET``
unset, so ``test_all_kernels_compile_for_sm90`` runs this file's ``variant`` tests in a
clean subprocess.
"""

from __future__ import annotations

import re

import pytest

from _sm90 import compile_sm90 as _compile, fused_fp32_multiply_adds, run_variants_in_subprocess


def test_all_kernels_compile_for_sm90():
    run_variants_in_subprocess(__file__)


from dsv4ops._layout import CacheFormat, CacheLayout  # noqa: E402


def _kernels():
    from dsv4ops.compress import kernels as ck
    from dsv4ops.planner import kernels as pk
    from dsv4ops.store import kernels as sk

    return ck, pk, sk


STORE_VARIANTS = [(0, 512), (1, 512), (2, 128), (3, 128)]
#: the ratio-128 tile-by-tile pool in row groups (``ROW_GROUPS`` > 1, not a default): (stages, tile),
#: two groups of 64 window rows, one warp across 128 channels each (with 4-row tiles, the bf16 build
#: spills 4-16 bytes)
ROW_GROUPS_TILE = (4, (2, 128, 32, 2, 2))
#: page_bytes = page_size x bytes per token (584, 1024, 132 or 68): a multiple of 16 for every format
#: once page_size >= 4 (DeepSeek-V4 uses 64 for ratio 4, and 2 for ratio 128, where 2 x 584 = 1168 is
#: one too), so real launches specialize it; the codes are then stored 16 bytes at a time
PAGE_BYTES_ALIGNED = ("page_bytes",)


@pytest.mark.parametrize("fmt,head_dim", STORE_VARIANTS)
@pytest.mark.parametrize("is_decode,ratio", [(True, 4), (False, 4), (False, 128)])
def test_variant_store_kernel(fmt, head_dim, is_decode, ratio):
    ck, pk, sk = _kernels()
    types = dict(kv_ptr="*fp32", plan_ptr="*i32", weight_ptr="*fp32", freqs_ptr="*fp32", out_loc_ptr="*i64",
                 cache_ptr="*u8", num_rows="i32", num_locs="i32", num_freq_rows="i32", num_pages="i32", eps="fp32",
                 log2_page="i32", page_bytes="i32")
    layout = CacheLayout(CacheFormat(fmt), 64)
    main = head_dim == 512
    kind = "main" if main else "indexer"
    block_m, blocks, warps = sk.launch_shape(kind, is_decode, ratio)
    flag = dict(BF16=fmt == 1) if main else dict(FP4=fmt == 3)
    consts = dict(**flag, IS_DECODE=is_decode, RATIO=ratio, SLOT_BYTES=layout.slot_bytes,
                  SCALE_STRIDE=layout.scale_stride, BLOCK_M=block_m, BLOCKS=blocks)
    # the GPU's fp8 conversion (what a launch on a GPU uses) and the integer rounding the interpreter runs
    for hw_cast in (True, False):
        compiled = _compile(sk._store_main_kernel if main else sk._store_indexer_kernel, types,
                            dict(consts, HW_CAST=hw_cast), warps, multiples_of_16=PAGE_BYTES_ALIGNED)
        if hw_cast and fmt in (0, 2):  # e4m3 codes: the saturating conversion, which the kernels rely on
            conversions = set(re.findall(r"cvt\.[\w.]*e4m3[\w.]*", compiled.asm["ptx"]))
            assert conversions == {"cvt.rn.satfinite.e4m3x2.f32"}, conversions
        # the reference rounds every fp32 product before it is added: a contracted multiply-add
        # (Triton lets LLVM fuse them, and ptxas fuses a plain mul.f32 into an add.f32 by itself)
        # skips that rounding and changes bytes on the GPU only, as the fourteenth session's Hadamard
        # did (the interpreter does not fuse). fp64 fmas are exact here (fp32 values widened to fp64:
        # their products need 48 bits), and so is the integer e4m3 path's a * 512 + 2^23 (a
        # power-of-two product; the only fp32 fma the PTX may have, and only without HW_CAST)
        fused = [f for f in fused_fp32_multiply_adds(compiled) or [] if not f.endswith(", 8388608 ;")]
        assert not fused, f"{len(fused)} fused fp32 multiply-adds in the SASS: {fused[:4]}"
        if hw_cast:
            fused = re.findall(r"fma\.rn\.f32", compiled.asm["ptx"])
            assert not fused, f"{len(fused)} contracted fp32 multiply-adds in the PTX"


@pytest.mark.parametrize("ratio,head_dim", [(4, 512), (4, 128), (128, 512), (128, 64)])
@pytest.mark.parametrize("state,inp,out", [("fp32", "fp32", "fp32"), ("bf16", "bf16", "bf16")])
@pytest.mark.parametrize("channels_fastest", [False, True], ids=["rows-fastest", "channels-fastest"])
def test_variant_compress_kernels(ratio, head_dim, state, inp, out, channels_fastest):
    ck, pk, sk = _kernels()
    ptrs = dict(state_ptr=f"*{state}", input_ptr=f"*{inp}", ape_ptr="*fp32", plan_ptr="*i32", out_ptr=f"*{out}")
    for pool_first in (True, False):  # DECODE_POOL_FIRST, and the order the sweep compares it with
        _compile(ck._decode_kernel, dict(ptrs, num_state_rows="i64"),
                 dict(HEAD_DIM=head_dim, RATIO=ratio, BLOCK_D=ck._channel_block(head_dim, ck.DECODE_BLOCK_D[ratio]),
                      BLOCK_W=8 if ratio == 4 else 32, CHANNELS_FASTEST=channels_fastest, POOL_FIRST=pool_first),
                 ck.decode_warps(ratio, head_dim))
    counts = dict(ptrs, num_events="i32", num_state_rows="i64", num_inputs="i32")
    if ratio == 4:
        events, channels, warps = ck.c4_tile(head_dim)
        # one block per program, and blocks in a pipelined loop (C4_STREAM's (stages, blocks); (2, 4) where off)
        pipelined = ck.c4_stream(head_dim) if ck.c4_stream(head_dim)[0] else (2, 4)
        launches = [((events, channels, warps), stream) for stream in ((0, 1), pipelined)]
        large = ck.C4_LARGE[ck.c4_key(head_dim)]
        if large is not None:  # the large plans' launch too
            [(_, tile, stream, _)] = ck.c4_launches(head_dim, large[0])
            launches.append((tile, stream))
        for (events, channels, warps), (stages, blocks) in launches:
            _compile(ck._pool_c4_kernel, counts,
                     dict(HEAD_DIM=head_dim, BLOCK_E=events, BLOCK_D=ck._channel_block(head_dim, channels),
                          BLOCKS=blocks, STAGES=stages, CHANNELS_FASTEST=channels_fastest), warps)
    else:
        # the whole-window path, the streaming one (online softmax, pipelined tile loop) at the
        # default stage count, the large plans' tile (C128_LARGE), and, where 128 channels divide D,
        # the streaming pool in row groups, one warp each (ROW_GROUPS_TILE above)
        streaming = (ck.C128_STREAM_STAGES or 2, ck.C128_STREAM_TILE)
        _, large_tile, large_stages = ck.c128_launches(head_dim, 1 << 30)[0]  # what a large plan takes
        large = [(large_stages, large_tile)] if (large_stages, large_tile) != streaming else []
        groups = [ROW_GROUPS_TILE] if head_dim % 128 == 0 else []
        for stages, tile in [(0, ck.C128_TILE), streaming] + large + groups:
            rows, channels, chunk, warps, row_groups = ck.c128_tile(tile)
            _compile(ck._pool_c128_kernel, dict(counts, num_programs="i32"),
                     dict(HEAD_DIM=head_dim, BLOCK_W=rows, BLOCK_D=ck._channel_block(head_dim, channels),
                          CHUNK=chunk, CHANNELS_FASTEST=channels_fastest, STAGES=stages,
                          ROW_GROUPS=row_groups if stages else 1), warps)
    width = (4 if ratio == 4 else 2) * head_dim
    block_r, block_c = ck.WRITE_TILE
    _compile(ck._write_kernel,
             dict(state_ptr=f"*{state}", input_ptr=f"*{inp}", plan_ptr="*i32", num_writes="i32", num_state_rows="i64",
                  num_inputs="i32", num_programs="i32"),
             dict(WIDTH=width, BLOCK_R=block_r, BLOCK_C=min(block_c, width), CHUNK=ck.WRITE_CHUNK))


@pytest.mark.parametrize("ratio,addressing", [(4, 0), (4, 2), (128, 0), (128, 1), (128, 2)])
def test_variant_planner_kernels(ratio, addressing):
    ck, pk, sk = _kernels()
    lookup = dict(r2t_ptr="*i32", r2t_stride="i32", num_reqs="i32", max_len="i32", f2s_ptr="*i64", num_full="i32",
                  sps="i32", ring="i32")
    meta = dict(RATIO=ratio, ADDRESSING=addressing, HAS_TABLE=addressing != 2)
    _compile(pk._plan_decode_kernel, dict(lookup, rpi_ptr="*i64", seq_ptr="*i64", plan_ptr="*i32", bs="i32"),
             dict(meta, BLOCK=pk.DECODE_BLOCK))
    for index, table in (("*i64", "*i32"), ("*i32", "*i64")):  # int64 or int32 lengths / ids / tables
        rows = dict(lookup, plan_c_ptr="*i32", plan_w_ptr="*i32", num_q_tokens="i32", bs="i32", rpi_ptr=index,
                    seq_ptr=index, ext_ptr=index, spec_pad="i32", offset="i32", r2t_ptr=table, f2s_ptr=index)
        _compile(pk._plan_prefill_kernel, rows, dict(meta, ONLINE=False, ROWS=pk.ROWS, CHUNK=pk.CHUNK))


@pytest.mark.parametrize("head_dim", [512, 64])
def test_variant_online_kernels(head_dim):
    from dsv4ops.online import kernels as ok
    from dsv4ops.planner import kernels as pk

    _compile(ok._plan_online_decode_kernel, dict(rpi_ptr="*i64", seq_ptr="*i64", plan_ptr="*i32", bs="i32", offset="i32"),
             dict(BLOCK=pk.DECODE_BLOCK))
    # the online launch: placeholder lookup tables (never read), as plan_online_prefill passes them
    _compile(pk._plan_prefill_kernel, dict(plan_c_ptr="*i32", plan_w_ptr="*i32", num_q_tokens="i32", bs="i32",
                                           rpi_ptr="*i64", seq_ptr="*i64", ext_ptr="*i64", spec_pad="i32",
                                           offset="i32", r2t_ptr="*i32", r2t_stride="i32", num_reqs="i32",
                                           max_len="i32", f2s_ptr="*i64", num_full="i32", sps="i32", ring="i32"),
             dict(RATIO=128, ADDRESSING=0, HAS_TABLE=False, ONLINE=True, ROWS=pk.ROWS, CHUNK=pk.CHUNK))
    ptrs = dict(state_ptr="*fp32", input_ptr="*fp32", ape_ptr="*fp32", plan_ptr="*i32", out_ptr="*fp32")
    block_d = min(128, head_dim)
    _compile(ok._online_decode_kernel, dict(ptrs, num_slots="i32"), dict(HEAD_DIM=head_dim, BLOCK_D=block_d))
    for is_write in (False, True):
        _compile(ok._online_prefill_kernel, dict(ptrs, num_rows="i32", num_slots="i32", num_inputs="i32"),
                 dict(HEAD_DIM=head_dim, IS_WRITE=is_write, BLOCK_D=block_d, BLOCK_T=32))


@pytest.mark.parametrize("head_dim,flag,ratio", [(512, False, 4), (512, True, 4), (128, False, 4), (128, True, 4),
                                                 (512, False, 128)])
@pytest.mark.parametrize("addressing", [0, 1, 2])
def test_variant_decode_step_kernels(head_dim, flag, ratio, addressing):
    from dsv4ops.compress import kernels as ck
    from dsv4ops.decode_step import kernels as dk

    if addressing == 1 and ratio == 4:
        pytest.skip("request addressing is ratio 128 only")
    lookup = dict(r2t_ptr="*i32", r2t_stride="i32", num_reqs="i32", max_len="i32", f2s_ptr="*i64", num_full="i32",
                  sps="i32", ring="i32")
    ptrs = dict(state_ptr="*fp32", input_ptr="*fp32", ape_ptr="*fp32", rpi_ptr="*i64", seq_ptr="*i64",
                plan_ptr="*i32", out_ptr="*fp32")
    meta = dict(HEAD_DIM=head_dim, ADDRESSING=addressing, HAS_TABLE=addressing != 2)
    if ratio == 128:
        _compile(dk._decode_step_c128_pool_kernel, dict(ptrs, num_state_rows="i64", **lookup),
                 dict(meta, BLOCK_D=ck._channel_block(head_dim, ck.DECODE_BLOCK_D[128]),
                      CHANNELS_FASTEST=ck.CHANNELS_FASTEST, POOL_FIRST=ck.DECODE_POOL_FIRST), ck.DECODE_WARPS[128])
        return
    fmt = (1 if flag else 0) if head_dim == 512 else (3 if flag else 2)
    layout = CacheLayout(CacheFormat(fmt), 64)
    store = dict(weight_ptr="*fp32", freqs_ptr="*fp32", out_loc_ptr="*i64", cache_ptr="*u8", bs="i32",
                 num_state_rows="i64", num_locs="i32", num_freq_rows="i32", num_pages="i32", eps="fp32",
                 log2_page="i32", page_bytes="i32")
    _compile(dk._decode_step_c4_kernel, dict(ptrs, **store, **lookup),
             dict(meta, FLAG=flag, SLOT_BYTES=layout.slot_bytes, SCALE_STRIDE=layout.scale_stride,
                  POOL_FIRST=ck.DECODE_POOL_FIRST, HW_CAST=True),
             num_warps=dk.C4_WARPS[head_dim], multiples_of_16=PAGE_BYTES_ALIGNED)
