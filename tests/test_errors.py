"""Bad input: a clear error naming the argument, raised before any kernel runs."""

from __future__ import annotations

import re

import pytest
import torch

import dsv4ops
from dsv4ops import CompressorDecodePlan, CompressorPrefillPlan
from dsv4ops.testing import PagedPools

P = PagedPools(max_requests=4, max_seq_len=64, swa_page_size=16, full_page_size=32)
I64 = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731


def _prefill(**over):
    args = dict(compress_ratio=4, req_pool_indices=I64(0, 1), seq_lens=I64(9, 5), extend_lens=I64(9, 5),
                req_to_token=P.req_to_token, full_to_state=P.full_to_state, swa_page_size=16, ring_size=8,
                num_q_tokens=14)
    args.update(over)
    return CompressorPrefillPlan.generate(**args)


def _decode(**over):
    args = dict(compress_ratio=4, req_pool_indices=I64(0, 1), req_to_token=P.req_to_token,
                full_to_state=P.full_to_state, seq_lens=I64(9, 5), swa_page_size=16, ring_size=8)
    args.update(over)
    return CompressorDecodePlan.generate(**args)


PLANNER_CASES = {
    "ratio": (lambda: _decode(compress_ratio=8), ValueError, "`compress_ratio` must be 4 or 128"),
    "seq dtype": (lambda: _decode(seq_lens=torch.tensor([9.0, 5.0])), TypeError, "`seq_lens` must have dtype int32 or int64"),
    "seq shape": (lambda: _decode(seq_lens=I64(9, 5, 3)), ValueError, "`seq_lens` has 3 entries"),
    "rpi rank": (lambda: _decode(req_pool_indices=I64(0, 1)[None]), ValueError, "`req_pool_indices` must be 1-D"),
    "r2t dtype": (lambda: _decode(req_to_token=P.req_to_token.float()), TypeError, "`req_to_token` must have dtype"),
    "device": (lambda: _decode(req_to_token=P.req_to_token.to("meta")), ValueError, "`req_to_token` is on meta"),
    "ring": (lambda: _decode(ring_size=6), ValueError, "`ring_size` must be a positive multiple of compress_ratio=4"),
    "sps": (lambda: _decode(swa_page_size=20), ValueError, "`swa_page_size` must be a positive multiple of ring_size=8"),
    "request c4": (lambda: _decode(addressing="request"), ValueError, "request-scoped addressing"),
    "addressing": (lambda: _decode(addressing="paged"), ValueError, "`addressing` must be 'swa' or 'request'"),
    "num_q_tokens": (lambda: _prefill(num_q_tokens=65536), ValueError, "`num_q_tokens` must be <= 65535"),
    "extend > seq": (lambda: _prefill(extend_lens=I64(9, 6)), ValueError, re.escape("`extend_lens[1]`=6 is larger than `seq_lens[1]`=5")),
    "negative": (lambda: _prefill(extend_lens=I64(-1, 5)), ValueError, "must be non-negative"),
    "sum > num_q": (lambda: _prefill(num_q_tokens=12), ValueError, re.escape("sum(`extend_lens`)=14 exceeds `num_q_tokens`=12")),
    "ext dtype": (lambda: _prefill(extend_lens=torch.tensor([9.0, 5.0])), TypeError, "`extend_lens` must have dtype"),
}


@pytest.mark.parametrize("case", list(PLANNER_CASES))
def test_planner_errors(case):
    fn, exc, msg = PLANNER_CASES[case]
    with pytest.raises(exc, match=msg):
        fn()


def test_planner_op_checks_num_q_tokens_directly():
    with pytest.raises(ValueError, match="`num_q_tokens` must be <= 65535"):
        torch.ops.dsv4ops.plan_prefill(I64(0), P.req_to_token, P.full_to_state, I64(3), I64(3), 70000, 4, 16, 8, 0)


# ---------------------------------------------------------------------------
# compress_forward
# ---------------------------------------------------------------------------

D = 128


def _call_leaving_unchanged(fn, kwargs, mutated):
    """Call ``fn(**kwargs)``; whatever it raises, ``mutated`` must be as it was (errors come before writes)."""
    before = mutated.clone()
    try:
        return fn(**kwargs)
    finally:
        assert torch.equal(mutated, before), "an error must be raised before anything is written"


def _compress(**over):
    plan = _decode(seq_lens=I64(8, 5))
    args = dict(kv_score_buffer=torch.zeros(P.state_rows(4, 8), 4 * D), kv_score_input=torch.randn(2, 4 * D),
                ape=torch.randn(8, D), plan=plan, head_dim=D, compress_ratio=4)
    args.update(over)
    return _call_leaving_unchanged(dsv4ops.compress_forward, args, args["kv_score_buffer"])


COMPRESS_CASES = {
    "plan ratio": (lambda: _compress(plan=CompressorDecodePlan(128, _decode().plan_d)), ValueError,
                   "`plan` was built for compress_ratio=128 but `compress_ratio`=4"),
    "plan type": (lambda: _compress(plan=(4, _decode().plan_d)), TypeError, "`plan` must be a CompressorDecodePlan"),
    "head_dim": (lambda: _compress(head_dim=96), ValueError, "`head_dim` must be a positive multiple of 128"),
    "input width": (lambda: _compress(kv_score_input=torch.randn(2, 2 * D)), ValueError, "`kv_score_input` must have size 512 in dim 1"),
    "input dtype": (lambda: _compress(kv_score_input=torch.randn(2, 4 * D).double()), TypeError, "`kv_score_input` must have dtype"),
    "state dtype": (lambda: _compress(kv_score_buffer=torch.zeros(16, 4 * D, dtype=torch.float16)), TypeError, "`kv_score_buffer` must have dtype float32 or bfloat16"),
    "state shape": (lambda: _compress(kv_score_buffer=torch.zeros(4, 8, 4 * D)), ValueError, "`kv_score_buffer` must be viewed as"),
    "state strided": (lambda: _compress(kv_score_buffer=torch.zeros(16, 8 * D)[:, ::2]), ValueError, "`kv_score_buffer` must be contiguous"),
    "ape shape": (lambda: _compress(ape=torch.randn(4, D)), ValueError, "`ape` must have size 8 in dim 0"),
    "decode rows": (lambda: _compress(kv_score_input=torch.randn(3, 4 * D)), ValueError, "decode: `kv_score_input` has 3 rows but the plan has 2"),
    "out rows": (lambda: _compress(out=torch.empty(5, D)), ValueError, "`out` has 5 rows but the plan has 2"),
    "out dtype": (lambda: _compress(out=torch.empty(2, D, dtype=torch.int32)), TypeError, "`out` must have dtype"),
    "plan dtype": (lambda: _compress(plan=CompressorDecodePlan(4, _decode().plan_d.view(torch.int32))), TypeError, "`plan` must have dtype uint8"),
    "device": (lambda: _compress(ape=torch.randn(8, D, device="meta")), ValueError, "`ape` is on meta"),
    "online ratio": (lambda: _compress(is_online=True), ValueError, "`is_online=True` needs compress_ratio=128"),
}


@pytest.mark.parametrize("case", list(COMPRESS_CASES))
def test_compress_errors(case):
    fn, exc, msg = COMPRESS_CASES[case]
    with pytest.raises(exc, match=msg):
        fn()


# ---------------------------------------------------------------------------
# compress_norm_rope_store
# ---------------------------------------------------------------------------


def _store(head_dim=512, **over):
    plan = _decode(seq_lens=I64(8, 5))
    args = dict(kv=torch.randn(2, head_dim), plan=plan, norm_weight=torch.ones(head_dim), norm_eps=1e-6,
                freq_cis=torch.randn(64, 64), out_loc=I64(3, 4),
                kvcache=torch.zeros(2, dsv4ops.cache_page_bytes(head_dim, 64), dtype=torch.uint8), page_size=64)
    args.update(over)
    return _call_leaving_unchanged(dsv4ops.compress_norm_rope_store, args, args["kvcache"])


STORE_CASES = {
    "head_dim": (lambda: _store(kv=torch.randn(2, 256)), ValueError, "`kv` rows must have head_dim 512 .* or 128"),
    "fp4 main": (lambda: _store(use_fp4=True), ValueError, "`use_fp4=True` needs the 128-wide indexer rows"),
    "bf16 indexer": (lambda: _store(128, bf16_store=True, kvcache=torch.zeros(2, 8448, dtype=torch.uint8)), ValueError, "`bf16_store=True` needs head_dim 512"),
    "page_size": (lambda: _store(page_size=48), ValueError, "`page_size` must be a positive power of two"),
    "cache dtype": (lambda: _store(kvcache=torch.zeros(2, 37440, dtype=torch.int8)), TypeError, "`kvcache` must have dtype uint8"),
    "cache size": (lambda: _store(kvcache=torch.zeros(2, 37440 - 64, dtype=torch.uint8)), ValueError, "`kvcache` must hold whole pages of 37440 bytes"),
    "freqs": (lambda: _store(freq_cis=torch.randn(64, 32)), ValueError, "`freqs` must have size 64 in dim 1"),
    "out_loc dtype": (lambda: _store(out_loc=torch.tensor([3.0, 4.0])), TypeError, "`out_loc` must have dtype int32 or int64"),
    "out_loc size": (lambda: _store(out_loc=I64(3)), ValueError, "decode: `out_loc` has 1 entries for 2 rows"),
    "weight": (lambda: _store(norm_weight=torch.ones(128)), ValueError, "`norm_weight` must have size 512 in dim 0"),
    "plan rows": (lambda: _store(kv=torch.randn(3, 512)), ValueError, "`plan` has 2 rows but `kv` has 3"),
    "device": (lambda: _store(out_loc=I64(3, 4).to("meta")), ValueError, "`out_loc` is on meta"),
}


@pytest.mark.parametrize("case", list(STORE_CASES))
def test_store_errors(case):
    fn, exc, msg = STORE_CASES[case]
    with pytest.raises(exc, match=msg):
        fn()


def test_errors_also_raise_under_torch_compile():
    """The fake kernels run the same checks, so a compiled model fails at trace time with the same message."""

    def step(kv, cache):
        dsv4ops.compress_norm_rope_store(kv, _decode(seq_lens=I64(8, 5)), norm_weight=torch.ones(512), norm_eps=1e-6,
                                         freq_cis=torch.randn(64, 64), out_loc=I64(3, 4), kvcache=cache, page_size=48)

    with pytest.raises(Exception, match="`page_size` must be a positive power of two"):
        torch.compile(step, fullgraph=True)(torch.randn(2, 512), torch.zeros(2, 37440, dtype=torch.uint8))


def test_same_errors_on_every_device(device):
    """The checks are device-agnostic: CUDA inputs get the same messages as CPU ones."""
    to = lambda t: t.to(device)  # noqa: E731
    plan = CompressorDecodePlan(4, to(_decode().plan_d))
    with pytest.raises(TypeError, match="`kv_score_input` must have dtype"):
        dsv4ops.compress_forward(to(torch.zeros(16, 4 * D)), to(torch.zeros(2, 4 * D, dtype=torch.float64)),
                                 to(torch.zeros(8, D)), plan, head_dim=D, compress_ratio=4)
    with pytest.raises(ValueError, match="`page_size` must be a positive power of two"):
        dsv4ops.compress_norm_rope_store(to(torch.zeros(2, 512)), plan, norm_weight=to(torch.ones(512)), norm_eps=1e-6,
                                         freq_cis=to(torch.zeros(8, 64)), out_loc=to(I64(0, 1)),
                                         kvcache=to(torch.zeros(1, 37440, dtype=torch.uint8)), page_size=3)
    with pytest.raises(ValueError, match="`compress_ratio` must be 4 or 128"):
        CompressorDecodePlan.generate(5, to(I64(0)), to(P.req_to_token), to(P.full_to_state), to(I64(3)), 16, 8)
