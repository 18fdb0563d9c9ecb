"""compress_forward (op, reference, Triton kernels)."""
from .op import compress_forward  # noqa: F401
