"""Demo: a DeepSeek-V4-Flash-sized compressor block, eager against torch.compile.

    python -m dsv4ops.demo              # CPU (or CUDA when present)
    python -m dsv4ops.demo --device cpu --requests 4 --decode-steps 12

The block holds the three compressors of a V4-Flash ratio-4/ratio-128 layer pair:
the core ratio-4 compressor (head_dim 512, FP8 cache), the ratio-4 indexer
compressor (head_dim 128, FP8 indexer cache, Hadamard) sharing its plan, and the
core ratio-128 compressor (head_dim 512). A few requests are served through
chunked prefill (a token budget per step, split at unaligned points) and decode
steps. The same steps run on an eager copy and on a ``torch.compile(fullgraph=True)``
copy; the demo prints agreement, graph breaks, compile counts and timings.
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Dict, List, Optional

import torch
from torch import nn

from .layer import DeepSeekV4Compressor, mark_dynamic_tokens
from .testing import PagedPools, make_batch

HIDDEN = 4096  # V4-Flash
SWA_PAGE = 128
FULL_PAGE = 256


class CompressorBlock(nn.Module):
    """Core ratio-4 + indexer ratio-4 (shared plan) + core ratio-128 compressors."""

    def __init__(self, pools: PagedPools, max_positions: int, device):
        super().__init__()
        common = dict(cache_pages=pools.cache_pages(), swa_page_size=SWA_PAGE, max_positions=max_positions, device=device)
        self.core_c4 = DeepSeekV4Compressor(
            HIDDEN, 512, 4, state_rows=pools.state_rows(4, 8), cache_page_size=FULL_PAGE // 4, **common)
        self.indexer_c4 = DeepSeekV4Compressor(
            HIDDEN, 128, 4, state_rows=pools.state_rows(4, 8), cache_page_size=FULL_PAGE // 4, **common)
        self.core_c128 = DeepSeekV4Compressor(
            HIDDEN, 512, 128, state_rows=pools.state_rows(128, 128), cache_page_size=FULL_PAGE // 128, **common)

    def forward(self, hidden, req_pool_indices, seq_lens, extend_lens: Optional[torch.Tensor], req_to_token,
                full_to_state, out_loc_c4, out_loc_c128):
        lookup = (req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_state)
        # prefill: one ratio-4 plan shared by the core and indexer compressors (as sglang does);
        # decode: each compressor runs its whole step as one fused op (compress_decode_step)
        plan4 = None if extend_lens is None else self.core_c4.plan(*lookup, hidden.shape[0])
        a = self.core_c4(hidden, *lookup, out_loc_c4, plan=plan4)
        b = self.indexer_c4(hidden, *lookup, out_loc_c4, plan=plan4)
        c = self.core_c128(hidden, *lookup, out_loc_c128)
        return a, b, c


def _schedule(prompts: List[int], budget: int, decode_steps: int):
    """sglang-like steps: chunked prefill filling a token budget, then decodes of every request."""
    done = [0] * len(prompts)
    while any(d < p for d, p in zip(done, prompts)):
        left, step = budget, []
        for rid, (d, p) in enumerate(zip(done, prompts)):
            if d < p and left > 0:
                n = min(p - d, left)
                step.append((rid, n))
                done[rid] += n
                left -= n
        yield step, False
    for _ in range(decode_steps):
        yield [(rid, 1) for rid in range(len(prompts))], True


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt", type=int, nargs="*", default=None, help="prompt lengths (default: varied)")
    parser.add_argument("--budget", type=int, default=389, help="prefill tokens per step (unaligned on purpose)")
    parser.add_argument("--decode-steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    prompts = args.prompt or [700, 301, 517, 129, 260, 42][: args.requests]
    max_len = max(prompts) + args.decode_steps + 8
    pools = PagedPools(max_requests=len(prompts), max_seq_len=max_len, swa_page_size=SWA_PAGE,
                       full_page_size=FULL_PAGE, seed=args.seed, device=device)
    eager = CompressorBlock(pools, pools.max_seq_len, device)
    compiled_block = copy.deepcopy(eager)
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    counters.clear()
    backends = {False: CompileCounterWithBackend("inductor"), True: CompileCounterWithBackend("inductor")}
    compiled = {mode: torch.compile(compiled_block, backend=backends[mode], fullgraph=True) for mode in backends}

    print(f"dsv4ops demo on {device}: V4-Flash compressors (hidden {HIDDEN}; core c4 D512, indexer c4 D128, core c128 D512)")
    print(f"requests: prompts {prompts}, prefill budget {args.budget} tokens/step, {args.decode_steps} decode steps\n")
    print(f"{'step':>4} {'kind':>7} {'tokens':>6} {'eager ms':>9} {'compiled ms':>11} {'max |diff|':>10}  compressed (c4/c128)")
    seq: Dict[int, int] = {}
    times = {"eager": [], "compiled": []}
    compiled_kinds = set()
    worst = 0.0
    for i, (requests, decode) in enumerate(_schedule(prompts, args.budget, args.decode_steps)):
        batch = make_batch(requests, seq, decode=decode, device=device)
        rids = [a for a, _ in batch.rows]
        pos = [b for _, b in batch.rows]
        hidden = torch.randn(batch.num_q_tokens, HIDDEN, device=device) * 0.05
        inputs = (hidden, batch.req_pool_indices, batch.seq_lens, batch.extend_lens, pools.req_to_token,
                  pools.full_to_state, pools.out_loc(rids, pos, 4), pools.out_loc(rids, pos, 128))
        mark_dynamic_tokens(hidden, batch.req_pool_indices, batch.seq_lens, batch.extend_lens, inputs[6], inputs[7])
        _sync(device)
        t0 = time.perf_counter()
        want = eager(*inputs)
        _sync(device)
        t1 = time.perf_counter()
        got = compiled[decode](*inputs)
        _sync(device)
        t2 = time.perf_counter()
        diff = max((g - w).abs().max().item() if w.numel() else 0.0 for g, w in zip(got, want))
        worst = max(worst, diff)
        first_of_kind = decode not in compiled_kinds  # this call paid for the compile
        compiled_kinds.add(decode)
        n4 = sum(1 for p in pos if (p + 1) % 4 == 0)
        n128 = sum(1 for p in pos if (p + 1) % 128 == 0)
        print(f"{i:>4} {'decode' if decode else 'prefill':>7} {batch.num_q_tokens:>6} {1e3 * (t1 - t0):>9.2f} "
              f"{1e3 * (t2 - t1):>11.2f} {diff:>10.2e}  {n4}/{n128}")
        if not first_of_kind:
            times["eager"].append(t1 - t0)
            times["compiled"].append(t2 - t1)
        for rid, n in requests:
            seq[rid] = seq.get(rid, 0) + n

    same_state = all(
        torch.equal(getattr(eager, name).state.view(torch.int32), getattr(compiled_block, name).state.view(torch.int32))
        for name in ("core_c4", "indexer_c4", "core_c128")
    )
    cache_agree = [
        (getattr(eager, name).kvcache == getattr(compiled_block, name).kvcache).float().mean().item()
        for name in ("core_c4", "indexer_c4", "core_c128")
    ]
    breaks = sum(counters["graph_break"].values())
    print()
    print(f"agreement: pooled rows max |eager - compiled| = {worst:.2e}; state rings bit-identical: {same_state}; "
          f"cache bytes identical: " + ", ".join(f"{100 * a:.3f}%" for a in cache_agree))
    print(f"graph breaks: {breaks}; compiled graphs: prefill {backends[False].frame_count}, decode {backends[True].frame_count} "
          f"(1 each means no recompiles across token counts and batch sizes)")
    if times["eager"]:
        e, c = sum(times["eager"]), sum(times["compiled"])
        print(f"time over the steps after the first compile of each kind: eager {1e3 * e:.1f} ms, compiled {1e3 * c:.1f} ms "
              f"({e / c:.2f}x)")
    ok = worst < 1e-3 and same_state and breaks == 0 and backends[False].frame_count <= 1 and backends[True].frame_count <= 1
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
