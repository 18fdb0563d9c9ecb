"""Synthetic serving state for tests, benchmarks and the demo.

``PagedPools`` builds sglang-shaped index tensors (``req_to_token``,
``full_to_state``) with shuffled, page-aligned slot assignments and optional
prefix sharing; ``Batch`` is one forward's worth of scheduler tensors. Nothing
here runs inside a model: it is ordinary eager Python.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from ._layout import Addressing


class PagedPools:
    """Token-to-slot mappings of a paged KV pool with an SWA-scoped compress state.

    * Full-KV slots come in pages of ``full_page_size`` tokens (page 0 is reserved,
      as in sglang); each request owns ``ceil(max_seq_len / full_page_size)`` pages
      drawn from a random permutation.
    * Every ``swa_page_size`` block of full slots maps to its own SWA page, again in
      random order, keeping ``swa_loc % swa_page_size == position % swa_page_size``.
    * A compressed token of ratio ``r`` completing at position ``t`` lives at cache
      slot ``req_to_token[rid, t] // r``; its cache page size is ``full_page_size // r``.
    """

    def __init__(
        self,
        *,
        max_requests: int,
        max_seq_len: int,
        swa_page_size: int = 128,
        full_page_size: int = 256,
        shuffle: bool = True,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ):
        if full_page_size % swa_page_size:
            raise ValueError("full_page_size must be a multiple of swa_page_size")
        gen = torch.Generator().manual_seed(seed)
        self.max_requests = max_requests
        self.swa_page_size = swa_page_size
        self.full_page_size = full_page_size
        self.pages_per_request = math.ceil(max_seq_len / full_page_size)
        self.max_seq_len = self.pages_per_request * full_page_size
        self.num_full_pages = 1 + max_requests * self.pages_per_request
        order = torch.randperm(self.num_full_pages - 1, generator=gen) + 1 if shuffle else torch.arange(1, self.num_full_pages)
        self.request_pages = order.view(max_requests, self.pages_per_request)
        self.req_to_token = self._tokens_of(self.request_pages).to(torch.int32)

        blocks_per_page = full_page_size // swa_page_size
        self.num_swa_pages = self.num_full_pages * blocks_per_page
        block_order = torch.randperm(self.num_swa_pages, generator=gen) if shuffle else torch.arange(self.num_swa_pages)
        slot = torch.arange(self.num_full_pages * full_page_size)
        self.full_to_state = block_order[slot // swa_page_size] * swa_page_size + slot % swa_page_size
        self.device = torch.device(device)
        self.req_to_token = self.req_to_token.to(self.device)
        self.full_to_state = self.full_to_state.to(self.device)

    def _tokens_of(self, pages: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.full_page_size)
        return (pages[:, :, None] * self.full_page_size + offsets).reshape(pages.shape[0], -1)

    def share_prefix(self, dst: int, src: int, num_tokens: int) -> None:
        """Make request ``dst`` reuse the first ``num_tokens`` slots of ``src`` (a radix-cache hit)."""
        if num_tokens % self.full_page_size:
            raise ValueError("a shared prefix must cover whole full-KV pages")
        n = num_tokens // self.full_page_size
        self.request_pages[dst, :n] = self.request_pages[src, :n]
        self.req_to_token[dst, :num_tokens] = self.req_to_token[src, :num_tokens]

    def state_rows(self, compress_ratio: int, ring_size: int, addressing: int = Addressing.SWA_PAGED) -> int:
        """Rows a compress-state buffer needs under ``addressing`` (a multiple of the ratio)."""
        if addressing == Addressing.SWA_PAGED:
            rows = self.num_swa_pages * ring_size
        elif addressing == Addressing.REQUEST:
            rows = self.max_requests * ring_size
        else:
            rows = self.max_requests * (8 if compress_ratio == 4 else compress_ratio)
        return rows

    def cache_pages(self) -> int:
        return self.num_full_pages

    def out_loc(self, req_ids: Sequence[int], positions: Sequence[int], compress_ratio: int, sentinel: int = -1) -> torch.Tensor:
        """sglang's ``c{r}_out_loc``: the cache slot of every query token that completes a chunk."""
        rid = torch.as_tensor(list(req_ids), dtype=torch.int64)
        pos = torch.as_tensor(list(positions), dtype=torch.int64)
        full = self.req_to_token.cpu()[rid, pos].long()
        loc = torch.where((pos + 1) % compress_ratio == 0, full // compress_ratio, torch.full_like(full, sentinel))
        return loc.to(self.device)


@dataclass
class Batch:
    """One forward: scheduler tensors plus the (request, position) of every ragged row."""

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: Optional[torch.Tensor]  # None for a decode batch
    num_q_tokens: int
    rows: List[tuple]  # (rid, position) per ragged row

    @property
    def is_decode(self) -> bool:
        return self.extend_lens is None


def make_batch(requests: Sequence[tuple], seq_before: dict, *, decode: bool, device="cpu") -> Batch:
    """``requests``: ``(rid, num_new_tokens)``; ``seq_before[rid]`` tokens already processed.

    A decode batch needs one new token per request.
    """
    rids, seqs, exts, rows = [], [], [], []
    for rid, n in requests:
        start = seq_before.get(rid, 0)
        if decode and n != 1:
            raise ValueError("decode batches take exactly one token per request")
        rids.append(rid)
        seqs.append(start + n)
        exts.append(n)
        rows.extend((rid, p) for p in range(start, start + n))
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return Batch(
        req_pool_indices=as_t(rids),
        seq_lens=as_t(seqs),
        extend_lens=None if decode else as_t(exts),
        num_q_tokens=len(rows),
        rows=rows,
    )


def fix_triton_interpreter() -> None:
    """Under TRITON_INTERPRET=1, patch a Triton 3.6 interpreter bug (no-op otherwise).

    Triton 3.6's interpreter turns a scalar into a Python int with ``int(array)``; NumPy >= 2.4
    refuses that for its shape-(1,) scalars, so a ``range`` with a run-time bound fails under
    TRITON_INTERPRET=1. Convert the array's one element instead (same value). Also skips the
    interpreter's redundant re-patching of ``triton.language`` at each helper call
    (``_patch_language_once``)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_dsv4ops_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._dsv4ops_fixed = True
    interpreter._patch_lang_tensor = patched
    _patch_language_once(interpreter)


def _patch_language_once(interpreter) -> None:
    """Make the interpreter's per-helper-call re-patching of ``triton.language`` a no-op when the
    launch has patched it already (same results; the kernel tests run about a third faster).

    A kernel launch patches ``triton.language`` (its builtins, ``tl.math``, ``tl.tensor``) for the
    whole grid and restores it at the end. Triton 3.6 patches it again, with ``inspect.getmembers``
    over each module, at every call of a ``@triton.jit`` helper inside the kernel, and never undoes
    that nested patch (the launch's restore does). The helpers of a kernel see the same module
    objects, so when every module named in the helper's globals is patched already, the nested
    call has nothing to change: it gets an empty patch scope instead."""
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    tl = getattr(interpreter, "tl", None)
    if original is None or scope_type is None or tl is None or getattr(original, "_dsv4ops_once", False):
        return
    is_builtin = tl.core.is_builtin

    def patched_already(fn) -> bool:
        langs = [value for value in fn.__globals__.values() if value is tl or value is tl.core]
        return (bool(langs) and all(not is_builtin(lang.load) for lang in langs)
                and not is_builtin(tl.math.exp) and not is_builtin(tl.core.tensor.__add__))

    def patch_lang(fn):
        return scope_type() if patched_already(fn) else original(fn)

    patch_lang._dsv4ops_once = True
    interpreter._patch_lang = patch_lang
