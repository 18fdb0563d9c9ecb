"""dsv4ops: DeepSeek-V4 KV compressor ops for compiled PyTorch.

Public API (mirrors ``sglang.jit_kernel.dsv4``)::

    from dsv4ops import (CompressorDecodePlan, CompressorPrefillPlan,
                         compress_forward, compress_norm_rope_store)

The ops themselves live in ``torch.ops.dsv4ops``: ``plan_decode``,
``plan_prefill``, ``compress_forward`` and ``compress_norm_rope_store``, plus the fused
``compress_decode_step`` (all three for one decode step).
"""

from ._layout import Addressing, CacheFormat, CacheLayout, cache_page_bytes
from .api import (
    CompressorDecodePlan,
    CompressorPrefillPlan,
    compress_decode_step,
    compress_forward,
    compress_norm_rope_store,
    freqs_table,
)
from .train import ape_window_layout, compress_train, norm_rope  # noqa: F401  (training ops, docs/training.md)

__all__ = [
    "Addressing",
    "CacheFormat",
    "CacheLayout",
    "CompressorDecodePlan",
    "CompressorPrefillPlan",
    "cache_page_bytes",
    "compress_decode_step",
    "compress_forward",
    "compress_norm_rope_store",
    "freqs_table",
]

__version__ = "0.1.0"
