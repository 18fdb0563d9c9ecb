"""Golden (slow, loop-based) ``compress_norm_rope_store`` and number formats.

Written from ``shared/docs/spec-norm-rope-store.md`` sections 3-6 and
``docs/semantics.md`` items 18-21 only; it shares no code with ``dsv4ops``.

Every float here is a Python float (IEEE binary64). ``f32(x)`` rounds a binary64
value to the nearest binary32 value (ties to even). Because a product, sum,
difference or quotient of two binary32 values computed in binary64 and then
rounded to binary32 is the correctly rounded binary32 result (binary64 has more
than 2*24+2 significand bits), ``f32(a * b)`` is exactly numpy's
``np.float32(a) * np.float32(b)``, and likewise for ``+ - /``.

Number formats (bf16, OCP E4M3FN, E2M1, UE8M0) are implemented from first
principles on bit patterns / value tables, never with torch or numpy casts.
"""

from __future__ import annotations

import bisect
import math
import struct

import numpy as np
import torch

from .planner_loop import compress_plan_rows, decode_plan_rows

INVALID_SEQ = 0xFFFFFFFF
ROPE_DIM = 64

_F32 = struct.Struct("<f")
_U32 = struct.Struct("<I")


# ---------------------------------------------------------------------------
# binary32 helpers
# ---------------------------------------------------------------------------

def f32(x: float) -> float:
    """Round a Python float to the nearest binary32 value (RNE), returned as a Python float."""
    try:
        return _F32.unpack(_F32.pack(x))[0]
    except OverflowError:  # rounds past FLT_MAX -> infinity (RNE)
        return math.copysign(math.inf, x)


def f32_bits(x: float) -> int:
    """The 32-bit pattern of f32(x)."""
    try:
        return _U32.unpack(_F32.pack(x))[0]
    except OverflowError:
        return 0xFF800000 if x < 0 else 0x7F800000


def bits_f32(b: int) -> float:
    return _F32.unpack(_U32.pack(b & 0xFFFFFFFF))[0]


# ---------------------------------------------------------------------------
# bf16
# ---------------------------------------------------------------------------

def bf16_encode(x: float) -> int:
    """16-bit pattern of bf16_RNE(x). ``x`` is first taken as binary32 (f32(x)), i.e. this is the
    usual fp32 -> bf16 conversion. Rounds on the bit pattern: keep the upper 16 bits, round up when
    the dropped 16 bits exceed half, or equal half and the kept part is odd. NaN -> quiet NaN."""
    bits = f32_bits(x)
    if (bits & 0x7F800000) == 0x7F800000 and (bits & 0x007FFFFF):  # NaN
        return ((bits >> 16) & 0x8000) | 0x7FC0
    upper = bits >> 16
    rest = bits & 0xFFFF
    if rest > 0x8000 or (rest == 0x8000 and (upper & 1)):
        upper += 1  # a carry into the exponent is correct (up to +-inf)
    return upper & 0xFFFF


def bf16_value(code: int) -> float:
    return bits_f32((code & 0xFFFF) << 16)


def bf16_round(x: float) -> float:
    """fp32(bf16_RNE(x))."""
    return bf16_value(bf16_encode(x))


# ---------------------------------------------------------------------------
# E4M3 (OCP e4m3fn: bias 7, max 448, subnormals down to 2^-9, 0x7F/0xFF NaN, no inf)
# ---------------------------------------------------------------------------

def _e4m3_magnitude(code: int) -> float:
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0:
        return m * 2.0 ** -9  # subnormal: m/8 * 2^(1-7)
    return (1.0 + m / 8.0) * 2.0 ** (e - 7)


#: the 127 finite non-negative magnitudes, indexed by code 0x00..0x7E (ascending)
E4M3_MAGNITUDES = [_e4m3_magnitude(c) for c in range(0x7F)]
assert E4M3_MAGNITUDES[-1] == 448.0
assert all(a < b for a, b in zip(E4M3_MAGNITUDES, E4M3_MAGNITUDES[1:]))


def e4m3_encode(x: float) -> int:
    """satfinite RNE encoding of the exact value ``x``: nearest of the 127 magnitudes, ties to the
    even code, saturating to 448 (0x7E) beyond; sign bit from the sign of ``x`` (so -0.0 and tiny
    negatives give 0x80). NaN -> 0x7F with the sign bit."""
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0x00
    if math.isnan(x):
        return sign | 0x7F
    a = abs(x)
    if a >= 448.0:
        return sign | 0x7E
    hi = bisect.bisect_left(E4M3_MAGNITUDES, a)  # first magnitude >= a (hi <= 126)
    if E4M3_MAGNITUDES[hi] == a:
        return sign | hi
    lo = hi - 1
    d_lo = a - E4M3_MAGNITUDES[lo]  # exact in binary64
    d_hi = E4M3_MAGNITUDES[hi] - a
    if d_lo < d_hi:
        code = lo
    elif d_hi < d_lo:
        code = hi
    else:
        code = lo if lo % 2 == 0 else hi
    return sign | code


def e4m3_value(code: int) -> float:
    code &= 0xFF
    if code & 0x7F == 0x7F:
        return math.nan
    v = E4M3_MAGNITUDES[code & 0x7F]
    return -v if code & 0x80 else v


# ---------------------------------------------------------------------------
# E2M1 (threshold rule, ties toward the smaller magnitude) and UE8M0
# ---------------------------------------------------------------------------

E2M1_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_encode(v: float) -> int:
    """4-bit code: index = number of thresholds strictly exceeded by min(|v|, 6); sign bit 0x8
    only when v < 0 and the index is non-zero (no negative zero)."""
    a = min(abs(v), 6.0)
    idx = sum(1 for t in E2M1_THRESHOLDS if a > t)
    if v < 0 and idx != 0:
        idx |= 0x8
    return idx


def e2m1_value(code: int) -> float:
    v = E2M1_MAGNITUDES[code & 0x7]
    return -v if code & 0x8 else v


def ue8m0_ceil(x: float) -> int:
    """Biased exponent of the smallest power of two >= f32(x) (x positive finite): exponent field
    plus one when the mantissa field is non-zero."""
    bits = f32_bits(x)
    e = (bits >> 23) & 0xFF
    m = bits & 0x7FFFFF
    return e + (1 if m != 0 else 0)


def pow2_f32(k: int) -> float:
    """2^k, exact (a binary32 value for -149 <= k <= 127)."""
    return math.ldexp(1.0, k)


# ---------------------------------------------------------------------------
# layouts (spec section 6)
# ---------------------------------------------------------------------------

def _format(head_dim: int, use_fp4: bool, bf16_store: bool) -> str:
    if head_dim == 512:
        if use_fp4:
            raise ValueError("use_fp4 requires head_dim 128")
        return "main_bf16" if bf16_store else "main_fp8"
    if head_dim == 128:
        if bf16_store:
            raise ValueError("bf16_store requires head_dim 512")
        return "idx_fp4" if use_fp4 else "idx_fp8"
    raise ValueError(f"head_dim must be 128 or 512, got {head_dim}")


def page_bytes_of(head_dim: int, page_size: int, use_fp4: bool = False, bf16_store: bool = False) -> int:
    fmt = _format(head_dim, use_fp4, bf16_store)
    P = page_size
    if fmt == "main_fp8":
        return -(-584 * P // 576) * 576
    if fmt == "main_bf16":
        return 1024 * P
    if fmt == "idx_fp8":
        return 132 * P
    return 68 * P


def _slot_offsets(fmt: str, P: int, off: int):
    """(payload offset, payload bytes, scale offset, scale bytes) within a page."""
    if fmt == "main_fp8":
        return 576 * off, 576, 576 * P + 8 * off, 7
    if fmt == "main_bf16":
        return 1024 * off, 1024, 0, 0
    if fmt == "idx_fp8":
        return 128 * off, 128, 128 * P + 4 * off, 4
    return 64 * off, 64, 64 * P + 4 * off, 4


def _flat_cache(kvcache: torch.Tensor) -> np.ndarray:
    assert kvcache.dtype == torch.uint8 and kvcache.is_contiguous() and kvcache.device.type == "cpu"
    return kvcache.view(-1).numpy()  # shares memory with kvcache


# ---------------------------------------------------------------------------
# the row pipeline
# ---------------------------------------------------------------------------

def norm_rope_row(x, w, eps, frow, D):
    """RMSNorm + RoPE (+ Hadamard for D = 128) of one row; returns D binary32 values (Python floats).

    ``x``, ``w``: D binary32 values; ``frow``: 64 binary32 values (cos, sin interleaved)."""
    S = math.fsum(v * v for v in x)  # every x_j^2 is exact in binary64; S is the rounded exact sum
    denom = math.sqrt(S / D + f32(eps))
    rstd = f32(1.0 / denom) if denom > 0.0 else math.inf
    y = [f32(f32(x[j] * rstd) * w[j]) for j in range(D)]
    base = D - ROPE_DIM
    for k in range(ROPE_DIM // 2):
        a, b = y[base + 2 * k], y[base + 2 * k + 1]
        c, s = frow[2 * k], frow[2 * k + 1]
        y[base + 2 * k] = f32(a * c - b * s)
        y[base + 2 * k + 1] = f32(a * s + b * c)
    if D == 128:
        for bit in (1, 2, 4, 8, 16, 32, 64):
            for i in range(128):
                if i & bit == 0:
                    u, v = y[i], y[i | bit]
                    y[i] = f32(u + v)
                    y[i | bit] = f32(u - v)
        scale = f32(128 ** -0.5)
        y = [f32(v * scale) for v in y]
    return y


def _encode_main_fp8(y):
    payload = bytearray(576)
    scales = bytearray(7)
    floor = f32(1e-4)
    for g in range(7):
        z = [bf16_round(y[j]) for j in range(64 * g, 64 * g + 64)]
        amax = max(abs(v) for v in z)
        s_raw = f32(max(floor, amax) / 448.0)
        e = ue8m0_ceil(s_raw)
        inv = pow2_f32(127 - e)
        scales[g] = e
        for i, v in enumerate(z):
            payload[64 * g + i] = e4m3_encode(f32(v * inv))
    for k in range(64):
        struct.pack_into("<H", payload, 448 + 2 * k, bf16_encode(y[448 + k]))
    return bytes(payload), bytes(scales)


def _encode_main_bf16(y):
    return b"".join(struct.pack("<H", bf16_encode(v)) for v in y), b""


def _encode_idx_fp8(h):
    amax = max(abs(v) for v in h)
    scale = f32(max(f32(1e-4), amax) / 448.0)
    inv = f32(1.0 / scale)
    payload = bytes(e4m3_encode(f32(v * inv)) for v in h)
    return payload, _F32.pack(scale)


def _encode_idx_fp4(h):
    floor = f32(1e-4)
    codes = []
    scales = bytearray(4)
    for g in range(4):
        grp = h[32 * g:32 * g + 32]
        amax = max(abs(v) for v in grp)
        s_raw = f32(max(floor, amax) / 6.0)
        e = ue8m0_ceil(s_raw)
        scales[g] = e
        inv = pow2_f32(127 - e)
        codes += [e2m1_encode(f32(v * inv)) for v in grp]
    payload = bytes(codes[2 * k] | (codes[2 * k + 1] << 4) for k in range(64))
    return payload, bytes(scales)


_ENCODERS = {
    "main_fp8": _encode_main_fp8,
    "main_bf16": _encode_main_bf16,
    "idx_fp8": _encode_idx_fp8,
    "idx_fp4": _encode_idx_fp4,
}


def store_loop(kv, plan, norm_weight, norm_eps, freqs, out_loc, kvcache, is_decode, compress_ratio,
               page_size, use_fp4=False, bf16_store=False) -> None:
    """Golden ``compress_norm_rope_store``: mutates ``kvcache`` (uint8, whole pages) in place."""
    r = int(compress_ratio)
    P = int(page_size)
    N, D = int(kv.shape[0]), int(kv.shape[1])
    fmt = _format(D, use_fp4, bf16_store)
    pbytes = page_bytes_of(D, P, use_fp4, bf16_store)
    flat = _flat_cache(kvcache)
    assert flat.size % pbytes == 0, "kvcache must hold whole pages"
    num_pages = flat.size // pbytes

    if torch.is_complex(freqs):
        freqs = torch.view_as_real(freqs).flatten(-2)
    ftab = freqs.to(torch.float32)
    assert ftab.shape[-1] == ROPE_DIM
    max_pos = int(ftab.shape[0])
    locs = [int(v) for v in out_loc.reshape(-1).tolist()]
    xs = kv.to(torch.float32).tolist()
    w = norm_weight.to(torch.float32).reshape(-1).tolist()
    assert len(w) == D

    rows = decode_plan_rows(plan) if is_decode else compress_plan_rows(plan)
    assert len(rows) == N, "kv row i pairs with plan row i"
    for i, row in enumerate(rows):
        s = row[0]
        if is_decode:
            if s % r != 0 or s < r or i >= len(locs):
                continue
            loc = locs[i]
        else:
            if s == INVALID_SEQ or s < r:
                continue
            ragged = row[1]
            if ragged >= len(locs):
                continue
            loc = locs[ragged]
        if loc < 0:
            continue
        page, off = loc // P, loc % P
        if page >= num_pages:
            continue
        pos = s - r
        if pos >= max_pos:
            continue
        frow = ftab[pos].tolist()
        y = norm_rope_row(xs[i], w, norm_eps, frow, D)
        payload, scales = _ENCODERS[fmt](y)
        p_off, p_len, s_off, s_len = _slot_offsets(fmt, P, off)
        assert len(payload) == p_len and len(scales) == s_len
        base = page * pbytes
        flat[base + p_off:base + p_off + p_len] = np.frombuffer(payload, dtype=np.uint8)
        if s_len:
            flat[base + s_off:base + s_off + s_len] = np.frombuffer(scales, dtype=np.uint8)


def decode_cache_slot(kvcache, loc, head_dim, page_size, use_fp4=False, bf16_store=False):
    """Read slot ``loc`` back: (float64 ``[D]`` dequantized values, raw bytes).

    raw bytes = the slot payload followed by its scale record (main FP8: the 7 scale bytes, the
    never-written 8th byte excluded; indexer: 4 bytes; bf16: none)."""
    D, P, loc = int(head_dim), int(page_size), int(loc)
    fmt = _format(D, use_fp4, bf16_store)
    pbytes = page_bytes_of(D, P, use_fp4, bf16_store)
    flat = _flat_cache(kvcache)
    page, off = loc // P, loc % P
    p_off, p_len, s_off, s_len = _slot_offsets(fmt, P, off)
    base = page * pbytes
    payload = bytes(flat[base + p_off:base + p_off + p_len].tolist())
    scales = bytes(flat[base + s_off:base + s_off + s_len].tolist()) if s_len else b""
    vals = []
    if fmt == "main_fp8":
        for j in range(448):
            vals.append(e4m3_value(payload[j]) * pow2_f32(scales[j // 64] - 127))
        for k in range(64):
            vals.append(bf16_value(struct.unpack_from("<H", payload, 448 + 2 * k)[0]))
    elif fmt == "main_bf16":
        vals = [bf16_value(struct.unpack_from("<H", payload, 2 * j)[0]) for j in range(512)]
    elif fmt == "idx_fp8":
        scale = _F32.unpack(scales)[0]
        vals = [e4m3_value(q) * scale for q in payload]
    else:
        for j in range(128):
            byte = payload[j // 2]
            code = (byte >> 4) if j % 2 else (byte & 0xF)
            vals.append(e2m1_value(code) * pow2_f32(scales[j // 32] - 127))
    return torch.tensor(vals, dtype=torch.float64), payload + scales
