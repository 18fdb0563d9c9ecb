"""Golden (slow, loop-based) compress planners.

Written from ``shared/docs/spec-compressor.md`` (sections 3, 5, 6, 9) and
``docs/semantics.md`` (items 1-11) only; it shares no code with ``dsv4ops``.
Every plan row is built with ``struct.pack`` from Python integers.

Conventions pinned here (see semantics.md):

* prefill plans are always padded to ``num_q_tokens`` rows with sentinels,
  valid rows first, in host order (batch-major, position-ascending);
* CompressPlan pages are always resolved (also when ``buffer_len == 0``);
* ``mtp_pad = min(ring - r, 4)`` for "swa" and "request" addressing, none for
  "legacy"; the SWA page-tail band only for r == 4 with "swa" addressing;
* a request with ``extend_len < 0`` or ``extend_len > seq_len`` gives no rows;
  ragged rows at or past ``num_q_tokens`` give no rows;
* any lookup that is out of range or negative gives row/page -1;
* a decode row with ``seq_len < 1`` gets ``seq_len = 0`` and all locations -1.
"""

from __future__ import annotations

import struct

import torch

ADDRESSING_MODES = ("swa", "request", "legacy")

COMPRESS_SENTINEL = struct.pack("<IHHii", 0xFFFFFFFF, 0, 0, -1, -1)
WRITE_SENTINEL = b"\xff" * 8


def _as_list(t):
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        return [int(v) for v in t.reshape(-1).tolist()]
    return [int(v) for v in t]


def _as_table(t):
    """2-D integer table as a list of lists (None stays None)."""
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        return [[int(v) for v in row] for row in t.tolist()]
    return [[int(v) for v in row] for row in t]


def _window_len(r: int) -> int:
    return 8 if r == 4 else r


class _Addresser:
    """state_row(rid, t) for one addressing mode; -1 for any bad lookup."""

    def __init__(self, req_to_token, full_to_state, r, sps, ring, addressing):
        if addressing not in ADDRESSING_MODES:
            raise ValueError(f"addressing must be one of {ADDRESSING_MODES}, got {addressing!r}")
        self.r, self.sps, self.ring, self.mode = r, sps, ring, addressing
        self.req_to_token = _as_table(req_to_token) if addressing == "swa" else None
        self.full_to_state = _as_list(full_to_state) if addressing == "swa" else None
        # request mode: the request pool size / max context come from req_to_token when given
        if addressing == "request" and req_to_token is not None:
            self.num_req, self.max_ctx = int(req_to_token.shape[0]), int(req_to_token.shape[1])
        else:
            self.num_req = self.max_ctx = None

    def state_row(self, rid: int, t: int) -> int:
        r, sps, ring = self.r, self.sps, self.ring
        if rid < 0 or t < 0:
            return -1
        if self.mode == "legacy":
            page = 2 * rid + (t // 4) % 2 if r == 4 else rid
            return page * r + t % r
        if self.mode == "request":
            if self.num_req is not None and (rid >= self.num_req or t >= self.max_ctx):
                return -1
            return rid * ring + t % ring
        # swa
        table = self.req_to_token
        if table is None or self.full_to_state is None:
            raise ValueError("swa addressing needs req_to_token and full_to_state")
        if rid >= len(table) or t >= len(table[rid]):
            return -1
        token = table[rid][t]
        if token < 0 or token >= len(self.full_to_state):
            return -1
        swa = self.full_to_state[token]
        if swa < 0:
            return -1
        return (swa // sps) * ring + swa % ring

    def page(self, rid: int, t: int) -> int:
        row = self.state_row(rid, t)
        return -1 if row < 0 else row // self.r


def plan_decode_loop(req_pool_indices, seq_lens, req_to_token, full_to_state, compress_ratio,
                     swa_page_size, ring_size, addressing) -> torch.Tensor:
    """DecodePlan rows ``[bs, 16]`` uint8: u32 seq_len | i32 write_loc | i32 page0 | i32 page1."""
    r = int(compress_ratio)
    addr = _Addresser(req_to_token, full_to_state, r, int(swa_page_size), int(ring_size), addressing)
    rids = _as_list(req_pool_indices)
    seqs = _as_list(seq_lens)
    assert len(rids) == len(seqs)
    out = bytearray()
    for rid, s in zip(rids, seqs):
        if s < 1:
            out += struct.pack("<Iiii", 0, -1, -1, -1)
            continue
        p1 = s - 1
        p0 = max(p1 - r, 0)
        write_loc = addr.state_row(rid, p1)
        page1 = -1 if write_loc < 0 else write_loc // r
        page0 = addr.page(rid, p0)
        out += struct.pack("<Iiii", s, write_loc, page0, page1)
    return torch.frombuffer(bytearray(out), dtype=torch.uint8).reshape(len(seqs), 16).clone() \
        if seqs else torch.empty((0, 16), dtype=torch.uint8)


def plan_prefill_loop(req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_state,
                      num_q_tokens, compress_ratio, swa_page_size, ring_size, addressing):
    """(plan_c ``[num_q_tokens, 16]``, plan_w ``[num_q_tokens, 8]``), padded with sentinels."""
    r = int(compress_ratio)
    sps, ring = int(swa_page_size), int(ring_size)
    W = _window_len(r)
    n_q = int(num_q_tokens)
    addr = _Addresser(req_to_token, full_to_state, r, sps, ring, addressing)
    rids = _as_list(req_pool_indices)
    seqs = _as_list(seq_lens)
    exts = _as_list(extend_lens)
    assert len(rids) == len(seqs) == len(exts)

    c_rows: list[bytes] = []
    w_rows: list[bytes] = []
    ragged_start = 0
    for rid, s, e in zip(rids, seqs, exts):
        start = ragged_start
        # the ragged layout is the concatenation of the extends; a negative
        # extend length occupies no ragged rows
        ragged_start += max(e, 0)
        if e < 0 or e > s:
            continue  # invalid request: no rows
        prefix = s - e
        last_c = (s // r) * r
        first_w = last_c - (4 if r == 4 else 0)
        if addressing != "legacy":
            mtp_pad = min(ring - r, 4)
            first_w = min(first_w, s - mtp_pad)
        for j in range(e):
            ragged = start + j
            if ragged >= n_q:
                break  # ragged rows past num_q_tokens are dropped
            t = prefix + j
            # compress event
            if (t + 1) % r == 0:
                buffer_len = W - min(j + 1, W)
                page0 = addr.page(rid, max(t - r, 0))
                page1 = addr.page(rid, t)
                c_rows.append(struct.pack("<IHHii", t + 1, ragged, buffer_len, page0, page1))
            # write set
            write = t >= first_w
            if r == 4 and addressing == "swa" and t % sps >= sps - 4:
                write = True
            if write:
                w_rows.append(struct.pack("<Ii", ragged, addr.state_row(rid, t)))

    assert len(c_rows) <= n_q and len(w_rows) <= n_q
    c_bytes = b"".join(c_rows) + COMPRESS_SENTINEL * (n_q - len(c_rows))
    w_bytes = b"".join(w_rows) + WRITE_SENTINEL * (n_q - len(w_rows))
    if n_q == 0:
        return torch.empty((0, 16), dtype=torch.uint8), torch.empty((0, 8), dtype=torch.uint8)
    plan_c = torch.frombuffer(bytearray(c_bytes), dtype=torch.uint8).reshape(n_q, 16).clone()
    plan_w = torch.frombuffer(bytearray(w_bytes), dtype=torch.uint8).reshape(n_q, 8).clone()
    return plan_c, plan_w


# ---------------------------------------------------------------------------
# plan row decoding helpers (used by the golden compress / store loops and tests)
# ---------------------------------------------------------------------------

def decode_plan_rows(plan_d):
    """[(seq_len, write_loc, read_page_0, read_page_1)] from a DecodePlan tensor."""
    raw = bytes(plan_d.contiguous().view(torch.uint8).reshape(-1).tolist())
    return [struct.unpack_from("<Iiii", raw, 16 * i) for i in range(len(raw) // 16)]


def compress_plan_rows(plan_c):
    """[(seq_len, ragged_id, buffer_len, read_page_0, read_page_1)] from a CompressPlan tensor."""
    raw = bytes(plan_c.contiguous().view(torch.uint8).reshape(-1).tolist())
    return [struct.unpack_from("<IHHii", raw, 16 * i) for i in range(len(raw) // 16)]


def write_plan_rows(plan_w):
    """[(ragged_id, write_loc)] from a WritePlan tensor."""
    raw = bytes(plan_w.contiguous().view(torch.uint8).reshape(-1).tolist())
    return [struct.unpack_from("<Ii", raw, 8 * i) for i in range(len(raw) // 8)]
