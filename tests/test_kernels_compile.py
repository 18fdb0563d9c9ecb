"""Every Triton kernel variant compiles for sm_90 (H100/H200), checked on any machine.

The Triton interpreter accepts programs the GPU compiler rejects (non-constexpr
globals, reassigned constexprs, ...). Compiling to cubin with Triton's bundled
ptxas needs no GPU, so CI catches those without one. The kernels must be imported
with ``TRITON_INTERPRET`` unset, so ``test_all_kernels_compile_for_sm90`` runs this
file as a script in a clean subprocess (``python tests/test_kernels_compile.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_all_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
                             os.path.abspath(__file__), "-k", "variant"], env=env, capture_output=True, text=True,
                            timeout=1200, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]


def _compile(fn, types: dict, constexprs: dict, num_warps=4):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter mode: test_all_kernels_compile_for_sm90 compiles this variant in a subprocess")
    names = fn.arg_names
    signature = {name: ("constexpr" if name in constexprs else types[name]) for name in names}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


from dsv4ops._layout import CacheFormat, CacheLayout  # noqa: E402


def _kernels():
    from dsv4ops.compress import kernels as ck
    from dsv4ops.planner import kernels as pk
    from dsv4ops.store import kernels as sk

    return ck, pk, sk


STORE_VARIANTS = [(0, 512, 4), (1, 512, 4), (2, 128, 8), (3, 128, 8)]


@pytest.mark.parametrize("fmt,head_dim,block_m", STORE_VARIANTS)
@pytest.mark.parametrize("is_decode", [True, False])
def test_variant_store_kernel(fmt, head_dim, block_m, is_decode):
    ck, pk, sk = _kernels()
    types = dict(kv_ptr="*fp32", plan_ptr="*i32", weight_ptr="*fp32", freqs_ptr="*fp32", out_loc_ptr="*i64",
                 cache_ptr="*u8", num_rows="i32", num_locs="i32", num_freq_rows="i32", num_pages="i32", eps="fp32",
                 log2_page="i32", page_bytes="i32")
    layout = CacheLayout(CacheFormat(fmt), 64)
    consts = dict(HEAD_DIM=head_dim, FORMAT=fmt, IS_DECODE=is_decode, RATIO=4, SLOT_BYTES=layout.slot_bytes,
                  SCALE_STRIDE=layout.scale_stride, BLOCK_M=block_m)
    _compile(sk._norm_rope_store_kernel, types, consts)


@pytest.mark.parametrize("ratio,head_dim", [(4, 512), (4, 128), (128, 512), (128, 64)])
@pytest.mark.parametrize("state,inp,out", [("fp32", "fp32", "fp32"), ("bf16", "bf16", "bf16")])
def test_variant_compress_kernels(ratio, head_dim, state, inp, out):
    ck, pk, sk = _kernels()
    block = dict(HEAD_DIM=head_dim, RATIO=ratio, BLOCK_D=ck._block_d(head_dim), BLOCK_W=8 if ratio == 4 else 32)
    ptrs = dict(state_ptr=f"*{state}", input_ptr=f"*{inp}", ape_ptr="*fp32", plan_ptr="*i32", out_ptr=f"*{out}")
    _compile(ck._compress_decode_kernel, dict(ptrs, num_state_rows="i64"), block)
    events, rows, channels, _ = ck.PREFILL_POOL_TILE[ratio]
    _compile(ck._compress_prefill_pool_kernel, dict(ptrs, num_events="i32", num_state_rows="i64", num_inputs="i32"),
             dict(HEAD_DIM=head_dim, RATIO=ratio, BLOCK_E=events, BLOCK_W=rows, BLOCK_D=min(channels, head_dim)))
    width = (4 if ratio == 4 else 2) * head_dim
    _compile(ck._compress_prefill_write_kernel,
             dict(state_ptr=f"*{state}", input_ptr=f"*{inp}", plan_ptr="*i32", num_writes="i32", num_state_rows="i64",
                  num_inputs="i32"),
             dict(WIDTH=width, BLOCK_R=4, BLOCK_C=min(1024, width)))


@pytest.mark.parametrize("ratio,addressing", [(4, 0), (4, 2), (128, 0), (128, 1), (128, 2)])
def test_variant_planner_kernels(ratio, addressing):
    ck, pk, sk = _kernels()
    lookup = dict(r2t_ptr="*i32", r2t_stride="i32", num_reqs="i32", max_len="i32", f2s_ptr="*i64", num_full="i32",
                  sps="i32", ring="i32")
    meta = dict(RATIO=ratio, ADDRESSING=addressing, HAS_TABLE=addressing != 2)
    _compile(pk._plan_decode_kernel, dict(lookup, rpi_ptr="*i64", seq_ptr="*i64", plan_ptr="*i32", bs="i32"),
             dict(meta, BLOCK=128))
    rows = dict(lookup, num_q_tokens="i32", ends_ptr="*i64", bs="i32", rpi_ptr="*i64", seq_ptr="*i64", ext_ptr="*i64")
    meta.update(LOG2_MAX_BS=17, BLOCK=pk.ROWS_PER_BLOCK)
    _compile(pk._count_rows_kernel, dict(rows, counts_ptr="*i32"), meta)
    _compile(pk._emit_rows_kernel, dict(rows, plan_c_ptr="*i32", plan_w_ptr="*i32", counts_ptr="*i32"),
             dict(meta, MAX_BLOCKS=pk.MAX_BLOCKS))


@pytest.mark.parametrize("head_dim", [512, 64])
def test_variant_online_kernels(head_dim):
    from dsv4ops.online import kernels as ok
    from dsv4ops.planner.kernels import MAX_BLOCKS, ROWS_PER_BLOCK

    _compile(ok._plan_online_decode_kernel, dict(rpi_ptr="*i64", seq_ptr="*i64", plan_ptr="*i32", bs="i32", offset="i32"),
             dict(BLOCK=128))
    rows = dict(num_q_tokens="i32", ends_ptr="*i64", bs="i32", rpi_ptr="*i64", seq_ptr="*i64", ext_ptr="*i64", offset="i32")
    meta = dict(LOG2_MAX_BS=17, BLOCK=ROWS_PER_BLOCK)
    _compile(ok._count_segments_kernel, dict(rows, counts_ptr="*i32"), meta)
    _compile(ok._emit_segments_kernel, dict(rows, plan_c_ptr="*i32", plan_w_ptr="*i32", counts_ptr="*i32"),
             dict(meta, MAX_BLOCKS=MAX_BLOCKS))
    ptrs = dict(state_ptr="*fp32", input_ptr="*fp32", ape_ptr="*fp32", plan_ptr="*i32", out_ptr="*fp32")
    block_d = min(128, head_dim)
    _compile(ok._online_decode_kernel, dict(ptrs, num_slots="i32"), dict(HEAD_DIM=head_dim, BLOCK_D=block_d))
    for is_write in (False, True):
        _compile(ok._online_prefill_kernel, dict(ptrs, num_rows="i32", num_slots="i32", num_inputs="i32"),
                 dict(HEAD_DIM=head_dim, IS_WRITE=is_write, BLOCK_D=block_d, BLOCK_T=32))
