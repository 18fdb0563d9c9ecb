"""Triton kernels for ``compress_norm_rope_store``: one fused kernel, specialized per cache format.

Each program takes ``BLOCK_M`` rows: RMSNorm, RoPE, (Hadamard), quantization and the
paged scatter, all in registers. The arithmetic follows the pinned numerics of
``reference.py`` operation by operation (fp64 where the reference uses fp64, IEEE
fp32 elsewhere, integer bit manipulation for every rounding to a storage format),
so the bytes written are identical to the reference's on the GPU and under the
Triton interpreter.
"""

from __future__ import annotations

import torch

from .._layout import CacheFormat, CacheLayout, cache_format
from .quant import fp32
from .._triton import HAVE_TRITON, cdiv, launch

if HAVE_TRITON:
    import triton
    import triton.language as tl

    # imported under their own names: Inductor re-emits a user kernel's helpers by name
    from .._triton_formats import bf16_bits, bf16_round

    # ------------------------------------------------------------------ number formats
    @triton.jit
    def _e4m3_code(v):
        """fp32 -> OCP e4m3fn code (int32 0..255): RNE, finite overflow saturates to +-448."""
        sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
        a = tl.minimum(tl.abs(v), 448.0)
        bits = a.to(tl.int32, bitcast=True)
        # normal range: keep 3 mantissa bits, round half to even, rebias the exponent 127 -> 7
        normal = ((bits + (0x7FFFF + ((bits >> 20) & 1))) >> 20) - (120 << 3)
        # subnormal range (a < 2^-6): the code is round-half-even(a / 2^-9); the 2^23 trick rounds
        subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
        return sign | tl.where(a < 0.015625, subnormal, normal)

    @triton.jit
    def _ue8m0_ceil(x):
        """Biased exponent of the smallest power of two >= x (positive finite fp32), int32."""
        bits = x.to(tl.int32, bitcast=True)
        return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)

    @triton.jit
    def _pow2_neg(e):
        """fp32 2^(127 - e) for a biased exponent e in [1, 253]."""
        return ((254 - e) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _e2m1_code(v):
        """fp32 -> 4-bit e2m1 code by thresholds (ties toward zero), no negative zero."""
        a = tl.minimum(tl.abs(v), 6.0)
        idx = ((a > 0.25).to(tl.int32) + (a > 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
               + (a > 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a > 3.5).to(tl.int32)
               + (a > 5.0).to(tl.int32))
        return idx | (((v < 0) & (idx != 0)).to(tl.int32) << 3)

    @triton.jit
    def _butterfly(y, BLOCK_M: tl.constexpr, STRIDE: tl.constexpr):
        """One radix-2 stage over index bit log2(STRIDE): lower index gets u + v, upper u - v."""
        t = tl.permute(tl.reshape(y, [BLOCK_M, 64 // STRIDE, 2, STRIDE]), [0, 1, 3, 2])
        u, v = tl.split(t)
        t = tl.permute(tl.join(u + v, u - v), [0, 1, 3, 2])
        return tl.reshape(t, [BLOCK_M, 128])

    @triton.jit
    def _hadamard128(y, BLOCK_M: tl.constexpr):
        """Walsh-Hadamard transform of ``[BLOCK_M, 128]`` rows, bit 0 first, then * fp32(128 ** -0.5)."""
        y = _butterfly(y, BLOCK_M, 1)
        y = _butterfly(y, BLOCK_M, 2)
        y = _butterfly(y, BLOCK_M, 4)
        y = _butterfly(y, BLOCK_M, 8)
        y = _butterfly(y, BLOCK_M, 16)
        y = _butterfly(y, BLOCK_M, 32)
        y = _butterfly(y, BLOCK_M, 64)
        return y * 0.08838834764831845  # fp32(128 ** -0.5), exact in fp32 as written

    # ------------------------------------------------------------------ the fused kernel
    @triton.jit
    def _norm_rope_store_kernel(
        kv_ptr, plan_ptr, weight_ptr, freqs_ptr, out_loc_ptr, cache_ptr,
        num_rows, num_locs, num_freq_rows, num_pages, eps, log2_page, page_bytes,
        HEAD_DIM: tl.constexpr, FORMAT: tl.constexpr, IS_DECODE: tl.constexpr, RATIO: tl.constexpr,
        SLOT_BYTES: tl.constexpr, SCALE_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr,
    ):
        D: tl.constexpr = HEAD_DIM
        HALF: tl.constexpr = HEAD_DIM // 2
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        in_rows = rows < num_rows

        # --- which rows are stored, where, at which RoPE position --------------------
        word0 = tl.load(plan_ptr + rows * 4, mask=in_rows, other=-1)
        seq_len = word0.to(tl.int64) & 0xFFFFFFFF
        if IS_DECODE:
            live = in_rows & (seq_len % RATIO == 0) & (seq_len >= RATIO)
            loc_index = rows
        else:
            live = in_rows & (word0 != -1) & (seq_len >= RATIO)
            loc_index = tl.load(plan_ptr + rows * 4 + 1, mask=in_rows, other=0).to(tl.int64) & 0xFFFF
        live = live & (loc_index < num_locs)
        loc = tl.load(out_loc_ptr + loc_index, mask=live, other=-1).to(tl.int64)
        pos = seq_len - RATIO
        page = loc >> log2_page
        slot = loc & ((1 << log2_page) - 1)
        live = live & (loc >= 0) & (page < num_pages) & (pos < num_freq_rows)
        base = page * page_bytes  # int64: caches can exceed 2 GiB

        # plans are padded (prefill) or mostly non-boundary (decode): skip blocks with no row to store
        if tl.max(live.to(tl.int32), axis=0) > 0:
            # --- RMSNorm: fp64 sum of squares, rstd rounded once to fp32 -------------------
            cols = tl.arange(0, D)
            x = tl.load(kv_ptr + rows[:, None] * D + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            x64 = x.to(tl.float64)
            sum_sq = tl.sum(x64 * x64, axis=1)
            rstd = (1.0 / tl.sqrt(sum_sq / D + eps)).to(tl.float32)  # eps: an fp32 value, widened
            w = tl.load(weight_ptr + cols).to(tl.float32)
            y = (x * rstd[:, None]) * w[None, :]

            # --- RoPE on the last 64 elements, interleaved pairs, each value rounded once ----
            a, b = tl.split(tl.reshape(y, [BLOCK_M, HALF, 2]))
            pair = tl.arange(0, HALF) - (D - 64) // 2  # rotated pairs: the last 64 elements
            rotated = live[:, None] & (pair >= 0)[None, :]
            f_at = freqs_ptr + pos[:, None] * 64 + 2 * pair[None, :]
            cos = tl.load(f_at, mask=rotated, other=0.0).to(tl.float64)
            sin = tl.load(f_at + 1, mask=rotated, other=0.0).to(tl.float64)
            a64 = a.to(tl.float64)
            b64 = b.to(tl.float64)
            a = tl.where(rotated, (a64 * cos - b64 * sin).to(tl.float32), a)
            b = tl.where(rotated, (a64 * sin + b64 * cos).to(tl.float32), b)
            y = tl.reshape(tl.join(a, b), [BLOCK_M, D])

            slot_at = base + slot * SLOT_BYTES  # [BLOCK_M]
            scale_at = base + (SLOT_BYTES << log2_page) + slot * SCALE_STRIDE
            if FORMAT == 0:  # main FP8 pack: groups 0..6 e4m3 with ue8m0 scales, group 7 (rope) bf16
                g = tl.reshape(y, [BLOCK_M, 8, 64])
                z = bf16_round(g)
                amax = tl.max(tl.abs(z), axis=2)  # [BLOCK_M, 8]
                exponent = _ue8m0_ceil((tl.maximum(amax, 1e-4).to(tl.float64) / 448.0).to(tl.float32))
                codes = _e4m3_code(z * _pow2_neg(exponent)[:, :, None])
                group = tl.arange(0, 8)
                within = tl.arange(0, 64)
                byte_at = slot_at[:, None, None] + group[None, :, None] * 64 + within[None, None, :]
                nope = live[:, None, None] & (group < 7)[None, :, None]
                tl.store(cache_ptr + byte_at, codes.to(tl.uint8), mask=nope)
                rope_at = (cache_ptr + slot_at[:, None, None] + 448 + 2 * within[None, None, :]).to(tl.pointer_type(tl.int16))
                rope = live[:, None, None] & (group == 7)[None, :, None]
                tl.store(rope_at + 0 * group[None, :, None], bf16_bits(g).to(tl.int16), mask=rope)
                tl.store(cache_ptr + scale_at[:, None] + group[None, :], exponent.to(tl.uint8),
                         mask=live[:, None] & (group < 7)[None, :])
            elif FORMAT == 1:  # main bf16
                at = (cache_ptr + slot_at[:, None] + 2 * cols[None, :]).to(tl.pointer_type(tl.int16))
                tl.store(at, bf16_bits(y).to(tl.int16), mask=live[:, None])
            elif FORMAT == 2:  # indexer FP8: Hadamard, one fp32 scale per row
                h = _hadamard128(y, BLOCK_M)
                amax = tl.max(tl.abs(h), axis=1)
                scale = (tl.maximum(amax, 1e-4).to(tl.float64) / 448.0).to(tl.float32)
                inv = (1.0 / scale.to(tl.float64)).to(tl.float32)
                codes = _e4m3_code(h * inv[:, None])
                tl.store(cache_ptr + slot_at[:, None] + cols[None, :], codes.to(tl.uint8), mask=live[:, None])
                tl.store((cache_ptr + scale_at).to(tl.pointer_type(tl.float32)), scale, mask=live)
            else:  # indexer FP4: Hadamard, 4 groups of 32 with ue8m0 scales, two codes per byte
                h = tl.reshape(_hadamard128(y, BLOCK_M), [BLOCK_M, 4, 32])
                amax = tl.max(tl.abs(h), axis=2)
                exponent = _ue8m0_ceil((tl.maximum(amax, 1e-4).to(tl.float64) / 6.0).to(tl.float32))
                codes = _e2m1_code(h * _pow2_neg(exponent)[:, :, None])
                lo, hi = tl.split(tl.reshape(codes, [BLOCK_M, 64, 2]))
                packed = lo | (hi << 4)
                byte = tl.arange(0, 64)
                tl.store(cache_ptr + slot_at[:, None] + byte[None, :], packed.to(tl.uint8), mask=live[:, None])
                group = tl.arange(0, 4)
                tl.store(cache_ptr + scale_at[:, None] + group[None, :], exponent.to(tl.uint8), mask=live[:, None])


def _block_m(fmt: CacheFormat) -> int:
    return 4 if fmt in (CacheFormat.MAIN_FP8, CacheFormat.MAIN_BF16) else 8


def norm_rope_store(kv, plan, norm_weight, norm_eps, freqs, out_loc, kvcache, is_decode, compress_ratio, page_size,
                    use_fp4=False, bf16_store=False) -> None:
    """Launch the fused kernel (arguments as ``torch.ops.dsv4ops.compress_norm_rope_store``)."""
    head_dim = kv.shape[1]
    layout = CacheLayout(cache_format(head_dim, use_fp4, bf16_store), page_size)
    block_m = _block_m(layout.format)
    launch(_norm_rope_store_kernel)[(cdiv(kv.shape[0], block_m),)](
        kv, plan.view(torch.int32), norm_weight, freqs, out_loc, kvcache,
        kv.shape[0], out_loc.shape[0], freqs.shape[0], kvcache.numel() // layout.page_bytes, fp32(norm_eps),
        page_size.bit_length() - 1, layout.page_bytes,
        HEAD_DIM=head_dim, FORMAT=int(layout.format), IS_DECODE=bool(is_decode), RATIO=int(compress_ratio),
        SLOT_BYTES=layout.slot_bytes, SCALE_STRIDE=layout.scale_stride, BLOCK_M=block_m,
        num_warps=4,
    )
