"""dsv4ops: DeepSeek-V4 KV compressor ops for compiled PyTorch.

Public API (mirrors ``sglang.jit_kernel.dsv4``)::

    from dsv4ops import (CompressorDecodePlan, CompressorPrefillPlan,
                         compress_forward, compress_norm_rope_store)

The ops themselves live in ``torch.ops.dsv4ops``: ``plan_decode``,
``plan_prefill``, ``compress_forward`` and ``compress_norm_rope_store``.
"""

from ._layout import Addressing, CacheFormat, CacheLayout, cache_page_bytes
from .api import (
    CompressorDecodePlan,
    CompressorPrefillPlan,
    compress_forward,
    compress_norm_rope_store,
    freqs_table,
)

__all__ = [
    "Addressing",
    "CacheFormat",
    "CacheLayout",
    "CompressorDecodePlan",
    "CompressorPrefillPlan",
    "cache_page_bytes",
    "compress_forward",
    "compress_norm_rope_store",
    "freqs_table",
]

__version__ = "0.1.0"
