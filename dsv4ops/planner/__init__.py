"""Decode and prefill planners (op, reference, Triton kernels)."""
from .op import plan_decode, plan_prefill  # noqa: F401
