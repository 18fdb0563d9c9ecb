"""Number formats of the compressed KV caches, as exact PyTorch functions.

These define the bytes ``compress_norm_rope_store`` writes. All of them are
exact (no rounding ambiguity): the Triton kernels reproduce them bit for bit
with integer arithmetic, and ``tests/golden`` re-derives them from first principles.
"""

from __future__ import annotations

import struct

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
SCALE_FLOOR = 1e-4  # amax floor before dividing by the format maximum (fp32 constant)
#: E2M1 magnitude index = number of these thresholds strictly below |v| (ties go down)
E2M1_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def fp32(value: float) -> float:
    """``value`` rounded to the nearest float32 (as a Python float)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


HADAMARD_SCALE = fp32(128.0**-0.5)


def scalar_like(value: float, like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``value`` rounded to ``dtype``, as a 0-dim tensor on ``like``'s device: how the reference
    brings a Python float (a format constant above, or ``norm_eps``) into tensor arithmetic.

    Under ``torch.compile(dynamic=True)`` a Python float read from a module global becomes a
    float64 CPU graph input, and Inductor (torch 2.11, CUDA, a batch of one row) passed a copy of
    one such input to a CUDA kernel ("CUDA driver error: invalid argument"). Made into a device
    tensor here, it reaches the kernels as a scalar. The format constants are exact in ``dtype``,
    so for them the arithmetic is that of the plain float."""
    return torch.full((), value, dtype=dtype, device=like.device)


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 (round to nearest even) -> fp32, for finite inputs.

    Done on the bit pattern: Inductor folds ``x.to(bfloat16).float()`` into ``x``
    unless precision-cast emulation is on, which would change the stored bytes.
    """
    bits = x.float().contiguous().view(torch.int32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536  # clear the low 16 bits
    return rounded.view(torch.float32)


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[..., k]`` -> ``[..., k * itemsize]`` uint8, little-endian, by shifting the bit pattern.

    Not ``view(torch.uint8)``: that needs a last-dimension stride of 1, which a size-1
    dimension need not have (``scale[:, None]`` of a one-row batch may carry a stride of 0
    under Inductor, and the view then fails at lowering). A view to an integer type of the
    same size has no stride requirement."""
    size = x.element_size()
    bits = x.view({2: torch.int16, 4: torch.int32}[size]).to(torch.int32)
    shifts = torch.arange(0, 8 * size, 8, dtype=torch.int32, device=x.device)
    return ((bits[..., None] >> shifts) & 0xFF).to(torch.uint8).reshape(*x.shape[:-1], x.shape[-1] * size)


def bf16_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[..., k]`` fp32 -> ``[..., 2k]`` uint8 little-endian bf16 (RNE)."""
    return _as_bytes(x.to(torch.bfloat16))


def fp32_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[..., k]`` fp32 -> ``[..., 4k]`` uint8 little-endian."""
    return _as_bytes(x.float())


def div_rn(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """fp32 ``x / divisor`` correctly rounded, robust to compilers.

    The quotient is formed in fp64 and rounded once to fp32. For the divisors used
    here (448, 6) a quotient of fp32 values is never within 2**-53 of an fp32
    rounding midpoint, so this is the IEEE fp32 division, and it stays so when a
    compiler rewrites the fp64 division as a multiplication by the reciprocal.
    """
    return (x.double() / scalar_like(divisor, x, torch.float64)).float()


def reciprocal_rn(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``1 / x`` correctly rounded (fp64 reciprocal rounded once; see ``div_rn``)."""
    return (1.0 / x.double()).float()


def ue8m0_ceil(x: torch.Tensor) -> torch.Tensor:
    """Biased exponent of the smallest power of two >= ``x`` (positive finite fp32), int32."""
    bits = x.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    return exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def pow2_from_biased(neg_exponent_field: torch.Tensor) -> torch.Tensor:
    """fp32 ``2 ** (field - 127)`` from an int32 biased exponent field in [1, 254]."""
    return (neg_exponent_field.to(torch.int32) << 23).view(torch.float32)


def e4m3_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> OCP float8 e4m3fn codes, round to nearest even, finite overflow saturates to +-448."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> 4-bit e2m1 codes (int32 0..15) by threshold rounding, ties toward zero, no -0."""
    mag = torch.clamp_max(v.abs(), scalar_like(E2M1_MAX, v))
    index = torch.zeros_like(v, dtype=torch.int32)
    for t in E2M1_THRESHOLDS:
        index = index + (mag > scalar_like(t, v)).to(torch.int32)
    negative = (v < 0) & (index != 0)
    return index | (negative.to(torch.int32) << 3)


def hadamard128(y: torch.Tensor) -> torch.Tensor:
    """Sylvester Walsh-Hadamard transform of ``[n, 128]`` fp32 rows, scaled by 128**-0.5.

    Seven radix-2 butterfly stages from index bit 0 upward (lower index gets
    ``u + v``, upper ``u - v``), each rounded to fp32, then one fp32 multiply.
    """
    n = y.shape[0]
    for k in range(7):
        stride = 1 << k
        pairs = y.reshape(n, 128 // (2 * stride), 2, stride)
        u, v = pairs[:, :, 0, :], pairs[:, :, 1, :]
        y = torch.stack([u + v, u - v], dim=2).reshape(n, 128)
    return y * scalar_like(HADAMARD_SCALE, y)
