"""PyTorch reference of the online ratio-128 compressor (sglang's ``is_online=True`` path).

Instead of a 128-row ring of raw tokens, each request keeps one fp32 state row
``[max | sum | kv]`` (3 x D) for the chunk in progress: the running per-channel
max of the biased scores, the softmax denominator relative to that max, and the
*normalized* weighted mean of the kv values so far. Decode merges one token per
step; prefill pools whole segments (the part of a chunk inside one extend) and
merges them with the stored state. See ``docs/online.md``.
"""

from __future__ import annotations

import torch

from .._indexing import in_range, masked_scatter_rows_, safe_index
from .._layout import INVALID_WORD
from ..planner.reference import _as_plan_bytes, _compact

RATIO = 128


def merge(m1, s1, k1, m2, s2, k2):
    """Merge two partial softmax pools (per channel): ``(max, denominator, normalized mean)``."""
    m = torch.maximum(m1, m2)
    w1 = s1 * torch.exp(m1 - m)
    w2 = s2 * torch.exp(m2 - m)
    total = w1 + w2
    return m, total, (k1 * w1 + k2 * w2) / total


def plan_online_decode_reference(req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, state_slot_offset: int) -> torch.Tensor:
    """DecodePlan ``[bs, 16]``: seq_len, write_loc = read_page_0 = state slot, read_page_1 = -1."""
    seq, rid = seq_lens.long(), req_pool_indices.long()
    live = (seq >= 1) & (rid >= 0)
    slot = torch.where(live, rid + state_slot_offset, torch.full_like(rid, -1))
    words = torch.stack([torch.where(live, seq, torch.zeros_like(seq)), slot, slot, torch.full_like(slot, -1)], dim=1)
    return _as_plan_bytes(words)


def plan_online_prefill_reference(
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor, num_q_tokens, state_slot_offset: int
):
    """Segment plans (both ``[num_q_tokens, 16]`` CompressPlan rows, padded).

    A segment is the part of one 128-token chunk inside this extend. Its row holds
    seq_len = last position + 1, ragged_id = ragged row of its last token,
    buffer_len = segment length, read_page_0 = the request's state slot (written by
    a trailing segment), read_page_1 = the slot to merge from when the segment
    continues a chunk begun by an earlier forward (else -1). Segments that end a
    chunk go to ``plan_c`` ("close"), the trailing partial one to ``plan_w`` ("write").
    """
    device = req_pool_indices.device
    seq, ext, rid = seq_lens.long(), extend_lens.long(), req_pool_indices.long()
    request_ok = (ext >= 0) & (ext <= seq) & (rid >= 0)
    ext = torch.clamp_min(ext, 0)
    ends = torch.cumsum(ext, 0)
    ragged = torch.arange(num_q_tokens, device=device, dtype=torch.int64)
    b = torch.searchsorted(ends, ragged, right=True)

    def per_row(values, pad):
        return torch.cat([values, values.new_full((1,), pad)])[b]

    row_seq, row_ext = per_row(seq, 0), per_row(ext, 0)
    ok = per_row(request_ok, False)
    prefix = row_seq - row_ext
    pos = prefix + ragged - (per_row(ends, 0) - row_ext)
    start = torch.maximum(pos - torch.remainder(pos, RATIO), prefix)  # first position of the segment
    slot = per_row(rid, 0) + state_slot_offset
    load = torch.where(torch.remainder(start, RATIO) != 0, slot, torch.full_like(slot, -1))
    words = torch.stack([pos + 1, ragged | ((pos + 1 - start) << 16), slot, load], dim=1)
    ends_chunk = torch.remainder(pos + 1, RATIO) == 0
    is_close = ok & ends_chunk
    is_write = ok & (pos == row_seq - 1) & ~ends_chunk
    sentinel = torch.tensor([INVALID_WORD, 0, INVALID_WORD, INVALID_WORD], dtype=torch.int64, device=device)
    return _as_plan_bytes(_compact(is_close, words, sentinel, num_q_tokens)), _as_plan_bytes(
        _compact(is_write, words, sentinel, num_q_tokens)
    )


def _split_state(rows: torch.Tensor, D: int):
    return rows[:, :D], rows[:, D : 2 * D], rows[:, 2 * D :]


def online_decode_reference(state, kv_score_input, ape, plan_d, out, head_dim) -> None:
    """One token per request: merge into the chunk state; emit at the chunk's last token."""
    D = head_dim
    num_slots = state.shape[0]
    words = plan_d.view(torch.int32).long()
    seq, write_slot, load_slot = words[:, 0] & 0xFFFFFFFF, words[:, 1], words[:, 2]
    q = torch.remainder(seq - 1, RATIO)
    x = kv_score_input.float()
    tok_m = x[:, D:] + ape.float()[safe_index(q, seq >= 1)]
    tok_s = torch.ones_like(tok_m)
    tok_k = x[:, :D]
    continues = q != 0
    valid = (seq >= 1) & (~continues | in_range(load_slot, num_slots))
    old_m, old_s, old_k = _split_state(state[safe_index(load_slot, in_range(load_slot, num_slots))], D)
    m, s, k = merge(old_m, old_s, old_k, tok_m, tok_s, tok_k)
    c = continues[:, None]
    m, s, k = torch.where(c, m, tok_m), torch.where(c, s, tok_s), torch.where(c, k, tok_k)
    closes = valid & (q == RATIO - 1)
    out.copy_(torch.where(closes[:, None], k, torch.zeros_like(k)))
    stores = valid & ~closes & in_range(write_slot, num_slots)
    masked_scatter_rows_(state, write_slot, torch.cat([m, s, k], dim=1), stores)


def _pool_segments(state, kv_score_input, ape, words, D):
    """Pooled (max, sum, mean) of every segment row merged with its stored prefix; validity."""
    num_slots, num_inputs = state.shape[0], kv_score_input.shape[0]
    seq = words[:, 0] & 0xFFFFFFFF
    ragged, length = words[:, 1] & 0xFFFF, (words[:, 1] >> 16) & 0xFFFF
    load = words[:, 3]
    j = torch.arange(RATIO, device=state.device)
    present = j[None, :] < length[:, None]
    rows = ragged[:, None] - length[:, None] + 1 + j[None, :]
    q = torch.remainder(seq[:, None] - length[:, None] + j[None, :], RATIO)
    valid = (words[:, 0] != INVALID_WORD) & (length >= 1) & (length <= RATIO) & (seq >= length)
    valid = valid & (~present | in_range(rows, num_inputs)).all(dim=1) & ((load < 0) | in_range(load, num_slots))
    take = present & valid[:, None]
    x = kv_score_input.float()[safe_index(rows, take)]  # [n, 128, 2D]
    score = x[:, :, D:] + ape.float()[safe_index(q, take)]
    score = torch.where(take[:, :, None], score, torch.full_like(score, float("-inf")))
    m = score.amax(dim=1)
    m_safe = torch.where(valid[:, None], m, torch.zeros_like(m))
    e = torch.where(take[:, :, None], torch.exp(score - m_safe[:, None, :]), torch.zeros_like(score))
    s = e.sum(dim=1)
    k = (e * x[:, :, :D]).sum(dim=1) / torch.where(valid[:, None], s, torch.ones_like(s))
    has_prefix = (valid & (load >= 0))[:, None]
    old_m, old_s, old_k = _split_state(state[safe_index(load, load >= 0)], D)
    mm, ms, mk = merge(old_m, old_s, old_k, m_safe, s, k)
    m = torch.where(has_prefix, mm, m_safe)
    s = torch.where(has_prefix, ms, s)
    k = torch.where(has_prefix, mk, k)
    return m, s, k, valid


def online_prefill_reference(state, kv_score_input, ape, plan_c, plan_w, out, head_dim) -> None:
    """Close pass (segments ending a chunk -> ``out``), then write pass (trailing segments -> state)."""
    D = head_dim
    _, _, k, valid = _pool_segments(state, kv_score_input, ape, plan_c.view(torch.int32).long(), D)
    out.copy_(torch.where(valid[:, None], k, torch.zeros_like(k)))
    words = plan_w.view(torch.int32).long()
    m, s, k, valid = _pool_segments(state, kv_score_input, ape, words, D)
    slot = words[:, 2]
    masked_scatter_rows_(state, slot, torch.cat([m, s, k], dim=1), valid & in_range(slot, state.shape[0]))
