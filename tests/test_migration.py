"""Migration check: sglang's compressor call site (tests/_sglang_callsite.py, a faithful retype of
compressor_v2.py whose only change is the import line) driven through a chunked-prefill + decode
sequence by a stand-in sglang runtime, with every result checked against independent oracles:

* every compressed row against the model-level formula (golden.compress_loop.compressed_token_truth)
  from the raw kv/score rows of its request;
* the set of emitted tokens against the positions that complete a window, every other row zero;
* plan bytes against the golden planner loops (offline plans);
* the final cache bytes against the golden store loop applied to the emitted rows with a plan and
  slots built here, into an equally poisoned cache (so nothing else may have been written).

The model: layer 0 has a ratio-4 core compressor (D=512, FP8 cache) and a ratio-4 indexer compressor
(D=128, FP8 or FP4 cache) sharing one c4 plan; layer 1 has a ratio-128 core compressor (D=512), in
the offline ring form or, with sglang's SGLANG_OPT_USE_ONLINE_COMPRESS, the online form.
"""

from __future__ import annotations

import copy
import math
import struct
from dataclasses import dataclass
from types import SimpleNamespace
from typing import List, Optional

import pytest
import torch

import _sglang_callsite as sgl
from dsv4ops.testing import PagedPools

from _asserts import assert_caches_equivalent, assert_same_bits
from golden.compress_loop import compressed_token_truth
from golden.planner_loop import compress_plan_rows, plan_decode_loop, plan_prefill_loop
from golden.store_loop import page_bytes_of, store_loop

FULL_PAGE, SWA_PAGE = 256, 128
MAX_REQUESTS, MAX_LEN = 6, 512
POISON = 0xA5
INVALID = 0xFFFFFFFF
ONLINE_SLOT_OFFSET = 1


def _freqs_cis(max_pos: int, rope_dim: int = 64, theta: float = 10000.0) -> torch.Tensor:
    """sglang keeps the RoPE table complex: ``[max_pos, rope_dim // 2]``."""
    inv = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


# ---------------------------------------------------------------------------
# A stand-in for the pieces of sglang the call site touches
# ---------------------------------------------------------------------------

class FakeCompressor:
    """The attributes sglang's ``Compressor`` exposes to the backend, plus the raw rows it projects."""

    def __init__(self, ratio, head_dim, *, is_in_indexer, state_rows, online, freqs_cis, gen):
        coff = 2 if ratio == 4 else 1
        self.ratio, self.head_dim = ratio, head_dim
        self.is_in_indexer = self.rotate = is_in_indexer
        self.ape = torch.randn(ratio, coff * head_dim, generator=gen)  # checkpoint layout
        self.norm = SimpleNamespace(weight=1 + 0.1 * torch.randn(head_dim, generator=gen), variance_epsilon=1e-6)
        self.freqs_cis = freqs_cis
        self.width = 2 * coff * head_dim
        self.raw = torch.randn(MAX_REQUESTS, MAX_LEN, self.width, generator=gen) * 2
        state_width = 3 * head_dim if online else self.width
        kv_score = torch.full((state_rows, state_width), float("nan"))
        self._state_pool = SimpleNamespace(kv_score_buffer=SimpleNamespace(kv_score=kv_score))

    @property
    def state(self) -> torch.Tensor:
        return self._state_pool.kv_score_buffer.kv_score

    def compute_kv_score(self, x, forward_batch):
        rid = torch.tensor([a for a, _ in forward_batch.rows], dtype=torch.long)
        pos = torch.tensor([b for _, b in forward_batch.rows], dtype=torch.long)
        rows = self.raw[rid, pos]
        padding = forward_batch.num_q_tokens - rows.shape[0]  # CUDA-graph padding rows hold garbage
        return torch.cat([rows, torch.randn(padding, self.width) * 1e3])

    def get_state_pool(self, backend):
        return self._state_pool


class FakeTokenToKVPool:
    """``DeepSeekV4TokenToKVPool``'s mapping and the compressed caches (fp8-typed, as sglang's)."""

    def __init__(self, pools: PagedPools, core: dict, indexer: dict, use_fp4: bool):
        self.swa_page_size = pools.swa_page_size
        self.full_to_swa_index_mapping = pools.full_to_state
        self.layer_mapping, self._extra, self._extra_page, self._index_k = {}, {}, {}, {}
        for layer_id, comp in core.items():
            page = FULL_PAGE // comp.ratio
            self._extra_page[layer_id] = page
            self._extra[layer_id] = self._cache(pools, comp.head_dim, page, False)
            self.layer_mapping[layer_id] = (None, None, SimpleNamespace())
        for layer_id, comp in indexer.items():
            self._index_k[layer_id] = self._cache(pools, comp.head_dim, self.get_index_k_page_size(), use_fp4)

    @staticmethod
    def _cache(pools, head_dim, page_size, use_fp4):
        raw = torch.full((pools.cache_pages(), page_bytes_of(head_dim, page_size, use_fp4)), POISON, dtype=torch.uint8)
        return raw.view(torch.float8_e4m3fn)

    def get_ring_size(self, compress_ratio: int) -> int:
        return 8 if compress_ratio == 4 else 128

    def get_extra_key_buffer(self, layer_id):
        return self._extra[layer_id]

    def get_extra_key_page_size(self, layer_id):
        return self._extra_page[layer_id]

    def get_index_k_with_scale_buffer(self, layer_id):
        return self._index_k[layer_id]

    def get_index_k_page_size(self):
        return FULL_PAGE // 4


class FakeForwardMode:
    def __init__(self, decode: bool):
        self.decode = decode

    def is_idle(self) -> bool:
        return False

    def is_decode(self) -> bool:
        return self.decode


@dataclass
class FakeForwardBatch:
    forward_mode: FakeForwardMode
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: Optional[torch.Tensor]
    seq_lens_cpu: Optional[List[int]]
    extend_lens_cpu: Optional[List[int]]
    num_q_tokens: int
    use_cuda_graph: bool
    rows: List[tuple]  # (rid, position) of every ragged row (test bookkeeping)


class FakeBackend(sgl.CompressorBackendMixin):
    def __init__(self, pools, token_to_kv_pool, fp4_indexer):
        self.pools = pools
        self.token_to_kv_pool = token_to_kv_pool
        self.enable_deepseek_v4_fp4_indexer = fp4_indexer
        self.forward_metadata = None

    def init_forward_metadata(self, fb: FakeForwardBatch):
        """What the DSV4 attention backend does once per forward: one plan and one out_loc per ratio."""
        meta = {}
        for r in (4, 128):
            meta[f"c{r}_compress_metadata"] = sgl.create_paged_compressor_data(
                r, is_prefill=not fb.forward_mode.is_decode(), token_to_kv_pool=self.token_to_kv_pool,
                req_to_token=self.pools.req_to_token, req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens,
                extend_lens=fb.extend_lens, seq_lens_cpu=fb.seq_lens_cpu, extend_lens_cpu=fb.extend_lens_cpu,
                use_prefill_cuda_graph=fb.use_cuda_graph, num_q_tokens=fb.num_q_tokens,
                online_state_slot_offset=ONLINE_SLOT_OFFSET,
            )
        core = {f"c{r}_out_loc": self._out_loc(fb, r) for r in (4, 128)}
        self.forward_metadata = SimpleNamespace(core_metadata=SimpleNamespace(**core), **meta)

    def _out_loc(self, fb, r):
        # sglang's c{r}_out_loc: the compressed slot of a token that completes a window, 0 elsewhere
        r2t = self.pools.req_to_token
        locs = [int(r2t[rid, pos]) // r if (pos + 1) % r == 0 else 0 for rid, pos in fb.rows]
        locs += [0] * (fb.num_q_tokens - len(fb.rows))
        return torch.tensor(locs, dtype=torch.int64)


# ---------------------------------------------------------------------------
# The serving sequence
# ---------------------------------------------------------------------------

SCHEDULE = [
    ("prefill", {0: 140, 1: 131, 2: 126}, dict(host=True)),  # host lengths (seq_lens_cpu)
    ("prefill", {0: 101, 1: 124}, dict(host=False, pad=5)),  # device lengths, CUDA-graph padded
    ("decode", [0, 1, 2], {}),  # request 1 reaches 256, request 2 reaches 128 in these decodes
    ("decode", [0, 1, 2], {}),
    ("decode", [0, 1, 2], {}),
    ("decode", [2, 0], {}),
    ("prefill", {3: 133, 2: 1}, dict(host=True)),  # a new request and a one-token extend
    ("decode", [0, 1, 2, 3], {}),
    ("decode", [3, 1], {}),
]


def _forward_batch(kind, reqs, opts, seq):
    decode = kind == "decode"
    items = [(rid, 1) for rid in reqs] if decode else list(reqs.items())
    rows, seq_lens, ext = [], [], []
    for rid, n in items:
        start = seq.get(rid, 0)
        rows += [(rid, p) for p in range(start, start + n)]
        seq_lens.append(start + n)
        ext.append(n)
    host = opts.get("host", False)
    return FakeForwardBatch(
        forward_mode=FakeForwardMode(decode), req_pool_indices=torch.tensor([rid for rid, _ in items], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), extend_lens=None if decode else torch.tensor(ext, dtype=torch.int32),
        seq_lens_cpu=seq_lens if host else None, extend_lens_cpu=ext if host else None,
        num_q_tokens=len(rows) + opts.get("pad", 0), use_cuda_graph=not host and not decode, rows=rows,
    )


class Model:
    """Two DeepSeek-V4 layers' compressors over one token-to-KV pool."""

    def __init__(self, *, online: bool, fp4_indexer: bool, seed: int = 0):
        sgl.envs.SGLANG_OPT_USE_ONLINE_COMPRESS.value = online
        gen = torch.Generator().manual_seed(seed)
        self.online = online
        self.pools = PagedPools(max_requests=MAX_REQUESTS, max_seq_len=MAX_LEN, swa_page_size=SWA_PAGE,
                                full_page_size=FULL_PAGE, seed=seed)
        freqs = _freqs_cis(MAX_LEN)
        swa_rows = lambda r: self.pools.num_swa_pages * (8 if r == 4 else 128)  # noqa: E731  (SWA-scoped ring)
        self.c4 = FakeCompressor(4, 512, is_in_indexer=False, state_rows=swa_rows(4), online=False, freqs_cis=freqs, gen=gen)
        self.c4_indexer = FakeCompressor(4, 128, is_in_indexer=True, state_rows=swa_rows(4), online=False,
                                         freqs_cis=freqs, gen=gen)
        rows128 = MAX_REQUESTS + ONLINE_SLOT_OFFSET if online else swa_rows(128)
        self.c128 = FakeCompressor(128, 512, is_in_indexer=False, state_rows=rows128, online=online, freqs_cis=freqs, gen=gen)
        self.layers = [(0, [self.c4, self.c4_indexer]), (1, [self.c128])]
        pool = FakeTokenToKVPool(self.pools, {0: self.c4, 1: self.c128}, {0: self.c4_indexer}, fp4_indexer)
        self.backend = FakeBackend(self.pools, pool, fp4_indexer)
        self.fp4_indexer = fp4_indexer

    def cache_of(self, comp) -> torch.Tensor:
        pool = self.backend.token_to_kv_pool
        layer_id = 0 if comp.ratio == 4 else 1
        buf = pool.get_index_k_with_scale_buffer(layer_id) if comp.is_in_indexer else pool.get_extra_key_buffer(layer_id)
        return buf.view(torch.uint8)

    def page_size_of(self, comp) -> int:
        pool = self.backend.token_to_kv_pool
        return pool.get_index_k_page_size() if comp.is_in_indexer else pool.get_extra_key_page_size(0 if comp.ratio == 4 else 1)

    def forward(self, fb, record):
        self.backend.init_forward_metadata(fb)
        x = torch.zeros(fb.num_q_tokens, 1)  # hidden states; FakeCompressor projects from its raw rows
        outs = {}
        for layer_id, comps in self.layers:
            for comp in comps:
                self.backend.forward_unified(x, fb, layer_id, comp)
                outs[id(comp)] = record.pop()
                assert not record
        return outs


@pytest.fixture
def recorder(monkeypatch):
    """Keeps what ``compress_forward`` returned at the call site (sglang discards it there)."""
    calls = []
    real = sgl.compress_forward

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out)
        return out

    monkeypatch.setattr(sgl, "compress_forward", recording)
    yield calls
    sgl.envs.SGLANG_OPT_USE_ONLINE_COMPRESS.value = False


# ---------------------------------------------------------------------------
# Oracles
# ---------------------------------------------------------------------------

def _emitted_rows(comp, fb, plan, out):
    """[(rid, pos, out row)] of the compressed tokens this forward produced; other rows must be zero."""
    r = comp.ratio
    completing = {(rid, pos) for rid, pos in fb.rows if (pos + 1) % r == 0}
    emitted = []
    if fb.forward_mode.is_decode():
        for b, (rid, pos) in enumerate(fb.rows):
            if (rid, pos) in completing:
                emitted.append((rid, pos, b))
    else:
        for k, (seq_len, ragged, *_rest) in enumerate(compress_plan_rows(plan.plan_c)):
            if seq_len == INVALID:
                continue
            rid, pos = fb.rows[ragged]
            assert pos + 1 == seq_len, f"plan row {k}: ragged row {ragged} is position {pos}, seq_len {seq_len}"
            emitted.append((rid, pos, k))
    assert {(rid, pos) for rid, pos, _ in emitted} == completing, "emitted tokens differ from the completed windows"
    assert len(emitted) == len(completing), "a compressed token was emitted twice"
    silent = torch.ones(out.shape[0], dtype=torch.bool)
    silent[[k for _, _, k in emitted]] = False
    assert torch.count_nonzero(out[silent]) == 0, "rows without a compressed token are not zero"
    return emitted


def _check_offline_plan(model, fb, r, plan):
    p = model.pools
    ring = 8 if r == 4 else 128
    if fb.forward_mode.is_decode():
        want = plan_decode_loop(fb.req_pool_indices, fb.seq_lens, p.req_to_token, p.full_to_state, r, SWA_PAGE, ring, "swa")
        assert torch.equal(plan.plan_d, want), f"c{r} decode plan differs from the golden planner"
    else:
        want_c, want_w = plan_prefill_loop(fb.req_pool_indices, fb.seq_lens, fb.extend_lens, p.req_to_token,
                                           p.full_to_state, fb.num_q_tokens, r, SWA_PAGE, ring, "swa")
        assert torch.equal(plan.plan_c, want_c) and torch.equal(plan.plan_w, want_w), f"c{r} prefill plan differs"


def _expected_cache(model, comp, stored):
    """Poisoned cache + the golden store of every emitted row at its slot (plan rows built here)."""
    r = comp.ratio
    cache = torch.full_like(model.cache_of(comp), POISON)
    if not stored:
        return cache
    rows = torch.stack([row for row, _, _ in stored])
    # DecodePlan rows: only seq_len is read by the store; position = seq_len - r
    plan = torch.tensor([[r * (n + 1), 0, 0, 0] for _, n, _ in stored], dtype=torch.int32).view(torch.uint8)
    locs = torch.tensor([loc for _, _, loc in stored], dtype=torch.int64)
    store_loop(rows, plan, comp.norm.weight, comp.norm.variance_epsilon, comp.freqs_cis, locs, cache, True, r,
               model.page_size_of(comp), comp.is_in_indexer and model.fp4_indexer, False)
    return cache


def _run_sequence(model, record, *, check_plans=True):
    seq, stored = {}, {id(c): [] for _, comps in model.layers for c in comps}
    counts = {key: {"prefill": 0, "decode": 0} for key in stored}
    for kind, reqs, opts in SCHEDULE:
        fb = _forward_batch(kind, reqs, opts, seq)
        outs = model.forward(fb, record)
        for _, comps in model.layers:
            for comp in comps:
                r, D = comp.ratio, comp.head_dim
                plan = getattr(model.backend.forward_metadata, f"c{r}_compress_metadata")
                out = outs[id(comp)]
                assert out.shape == (plan[1].shape[0], D) and out.dtype == torch.float32
                if check_plans and not (r == 128 and model.online):
                    _check_offline_plan(model, fb, r, plan)
                ape = comp.ape.view(-1, D).double()
                for rid, pos, k in _emitted_rows(comp, fb, plan, out):
                    n = pos // r
                    want = compressed_token_truth(comp.raw[rid, : r * (n + 1)].double(), ape, n, r, D)
                    torch.testing.assert_close(out[k].double(), want, rtol=2e-5, atol=2e-5,
                                               msg=lambda m: f"c{r} D{D} request {rid} token {n}: {m}")
                    slot = int(model.pools.req_to_token[rid, pos]) // r
                    stored[id(comp)].append((out[k], n, slot))
                    counts[id(comp)][kind] += 1
        for rid, pos in fb.rows:
            seq[rid] = pos + 1
    return stored, counts


@pytest.mark.parametrize("online,fp4_indexer", [(False, False), (False, True), (True, False)],
                         ids=["offline", "offline-fp4-indexer", "online-c128"])
def test_sglang_call_site_runs_unchanged_and_correct(recorder, online, fp4_indexer):
    model = Model(online=online, fp4_indexer=fp4_indexer)
    stored, counts = _run_sequence(model, recorder)
    # every compressor emitted tokens from prefill and from decode; c128 crossed boundaries in both
    c4, c128 = counts[id(model.c4)], counts[id(model.c128)]
    assert c4["prefill"] > 100 and c4["decode"] >= 5 and counts[id(model.c4_indexer)] == c4, counts
    assert c128["prefill"] >= 3 and c128["decode"] >= 2, c128
    for _, comps in model.layers:
        for comp in comps:
            want = _expected_cache(model, comp, stored[id(comp)])
            got = model.cache_of(comp)
            bad = (got != want).nonzero()
            assert bad.numel() == 0, f"c{comp.ratio} D{comp.head_dim}: {bad.shape[0]} cache bytes differ, first {bad[:4].tolist()}"


def test_call_site_as_a_compiled_region(recorder):
    """``_forward_compress_all_in_one`` under ``torch.compile(fullgraph=True)`` (the plan is read
    from the metadata inside the region) matches the eager call site: same rows, same state,
    equivalent caches."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from dsv4ops._layout import CacheLayout, cache_format

    torch._dynamo.reset()
    eager, compiled = Model(online=False, fp4_indexer=False), Model(online=False, fp4_indexer=False)
    for m in (eager, compiled):  # one layer keeps the compile count low: the c4 core compressor
        m.layers = [(0, [m.c4])]
    counter = CompileCounterWithBackend("inductor")
    region = torch.compile(compiled.backend._forward_compress_all_in_one, backend=counter, fullgraph=True)
    compiled.backend._forward_compress_all_in_one = region
    seq, locs = {}, []
    for kind, reqs, opts in SCHEDULE[:4] + SCHEDULE[6:8]:
        fb = _forward_batch(kind, reqs, opts, seq)
        want = eager.forward(fb, recorder)[id(eager.c4)]
        got = compiled.forward(fb, recorder)[id(compiled.c4)]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        locs.append(eager.backend.forward_metadata.core_metadata.c4_out_loc)
        for rid, pos in fb.rows:
            seq[rid] = pos + 1
    # automatic dynamic shapes: one static and one dynamic graph each for prefill and decode plans
    assert counter.frame_count <= 4, counter.frame_count
    assert_same_bits(compiled.c4.state, eager.c4.state, "state")
    layout = CacheLayout(cache_format(512, False, False), FULL_PAGE // 4)
    live = torch.cat(locs)
    assert_caches_equivalent(compiled.cache_of(compiled.c4), eager.cache_of(eager.c4), live[live > 0], layout)
