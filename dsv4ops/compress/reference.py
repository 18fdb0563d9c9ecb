"""PyTorch reference of ``compress_forward`` (offline state, ratio 4 and 128).

Vectorized and traceable: the CPU implementation of
``torch.ops.dsv4ops.compress_forward`` and the oracle for the Triton kernels.
Pooling is fp32 whatever the input/state/output dtypes; see
``docs/compress_forward.md`` for the window picture.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._indexing import in_range, masked_scatter_rows_, safe_index
from .._layout import INVALID_WORD, coff, window_len


def softmax_pool(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, masked: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-channel softmax pooling over the window axis.

    ``kv``/``score``: ``[n, W, D]``; ``ape``: ``[W, D]``; ``masked``: ``[n, W]`` rows that
    do not exist (score -inf, value 0). Returns ``[n, D]`` fp32.
    """
    kv = kv.float()
    score = score.float() + ape.float()
    if masked is not None:
        m = masked.unsqueeze(-1)
        score = torch.where(m, torch.full_like(score, float("-inf")), score)
        kv = torch.where(m, torch.zeros_like(kv), kv)
    weights = torch.softmax(score, dim=1)
    return (weights * kv).sum(dim=1)


def _split_window(rows: torch.Tensor, head_dim: int, compress_ratio: int):
    """kv and score parts of gathered state/input rows ``[n, W, 2*coff*D]``.

    Ratio 4 rows are ``[kv_A | kv_B | score_A | score_B]``; window rows 0..3 (the
    previous chunk) use the A quarters, rows 4..7 (the current chunk) the B quarters.
    """
    D = head_dim
    if compress_ratio != 4:
        return rows[..., :D], rows[..., D:]
    is_overlap = (torch.arange(8, device=rows.device) < 4).view(1, 8, 1)
    kv = torch.where(is_overlap, rows[..., 0:D], rows[..., D : 2 * D])
    score = torch.where(is_overlap, rows[..., 2 * D : 3 * D], rows[..., 3 * D : 4 * D])
    return kv, score


def _window_slots(page0: torch.Tensor, page1: torch.Tensor, compress_ratio: int) -> torch.Tensor:
    """State row of every window row ``[n, W]``: ratio 4 reads page0 then page1, ratio 128 page1."""
    r = compress_ratio
    if r == 4:
        slot = torch.arange(4, device=page1.device)
        return torch.cat([page0[:, None] * 4 + slot, page1[:, None] * 4 + slot], dim=1)
    return page1[:, None] * r + torch.arange(r, device=page1.device)


def _plan_words(plan: torch.Tensor) -> torch.Tensor:
    return plan.view(torch.int32).long()


def compress_decode_reference(
    kv_score_buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    ape: torch.Tensor,
    plan_d: torch.Tensor,
    out: torch.Tensor,
    head_dim: int,
    compress_ratio: int,
) -> None:
    """Decode step: write each new token into the ring, then pool the rows that end a chunk.

    Mutates ``kv_score_buffer`` (rows ``write_loc``) and ``out`` (every row; rows
    that do not end a chunk, or whose plan is out of range, are zero).
    """
    r = compress_ratio
    width = 2 * coff(r) * head_dim
    state = kv_score_buffer.view(-1, width)
    num_rows = state.shape[0]
    num_pages = num_rows // r
    words = _plan_words(plan_d)
    seq_len, write_loc, page0, page1 = words[:, 0] & 0xFFFFFFFF, words[:, 1], words[:, 2], words[:, 3]

    live = in_range(write_loc, num_rows)
    masked_scatter_rows_(state, write_loc, kv_score_input, live)

    emits = live & (torch.remainder(seq_len, r) == 0) & (seq_len >= r) & in_range(page1, num_pages)
    overlap_masked = None
    if r == 4:
        has_overlap = seq_len > 4
        emits = emits & (~has_overlap | in_range(page0, num_pages))
        overlap_masked = (~has_overlap)[:, None] & (torch.arange(8, device=state.device) < 4)[None, :]
    slots = _window_slots(safe_index(page0, in_range(page0, num_pages)), safe_index(page1, emits), r)
    kv, score = _split_window(state[slots], head_dim, r)
    pooled = softmax_pool(kv, score, ape, overlap_masked)
    out.copy_(torch.where(emits[:, None], pooled, torch.zeros_like(pooled)))


def compress_prefill_reference(
    kv_score_buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    ape: torch.Tensor,
    plan_c: torch.Tensor,
    plan_w: torch.Tensor,
    out: torch.Tensor,
    head_dim: int,
    compress_ratio: int,
) -> None:
    """Prefill step: pool every compress event (pass 1), then persist the write set (pass 2).

    Pass 1 reads the ring as it was before this call: window row ``w`` comes from
    the state when ``w < buffer_len`` (tokens before this extend), otherwise from
    input row ``ragged_id - (W - 1) + w``. ``out[k]`` belongs to ``plan_c[k]``;
    padding or malformed rows are zero. Pass 2 copies input rows into the ring.
    """
    r = compress_ratio
    W = window_len(r)
    width = 2 * coff(r) * head_dim
    state = kv_score_buffer.view(-1, width)
    num_rows = state.shape[0]
    num_inputs = kv_score_input.shape[0]
    device = state.device

    words = _plan_words(plan_c)
    seq_len = words[:, 0] & 0xFFFFFFFF
    ragged = words[:, 1] & 0xFFFF
    buffer_len = (words[:, 1] >> 16) & 0xFFFF
    page0, page1 = words[:, 2], words[:, 3]
    valid = (words[:, 0] != INVALID_WORD) & (buffer_len <= W) & (seq_len >= r)

    w = torch.arange(W, device=device)
    from_state = w[None, :] < buffer_len[:, None]  # [n, W]
    masked = torch.zeros_like(from_state)
    if r == 4:
        masked = (seq_len <= 4)[:, None] & (w < 4)[None, :]
    state_slot = _window_slots(page0, page1, r)
    input_row = ragged[:, None] - (W - 1) + w[None, :]
    needed_state = from_state & ~masked
    needed_input = ~from_state & ~masked
    state_ok = ~needed_state | in_range(state_slot, num_rows)
    input_ok = ~needed_input | in_range(input_row, num_inputs)
    valid = valid & state_ok.all(dim=1) & input_ok.all(dim=1)

    from_state_rows = state[safe_index(state_slot, needed_state & valid[:, None])].float()
    from_input_rows = kv_score_input[safe_index(input_row, needed_input & valid[:, None])].float()
    rows = torch.where(from_state.unsqueeze(-1), from_state_rows, from_input_rows)
    kv, score = _split_window(rows, head_dim, r)
    pooled = softmax_pool(kv, score, ape, masked if r == 4 else None)
    out.copy_(torch.where(valid[:, None], pooled, torch.zeros_like(pooled)))

    # Pass 2 -- after every read above.
    w_words = _plan_words(plan_w)
    src = w_words[:, 0] & 0xFFFFFFFF
    write_loc = w_words[:, 1]
    live = in_range(src, num_inputs) & in_range(write_loc, num_rows)
    masked_scatter_rows_(state, write_loc, kv_score_input[safe_index(src, live)], live)
