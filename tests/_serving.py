"""A small serving simulator driving the public API the way sglang does.

It keeps the raw kv/score row of every (request, position) so that every
compressed token can be checked against the model-level formula, and it can
replay every step through the golden loops to compare plans, state and cache
bytes. Used by the serving, compile and kernel tests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

import dsv4ops
from dsv4ops import Addressing, CompressorDecodePlan, CompressorPrefillPlan
from dsv4ops._layout import CacheLayout, cache_format, state_row_width, window_len
from dsv4ops.layer import rope_freqs_table
from dsv4ops.testing import PagedPools, make_batch

POISON_BYTE = 0xA5

ADDRESSING_NAME = {Addressing.SWA_PAGED: "swa", Addressing.REQUEST: "request", Addressing.LEGACY: "legacy"}


@dataclass
class StepRecord:
    batch: object
    plan: object
    kv_score_input: torch.Tensor
    out: torch.Tensor
    out_loc: torch.Tensor
    emitted: List[Tuple[int, int, int]]  # (rid, chunk index n, out row)


@dataclass
class ServingSim:
    compress_ratio: int
    head_dim: int
    ring_size: Optional[int] = None
    swa_page_size: int = 16
    full_page_size: int = 32
    max_requests: int = 8
    max_seq_len: int = 160
    state_dtype: torch.dtype = torch.float32
    addressing: Addressing = Addressing.SWA_PAGED
    use_fp4: bool = False
    bf16_store: bool = False
    device: str = "cpu"
    seed: int = 0
    input_dtype: torch.dtype = torch.float32
    golden: bool = False  # replay every step through the golden loops and compare
    steps: List[StepRecord] = field(default_factory=list)

    def __post_init__(self):
        r = self.compress_ratio
        if self.ring_size is None:
            self.ring_size = window_len(r)
        gen = torch.Generator().manual_seed(self.seed)
        self.pools = PagedPools(
            max_requests=self.max_requests, max_seq_len=self.max_seq_len, swa_page_size=self.swa_page_size,
            full_page_size=self.full_page_size, seed=self.seed, device=self.device,
        )
        self.width = state_row_width(self.head_dim, r)
        rows = self.pools.state_rows(r, self.ring_size, self.addressing)
        rows = -(-rows // r) * r
        self.state = torch.full((rows, self.width), float("nan"), dtype=self.state_dtype, device=self.device)
        L = self.pools.max_seq_len
        self.tokens = (torch.randn(self.max_requests, L, self.width, generator=gen) * 2).to(self.input_dtype).float()
        self.ape = (torch.randn(window_len(r), self.head_dim, generator=gen)).to(self.device)
        self.norm_weight = (1 + 0.2 * torch.randn(self.head_dim, generator=gen)).to(self.device)
        self.freqs = rope_freqs_table(L + 8).to(self.device)
        fmt = cache_format(self.head_dim, self.use_fp4, self.bf16_store)
        self.layout = CacheLayout(fmt, self.full_page_size // r)
        self.cache = torch.full(
            (self.pools.cache_pages(), self.layout.page_bytes), POISON_BYTE, dtype=torch.uint8, device=self.device
        )
        self.seq: Dict[int, int] = {}
        self.stores = self.head_dim in (128, 512)  # the store op exists for these widths only

    # ---------------------------------------------------------------- workload
    def share_prefix(self, dst: int, src: int, num_tokens: int) -> None:
        """Request ``dst`` starts with ``src``'s first ``num_tokens`` tokens, already in the cache."""
        assert self.seq.get(src, 0) >= num_tokens and self.seq.get(dst, 0) == 0
        self.pools.share_prefix(dst, src, num_tokens)
        self.tokens[dst, :num_tokens] = self.tokens[src, :num_tokens]
        self.seq[dst] = num_tokens

    def plan_for(self, batch):
        r, name = self.compress_ratio, ADDRESSING_NAME[self.addressing]
        p = self.pools
        if self.addressing == Addressing.LEGACY:
            if batch.is_decode:
                return CompressorDecodePlan.generate_legacy(r, batch.req_pool_indices.to(self.device), batch.seq_lens)
            return CompressorPrefillPlan.generate_legacy(
                r, batch.req_pool_indices.to(self.device), batch.seq_lens, batch.extend_lens, batch.num_q_tokens
            )
        rpi = batch.req_pool_indices.to(self.device)
        if batch.is_decode:
            return CompressorDecodePlan.generate(
                r, rpi, p.req_to_token, p.full_to_state, batch.seq_lens.to(self.device), self.swa_page_size,
                self.ring_size, addressing=name,
            )
        return CompressorPrefillPlan.generate(
            r, rpi, batch.seq_lens, batch.extend_lens, p.req_to_token, p.full_to_state, self.swa_page_size,
            self.ring_size, batch.num_q_tokens, addressing=name,
        )

    def inputs_for(self, batch) -> torch.Tensor:
        rid = torch.tensor([a for a, _ in batch.rows], dtype=torch.long)
        pos = torch.tensor([b for _, b in batch.rows], dtype=torch.long)
        rows = self.tokens[rid, pos] if len(batch.rows) else self.tokens.new_zeros((0, self.width))
        padding = batch.num_q_tokens - len(batch.rows)  # padded prefill rows hold garbage
        rows = torch.cat([rows, torch.randn(padding, self.width) * 1e3])
        return rows.to(self.input_dtype).to(self.device)

    def out_loc_for(self, batch) -> torch.Tensor:
        loc = self.pools.out_loc([a for a, _ in batch.rows], [b for _, b in batch.rows], self.compress_ratio)
        padding = batch.num_q_tokens - len(batch.rows)
        return torch.cat([loc, torch.full((padding,), -1, dtype=loc.dtype, device=loc.device)])

    def step(self, requests: List[Tuple[int, int]], decode: bool, pad: int = 0) -> StepRecord:
        """One forward. ``pad`` adds CUDA-graph style padding: for prefill, ``pad`` ragged rows
        past the last extend; for decode, ``pad`` rows of the reserved last request at seq_len 1."""
        r = self.compress_ratio
        batch = make_batch(requests, self.seq, decode=decode)
        if pad and decode:
            spare = self.max_requests - 1
            assert all(rid != spare for rid, _ in requests), "the last request id is reserved for padding"
            batch.req_pool_indices = torch.cat([batch.req_pool_indices, torch.full((pad,), spare)])
            batch.seq_lens = torch.cat([batch.seq_lens, torch.ones(pad, dtype=torch.int64)])
            batch.rows = batch.rows + [(spare, 0)] * pad
            batch.num_q_tokens += pad
        elif pad:
            batch.num_q_tokens += pad
        plan = self.plan_for(batch)
        x = self.inputs_for(batch)
        state_before = self.state.cpu().clone() if self.golden else None
        cache_before = self.cache.cpu().clone() if self.golden else None
        out = dsv4ops.compress_forward(self.state, x, self.ape, plan, head_dim=self.head_dim, compress_ratio=r)
        if self.golden:
            self._check_plan(batch, plan)
            self._check_compress(plan, x, out, state_before)
        out_loc = self.out_loc_for(batch)
        if self.stores:
            dsv4ops.compress_norm_rope_store(
                out, plan, norm_weight=self.norm_weight, norm_eps=1e-6, freq_cis=self.freqs, out_loc=out_loc,
                kvcache=self.cache, page_size=self.layout.page_size, use_fp4=self.use_fp4,
                bf16_store=self.bf16_store,
            )
        if self.golden and self.stores:
            self._check_store(plan, out, out_loc, cache_before)
        emitted = []
        if decode:
            for b, (rid, pos) in enumerate(batch.rows[: len(requests)]):
                if (pos + 1) % r == 0:
                    emitted.append((rid, (pos + 1) // r - 1, b))
        else:
            words = plan.plan_c.view(torch.int32).cpu()
            for k in range(words.shape[0]):
                if words[k, 0].item() == -1:
                    break
                rid, pos = batch.rows[words[k, 1].item() & 0xFFFF]
                emitted.append((rid, (pos + 1) // r - 1, k))
        for rid, n in requests:
            self.seq[rid] = self.seq.get(rid, 0) + n
        rec = StepRecord(batch, plan, x, out, out_loc, emitted)
        self.steps.append(rec)
        return rec


    # ------------------------------------------------------------- golden replay
    def _check_plan(self, batch, plan) -> None:
        from golden.planner_loop import plan_decode_loop, plan_prefill_loop

        name, p = ADDRESSING_NAME[self.addressing], self.pools
        r2t, f2s = (p.req_to_token.cpu(), p.full_to_state.cpu()) if name != "legacy" else (None, None)
        common = (self.compress_ratio, self.swa_page_size, self.ring_size, name)
        if batch.is_decode:
            want = plan_decode_loop(batch.req_pool_indices, batch.seq_lens, r2t, f2s, *common)
            assert torch.equal(plan.plan_d.cpu(), want), "decode plan differs from the golden planner"
        else:
            want_c, want_w = plan_prefill_loop(
                batch.req_pool_indices, batch.seq_lens, batch.extend_lens, r2t, f2s, batch.num_q_tokens, *common
            )
            assert torch.equal(plan.plan_c.cpu(), want_c), "CompressPlan differs from the golden planner"
            assert torch.equal(plan.plan_w.cpu(), want_w), "WritePlan differs from the golden planner"

    def _check_compress(self, plan, x, out, state_before) -> None:
        from golden.compress_loop import compress_decode_loop, compress_prefill_loop

        from _asserts import assert_same_bits

        args = (x.cpu(), self.ape.cpu())
        if plan.is_decode:
            want = compress_decode_loop(state_before, *args, plan.plan_d.cpu(), self.head_dim, self.compress_ratio)
        else:
            want = compress_prefill_loop(
                state_before, *args, plan.plan_c.cpu(), plan.plan_w.cpu(), self.head_dim, self.compress_ratio
            )
        assert_same_bits(self.state.cpu(), state_before, "state after the step")
        tol = 2e-5 if out.dtype == torch.float32 else 8e-3  # out has the input dtype by default
        torch.testing.assert_close(out.cpu().double(), want, rtol=tol, atol=tol)

    def _check_store(self, plan, out, out_loc, cache_before) -> None:
        from golden.store_loop import store_loop

        store_loop(
            out.cpu(), plan[1].cpu(), self.norm_weight.cpu(), 1e-6, self.freqs.cpu(), out_loc.cpu(), cache_before,
            plan.is_decode, self.compress_ratio, self.layout.page_size, self.use_fp4, self.bf16_store,
        )
        bad = (self.cache.cpu() != cache_before).nonzero()
        assert bad.numel() == 0, f"{bad.shape[0]} cache bytes differ from the golden store, first {bad[:4].tolist()}"

    def check_truth(self, rtol: float = 2e-5, atol: float = 2e-5) -> int:
        """Every emitted compressed token against the model-level formula; returns how many."""
        from golden.compress_loop import compressed_token_truth

        count = 0
        for rec in self.steps:
            for rid, n, row in rec.emitted:
                seq_end = self.compress_ratio * (n + 1)
                want = compressed_token_truth(
                    self.tokens[rid, :seq_end].double(), self.ape.cpu().double(), n, self.compress_ratio, self.head_dim
                )
                torch.testing.assert_close(rec.out[row].cpu().double(), want, rtol=rtol, atol=atol)
                count += 1
        return count


def random_trace(sim: ServingSim, rng: random.Random, num_steps: int, *, share_prefixes: bool = True):
    """Drive ``sim`` through a random mix of chunked prefills (unaligned splits), decodes,
    mixed extend batches (some requests extending by one token) and prefix-cache hits."""
    r = sim.compress_ratio
    limit = sim.pools.max_seq_len
    ids = range(sim.max_requests - 1)  # the last request id is reserved for decode padding
    for _ in range(num_steps):
        pad = rng.choice([0, 0, rng.randint(1, 5)])
        live = [rid for rid in ids if sim.seq.get(rid, 0) < limit - 1]
        if not live:
            break
        if share_prefixes and rng.random() < 0.15:
            fresh = [rid for rid in ids if sim.seq.get(rid, 0) == 0]
            donors = [rid for rid in ids if sim.seq.get(rid, 0) >= sim.full_page_size]
            if fresh and donors:
                src = rng.choice(donors)
                pages = rng.randint(1, sim.seq[src] // sim.full_page_size)
                sim.share_prefix(rng.choice(fresh), src, pages * sim.full_page_size)
                continue
        chosen = rng.sample(live, rng.randint(1, min(len(live), 4)))
        started = [rid for rid in chosen if sim.seq.get(rid, 0) > 0]
        if started and rng.random() < 0.4:
            sim.step([(rid, 1) for rid in started], decode=True, pad=pad)
            continue
        reqs = []
        for rid in chosen:
            room = limit - sim.seq.get(rid, 0)
            n = 1 if rng.random() < 0.25 else rng.randint(1, min(room, 3 * r + 5))
            reqs.append((rid, min(n, room)))
        sim.step(reqs, decode=False, pad=pad)
