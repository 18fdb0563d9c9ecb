"""compress_norm_rope_store (op, reference, Triton kernels)."""
from .op import compress_norm_rope_store  # noqa: F401
