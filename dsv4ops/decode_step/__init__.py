"""Fused decode step: plan + compress_forward + compress_norm_rope_store in one op."""
