"""Golden (slow, loop-based) ``compress_forward`` and the model-level formula.

Written from ``shared/docs/spec-compressor.md`` sections 1, 4, 7 and
``docs/semantics.md`` items 12-17 only; it shares no code with ``dsv4ops``.

All pooling arithmetic is float64. The loops run over plan rows and window
rows; the per-channel softmax is evaluated channel-wise with numpy float64
vectors (each channel's computation is independent of every other channel, so
this is the same per-element formula, just evaluated for all d at once).

State writes cast the fp32 input row to the state dtype (torch ``.to``), reads
widen the stored value to float64.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .planner_loop import compress_plan_rows, decode_plan_rows, write_plan_rows

INVALID_SEQ = 0xFFFFFFFF


def _window_len(r: int) -> int:
    return 8 if r == 4 else r


def _pool(entries, D):
    """Per-channel softmax pooling.

    ``entries`` is a list of (value[D], score_with_ape[D]) float64 vectors (masked
    rows are simply absent).  For every channel d:
        m = max_w s_w[d];  e_w = exp(s_w[d] - m);  out[d] = sum_w e_w v_w[d] / sum_w e_w
    """
    assert entries, "window has no unmasked row"
    m = np.full(D, -math.inf)
    for _, s in entries:
        m = np.maximum(m, s)
    num = np.zeros(D)
    den = np.zeros(D)
    for v, s in entries:
        e = np.exp(s - m)
        num = num + e * v
        den = den + e
    return num / den


def _np64(t):
    if isinstance(t, torch.Tensor):
        return t.detach().to(torch.float64).cpu().numpy()
    return np.asarray(t, dtype=np.float64)


def _state_2d(state, width):
    s2 = state.view(-1, width)
    assert s2.data_ptr() == state.data_ptr()
    return s2


def _window_decode(state64, rows, seq_len, page0, page1, ape, D, r):
    """Window entries read entirely from the state, or None if a row is out of range."""
    entries = []
    if r == 4:
        if seq_len > 4:  # overlap rows (A quarters of the previous chunk's page)
            for i in range(4):
                row = page0 * 4 + i
                if page0 < 0 or not 0 <= row < rows:
                    return None
                x = state64[row]
                entries.append((x[0:D], x[2 * D:3 * D] + ape[i]))
        for i in range(4):  # current rows (B quarters)
            row = page1 * 4 + i
            if page1 < 0 or not 0 <= row < rows:
                return None
            x = state64[row]
            entries.append((x[D:2 * D], x[3 * D:4 * D] + ape[4 + i]))
    else:
        for j in range(r):
            row = page1 * r + j
            if page1 < 0 or not 0 <= row < rows:
                return None
            x = state64[row]
            entries.append((x[0:D], x[D:2 * D] + ape[j]))
    return entries


def compress_decode_loop(state, kv_score_input, ape, plan_d, head_dim, compress_ratio):
    """Decode ``compress_forward``: per batch row write the token, then pool at a boundary.

    Mutates ``state`` (``[rows, 2cD]``, fp32 or bf16). Returns float64 ``[bs, head_dim]``;
    rows that emit nothing are zero.
    """
    D, r = int(head_dim), int(compress_ratio)
    c = 2 if r == 4 else 1
    width = 2 * c * D
    st = _state_2d(state, width)
    rows = st.shape[0]
    inp = kv_score_input.reshape(-1, width)
    ape64 = _np64(ape).reshape(_window_len(r), D)
    plan = decode_plan_rows(plan_d)
    out = np.zeros((len(plan), D))
    for b, (seq_len, write_loc, page0, page1) in enumerate(plan):
        # 1. write (bounds-checked: an out-of-range write_loc writes and emits nothing)
        if not 0 <= write_loc < rows:
            continue
        st[write_loc] = inp[b].to(st.dtype)
        # 2. boundary test
        if not (seq_len % r == 0 and seq_len >= r):
            continue
        # 3. pool a window read entirely from the state (after the write)
        needed = []
        if r == 4:
            if seq_len > 4:
                needed += [page0 * 4 + i for i in range(4)] if page0 >= 0 else [-1]
            needed += [page1 * 4 + i for i in range(4)] if page1 >= 0 else [-1]
        else:
            needed += [page1 * r + j for j in range(r)] if page1 >= 0 else [-1]
        if any(not 0 <= row < rows for row in needed):
            continue
        state64 = {row: st[row].to(torch.float64).numpy() for row in needed}
        entries = _window_decode(state64, rows, seq_len, page0, page1, ape64, D, r)
        if entries is None:
            continue
        out[b] = _pool(entries, D)
    return torch.from_numpy(out)


def compress_prefill_loop(state, kv_score_input, ape, plan_c, plan_w, head_dim, compress_ratio):
    """Prefill ``compress_forward``: pass 1 pools every valid plan_c row (all reads), then
    pass 2 persists every valid plan_w row into the state. Returns float64 ``[n_c, head_dim]``.
    """
    D, r = int(head_dim), int(compress_ratio)
    c = 2 if r == 4 else 1
    W = _window_len(r)
    width = 2 * c * D
    st = _state_2d(state, width)
    rows = st.shape[0]
    inp = kv_score_input.reshape(-1, width)
    n_in = inp.shape[0]
    inp64 = inp.to(torch.float64).numpy()
    ape64 = _np64(ape).reshape(W, D)
    cplan = compress_plan_rows(plan_c)
    wplan = write_plan_rows(plan_w)
    out = np.zeros((len(cplan), D))

    state_cache = {}  # pass 1 never writes, so caching float64 copies of state rows is safe

    def state_row(page, slot):
        row = page * r + slot
        if page < 0 or not 0 <= row < rows:
            return None
        if row not in state_cache:
            state_cache[row] = st[row].to(torch.float64).numpy()
        return state_cache[row]

    def input_row(idx):
        if not 0 <= idx < n_in:
            return None
        return inp64[idx]

    # ---- pass 1: every compress event reads (state is not modified here) ----
    for k, (seq_len, P, bl, page0, page1) in enumerate(cplan):
        if seq_len == INVALID_SEQ or seq_len < r or bl > W:
            continue
        entries = []
        ok = True
        if r == 4:
            if seq_len > 4:  # overlap rows 0..3: A quarters
                for i in range(4):
                    x = state_row(page0, i) if i < bl else input_row(P - 7 + i)
                    if x is None:
                        ok = False
                        break
                    entries.append((x[0:D], x[2 * D:3 * D] + ape64[i]))
            if ok:
                for i in range(4):  # current rows 4..7: B quarters
                    x = state_row(page1, i) if 4 + i < bl else input_row(P - 3 + i)
                    if x is None:
                        ok = False
                        break
                    entries.append((x[D:2 * D], x[3 * D:4 * D] + ape64[4 + i]))
        else:
            for j in range(r):
                x = state_row(page1, j) if j < bl else input_row(P - (r - 1) + j)
                if x is None:
                    ok = False
                    break
                entries.append((x[0:D], x[D:2 * D] + ape64[j]))
        if not ok:
            continue
        out[k] = _pool(entries, D)

    # ---- pass 2: persist tokens into the ring ----
    for ragged, write_loc in wplan:
        if not 0 <= ragged < n_in or not 0 <= write_loc < rows:
            continue
        st[write_loc] = inp[ragged].to(st.dtype)
    return torch.from_numpy(out)


def compressed_token_truth(token_rows, ape, n, compress_ratio, head_dim):
    """Model-level compressed token ``n`` of one request (spec section 1), float64 ``[D]``.

    ``token_rows`` is that request's raw kv_score rows ``[seq_len, 2cD]``;
    ``ape`` is the kernel layout ``[W, D]`` (r = 4: ``[8, D]``).
    """
    D, r = int(head_dim), int(compress_ratio)
    x = _np64(token_rows)
    a = _np64(ape).reshape(_window_len(r), D)
    n = int(n)
    assert n >= 0 and x.shape[0] >= r * (n + 1), "token n is not complete"
    entries = []
    if r == 128:
        for j in range(128):
            t = 128 * n + j
            entries.append((x[t, 0:D], x[t, D:2 * D] + a[j]))
    elif r == 4:
        if n > 0:  # rows 0..3: A halves of the previous chunk
            for w in range(4):
                t = 4 * n - 4 + w
                entries.append((x[t, 0:D], x[t, 2 * D:3 * D] + a[w]))
        for w in range(4, 8):  # rows 4..7: B halves of the current chunk
            t = 4 * n + w - 4
            entries.append((x[t, D:2 * D], x[t, 3 * D:4 * D] + a[w]))
    else:
        raise ValueError(f"compress_ratio must be 4 or 128, got {r}")
    return torch.from_numpy(_pool(entries, D))
