"""Byte layouts and constants shared by the three ops.

Everything that two ops (or an op and its caller) must agree on lives here:
plan row layouts, the sentinel, addressing modes, and the paged-cache layouts
written by ``compress_norm_rope_store``. See ``docs/plans.md`` and
``docs/compress_norm_rope_store.md`` for the byte-level pictures.
"""

from __future__ import annotations

import enum
import math

# ---------------------------------------------------------------------------
# Plans (little-endian; every plan row is a whole number of int32 words)
# ---------------------------------------------------------------------------
#: DecodePlan row: u32 seq_len | i32 write_loc | i32 read_page_0 | i32 read_page_1
DECODE_PLAN_BYTES = 16
#: CompressPlan row: u32 seq_len | u16 ragged_id, u16 buffer_len | i32 read_page_0 | i32 read_page_1
COMPRESS_PLAN_BYTES = 16
#: WritePlan row: u32 ragged_id | i32 write_loc
WRITE_PLAN_BYTES = 8

#: 0xFFFFFFFF read as int32. A CompressPlan row whose seq_len word equals this
#: is a padding row; a WritePlan row is padding when all its bytes are 0xFF.
INVALID_WORD = -1

#: Ragged ids and batch ids are stored in 16 bits.
MAX_Q_TOKENS = 65535

SUPPORTED_RATIOS = (4, 128)


class Addressing(enum.IntEnum):
    """How a (request, position) pair maps to a row of the compress state.

    SWA_PAGED: ``swa = full_to_state[req_to_token[rid, t]]``,
        ``row = (swa // swa_page_size) * ring_size + swa % ring_size``.
    REQUEST: ``row = rid * ring_size + t % ring_size`` (request-scoped rings,
        used by newer sglang for ratio 128).
    LEGACY: no paging. Ratio 4: ``page = 2 * rid + (t // 4) % 2``,
        ratio 128: ``page = rid``; ``row = page * ratio + t % ratio``.
    """

    SWA_PAGED = 0
    REQUEST = 1
    LEGACY = 2


def window_len(compress_ratio: int) -> int:
    """Rows pooled into one compressed token: 8 for ratio 4 (overlap), else ratio."""
    return 8 if compress_ratio == 4 else compress_ratio


def coff(compress_ratio: int) -> int:
    """2 for the overlapping ratio-4 compressor (two D-wide halves per token), else 1."""
    return 2 if compress_ratio == 4 else 1


def state_row_width(head_dim: int, compress_ratio: int) -> int:
    """Elements in one state row / one kv_score_input row: ``2 * coff * head_dim``."""
    return 2 * coff(compress_ratio) * head_dim


# ---------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------
ROPE_DIM = 64  # the last 64 elements of every compressed row are rotated

# ---------------------------------------------------------------------------
# Paged caches written by compress_norm_rope_store
# ---------------------------------------------------------------------------


class CacheFormat(enum.IntEnum):
    MAIN_FP8 = 0  # D = 512: 448 fp8 e4m3 (7 ue8m0 scales) + 64 bf16 rope
    MAIN_BF16 = 1  # D = 512: 512 bf16
    INDEXER_FP8 = 2  # D = 128: 128 fp8 e4m3 + one fp32 scale
    INDEXER_FP4 = 3  # D = 128: 64 bytes of packed e2m1 + 4 ue8m0 scales


class CacheLayout:
    """Where one compressed token lives inside a cache page.

    A page holds ``page_size`` tokens: first all token payloads (``slot_bytes``
    apart), then all per-token scale records (``scale_stride`` apart), then
    padding up to ``page_bytes``.
    """

    def __init__(self, fmt: CacheFormat, page_size: int):
        self.format = fmt
        self.page_size = page_size
        if fmt == CacheFormat.MAIN_FP8:
            self.slot_bytes, self.scale_stride, self.scale_bytes = 576, 8, 7
            self.page_bytes = math.ceil(584 * page_size / 576) * 576
        elif fmt == CacheFormat.MAIN_BF16:
            self.slot_bytes, self.scale_stride, self.scale_bytes = 1024, 0, 0
            self.page_bytes = 1024 * page_size
        elif fmt == CacheFormat.INDEXER_FP8:
            self.slot_bytes, self.scale_stride, self.scale_bytes = 128, 4, 4
            self.page_bytes = 132 * page_size
        elif fmt == CacheFormat.INDEXER_FP4:
            self.slot_bytes, self.scale_stride, self.scale_bytes = 64, 4, 4
            self.page_bytes = 68 * page_size
        else:  # pragma: no cover - enum is closed
            raise ValueError(f"unknown cache format {fmt}")
        #: byte offset of the scale region inside a page
        self.scale_base = self.slot_bytes * page_size

    def __repr__(self) -> str:
        return (
            f"CacheLayout({self.format.name}, page_size={self.page_size}, "
            f"page_bytes={self.page_bytes})"
        )


def cache_format(head_dim: int, use_fp4: bool, bf16_store: bool) -> CacheFormat:
    """The store format implied by sglang's flags (validated by the op checks)."""
    if head_dim == 512:
        return CacheFormat.MAIN_BF16 if bf16_store else CacheFormat.MAIN_FP8
    return CacheFormat.INDEXER_FP4 if use_fp4 else CacheFormat.INDEXER_FP8


def cache_page_bytes(head_dim: int, page_size: int, *, use_fp4: bool = False, bf16_store: bool = False) -> int:
    """Bytes per cache page for a compressor of ``head_dim`` (512 main, 128 indexer)."""
    return CacheLayout(cache_format(head_dim, use_fp4, bf16_store), page_size).page_bytes
