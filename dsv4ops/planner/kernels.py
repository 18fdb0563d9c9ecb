"""Triton planners: decode (elementwise) and prefill (closed-form compaction in one launch).

Prefill: every plan row has a closed-form destination. Per request ``b`` (prefix =
seq_len - extend_len, ``n_b`` = its extend rows below ``num_q_tokens``) the compress
events are the positions ``p`` in ``[prefix, prefix + n_b)`` with ``(p + 1) % r == 0``;
the event of ``p`` goes to plan_c row ``E_b + (p + 1) // r - prefix // r - 1``, where
``E_b`` counts the events of the requests before ``b``. The written positions are
``p >= first_write`` plus (ratio 4, SWA addressing) the SWA page-tail band below
``first_write``; the rank of a written position inside its request is a count of band
positions plus a difference of positions, so it lands in plan_w row ``W_b + rank``.

One launch, programs over blocks of ``ROWS`` ragged rows. Each program walks the
batch in chunks of ``CHUNK`` requests (loads of the next chunk in flight while the
current one is processed), computing per request its ragged start (clamped exclusive
prefix sum of ``max(extend_len, 0)``), its event and write counts, and running totals.
A chunk that lies wholly before the block's rows adds its totals to every row; a
chunk that straddles the block adds, per row, the requests that end at or before the
row (one ``[ROWS, CHUNK]`` compare); a chunk past the block only adds to the totals.
That gives each row its request, ragged start and event/write bases without a
search. The row then computes its flags and destinations in int32, does the state
lookups only where a row is emitted, scatters 16 / 8-byte rows, and writes the
padding rows of its own range (``[total_events, num_q_tokens)`` of plan_c,
``[total_writes, num_q_tokens)`` of plan_w). Rows land in ragged order (batch-major,
position-ascending), exactly as the reference orders them. No host sync: the grid is
``cdiv(num_q_tokens, ROWS)`` and the batch size is a kernel argument.

With ``ONLINE`` the same kernel plans the online ratio-128 compressor (``online.kernels``): the
walk is the same (requests with a negative id count as invalid), the tail emits close segments
(the chunk ends) to plan_c and each request's trailing write segment to plan_w row ``W_b``.

Positions, request ids, slots and SWA slots are handled in int32 (they must be
below 2**31); ``req_to_token`` offsets are int64.
"""

from __future__ import annotations

import torch

from .._triton import HAVE_TRITON, cdiv, launch

ROWS = 128  # ragged rows per prefill program
CHUNK = 32  # requests per step of a program's walk over the batch
DECODE_BLOCK = 128  # requests per decode program

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _state_row(rid, pos, ok, r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full,
                   sps, ring, RATIO: tl.constexpr, ADDRESSING: tl.constexpr,
                   HAS_TABLE: tl.constexpr):
        """State row of (rid, pos) (int32 in, int32 out), -1 where ``ok`` is off or a lookup is out of range."""
        ok = ok & (rid >= 0) & (pos >= 0)
        if ADDRESSING == 2:  # legacy: ratio 4 -> page 2 * rid + (pos // 4) % 2, i.e. row 8 * rid + pos % 8
            if RATIO == 4:
                row = rid * 8 + pos % 8
            else:
                row = rid * RATIO + pos % RATIO
        elif ADDRESSING == 1:  # request-scoped ring
            row = rid * ring + pos % ring
            if HAS_TABLE:
                ok = ok & (rid < num_reqs) & (pos < max_len)
        else:  # SWA-paged
            ok = ok & (rid < num_reqs) & (pos < max_len)
            token = tl.load(r2t_ptr + rid.to(tl.int64) * r2t_stride + pos, mask=ok, other=0)
            ok = ok & (token >= 0) & (token < num_full)
            swa = tl.load(f2s_ptr + token, mask=ok, other=0)
            ok = ok & (swa >= 0)
            swa = swa.to(tl.int32)
            row = (swa // sps) * ring + swa % ring
        return tl.where(ok, row, -1)

    @triton.jit
    def _page(row, RATIO: tl.constexpr):
        return tl.where(row >= 0, row // RATIO, -1)

    @triton.jit
    def _words4(w0, w1, w2, w3):
        """Four ``[N]`` int32 vectors -> ``[N, 4]`` rows (one 16-byte store per row)."""
        return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (w0.shape[0], 4))

    @triton.jit
    def _first_write(seq, spec_pad, RATIO: tl.constexpr, ADDRESSING: tl.constexpr):
        """First position of a request (seq_len ``seq``) that is always written to the ring."""
        first = (seq // RATIO) * RATIO - (4 if RATIO == 4 else 0)
        if ADDRESSING != 2:
            first = tl.minimum(first, seq - spec_pad)
        return first

    @triton.jit
    def _band(x, sps):
        """SWA page-tail positions (the last 4 of each page) in ``[0, x)``, ``x >= 0``, ``sps >= 4``."""
        return (x // sps) * 4 + tl.maximum(x % sps - (sps - 4), 0)

    @triton.jit
    def _writes_before(x, prefix, first, sps, RATIO: tl.constexpr, ADDRESSING: tl.constexpr):
        """Written positions of a request in ``[prefix, x)`` (``x >= prefix``)."""
        n = tl.maximum(x - tl.maximum(prefix, first), 0)
        if RATIO == 4 and ADDRESSING == 0:
            n += _band(tl.maximum(tl.minimum(x, first), prefix), sps) - _band(prefix, sps)
        return n

    @triton.jit
    def _request_counts(begin, rows, seq64, ext64, ok, num_q_tokens, spec_pad, sps,
                        RATIO: tl.constexpr, ADDRESSING: tl.constexpr, ONLINE: tl.constexpr):
        """(events, writes) of requests whose ragged rows are ``[begin, begin + rows)``, over the rows that exist.

        Offline: events are chunk-completing positions, writes the written positions.
        Online: events are the close segments, writes the (at most one) trailing write segment."""
        seq = seq64.to(tl.int32)
        prefix = seq - ext64.to(tl.int32)
        n = tl.minimum(tl.maximum(num_q_tokens - begin, 0), rows)
        stop = prefix + n
        events = tl.where(ok, stop // RATIO - prefix // RATIO, 0)
        if ONLINE:
            writes = (ok & (n > 0) & (stop == seq) & (seq % RATIO != 0)).to(tl.int32)
        else:
            writes = tl.where(ok, _writes_before(stop, prefix, _first_write(seq, spec_pad, RATIO, ADDRESSING), sps,
                                                 RATIO, ADDRESSING), 0)
        return events, writes

    # Locating ragged rows. A block of ROWS ragged rows ``i`` walks the batch in chunks of CHUNK
    # requests and keeps, per row, the requests that end at or before it and their rows, events and
    # writes. The kernel body does the loads (seq_lens, extend_lens, request ids) and the loop; the
    # helpers below only compute. Inductor's mutation analysis of user Triton kernels counts every
    # pointer handed to a helper whose result feeds a store address as written, and a compiled
    # graph whose inputs look mutated skips CUDA graphs.
    @triton.jit
    def walk_chunk(i, i0, c0, bs, seq64, ext64, rid_ok, b, begin, ev_base, wr_base, done, ev_total, wr_total,
                   num_q_tokens, spec_pad, sps, RATIO: tl.constexpr, ADDRESSING: tl.constexpr, ONLINE: tl.constexpr,
                   ROWS: tl.constexpr, CHUNK: tl.constexpr):
        """Fold requests ``c0 + [0, CHUNK)`` (their seq_lens, extend_lens, ``rid_ok``) into the walk state
        ``(b, begin, ev_base, wr_base)`` per row and ``(done, ev_total, wr_total)`` of the block.

        ``done``: ragged rows of the requests walked so far, clamped at 65536 (> any row)."""
        k = c0 + tl.arange(0, CHUNK)
        in_batch = k < bs
        ok = in_batch & (ext64 >= 0) & (ext64 <= seq64) & rid_ok
        rows = tl.minimum(tl.maximum(ext64, 0), 65536).to(tl.int32)  # ragged rows the request occupies
        ends = done + tl.cumsum(rows, 0)
        events, writes = _request_counts(ends - rows, rows, seq64, ext64, ok, num_q_tokens, spec_pad, sps,
                                         RATIO, ADDRESSING, ONLINE)
        chunk_rows = tl.sum(rows, 0)
        chunk_events = tl.sum(events, 0)
        chunk_writes = tl.sum(writes, 0)
        if done + chunk_rows <= i0:  # every request of the chunk ends before the block
            b += tl.minimum(bs - c0, CHUNK)
            begin += chunk_rows
            ev_base += chunk_events
            wr_base += chunk_writes
        elif done < i0 + ROWS:  # the chunk straddles the block
            # [CHUNK, ROWS] (not [ROWS, CHUNK]): each thread then holds a whole chunk column for its row
            # and the sums are thread-local
            before = (ends[:, None] <= i[None, :]) & in_batch[:, None]
            b += tl.sum(before.to(tl.int32), 0)
            begin += tl.sum(tl.where(before, rows[:, None], 0), 0)
            ev_base += tl.sum(tl.where(before, events[:, None], 0), 0)
            wr_base += tl.sum(tl.where(before, writes[:, None], 0), 0)
        return (b, begin, ev_base, wr_base, tl.minimum(done + chunk_rows, 65536), ev_total + chunk_events,
                wr_total + chunk_writes)

    @triton.jit
    def row_fields(i, live, begin, seq64, ext64, rid64, ONLINE: tl.constexpr):
        """Rows ``i`` of request ``b`` (``live``: in range and ``b < bs``; ``seq64, ext64, rid64``: its
        seq_len, extend_len, id): (belongs to a valid request, index inside the request's extend,
        position, prefix, seq_len, request id), int32."""
        ok = live & (ext64 >= 0) & (ext64 <= seq64)
        if ONLINE:
            ok = ok & (rid64 >= 0)
        seq = seq64.to(tl.int32)
        prefix = seq - ext64.to(tl.int32)
        j = i - begin
        return ok, j, prefix + j, prefix, seq, rid64.to(tl.int32)

    @triton.jit
    def _plan_decode_kernel(
        rpi_ptr, seq_ptr, plan_ptr, bs, r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full,
        sps, ring, RATIO: tl.constexpr, ADDRESSING: tl.constexpr,
        HAS_TABLE: tl.constexpr, BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        in_batch = b < bs
        rid = tl.load(rpi_ptr + b, mask=in_batch, other=0).to(tl.int32)
        seq64 = tl.load(seq_ptr + b, mask=in_batch, other=0)
        live = in_batch & (seq64 >= 1)
        seq = tl.where(live, seq64.to(tl.int32), 0)
        lookup = (r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full, sps, ring, RATIO, ADDRESSING, HAS_TABLE)
        write_loc = _state_row(rid, seq - 1, live, *lookup)
        page0 = _page(_state_row(rid, tl.maximum(seq - 1 - RATIO, 0), live, *lookup), RATIO)
        words = _words4(seq, write_loc, page0, _page(write_loc, RATIO))
        tl.store(plan_ptr + b[:, None] * 4 + tl.arange(0, 4)[None, :], words, mask=in_batch[:, None])

    @triton.jit
    def _plan_prefill_kernel(
        plan_c_ptr, plan_w_ptr, num_q_tokens, bs, rpi_ptr, seq_ptr, ext_ptr, spec_pad, offset,
        r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full, sps, ring,
        RATIO: tl.constexpr, ADDRESSING: tl.constexpr, HAS_TABLE: tl.constexpr, ONLINE: tl.constexpr,
        ROWS: tl.constexpr, CHUNK: tl.constexpr,
    ):
        """Offline plan, or (``ONLINE``: ratio 128, state slot ``request id + offset``) the online one."""
        W: tl.constexpr = 8 if RATIO == 4 else RATIO
        i0 = tl.program_id(0) * ROWS
        i = i0 + tl.arange(0, ROWS)
        lane = tl.arange(0, CHUNK)
        b = tl.zeros([ROWS], tl.int32)  # per row: requests that end at or before it
        begin = tl.zeros([ROWS], tl.int32)  # their rows: the ragged start of the row's request
        ev_base = tl.zeros([ROWS], tl.int32)  # their events and writes (online: close and write segments)
        wr_base = tl.zeros([ROWS], tl.int32)
        done = tl.sum(b, 0)
        total_events = tl.sum(b, 0)
        total_writes = tl.sum(b, 0)
        seq_next = tl.load(seq_ptr + lane, mask=lane < bs, other=0)
        ext_next = tl.load(ext_ptr + lane, mask=lane < bs, other=0)
        if ONLINE:
            rid_next = tl.load(rpi_ptr + lane, mask=lane < bs, other=0)
        c0 = 0
        while c0 < bs:
            seq64 = seq_next
            ext64 = ext_next
            if ONLINE:
                rid_ok = rid_next >= 0
            else:
                rid_ok = lane >= 0
            nxt = c0 + CHUNK + lane
            seq_next = tl.load(seq_ptr + nxt, mask=nxt < bs, other=0)  # in flight while this chunk is walked
            ext_next = tl.load(ext_ptr + nxt, mask=nxt < bs, other=0)
            if ONLINE:
                rid_next = tl.load(rpi_ptr + nxt, mask=nxt < bs, other=0)
            b, begin, ev_base, wr_base, done, total_events, total_writes = walk_chunk(
                i, i0, c0, bs, seq64, ext64, rid_ok, b, begin, ev_base, wr_base, done, total_events, total_writes,
                num_q_tokens, spec_pad, sps, RATIO, ADDRESSING, ONLINE, ROWS, CHUNK)
            c0 += CHUNK
        in_rows = i < num_q_tokens
        live = in_rows & (b < bs)
        ok, j, pos, prefix, seq, rid = row_fields(
            i, live, begin, tl.load(seq_ptr + b, mask=live, other=0), tl.load(ext_ptr + b, mask=live, other=0),
            tl.load(rpi_ptr + b, mask=live, other=0), ONLINE)
        col4 = tl.arange(0, 4)[None, :]
        sentinel = tl.broadcast_to(tl.where(col4 == 1, 0, -1), (ROWS, 4))  # a padding plan_c row
        if ONLINE:
            # close segment of position p (a chunk end) -> plan_c row ev_base + (p + 1) // 128 - prefix // 128 - 1;
            # the request's trailing write segment (its last position, not a chunk end) -> plan_w row wr_base
            start = tl.maximum(pos - pos % 128, prefix)  # first position of the segment
            ends_chunk = (pos + 1) % 128 == 0
            is_close = ok & ends_chunk
            is_write = ok & (pos == seq - 1) & ~ends_chunk
            slot = rid + offset
            words = _words4(pos + 1, i | ((pos + 1 - start) << 16), slot, tl.where(start % 128 != 0, slot, -1))
            close_dst = ev_base + (pos + 1) // 128 - prefix // 128 - 1
            tl.store(plan_c_ptr + close_dst[:, None] * 4 + col4, words, mask=is_close[:, None])
            tl.store(plan_w_ptr + wr_base[:, None] * 4 + col4, words, mask=is_write[:, None])
            tl.store(plan_w_ptr + i[:, None] * 4 + col4, sentinel, mask=(in_rows & (i >= total_writes))[:, None])
        else:
            lookup = (r2t_ptr, r2t_stride, num_reqs, max_len, f2s_ptr, num_full, sps, ring, RATIO, ADDRESSING,
                      HAS_TABLE)
            is_event = ok & ((pos + 1) % RATIO == 0)
            first = _first_write(seq, spec_pad, RATIO, ADDRESSING)
            keep = pos >= first
            if RATIO == 4 and ADDRESSING == 0:
                keep = keep | (pos % sps >= sps - 4)  # last chunk of every SWA page
            is_write = ok & keep
            row = _state_row(rid, pos, is_event | is_write, *lookup)
            page0 = _page(_state_row(rid, tl.maximum(pos - RATIO, 0), is_event, *lookup), RATIO)

            ev_dst = ev_base + (pos + 1) // RATIO - prefix // RATIO - 1
            c_words = _words4(pos + 1, i | ((W - tl.minimum(j + 1, W)) << 16), page0, _page(row, RATIO))
            tl.store(plan_c_ptr + ev_dst[:, None] * 4 + col4, c_words, mask=is_event[:, None])
            col2 = tl.arange(0, 2)[None, :]
            wr_dst = wr_base + _writes_before(pos, prefix, first, sps, RATIO, ADDRESSING)
            tl.store(plan_w_ptr + wr_dst[:, None] * 2 + col2, tl.join(i, row), mask=is_write[:, None])
            pad_w = in_rows & (i >= total_writes)
            tl.store(plan_w_ptr + i[:, None] * 2 + col2, tl.full([ROWS, 2], -1, tl.int32), mask=pad_w[:, None])
        # padding: plan_c rows of this block's range past the valid ones
        tl.store(plan_c_ptr + i[:, None] * 4 + col4, sentinel, mask=(in_rows & (i >= total_events))[:, None])


def _lookup_args(req_to_token, full_to_state, compress_ratio, swa_page_size, ring_size, addressing, device):
    """Kernel arguments of ``_state_row``; absent tables become never-read one-element placeholders."""
    has_table = req_to_token is not None
    r2t = req_to_token if has_table else torch.empty(1, 1, dtype=torch.int32, device=device)
    f2s = full_to_state if full_to_state is not None else torch.empty(1, dtype=torch.int64, device=device)
    tensors = (r2t, r2t.stride(0), r2t.shape[0], r2t.shape[1], f2s, f2s.shape[0], max(swa_page_size, 1),
               max(ring_size, 1))
    meta = dict(RATIO=compress_ratio, ADDRESSING=int(addressing), HAS_TABLE=has_table)
    return tensors, meta


def plan_decode(req_pool_indices, req_to_token, full_to_state, seq_lens, compress_ratio, swa_page_size, ring_size,
                addressing, plan=None) -> torch.Tensor:
    """DecodePlan rows ``[bs, 16]`` uint8, written into ``plan`` (``[bs, 16]`` uint8) when given."""
    bs = req_pool_indices.shape[0]
    if plan is None:
        plan = torch.empty((bs, 16), dtype=torch.uint8, device=req_pool_indices.device)
    tensors, meta = _lookup_args(req_to_token, full_to_state, compress_ratio, swa_page_size, ring_size, addressing,
                                 req_pool_indices.device)
    launch(_plan_decode_kernel)[(cdiv(bs, DECODE_BLOCK),)](
        req_pool_indices, seq_lens, plan.view(torch.int32), bs, *tensors, BLOCK=DECODE_BLOCK, **meta, num_warps=4,
    )
    return plan


def plan_prefill(req_pool_indices, req_to_token, full_to_state, seq_lens, extend_lens, num_q_tokens, compress_ratio,
                 swa_page_size, ring_size, addressing):
    device = req_pool_indices.device
    plan_c = torch.empty((num_q_tokens, 4), dtype=torch.int32, device=device)
    plan_w = torch.empty((num_q_tokens, 2), dtype=torch.int32, device=device)
    tensors, meta = _lookup_args(req_to_token, full_to_state, compress_ratio, swa_page_size, ring_size, addressing,
                                 device)
    spec_pad = min(ring_size - compress_ratio, 4)  # speculative rollback tail (paged addressing only)
    launch(_plan_prefill_kernel)[(cdiv(num_q_tokens, ROWS),)](
        plan_c, plan_w, num_q_tokens, req_pool_indices.shape[0], req_pool_indices, seq_lens, extend_lens, spec_pad,
        0, *tensors, **meta, ONLINE=False, ROWS=ROWS, CHUNK=CHUNK, num_warps=4,
    )
    return plan_c.view(torch.uint8), plan_w.view(torch.uint8)
