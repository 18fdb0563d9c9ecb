"""Triton helpers for rounding to storage formats with explicit bit arithmetic.

They round to nearest even on the bit pattern, so a kernel gives the same bits on
the GPU and under ``TRITON_INTERPRET=1`` (whose own fp32 -> bf16 cast truncates).
"""

from ._triton import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def bf16_bits(x):
        """fp32 -> bf16 bit pattern as int32 in [0, 65535], round to nearest even (finite x)."""
        bits = x.to(tl.int32, bitcast=True)
        return ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16) & 0xFFFF

    @triton.jit
    def bf16_round(x):
        """fp32 -> bf16 (round to nearest even) -> fp32."""
        bits = x.to(tl.int32, bitcast=True)
        return ((bits + (0x7FFF + ((bits >> 16) & 1))) & -65536).to(tl.float32, bitcast=True)

    @triton.jit
    def cast_rne(x, dtype: tl.constexpr):
        """fp32 ``x`` to ``dtype`` with round-to-nearest-even on every backend."""
        if dtype == tl.bfloat16:
            return bf16_bits(x).to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dtype)
