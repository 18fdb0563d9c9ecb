"""PyTorch reference of the decode and prefill planners (vectorized, static shapes).

This is the CPU implementation of ``torch.ops.dsv4ops.plan_decode`` /
``plan_prefill`` and the oracle the Triton planners are tested against. It runs
on any device, never syncs with the host, and traces under torch.compile and
torch.export with symbolic batch and token counts.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._indexing import in_range, safe_index
from .._layout import INVALID_WORD, Addressing, window_len


def state_rows(
    positions: torch.Tensor,
    req_ids: torch.Tensor,
    req_to_token: Optional[torch.Tensor],
    full_to_state: Optional[torch.Tensor],
    *,
    compress_ratio: int,
    swa_page_size: int,
    ring_size: int,
    addressing: int,
) -> torch.Tensor:
    """State row of every (request, position) pair, int64; -1 where a lookup is out of range."""
    pos, rid = positions.long(), req_ids.long()
    ok = (pos >= 0) & (rid >= 0)
    if addressing == Addressing.LEGACY:
        if compress_ratio == 4:
            page = 2 * rid + torch.remainder(torch.div(pos, 4, rounding_mode="floor"), 2)
            row = page * 4 + torch.remainder(pos, 4)
        else:
            row = rid * compress_ratio + torch.remainder(pos, compress_ratio)
    elif addressing == Addressing.REQUEST:
        row = rid * ring_size + torch.remainder(pos, ring_size)
        if req_to_token is not None:  # bounds the request id and the position when the table is given
            ok = ok & (rid < req_to_token.shape[0]) & (pos < req_to_token.shape[1])
    else:
        num_reqs, max_len = req_to_token.shape
        ok = ok & (rid < num_reqs) & (pos < max_len)
        token = req_to_token[safe_index(rid, ok), safe_index(pos, ok)].long()
        ok = ok & in_range(token, full_to_state.shape[0])
        swa = full_to_state[safe_index(token, ok)].long()
        ok = ok & (swa >= 0)
        row = torch.div(swa, swa_page_size, rounding_mode="floor") * ring_size + torch.remainder(swa, ring_size)
    return torch.where(ok, row, torch.full_like(row, -1))


def _page_of(rows: torch.Tensor, compress_ratio: int) -> torch.Tensor:
    return torch.where(rows >= 0, torch.div(rows, compress_ratio, rounding_mode="floor"), rows)


def _as_plan_bytes(words: torch.Tensor) -> torch.Tensor:
    """int64 words ``[n, k]`` -> little-endian uint8 ``[n, 4k]``."""
    return words.to(torch.int32).contiguous().view(torch.uint8)


def plan_decode_reference(
    req_pool_indices: torch.Tensor,
    req_to_token: Optional[torch.Tensor],
    full_to_state: Optional[torch.Tensor],
    seq_lens: torch.Tensor,
    compress_ratio: int,
    swa_page_size: int,
    ring_size: int,
    addressing: int,
) -> torch.Tensor:
    """DecodePlan ``[bs, 16]`` uint8: one row per request (the token at ``seq_len - 1``).

    Rows with ``seq_len < 1`` get ``seq_len = 0`` and all locations -1.
    """
    lookup = dict(
        compress_ratio=compress_ratio, swa_page_size=swa_page_size, ring_size=ring_size, addressing=addressing
    )
    seq = seq_lens.long()
    live = seq >= 1
    last = seq - 1
    overlap = torch.clamp_min(last - compress_ratio, 0)
    write_loc = state_rows(last, req_pool_indices, req_to_token, full_to_state, **lookup)
    write_loc = torch.where(live, write_loc, torch.full_like(write_loc, -1))
    page0 = _page_of(state_rows(overlap, req_pool_indices, req_to_token, full_to_state, **lookup), compress_ratio)
    page0 = torch.where(live, page0, torch.full_like(page0, -1))
    words = torch.stack(
        [torch.where(live, seq, torch.zeros_like(seq)), write_loc, page0, _page_of(write_loc, compress_ratio)], dim=1
    )
    return _as_plan_bytes(words)


def _compact(mask: torch.Tensor, words: torch.Tensor, sentinel: torch.Tensor, num_rows) -> torch.Tensor:
    """Rows of ``words`` where ``mask`` (keeping their order) first, then ``sentinel`` rows."""
    dest = torch.cumsum(mask.to(torch.int64), 0) - 1
    dest = torch.where(mask, dest, torch.full_like(dest, num_rows))  # dead rows land in a dump row
    out = sentinel.expand(num_rows + 1, sentinel.shape[0]).clone()
    out.index_put_((dest,), words)
    return out[:num_rows]


def plan_prefill_reference(
    req_pool_indices: torch.Tensor,
    req_to_token: Optional[torch.Tensor],
    full_to_state: Optional[torch.Tensor],
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    num_q_tokens,
    compress_ratio: int,
    swa_page_size: int,
    ring_size: int,
    addressing: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """CompressPlan ``[num_q_tokens, 16]`` and WritePlan ``[num_q_tokens, 8]`` (uint8).

    Ragged row ``i`` is extend token ``j`` of request ``b`` when
    ``i = sum(extend_lens[:b]) + j``. Valid rows come first in ragged order
    (batch-major, position-ascending), padding rows after. Requests with
    ``extend_len < 0`` or ``extend_len > seq_len`` contribute no rows; ragged rows
    past ``num_q_tokens`` are dropped.
    """
    lookup = dict(
        compress_ratio=compress_ratio, swa_page_size=swa_page_size, ring_size=ring_size, addressing=addressing
    )
    r = compress_ratio
    device = req_pool_indices.device
    seq, ext, rid = seq_lens.long(), extend_lens.long(), req_pool_indices.long()
    request_ok = (ext >= 0) & (ext <= seq)
    ext = torch.clamp_min(ext, 0)
    ends = torch.cumsum(ext, 0)

    # Per ragged row: its request b (== bs for rows past the last extend) and its position.
    ragged = torch.arange(num_q_tokens, device=device, dtype=torch.int64)
    b = torch.searchsorted(ends, ragged, right=True)

    def per_row(values: torch.Tensor, pad) -> torch.Tensor:  # values[b] with a dummy entry for b == bs
        return torch.cat([values, values.new_full((1,), pad)])[b]

    row_seq = per_row(seq, 0)
    row_ext = per_row(ext, 0)
    token_ok = per_row(request_ok, False)
    j = ragged - (per_row(ends, 0) - row_ext)  # index inside the request's extend
    pos = row_seq - row_ext + j
    row_rid = per_row(rid, 0)

    # --- compress events: the token that completes a chunk --------------------------
    window = window_len(r)
    is_event = token_ok & (torch.remainder(pos + 1, r) == 0)
    buffer_len = window - torch.clamp_max(j + 1, window)
    page1 = _page_of(state_rows(pos, row_rid, req_to_token, full_to_state, **lookup), r)
    page0 = _page_of(
        state_rows(torch.clamp_min(pos - r, 0), row_rid, req_to_token, full_to_state, **lookup), r
    )
    c_words = torch.stack([pos + 1, ragged | (buffer_len << 16), page0, page1], dim=1)
    c_sentinel = torch.tensor([INVALID_WORD, 0, INVALID_WORD, INVALID_WORD], dtype=torch.int64, device=device)
    plan_c = _compact(is_event, c_words, c_sentinel, num_q_tokens)

    # --- writes: tokens a later forward will read back from the ring -------------------
    last_complete = torch.div(row_seq, r, rounding_mode="floor") * r
    if addressing == Addressing.LEGACY:
        first_write = last_complete - (4 if r == 4 else 0)
        keep = pos >= first_write
    else:
        spec_pad = min(ring_size - r, 4)  # keeps trailing tokens for speculative rollback
        first_write = torch.minimum(last_complete - (r if r == 4 else 0), row_seq - spec_pad)
        keep = pos >= first_write
        if r == 4 and addressing == Addressing.SWA_PAGED:
            # last chunk of every SWA page: the overlap a prefix-cache hit at the next page needs
            keep = keep | (torch.remainder(pos, swa_page_size) >= swa_page_size - 4)
    is_write = token_ok & keep
    write_loc = state_rows(pos, row_rid, req_to_token, full_to_state, **lookup)
    w_words = torch.stack([ragged, write_loc], dim=1)
    w_sentinel = torch.tensor([INVALID_WORD, INVALID_WORD], dtype=torch.int64, device=device)
    plan_w = _compact(is_write, w_words, w_sentinel, num_q_tokens)
    return _as_plan_bytes(plan_c), _as_plan_bytes(plan_w)
