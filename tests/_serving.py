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
        return rows.to(self.input_dtype).to(self.device)

    def step(self, requests: List[Tuple[int, int]], decode: bool) -> StepRecord:
        r = self.compress_ratio
        batch = make_batch(requests, self.seq, decode=decode)
        plan = self.plan_for(batch)
        x = self.inputs_for(batch)
        out = dsv4ops.compress_forward(self.state, x, self.ape, plan, head_dim=self.head_dim, compress_ratio=r)
        out_loc = self.pools.out_loc([a for a, _ in batch.rows], [b for _, b in batch.rows], r)
        if self.stores:
            dsv4ops.compress_norm_rope_store(
                out, plan, norm_weight=self.norm_weight, norm_eps=1e-6, freq_cis=self.freqs, out_loc=out_loc,
                kvcache=self.cache, page_size=self.layout.page_size, use_fp4=self.use_fp4,
                bf16_store=self.bf16_store,
            )
        emitted = []
        if decode:
            for b, (rid, pos) in enumerate(batch.rows):
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


def random_trace(sim: ServingSim, rng: random.Random, num_steps: int, *, share_prefixes: bool = True):
    """Drive ``sim`` through a random mix of chunked prefills (unaligned splits), decodes,
    mixed extend batches (some requests extending by one token) and prefix-cache hits."""
    r = sim.compress_ratio
    limit = sim.pools.max_seq_len
    for _ in range(num_steps):
        live = [rid for rid in range(sim.max_requests) if sim.seq.get(rid, 0) < limit - 1]
        if not live:
            break
        if share_prefixes and rng.random() < 0.15:
            fresh = [rid for rid in range(sim.max_requests) if sim.seq.get(rid, 0) == 0]
            donors = [rid for rid in range(sim.max_requests) if sim.seq.get(rid, 0) >= sim.full_page_size]
            if fresh and donors:
                src = rng.choice(donors)
                pages = rng.randint(1, sim.seq[src] // sim.full_page_size)
                sim.share_prefix(rng.choice(fresh), src, pages * sim.full_page_size)
                continue
        chosen = rng.sample(live, rng.randint(1, min(len(live), 4)))
        started = [rid for rid in chosen if sim.seq.get(rid, 0) > 0]
        if started and rng.random() < 0.4:
            sim.step([(rid, 1) for rid in started], decode=True)
            continue
        reqs = []
        for rid in chosen:
            room = limit - sim.seq.get(rid, 0)
            n = 1 if rng.random() < 0.25 else rng.randint(1, min(room, 3 * r + 5))
            reqs.append((rid, min(n, room)))
        sim.step(reqs, decode=False)
