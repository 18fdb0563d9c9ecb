"""Triton kernels for ``compress_norm_rope_store``: one fused kernel per compressor width.

``_store_main_kernel`` (D = 512: FP8 pack or bf16) and ``_store_indexer_kernel``
(D = 128: Hadamard, then FP8 or FP4). Each program takes blocks of ``BLOCK_M`` rows
(one in decode; ``PREFILL_BLOCKS`` in prefill, strided over the padded plan, so that
fewer programs read only padding): RMSNorm, RoPE, (Hadamard), quantization and the
paged scatter, all in registers; a block of rows with nothing to store (plan
padding, decode rows off a chunk boundary) only reads its plan words. A block's
rows are read while their cache slots are looked up. The arithmetic follows the pinned numerics of
``reference.py`` operation by operation (fp64 where the reference uses fp64, IEEE
fp32 elsewhere with no product fused into an add (``_mul_rn``), round-to-nearest-even
for every rounding to a storage format), so
the bytes written are identical to the reference's on the GPU and under the Triton
interpreter. The bf16 and e4m3 roundings use the GPU's conversion instructions
(``HW_CAST``); under the interpreter, whose fp8 cast does not round to nearest even,
they use integer bit manipulation instead. E2M1 (FP4) is always rounded by thresholds.
"""

from __future__ import annotations

import torch

from .._layout import CacheFormat, CacheLayout, cache_format
from .quant import fp32
from .._triton import HAVE_TRITON, cdiv, hardware_casts, interpreting, launch

if HAVE_TRITON:
    import triton
    import triton.language as tl

    # imported under their own names: Inductor re-emits a user kernel's helpers by name
    from .._triton_formats import bf16_bits, bf16_round

    # ------------------------------------------------------------------ number formats
    @triton.jit
    def _e4m3_code(v, HW_CAST: tl.constexpr):
        """fp32 -> OCP e4m3fn code (int32 0..255): RNE, finite overflow saturates to +-448.

        ``HW_CAST``: the GPU's conversion (``cvt.rn.satfinite.e4m3x2.f32`` on sm_89+, two values per
        instruction; PTX has no fp8 conversion without ``.satfinite``, so out-of-range values saturate
        as the reference's clamp makes them), the rounding of torch's ``float8_e4m3fn`` cast; else the
        same rounding in integer arithmetic (about 15 instructions a value), for the interpreter."""
        if HW_CAST:
            return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
        sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
        a = tl.minimum(tl.abs(v), 448.0)
        bits = a.to(tl.int32, bitcast=True)
        # normal range: keep 3 mantissa bits, round half to even, rebias the exponent 127 -> 7
        normal = ((bits + (0x7FFFF + ((bits >> 20) & 1))) >> 20) - (120 << 3)
        # subnormal range (a < 2^-6): the code is round-half-even(a / 2^-9); the 2^23 trick rounds
        subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
        return sign | tl.where(a < 0.015625, subnormal, normal)

    @triton.jit
    def _bf16_round(x, HW_CAST: tl.constexpr):
        """fp32 -> bf16 (round to nearest even) -> fp32: the GPU's ``cvt.rn.bf16.f32``, or integer arithmetic."""
        if HW_CAST:
            return x.to(tl.bfloat16).to(tl.float32)
        return bf16_round(x)

    @triton.jit
    def _bf16_bits(x, HW_CAST: tl.constexpr):
        """fp32 -> bf16 bit pattern as int32 in [0, 65535], round to nearest even (as ``_bf16_round``)."""
        if HW_CAST:
            return x.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int32)
        return bf16_bits(x)

    #: compiled for a GPU (inline PTX available), not run by the interpreter (``TRITON_INTERPRET=1``,
    #: fixed when this module is imported, as the JIT's own mode is)
    _COMPILED = tl.constexpr(not interpreting())

    @triton.jit
    def _mul_rn(a, b):
        """fp32 ``a * b`` rounded on its own, never fused into a following add: LLVM and ptxas fuse a
        plain fp32 multiply whose result feeds an add into one ``fma``, skipping this rounding (and
        LLVM turns an fp64 product of two widened fp32 values, rounded back, into that same plain
        multiply). Compiled: the PTX ``mul.rn.f32``, which neither contracts; interpreted: numpy's
        fp32 multiply, which nothing fuses."""
        if _COMPILED:
            return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                             is_pure=True, pack=1)
        return a * b

    @triton.jit
    def _scale_exponent(amax, LOG2_MAX: tl.constexpr, MAX_MANTISSA: tl.constexpr):
        """The reference's power-of-two group scale ``ue8m0_ceil(fp32(max(amax, 1e-4) / fmt_max))``
        (``quant.ue8m0_ceil``: the biased exponent of the smallest power of two >= an IEEE fp32
        quotient) for a format maximum ``fmt_max = (1 + MAX_MANTISSA / 2^23) * 2^LOG2_MAX``
        (e4m3: 448 = 1.75 * 2^8; e2m1: 6 = 1.5 * 2^2), without dividing, for amax >= 0.

        With ``m = max(amax, 1e-4) = f * 2^E`` (f in [1, 2)) and ``fmt_max = c * 2^p``, the quotient
        ``m / fmt_max`` is ``(f / c) * 2^(E - p)``. For f = c it is 2^(E - p) exactly; for f > c it lies
        strictly between 2^(E - p) and 2^(E - p + 1), and for f < c strictly between 2^(E - p - 1) and
        2^(E - p), and in both cases at least 2^-23 / c (more than half an fp32 ulp) away from the
        powers of two, so the fp32 rounding stays strictly between them. The smallest power of two
        >= the rounded quotient therefore has the biased exponent ``field(m) - p + (f > c)``.
        Infinities keep the old formula's 255 (``m / fmt_max`` is infinite too)."""
        bits = tl.maximum(amax, 1e-4).to(tl.int32, bitcast=True)
        field = (bits >> 23) & 0xFF
        mantissa = bits & 0x7FFFFF
        finite = field - LOG2_MAX + (mantissa > MAX_MANTISSA).to(tl.int32)
        return tl.where(field == 255, 255 + (mantissa != 0).to(tl.int32), finite)

    @triton.jit
    def _pow2_neg(e):
        """fp32 2^(127 - e) for a biased exponent e in [1, 253]."""
        return ((254 - e) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _e2m1_code(v):
        """fp32 -> 4-bit e2m1 code, rounded as the thresholds {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5}
        (ties toward zero), no negative zero. From 1 up the code is the fp32 exponent and top
        mantissa bit, rounded half down by adding 2^21 - 1 below them; under 1 it is a count of
        two thresholds. (Checked against the thresholds for every fp32 bit pattern but NaN.)"""
        a = tl.minimum(tl.abs(v), 6.0)
        normal = ((a.to(tl.int32, bitcast=True) + 0x1FFFFF) >> 22) - 252  # 252: exponent 127 -> 1, 2 codes each
        small = (a > 0.25).to(tl.int32) + (a > 0.75).to(tl.int32)
        idx = tl.where(a >= 1.0, normal, small)
        return idx | (((v < 0) & (idx != 0)).to(tl.int32) << 3)

    @triton.jit
    def _butterfly(y, BLOCK_M: tl.constexpr, STRIDE: tl.constexpr):
        """One radix-2 stage of ``[BLOCK_M, 64]`` rows over index bit log2(STRIDE): the lower index of each
        pair gets u + v, the upper u - v (as u + (-v), the same IEEE operation).

        Each element's partner comes from an xor-reduction over its pair (the xor of both bit patterns,
        xor-ed with its own), so every stage keeps the rows' register layout: a pair within a thread
        costs an add, a pair across threads one shuffle more, and nothing goes through shared memory
        (permuting the pair to the last axis and splitting it made Triton move the whole tile through
        shared memory at every stage that crossed threads)."""
        t = tl.reshape(y, [BLOCK_M, 32 // STRIDE, 2, STRIDE])
        bits = t.to(tl.int32, bitcast=True)
        partner = (bits ^ tl.xor_sum(bits, axis=2, keep_dims=True)).to(tl.float32, bitcast=True)
        upper = (tl.arange(0, 2) == 1)[None, None, :, None]
        return tl.reshape(partner + tl.where(upper, -t, t), [BLOCK_M, 64])

    @triton.jit
    def _hadamard128(y_lo, y_hi, BLOCK_M: tl.constexpr):
        """Walsh-Hadamard transform of ``[BLOCK_M, 128]`` rows given as their halves (elements 0..63 and
        64..127), bit 0 first, then * fp32(128 ** -0.5): bits 0..5 within each half, bit 6 across them."""
        for stride in tl.static_range(6):
            y_lo = _butterfly(y_lo, BLOCK_M, 1 << stride)
            y_hi = _butterfly(y_hi, BLOCK_M, 1 << stride)
        scale = 0.08838834764831845  # fp32(128 ** -0.5), exact in fp32 as written
        return (y_lo + y_hi) * scale, (y_lo - y_hi) * scale

    # ------------------------------------------------------------------ shared steps
    @triton.jit
    def _store_rows(word0, word1, rows, num_rows, num_locs, IS_DECODE: tl.constexpr, RATIO: tl.constexpr):
        """Which plan rows may store a token, from their first two plan words: (candidate, index into
        out_loc). A candidate is live once its cache slot (``_store_slots``) is in range."""
        seq_len = word0.to(tl.int64) & 0xFFFFFFFF
        in_rows = rows < num_rows
        if IS_DECODE:
            live = in_rows & (seq_len % RATIO == 0) & (seq_len >= RATIO)
            loc_index = rows
        else:
            live = in_rows & (word0 != -1) & (seq_len >= RATIO)
            loc_index = word1.to(tl.int64) & 0xFFFF
        return live & (loc_index < num_locs), loc_index

    @triton.jit
    def _store_position(word0, candidate, num_freq_rows, RATIO: tl.constexpr):
        """The RoPE position of each row (its plan word 0), and the rows whose position is in the table."""
        pos = (word0.to(tl.int64) & 0xFFFFFFFF) - RATIO
        return candidate & (pos < num_freq_rows), pos

    @triton.jit
    def _store_slots(loc, candidate, num_pages, log2_page, page_bytes):
        """Where each row goes, from its cache slot ``loc``: (live, byte offset of the page, slot in the page)."""
        page = loc >> log2_page
        live = candidate & (loc >= 0) & (page < num_pages)
        return live, page * page_bytes, loc & ((1 << log2_page) - 1)  # int64: caches can exceed 2 GiB

    @triton.jit
    def _squares(x):
        """fp64 ``x * x`` of an fp32 tile (exact: 48 significant bits)."""
        x64 = x.to(tl.float64)
        return x64 * x64

    @triton.jit
    def _rstd(sum_sq, eps, HEAD_DIM: tl.constexpr):
        """``fp32(1 / sqrt(sum_sq / D + eps))`` per row, in fp64, from the rows' fp64 sums of squares."""
        return (1.0 / tl.sqrt(sum_sq / HEAD_DIM + eps)).to(tl.float32)  # eps: an fp32 value, widened

    @triton.jit
    def _rotate(a, b, cos, sin):
        """One RoPE rotation of the pairs (a, b), each output the fp64 value rounded once to fp32."""
        a64 = a.to(tl.float64)
        b64 = b.to(tl.float64)
        c = cos.to(tl.float64)
        s = sin.to(tl.float64)
        return (a64 * c - b64 * s).to(tl.float32), (a64 * s + b64 * c).to(tl.float32)

    # ------------------------------------------------------------------ main compressor (D = 512)
    @triton.jit
    def _store_main_rows(kv_ptr, rows, readable, live, base, slot, pos, weight_ptr, freqs_ptr, cache_ptr, eps,
                         log2_page, BF16: tl.constexpr, SLOT_BYTES: tl.constexpr, SCALE_STRIDE: tl.constexpr,
                         HW_CAST: tl.constexpr):
        """Normalize, rotate, quantize and store the rows ``rows`` of ``kv`` ``[*, 512]`` where ``live``.
        ``readable`` (a superset of ``live`` that does not wait for the cache-slot lookup, so the
        row and slot loads are in flight together) says which rows' kv and RoPE positions are valid;
        the others read kv row 0 in their place and store nothing.

        FP8 pack (448 e4m3 + 7 ue8m0 scales + 64 bf16 rope) or plain bf16. The row is read as
        8 groups of 64 (groups 0..6 are the FP8 groups); the rope tail (group 7) is read a
        second time (from L1) as a ``[rows, 64]`` tile, with its table row in the same layout, so
        the pairs split within each thread; each pair is rotated and stored as one 32-bit word
        (bf16 of the even element in the low half). Every tile the arithmetic meets is read in
        the layout of the tile it meets (the weight as ``[rows, 8, 64]``, not a shared ``[8, 64]``
        that would be moved through shared memory into the rows' layout).
        """
        group = tl.arange(0, 8)
        col = tl.arange(0, 64)
        pair = tl.arange(0, 32)
        element = group[:, None] * 64 + col[None, :]  # [8, 64]
        # rows that are not read take row 0 of kv instead (never stored; kv has a row wherever this
        # runs): unmasked loads, with no registers to clear for masked-off lanes. (The table may be
        # empty, so its loads keep their mask.)
        rows = tl.where(readable, rows, 0)
        x = tl.load(kv_ptr + rows[:, None, None] * 512 + element[None, :, :]).to(tl.float32)
        # The row's fp64 sum of squares, nested (a reshape to [rows, 512] for one sum gives a linear
        # layout with a row bit among the lane bits, which Triton 3.6 reduces with the wrong shuffles;
        # tests/_sm90.py checks for that), in the order the tile's layout makes cheap. Triton lays the
        # tile out for its widest access: the FP8 codes' 16-byte stores give each thread 16 elements of
        # 2 groups of a row (4 lanes per group, 8 rows per warp, the groups over the warps), so the sum
        # goes within each group first; the bf16 words give each thread 4 elements of all 8 groups
        # (16 lanes per row, a warp's rows its own), so it goes over the groups first, within the
        # thread, and then over the lanes (the other order took 990 of the kernel's 2488 instructions)
        squares = _squares(x)
        if BF16 and rows.shape[0] >= 8:  # (at 4 warps; with fewer rows than 2 per warp the warps split the groups)
            rstd = _rstd(tl.sum(tl.sum(squares, axis=1), axis=1), eps, 512)
        else:
            rstd = _rstd(tl.sum(tl.sum(squares, axis=2), axis=1), eps, 512)
        # the weight as a [rows, 8, 64] tile in the row's layout (from L1), not a shared [8, 64] tile
        weight = tl.load(tl.broadcast_to(weight_ptr + element[None, :, :], [rows.shape[0], 8, 64])).to(tl.float32)
        y = (x * rstd[:, None, None]) * weight

        slot_at = base + slot * SLOT_BYTES  # byte offset of each row's slot
        # the 32-bit words of each slot, addressed as int32 elements (offsets of 4 bytes into a byte
        # pointer look strided to Triton, which then lays the stores out with rows fastest across lanes)
        slot_words = (cache_ptr + slot_at).to(tl.pointer_type(tl.int32))
        nope = live[:, None, None] & (group < 7)[None, :, None]
        if BF16:
            # two bf16 per 32-bit word (the even element in the low half), so a thread's run of
            # elements goes out in wide stores rather than 2 bytes at a time
            lo, hi = tl.split(tl.reshape(_bf16_bits(y, HW_CAST), [rows.shape[0], 8, 32, 2]))
            word = group[:, None] * 32 + pair[None, :]  # [8, 32]
            tl.store(slot_words[:, None, None] + word[None, :, :], lo | (hi << 16), mask=nope)
            rope_at = slot_words[:, None] + 896 // 4 + pair[None, :]
        else:
            z = _bf16_round(y, HW_CAST)
            exponent = _scale_exponent(tl.max(tl.abs(z), axis=2), 8, 0x600000)  # [rows, 8]; 448 = 1.75 * 2^8
            codes = _e4m3_code(z * _pow2_neg(exponent)[:, :, None], HW_CAST)
            tl.store(cache_ptr + slot_at[:, None, None] + element[None, :, :], codes.to(tl.uint8), mask=nope)
            scale_at = base + (SLOT_BYTES << log2_page) + slot * SCALE_STRIDE
            tl.store(cache_ptr + scale_at[:, None] + group[None, :], exponent.to(tl.uint8),
                     mask=live[:, None] & (group < 7)[None, :])
            rope_at = slot_words[:, None] + 448 // 4 + pair[None, :]

        # the rope tail again (from L1), as a contiguous [rows, 64] tile, and its table row in the same
        # layout (cos at even, sin at odd): the pairs are then split within each thread; each pair is
        # rotated and stored as one 32-bit word (bf16 of the even element in the low half)
        tail = 448 + col
        xt = tl.load(kv_ptr + rows[:, None] * 512 + tail[None, :]).to(tl.float32)
        wt = tl.load(tl.broadcast_to(weight_ptr + tail[None, :], [rows.shape[0], 64])).to(tl.float32)
        yt = (xt * rstd[:, None]) * wt
        freqs = tl.load(freqs_ptr + pos[:, None] * 64 + col[None, :], mask=readable[:, None], other=0.0)
        ye, yo = tl.split(tl.reshape(yt, [rows.shape[0], 32, 2]))
        cos, sin = tl.split(tl.reshape(freqs, [rows.shape[0], 32, 2]))
        re, ro = _rotate(ye, yo, cos, sin)
        rope_words = _bf16_bits(re, HW_CAST) | (_bf16_bits(ro, HW_CAST) << 16)
        tl.store(rope_at, rope_words, mask=live[:, None])

    @triton.jit
    def _store_main_kernel(
        kv_ptr, plan_ptr, weight_ptr, freqs_ptr, out_loc_ptr, cache_ptr,
        num_rows, num_locs, num_freq_rows, num_pages, eps, log2_page, page_bytes,
        BF16: tl.constexpr, IS_DECODE: tl.constexpr, RATIO: tl.constexpr,
        SLOT_BYTES: tl.constexpr, SCALE_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCKS: tl.constexpr,
        HW_CAST: tl.constexpr,
    ):
        # BLOCKS blocks of BLOCK_M rows, strided over the plan (blocks p, p + P, ... of P programs); the
        # index loads stay in the kernel body: Inductor's mutation analysis of user Triton kernels
        # treats every pointer passed to a helper whose result feeds a store address as written
        programs = tl.num_programs(0)
        row_blocks = ()
        words0 = ()
        words1 = ()
        for i in tl.static_range(BLOCKS):  # every block's plan words in flight at once
            rows = (tl.program_id(0) + i * programs).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
            row_blocks = row_blocks + (rows,)
            words0 = words0 + (tl.load(plan_ptr + rows * 4, mask=rows < num_rows, other=-1),)
            words1 = words1 + (tl.load(plan_ptr + rows * 4 + 1, mask=(rows < num_rows) & (not IS_DECODE), other=0),)
        for i in tl.static_range(BLOCKS):
            rows = row_blocks[i]
            candidate, loc_index = _store_rows(words0[i], words1[i], rows, num_rows, num_locs, IS_DECODE, RATIO)
            candidate, pos = _store_position(words0[i], candidate, num_freq_rows, RATIO)
            loc = tl.load(out_loc_ptr + loc_index, mask=candidate, other=-1).to(tl.int64)
            live, base, slot = _store_slots(loc, candidate, num_pages, log2_page, page_bytes)
            # plans are padded (prefill) or mostly off a boundary (decode): skip blocks with nothing to store
            if tl.max(candidate.to(tl.int32), axis=0) > 0:
                _store_main_rows(kv_ptr, rows, candidate, live, base, slot, pos, weight_ptr, freqs_ptr, cache_ptr, eps,
                                 log2_page, BF16, SLOT_BYTES, SCALE_STRIDE, HW_CAST)

    # ------------------------------------------------------------------ indexer compressor (D = 128)
    @triton.jit
    def _store_indexer_rows(kv_ptr, rows, readable, live, base, slot, pos, weight_ptr, freqs_ptr, cache_ptr, eps,
                            log2_page, FP4: tl.constexpr, SLOT_BYTES: tl.constexpr, SCALE_STRIDE: tl.constexpr,
                            BLOCK_M: tl.constexpr, HW_CAST: tl.constexpr):
        """Hadamard-rotated rows of 128: FP8 with one fp32 scale, or FP4 (e2m1) with 4 ue8m0 scales.
        ``readable`` and ``live`` as in ``_store_main_rows`` (rows not readable read kv row 0 and store nothing).

        A row is handled as its two halves, ``[BLOCK_M, 64]`` each, in one register layout throughout:
        RoPE touches only the upper half (its 32 pairs, with the row's 64 table entries read as a
        contiguous tile in that layout: cos at even, sin at odd), the Hadamard's last stage combines
        the halves element by element, and the codes of each half go out as contiguous bytes."""
        half = tl.arange(0, 64)
        rows = tl.where(readable, rows, 0)  # unmasked loads of kv, as in _store_main_rows
        at = kv_ptr + rows[:, None] * 128 + half[None, :]
        x_lo = tl.load(at).to(tl.float32)
        x_hi = tl.load(at + 64).to(tl.float32)
        rstd = _rstd(tl.sum(_squares(x_lo) + _squares(x_hi), axis=1), eps, 128)
        w_at = tl.broadcast_to(weight_ptr + half[None, :], [BLOCK_M, 64])  # in the rows' layout, from L1
        # rounded here, as the reference rounds it: the Hadamard's first stage adds it to its partner,
        # and the compiler would otherwise fuse the product into that add (one rounding, not two)
        y_lo = _mul_rn(x_lo * rstd[:, None], tl.load(w_at).to(tl.float32))
        y_hi = (x_hi * rstd[:, None]) * tl.load(w_at + 64).to(tl.float32)
        freqs = tl.load(freqs_ptr + pos[:, None] * 64 + half[None, :], mask=readable[:, None], other=0.0)
        a, b = tl.split(tl.reshape(y_hi, [BLOCK_M, 32, 2]))
        cos, sin = tl.split(tl.reshape(freqs, [BLOCK_M, 32, 2]))
        a, b = _rotate(a, b, cos, sin)
        h_lo, h_hi = _hadamard128(y_lo, tl.reshape(tl.join(a, b), [BLOCK_M, 64]), BLOCK_M)
        slot_at = base + slot * SLOT_BYTES
        scale_at = base + (SLOT_BYTES << log2_page) + slot * SCALE_STRIDE
        if FP4:  # 4 groups of 32 (2 per half) with ue8m0 scales, two codes per byte (even element low)
            byte = tl.arange(0, 32)
            group = tl.arange(0, 2)
            for upper in tl.static_range(2):
                g = tl.reshape(h_hi if upper else h_lo, [BLOCK_M, 2, 32])
                exponent = _scale_exponent(tl.max(tl.abs(g), axis=2), 2, 0x400000)  # 6 = 1.5 * 2^2
                codes = _e2m1_code(g * _pow2_neg(exponent)[:, :, None])
                lo, hi = tl.split(tl.reshape(codes, [BLOCK_M, 32, 2]))
                tl.store(cache_ptr + slot_at[:, None] + 32 * upper + byte[None, :], (lo | (hi << 4)).to(tl.uint8),
                         mask=live[:, None])
                tl.store(cache_ptr + scale_at[:, None] + 2 * upper + group[None, :], exponent.to(tl.uint8),
                         mask=live[:, None])
        else:  # one fp32 scale per row
            amax = tl.maximum(tl.max(tl.abs(h_lo), axis=1), tl.max(tl.abs(h_hi), axis=1))
            scale = (tl.maximum(amax, 1e-4).to(tl.float64) / 448.0).to(tl.float32)
            inv = (1.0 / scale.to(tl.float64)).to(tl.float32)
            code_at = cache_ptr + slot_at[:, None] + half[None, :]
            tl.store(code_at, _e4m3_code(h_lo * inv[:, None], HW_CAST).to(tl.uint8), mask=live[:, None])
            tl.store(code_at + 64, _e4m3_code(h_hi * inv[:, None], HW_CAST).to(tl.uint8), mask=live[:, None])
            tl.store((cache_ptr + scale_at).to(tl.pointer_type(tl.float32)), scale, mask=live)

    @triton.jit
    def _store_indexer_kernel(
        kv_ptr, plan_ptr, weight_ptr, freqs_ptr, out_loc_ptr, cache_ptr,
        num_rows, num_locs, num_freq_rows, num_pages, eps, log2_page, page_bytes,
        FP4: tl.constexpr, IS_DECODE: tl.constexpr, RATIO: tl.constexpr,
        SLOT_BYTES: tl.constexpr, SCALE_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCKS: tl.constexpr,
        HW_CAST: tl.constexpr,
    ):
        # BLOCKS blocks of BLOCK_M rows, strided over the plan (blocks p, p + P, ... of P programs); the
        # index loads stay in the kernel body: Inductor's mutation analysis of user Triton kernels
        # treats every pointer passed to a helper whose result feeds a store address as written
        programs = tl.num_programs(0)
        row_blocks = ()
        words0 = ()
        words1 = ()
        for i in tl.static_range(BLOCKS):  # every block's plan words in flight at once
            rows = (tl.program_id(0) + i * programs).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
            row_blocks = row_blocks + (rows,)
            words0 = words0 + (tl.load(plan_ptr + rows * 4, mask=rows < num_rows, other=-1),)
            words1 = words1 + (tl.load(plan_ptr + rows * 4 + 1, mask=(rows < num_rows) & (not IS_DECODE), other=0),)
        for i in tl.static_range(BLOCKS):
            rows = row_blocks[i]
            candidate, loc_index = _store_rows(words0[i], words1[i], rows, num_rows, num_locs, IS_DECODE, RATIO)
            candidate, pos = _store_position(words0[i], candidate, num_freq_rows, RATIO)
            loc = tl.load(out_loc_ptr + loc_index, mask=candidate, other=-1).to(tl.int64)
            live, base, slot = _store_slots(loc, candidate, num_pages, log2_page, page_bytes)
            # plans are padded (prefill) or mostly off a boundary (decode): skip blocks with nothing to store
            if tl.max(candidate.to(tl.int32), axis=0) > 0:
                _store_indexer_rows(kv_ptr, rows, candidate, live, base, slot, pos, weight_ptr, freqs_ptr, cache_ptr, eps,
                                    log2_page, FP4, SLOT_BYTES, SCALE_STRIDE, BLOCK_M, HW_CAST)


#: rows per program, per format family: (prefill, decode). H200 sweep at 16K tokens (2026-12-03,
#: fifth session): main 7.14 us at 8 rows, 7.50 at 4, 9.35 at 16; indexer 6.01 us at 4, 6.15 at 8,
#: 6.34 at 16; with row blocks (2026-12-04, below): indexer 5.42 us at 8 rows x 4 blocks.
#: H100 sweep at 16K / 64K tokens (2026-12-06, thirteenth session, with ``HW_CAST``): indexer
#: 16 rows x 1 block 5.99 / 12.62 us, 8 x 4 (the default until then) 5.29 / 16.40, 8 x 1 5.67 / 13.91,
#: 16 x 4 5.60 / 14.19. 16 x 1 (64 registers on sm_90, against 80) is 23% faster at 64K and 0.7 us
#: slower at 16K; a choice by token count would put a guard on it under torch.compile. Main: 8 x 2
#: stays (5.73 / 24.15; 8 x 1 6.09 / 25.17, 16 x 2 7.93 / 25.38).
BLOCK_M = {"main": (8, 2), "indexer": (16, 4)}
#: prefill: row blocks per program, per (format family, compress ratio); decode: 1. A prefill plan is
#: padded to the token count and at most one row in ``ratio`` (plus one per request) stores a token,
#: valid rows first; with strided blocks (see the kernels) a program meets a block with rows to
#: store and blocks of padding, instead of whole programs reading only padding. H200 sweep at 16K
#: tokens (2026-12-04): ratio-4 main 6.45 us at 2 blocks of 8 rows, 6.99 at 1, 7.73 at 4; ratio-4
#: indexer 5.42 us at 4 blocks of 8, 5.87 at 1; ratio-128 main 3.53 us at 1 block of 8, 3.78 at 2.
#: (A gain of 10% at best, near the run-to-run spread: these kernels are bound by the latency of
#: the plan, slot and row loads one after the other, not by the blocks of padding.)
PREFILL_BLOCKS = {("main", 4): 2, ("indexer", 4): 1, ("main", 128): 1, ("indexer", 128): 1}
#: warps per program, per format family: (prefill, decode). H100 sweep (2026-12-07, seventeenth
#: session, 16K / 64K tokens): 8 warps, which spread each tile over more threads with fewer registers
#: each, were slower for every tile (main 8 x 2: 8.47 / 38.23 us against 5.57 / 23.66 at 4; indexer
#: 16 x 1: 3.67 / 8.70 against 3.46 / 6.72; 2 warps 3.82 / 7.09)
STORE_WARPS = {"main": (4, 4), "indexer": (4, 4)}


def launch_shape(kind: str, is_decode: bool, compress_ratio: int) -> tuple:
    """(rows per block, row blocks per program, warps) of a store launch, from ``BLOCK_M``,
    ``PREFILL_BLOCKS`` and ``STORE_WARPS``; ``kind`` is "main" (D = 512) or "indexer" (D = 128)."""
    phase = 1 if is_decode else 0
    blocks = 1 if is_decode else PREFILL_BLOCKS[kind, int(compress_ratio)]
    return BLOCK_M[kind][phase], blocks, STORE_WARPS[kind][phase]


def norm_rope_store(kv, plan, norm_weight, norm_eps, freqs, out_loc, kvcache, is_decode, compress_ratio, page_size,
                    use_fp4=False, bf16_store=False) -> None:
    """Launch the fused kernel (arguments as ``torch.ops.dsv4ops.compress_norm_rope_store``)."""
    head_dim = kv.shape[1]
    layout = CacheLayout(cache_format(head_dim, use_fp4, bf16_store), page_size)
    main = head_dim == 512
    kind = "main" if main else "indexer"
    block_m, blocks, num_warps = launch_shape(kind, is_decode, compress_ratio)
    kernel = _store_main_kernel if main else _store_indexer_kernel
    flag = dict(BF16=bool(bf16_store)) if main else dict(FP4=bool(use_fp4))
    launch(kernel)[(cdiv(cdiv(kv.shape[0], block_m), blocks),)](
        kv, plan.view(torch.int32), norm_weight, freqs, out_loc, kvcache,
        kv.shape[0], out_loc.shape[0], freqs.shape[0], kvcache.numel() // layout.page_bytes, fp32(norm_eps),
        page_size.bit_length() - 1, layout.page_bytes,
        **flag, IS_DECODE=bool(is_decode), RATIO=int(compress_ratio),
        SLOT_BYTES=layout.slot_bytes, SCALE_STRIDE=layout.scale_stride, BLOCK_M=block_m,
        BLOCKS=blocks, HW_CAST=hardware_casts(), num_warps=num_warps,
    )
