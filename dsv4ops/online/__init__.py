"""Online ratio-128 compressor (op, reference, Triton kernels)."""
from .op import compress_forward_online, plan_online_decode, plan_online_prefill  # noqa: F401
