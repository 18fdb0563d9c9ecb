"""Inductor sees exactly the tensors each Triton kernel writes, checked on any machine.

Under ``torch.compile`` / AOTInductor a kernel launched through ``wrap_triton`` is
functionalized from Inductor's own analysis of its Triton IR: a pointer argument counts as
written when a store address depends on it. The analysis stops at loads, but not at calls
of ``@triton.jit`` helpers: a pointer handed to a helper whose result feeds a store address
counts as written. An input that looks written (``seq_lens``, ``out_loc``, ``req_to_token``)
makes CUDA graphs skip the compiled graph ("mutated inputs") and can add copies. This test
runs that analysis (for an sm_90 target, no GPU needed) on every launch the ops make for
a set of serving steps and checks that the written pointers are the kernel's outputs, no more.

The kernels must be imported with ``TRITON_INTERPRET`` unset, so the driver test runs this
file's ``variant`` tests in a clean subprocess.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from _sm90 import run_variants_in_subprocess, sm90_driver

#: kernel -> the pointer arguments it writes (its outputs)
WRITES = {
    "_plan_decode_kernel": {"plan_ptr"},
    "_plan_prefill_kernel": {"plan_c_ptr", "plan_w_ptr"},
    "_decode_kernel": {"state_ptr", "out_ptr"},
    "_pool_c4_kernel": {"out_ptr"},
    "_pool_c128_kernel": {"out_ptr"},
    "_write_kernel": {"state_ptr"},
    "_store_main_kernel": {"cache_ptr"},
    "_store_indexer_kernel": {"cache_ptr"},
    "_decode_step_c4_kernel": {"state_ptr", "plan_ptr", "out_ptr", "cache_ptr"},
    "_decode_step_c128_pool_kernel": {"state_ptr", "plan_ptr", "out_ptr"},
    "_plan_online_decode_kernel": {"plan_ptr"},
    "_online_decode_kernel": {"state_ptr", "out_ptr"},
    "_online_prefill_kernel": {"out_ptr"},  # close segments; the write launch (IS_WRITE) stores the state
    "_online_prefill_kernel/IS_WRITE": {"state_ptr"},
    "_pool4_fwd_kernel": {"out_ptr"},
    "_pool128_fwd_kernel": {"out_ptr"},
    "_pool4_bwd_kernel": {"gx_ptr", "ws_ptr"},
    "_pool128_bwd_kernel": {"gx_ptr", "ws_ptr"},
    "_sum_partials_kernel": {"out_ptr"},
    "_norm_rope_fwd_kernel": {"y_ptr"},
    "_norm_rope_bwd_kernel": {"gx_ptr", "ws_ptr"},
}


def test_inductor_sees_exact_kernel_writes():
    run_variants_in_subprocess(__file__)


class _Capture:
    """Stands in for ``dsv4ops._triton.launch``: records (kernel, arguments) instead of launching."""

    launches: list = []

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            _Capture.launches.append((self.kernel, args, kwargs))

        return record


@pytest.fixture
def captured(monkeypatch):
    """Run the ops' CUDA path on CPU tensors with every launch recorded, not run."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter mode: the variants run in a subprocess without TRITON_INTERPRET")
    import dsv4ops  # noqa: F401

    for name, module in list(sys.modules.items()):
        if name.startswith("dsv4ops."):
            if hasattr(module, "use_triton"):
                monkeypatch.setattr(module, "use_triton", lambda t: True)
            if hasattr(module, "launch"):
                monkeypatch.setattr(module, "launch", _Capture)
    _Capture.launches = []
    return _Capture.launches


def _written(kernel, args, kwargs) -> set:
    """The pointer arguments Inductor's analysis counts as written, for an sm_90 target."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    named = dict(zip(kernel.arg_names, args), **kwargs)
    with sm90_driver():
        module, arg_names = wrap.generate_ttir(kernel, named, {})  # raises where the analysis would give up
        analyze = getattr(wrap, "identify_accessed_tensors", None)
        if analyze is not None:  # torch >= 2.12
            writes = {str(dep.name) for dep in analyze(kernel, named, {}).read_writes.writes}
        else:
            writes = set(wrap.identify_mutated_tensors(kernel, named, {}))
    return {name for name in writes if isinstance(named.get(name), torch.Tensor)}


def _check(launches):
    assert launches, "no kernel was launched"
    for kernel, args, kwargs in launches:
        name = kernel.fn.__name__
        key = f"{name}/IS_WRITE" if kwargs.get("IS_WRITE") else name
        assert _written(kernel, args, kwargs) == WRITES[key], f"{name} {sorted(kwargs.items(), key=str)}"


def _layer_steps(r, D, fused, **kw):
    from dsv4ops.layer import DeepSeekV4Compressor
    from dsv4ops.testing import PagedPools, make_batch

    bs = 3
    pools = PagedPools(max_requests=bs, max_seq_len=512, swa_page_size=128, full_page_size=256, device="cpu")
    layer = DeepSeekV4Compressor(32, D, r, state_rows=pools.state_rows(r, 8 if r == 4 else 128),
                                 cache_pages=pools.cache_pages(), cache_page_size=256 // r, swa_page_size=128,
                                 max_positions=512, fused_decode=fused, **kw)
    prefill = ([(i, 130 + 7 * i) for i in range(bs)], {}, False)
    decode = ([(i, 1) for i in range(bs)], {i: 255 + i for i in range(bs)}, True)
    for rows, seq, is_decode in (prefill, decode):
        batch = make_batch(rows, seq, decode=is_decode)
        out_loc = pools.out_loc([a for a, _ in batch.rows], [b for _, b in batch.rows], r)
        layer(torch.randn(batch.num_q_tokens, 32), batch.req_pool_indices, batch.seq_lens, batch.extend_lens,
              pools.req_to_token, pools.full_to_state, out_loc)


@pytest.mark.parametrize("r,D,kw", [(4, 512, {}), (4, 512, {"bf16_store": True}), (4, 128, {}),
                                    (4, 128, {"use_fp4": True}), (128, 512, {})])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_variant_compressor_layer_kernels(captured, r, D, kw, fused):
    _layer_steps(r, D, fused, **kw)
    _check(captured)


def test_variant_online_kernels(captured):
    from dsv4ops.online import kernels as ok

    D, bs = 128, 3
    rpi = torch.arange(bs, dtype=torch.int64)
    seq = torch.tensor([300, 129, 77])
    ext = torch.tensor([40, 129, 77])
    n = int(ext.sum())
    plan_c, plan_w = ok.plan_online_prefill(rpi, seq, ext, n, 0)
    state = torch.randn(bs, 3 * D)
    ok.compress_forward_online(state, torch.randn(n, 2 * D), torch.randn(128, D), plan_c, plan_w,
                               torch.empty(n, D), D)
    plan = ok.plan_online_decode(rpi, seq, 0)
    ok.compress_forward_online(state, torch.randn(bs, 2 * D), torch.randn(128, D), plan, None, torch.empty(bs, D), D)
    _check(captured)


@pytest.mark.parametrize("r", [4, 128])
def test_variant_train_kernels(captured, r):
    from dsv4ops.train import kernels as tk

    D = 512
    width = (4 if r == 4 else 2) * D
    kv_score, ape = torch.randn(2, 2 * r, width), torch.randn(8 if r == 4 else r, D)
    out = tk.compress_train(kv_score, ape, D, r)
    tk.compress_train_backward(torch.randn_like(out), kv_score, ape, D, r)
    x, w, freqs = torch.randn(5, D), torch.randn(D), torch.randn(64, 64)
    positions = torch.arange(5)
    tk.norm_rope(x, w, 1e-6, freqs, positions)
    tk.norm_rope_backward(torch.randn_like(x), x, w, 1e-6, freqs, positions)
    _check(captured)
