"""Triton kernels of the training ops: ``compress_train`` and ``norm_rope``, forward and backward.

compress_train (``[B, T, 2cD]`` rows, every complete chunk pooled):

* one program per (block of ``BLOCK_Q`` compressed tokens of the flattened ``(b, n)``
  axis, block of ``BLOCK_D`` channels); tiles are ``[BLOCK_Q, window rows, BLOCK_D]``
  with the channel axis contiguous in memory;
* ratio 4: the whole 8-row window is in registers (A halves of chunk n-1, B halves of
  chunk n), softmax in one pass; ratio 128: the 128 rows are streamed in chunks of
  ``BLOCK_W`` with an online softmax (forward), and twice in the backward (statistics,
  then gradients; the second read is served by L2);
* the backward recomputes the softmax (nothing but the inputs is saved). It is a
  gather: the program of token n writes the gradient of every raw element that output
  n reads (ratio 4: B halves of chunk n and A halves of chunk n-1), so every gradient
  element is written exactly once, no atomics; the program of the last compressed
  token of a sequence also zeroes the rows that feed no output;
* ``d ape`` is reduced without atomics: each program writes its partial sum over its
  ``BLOCK_Q`` tokens into a workspace ``[programs, W, D]``, then ``_sum_partials_kernel``
  adds the partials in program order. Bit-reproducible run to run.

norm_rope: ``BLOCK_M`` rows per program, the whole row in registers; the backward
accumulates the weight gradient over a fixed range of row blocks per program and
reduces the per-program partials with the same ordered kernel.

Stores to bf16 round to nearest even with bit arithmetic (``cast_rne``), so results are
the same under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._triton import HAVE_TRITON, cdiv, launch, next_pow2

if HAVE_TRITON:
    import triton
    import triton.language as tl

    # imported under its own name: Inductor re-emits a user kernel's helpers by name
    from .._triton_formats import cast_rne

    # ------------------------------------------------------------------ ratio 128
    @triton.jit
    def _program_tile(HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        """(token block, channel offsets) of this program in a 1-D grid, channel blocks fastest.

        Programs that run together then read whole rows between them (each row is a few KiB:
        consecutive programs take its consecutive channel slices), which keeps DRAM pages
        and L2 lines fully used; a 1-D grid also has no 65535 limit on the token blocks.
        """
        NUM_D: tl.constexpr = HEAD_DIM // BLOCK_D
        pid = tl.program_id(0).to(tl.int64)
        return pid // NUM_D, (pid % NUM_D).to(tl.int32) * BLOCK_D + tl.arange(0, BLOCK_D)

    @triton.jit
    def _pool128_stats(x_ptr, ape_ptr, row0, q_ok, d,
                       HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr):
        """Online softmax over the 128 window rows: running max, denominator, numerator ``[BLOCK_Q, BLOCK_D]``."""
        D: tl.constexpr = HEAD_DIM
        m = tl.full([BLOCK_Q, BLOCK_D], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
        acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
        live = q_ok[:, None, None]
        for w0 in range(0, 128, BLOCK_W):
            w = w0 + tl.arange(0, BLOCK_W)
            at = x_ptr + (row0[:, None, None] + w[None, :, None]) * (2 * D) + d[None, None, :]
            kv = tl.load(at, mask=live, other=0.0).to(tl.float32)
            ape = tl.load(ape_ptr + w[:, None] * D + d[None, :]).to(tl.float32)
            s = tl.load(at + D, mask=live, other=0.0).to(tl.float32) + ape[None, :, :]
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None, :])
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha + tl.sum(p * kv, axis=1)
            m = m_new
        return m, l, acc

    @triton.jit
    def _pool128_fwd_kernel(x_ptr, ape_ptr, out_ptr, T, N, num_out,
                            HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_W: tl.constexpr,
                            BLOCK_D: tl.constexpr):
        D: tl.constexpr = HEAD_DIM
        q_block, d = _program_tile(HEAD_DIM, BLOCK_D)
        q = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
        q_ok = q < num_out
        row0 = (q // N) * T + (q % N) * 128
        m, l, acc = _pool128_stats(x_ptr, ape_ptr, row0, q_ok, d, HEAD_DIM, BLOCK_Q, BLOCK_W, BLOCK_D)
        tl.store(out_ptr + q[:, None] * D + d[None, :], cast_rne(acc / l, out_ptr.dtype.element_ty),
                 mask=q_ok[:, None])

    @triton.jit
    def _pool128_bwd_kernel(x_ptr, ape_ptr, g_ptr, gx_ptr, ws_ptr, T, N, num_out,
                            HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_W: tl.constexpr,
                            BLOCK_D: tl.constexpr):
        D: tl.constexpr = HEAD_DIM
        q_block, d = _program_tile(HEAD_DIM, BLOCK_D)
        q = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
        q_ok = q < num_out
        b = q // N
        n = q % N
        row0 = b * T + n * 128
        m, l, acc = _pool128_stats(x_ptr, ape_ptr, row0, q_ok, d, HEAD_DIM, BLOCK_Q, BLOCK_W, BLOCK_D)
        inv_l = 1.0 / l
        out = acc * inv_l
        g = tl.load(g_ptr + q[:, None] * D + d[None, :], mask=q_ok[:, None], other=0.0)
        g = g.to(tl.float32)
        live = q_ok[:, None, None]
        # the last compressed token of each sequence also zeroes the trailing partial chunk
        last = q_ok & (n == N - 1)
        zero = tl.zeros([BLOCK_Q, BLOCK_W, BLOCK_D], tl.float32)
        for w0 in range(0, 128, BLOCK_W):
            w = w0 + tl.arange(0, BLOCK_W)
            at = (row0[:, None, None] + w[None, :, None]) * (2 * D) + d[None, None, :]
            kv = tl.load(x_ptr + at, mask=live, other=0.0).to(tl.float32)
            ape = tl.load(ape_ptr + w[:, None] * D + d[None, :]).to(tl.float32)
            s = tl.load(x_ptr + at + D, mask=live, other=0.0).to(tl.float32) + ape[None, :, :]
            p = tl.exp(s - m[:, None, :]) * inv_l[:, None, :]
            pg = p * g[:, None, :]
            d_score = pg * (kv - out[:, None, :])
            tl.store(gx_ptr + at, cast_rne(pg, gx_ptr.dtype.element_ty), mask=live)
            tl.store(gx_ptr + at + D, cast_rne(d_score, gx_ptr.dtype.element_ty), mask=live)
            tl.store(ws_ptr + q_block * (128 * D) + w[:, None] * D + d[None, :],
                     tl.sum(d_score, axis=0))
            tail_t = (n + 1)[:, None] * 128 + w[None, :]  # [BLOCK_Q, BLOCK_W]
            tail = (last[:, None] & (tail_t < T))[:, :, None]
            tail_at = (b[:, None, None] * T + tail_t[:, :, None]) * (2 * D) + d[None, None, :]
            tl.store(gx_ptr + tail_at, cast_rne(zero, gx_ptr.dtype.element_ty), mask=tail)
            tl.store(gx_ptr + tail_at + D, cast_rne(zero, gx_ptr.dtype.element_ty), mask=tail)

    # ------------------------------------------------------------------ ratio 4
    @triton.jit
    def _pool4_rows(q, d, T, N, num_out, HEAD_DIM: tl.constexpr):
        """Where the 8-row window of compressed tokens ``q`` lives: A rows (chunk n-1), B rows (chunk n).

        Returns the element offsets ``at_a``/``at_b`` ``[BLOCK_Q, 4, BLOCK_D]`` of their kv parts,
        whether the A rows exist, the masks, ``(b, n)`` and the B row indices. Pure index math: the
        stores of the backward kernel address through it, and a pointer passed to a helper whose
        result feeds a store address would count as written for Inductor (see
        tests/test_kernel_mutations.py).
        """
        D: tl.constexpr = HEAD_DIM
        q_ok = q < num_out
        b = q // N
        n = q % N
        j = tl.arange(0, 4)
        row_b = (b * T + n * 4)[:, None] + j[None, :]  # tokens 4n .. 4n+3
        has_a = q_ok & (n > 0)
        at_a = (row_b - 4)[:, :, None] * (4 * D) + d[None, None, :]  # kv_A of tokens 4n-4 .. 4n-1
        at_b = row_b[:, :, None] * (4 * D) + D + d[None, None, :]  # kv_B of tokens 4n .. 4n+3
        return at_a, at_b, has_a, has_a[:, None, None], q_ok[:, None, None], b, n, row_b

    @triton.jit
    def _pool4_window(x_ptr, ape_ptr, d, at_a, at_b, has_a, live_a, live_b, HEAD_DIM: tl.constexpr):
        """The window's values: ``(kv_a, s_a, kv_b, s_b)`` ``[BLOCK_Q, 4, BLOCK_D]`` fp32, scores
        biased, A scores -inf where there is no chunk n-1."""
        D: tl.constexpr = HEAD_DIM
        j = tl.arange(0, 4)
        ape_at = ape_ptr + j[:, None] * D + d[None, :]
        ape_a = tl.load(ape_at).to(tl.float32)
        ape_b = tl.load(ape_at + 4 * D).to(tl.float32)
        kv_a = tl.load(x_ptr + at_a, mask=live_a, other=0.0).to(tl.float32)
        s_a = tl.load(x_ptr + at_a + 2 * D, mask=live_a, other=0.0).to(tl.float32) + ape_a[None, :, :]
        s_a = tl.where(has_a[:, None, None], s_a, float("-inf"))
        kv_b = tl.load(x_ptr + at_b, mask=live_b, other=0.0).to(tl.float32)
        s_b = tl.load(x_ptr + at_b + 2 * D, mask=live_b, other=0.0).to(tl.float32) + ape_b[None, :, :]
        return kv_a, s_a, kv_b, s_b

    @triton.jit
    def _pool4_fwd_kernel(x_ptr, ape_ptr, out_ptr, T, N, num_out,
                          HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
        D: tl.constexpr = HEAD_DIM
        q_block, d = _program_tile(HEAD_DIM, BLOCK_D)
        q = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
        at_a, at_b, has_a, live_a, live_b, b, n, row_b = _pool4_rows(q, d, T, N, num_out, HEAD_DIM)
        kv_a, s_a, kv_b, s_b = _pool4_window(x_ptr, ape_ptr, d, at_a, at_b, has_a, live_a, live_b, HEAD_DIM)
        m = tl.maximum(tl.max(s_a, axis=1), tl.max(s_b, axis=1))
        p_a = tl.exp(s_a - m[:, None, :])
        p_b = tl.exp(s_b - m[:, None, :])
        out = (tl.sum(p_a * kv_a, axis=1) + tl.sum(p_b * kv_b, axis=1)) / (tl.sum(p_a, axis=1) + tl.sum(p_b, axis=1))
        tl.store(out_ptr + q[:, None] * D + d[None, :], cast_rne(out, out_ptr.dtype.element_ty),
                 mask=(q < num_out)[:, None])

    @triton.jit
    def _pool4_bwd_kernel(x_ptr, ape_ptr, g_ptr, gx_ptr, ws_ptr, T, N, num_out,
                          HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
        D: tl.constexpr = HEAD_DIM
        q_block, d = _program_tile(HEAD_DIM, BLOCK_D)
        q = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
        q_ok = q < num_out
        at_a, at_b, has_a, live_a, live_b, b, n, row_b = _pool4_rows(q, d, T, N, num_out, HEAD_DIM)
        kv_a, s_a, kv_b, s_b = _pool4_window(x_ptr, ape_ptr, d, at_a, at_b, has_a, live_a, live_b, HEAD_DIM)
        m = tl.maximum(tl.max(s_a, axis=1), tl.max(s_b, axis=1))
        p_a = tl.exp(s_a - m[:, None, :])
        p_b = tl.exp(s_b - m[:, None, :])
        inv_l = 1.0 / (tl.sum(p_a, axis=1) + tl.sum(p_b, axis=1))
        out = (tl.sum(p_a * kv_a, axis=1) + tl.sum(p_b * kv_b, axis=1)) * inv_l
        g = tl.load(g_ptr + q[:, None] * D + d[None, :], mask=q_ok[:, None], other=0.0)
        gl = (g.to(tl.float32) * inv_l)[:, None, :]
        o = out[:, None, :]
        dtype = gx_ptr.dtype.element_ty
        pg_a = p_a * gl
        ds_a = pg_a * (kv_a - o)
        pg_b = p_b * gl
        ds_b = pg_b * (kv_b - o)
        # window rows 0..3 are the A halves of chunk n-1, rows 4..7 the B halves of chunk n
        tl.store(gx_ptr + at_a, cast_rne(pg_a, dtype), mask=live_a)
        tl.store(gx_ptr + at_a + 2 * D, cast_rne(ds_a, dtype), mask=live_a)
        tl.store(gx_ptr + at_b, cast_rne(pg_b, dtype), mask=live_b)
        tl.store(gx_ptr + at_b + 2 * D, cast_rne(ds_b, dtype), mask=live_b)
        j = tl.arange(0, 4)
        ws = ws_ptr + q_block * (8 * D) + j[:, None] * D + d[None, :]
        tl.store(ws, tl.sum(ds_a, axis=0))
        tl.store(ws + 4 * D, tl.sum(ds_b, axis=0))
        # rows no output reads: A halves of the last complete chunk, every part of the partial chunk
        last = (q_ok & (n == N - 1))[:, None, None]
        zero = tl.zeros([BLOCK_Q, 4, BLOCK_D], tl.float32)
        own_a = row_b[:, :, None] * (4 * D) + d[None, None, :]
        tl.store(gx_ptr + own_a, cast_rne(zero, dtype), mask=last)
        tl.store(gx_ptr + own_a + 2 * D, cast_rne(zero, dtype), mask=last)
        tail = last & (((n + 1) * 4)[:, None] + j[None, :] < T)[:, :, None]
        tail_at = own_a + 16 * D  # the same columns four tokens later
        for part in tl.static_range(4):
            tl.store(gx_ptr + tail_at + part * D, cast_rne(zero, dtype), mask=tail)

    # ------------------------------------------------------------------ ordered reduction
    @triton.jit
    def _sum_partials_kernel(ws_ptr, out_ptr, num_partials, size, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
        """``out[i] = sum_p ws[p, i]``: ``CHUNK`` partials at a time, each chunk reduced as one tile and
        the chunks added in order p = 0, CHUNK, ..., so the order is fixed by the shapes alone
        (deterministic). One partial per step made a 512-partial sum a chain of 512 dependent loads."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < size
        acc = tl.zeros([BLOCK], tl.float32)
        p0 = 0
        while p0 < num_partials:  # a while loop: the interpreter cannot run range() over a runtime bound
            p = p0 + tl.arange(0, CHUNK)
            tile = tl.load(ws_ptr + p.to(tl.int64)[:, None] * size + i[None, :],
                           mask=(p < num_partials)[:, None] & ok[None, :], other=0.0)
            acc += tl.sum(tile, axis=0)
            p0 += CHUNK
        tl.store(out_ptr + i, cast_rne(acc, out_ptr.dtype.element_ty), mask=ok)

    # ------------------------------------------------------------------ norm_rope
    @triton.jit
    def _rope_cos_sin(freqs_ptr, pos_ptr, rows, ok, num_pos, BLOCK_M: tl.constexpr):
        """cos, sin ``[BLOCK_M, 32]`` per row (cos 1, sin 0 where the position is outside the table)."""
        pos = tl.load(pos_ptr + rows, mask=ok, other=0).to(tl.int64)
        rot = ok & (pos >= 0) & (pos < num_pos)
        f = tl.load(freqs_ptr + pos[:, None] * 64 + tl.arange(0, 64)[None, :], mask=rot[:, None], other=0.0)
        c, s = tl.split(tl.reshape(f, [BLOCK_M, 32, 2]))
        return tl.where(rot[:, None], c, 1.0), s

    @triton.jit
    def _pairs(ptr, rows, ok, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
        """The last 64 elements of each row as (even, odd) ``[BLOCK_M, 32]`` fp32."""
        t = tl.load(ptr + rows[:, None] * HEAD_DIM + (HEAD_DIM - 64) + tl.arange(0, 64)[None, :],
                    mask=ok[:, None], other=0.0).to(tl.float32)
        return tl.split(tl.reshape(t, [BLOCK_M, 32, 2]))

    @triton.jit
    def _store_pairs(ptr, rows, ok, a, b, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
        t = tl.reshape(tl.join(a, b), [BLOCK_M, 64])
        tl.store(ptr + rows[:, None] * HEAD_DIM + (HEAD_DIM - 64) + tl.arange(0, 64)[None, :],
                 cast_rne(t, ptr.dtype.element_ty), mask=ok[:, None])

    @triton.jit
    def _norm_rope_fwd_kernel(x_ptr, w_ptr, freqs_ptr, pos_ptr, y_ptr, num_rows, num_pos, eps,
                              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        D: tl.constexpr = HEAD_DIM
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        ok = rows < num_rows
        cols = tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=ok[:, None] & (cols < D)[None, :],
                    other=0.0).to(tl.float32)
        rstd = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)).to(tl.float32)  # eps may come as fp64
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        y = x * rstd[:, None] * w[None, :]
        tl.store(y_ptr + rows[:, None] * D + cols[None, :], cast_rne(y, y_ptr.dtype.element_ty),
                 mask=ok[:, None] & (cols < D - 64)[None, :])
        xa, xb = _pairs(x_ptr, rows, ok, HEAD_DIM, BLOCK_M)
        wa, wb = tl.split(tl.reshape(tl.load(w_ptr + (D - 64) + tl.arange(0, 64)).to(tl.float32), [32, 2]))
        a = xa * rstd[:, None] * wa[None, :]
        b = xb * rstd[:, None] * wb[None, :]
        c, s = _rope_cos_sin(freqs_ptr, pos_ptr, rows, ok, num_pos, BLOCK_M)
        _store_pairs(y_ptr, rows, ok, a * c - b * s, a * s + b * c, HEAD_DIM, BLOCK_M)

    @triton.jit
    def _norm_rope_bwd_kernel(x_ptr, w_ptr, freqs_ptr, pos_ptr, gy_ptr, gx_ptr, ws_ptr, num_rows, num_pos, eps,
                              blocks_per_program,
                              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        D: tl.constexpr = HEAD_DIM
        pid = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        body = (cols < D - 64)[None, :]
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        wa, wb = tl.split(tl.reshape(tl.load(w_ptr + (D - 64) + tl.arange(0, 64)).to(tl.float32), [32, 2]))
        acc_w = tl.zeros([BLOCK_D], tl.float32)
        acc_a = tl.zeros([32], tl.float32)
        acc_b = tl.zeros([32], tl.float32)
        i = 0
        while i < blocks_per_program:  # rows blocks pid * blocks_per_program + i, in order
            rows = (pid * blocks_per_program + i) * BLOCK_M + tl.arange(0, BLOCK_M)
            ok = rows < num_rows
            at = rows[:, None] * D + cols[None, :]
            full = ok[:, None] & (cols < D)[None, :]
            x = tl.load(x_ptr + at, mask=full, other=0.0).to(tl.float32)
            rstd = tl.where(ok, (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)).to(tl.float32), 0.0)
            g = tl.where(body, tl.load(gy_ptr + at, mask=full, other=0.0).to(tl.float32), 0.0)
            xa, xb = _pairs(x_ptr, rows, ok, HEAD_DIM, BLOCK_M)
            g0, g1 = _pairs(gy_ptr, rows, ok, HEAD_DIM, BLOCK_M)
            c, s = _rope_cos_sin(freqs_ptr, pos_ptr, rows, ok, num_pos, BLOCK_M)
            ga = g0 * c + g1 * s  # gradient before the rotation (its transpose)
            gb = g1 * c - g0 * s
            h = g * w[None, :]
            ha = ga * wa[None, :]
            hb = gb * wb[None, :]
            dot = tl.sum(h * x, axis=1) + tl.sum(ha * xa, axis=1) + tl.sum(hb * xb, axis=1)
            coef = (rstd * rstd * rstd * dot / D)[:, None]
            r = rstd[:, None]
            tl.store(gx_ptr + at, cast_rne(r * h - x * coef, gx_ptr.dtype.element_ty), mask=full & body)
            _store_pairs(gx_ptr, rows, ok, r * ha - xa * coef, r * hb - xb * coef, HEAD_DIM, BLOCK_M)
            acc_w += tl.sum(g * x * r, axis=0)
            acc_a += tl.sum(ga * xa * r, axis=0)
            acc_b += tl.sum(gb * xb * r, axis=0)
            i += 1
        ws = ws_ptr + pid * D
        tl.store(ws + cols, acc_w, mask=cols < D - 64)
        tl.store(ws + (D - 64) + tl.arange(0, 64), tl.reshape(tl.join(acc_a, acc_b), [64]))


# ---------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------

#: compress_train tiles: ratio -> (tokens per program, window rows per step, channels, warps)
POOL_FWD_TILE = {4: (16, 8, 64, 4), 128: (1, 32, 64, 4)}
POOL_BWD_TILE = {4: (16, 8, 64, 8), 128: (4, 16, 32, 4)}
#: partial-sum reduction: (columns per program, partials per step)
SUM_TILE = (64, 64)
#: norm_rope backward: aim for this many programs (each one partial of the weight gradient)
NORM_BWD_PROGRAMS = 512


def _workspace(partials, *shape, device) -> torch.Tensor:
    """fp32 workspace for ``partials`` per-program partial sums of ``shape``.

    Under torch.compile ``partials`` is a size expression (e.g. ``cdiv(B * T // r, BLOCK_Q)``).
    A leading dimension that may equal 1 makes the tracer guard on ``partials == 1`` (a size-1
    dimension's stride does not count for contiguity), and a later token count on the other side
    of that guard recompiles. At least two rows keep the question statically answered; only the
    first ``partials`` rows are written and summed."""
    return torch.empty((torch.sym_max(partials, 2), *shape), dtype=torch.float32, device=device)


def _sum_partials(ws: torch.Tensor, partials, out: torch.Tensor) -> None:
    """``out = ws[:partials].sum(0)``, added in an order fixed by the shapes (deterministic)."""
    size = out.numel()
    block, chunk = SUM_TILE
    launch(_sum_partials_kernel)[(cdiv(size, block),)](ws, out, partials, size, BLOCK=block, CHUNK=chunk, num_warps=4)


def _channels(tile: int, head_dim: int) -> int:
    """Channel block: divides head_dim (a multiple of 64), so the kernels need no channel mask."""
    block = min(tile, head_dim)
    assert head_dim % block == 0
    return block


def compress_train(kv_score: torch.Tensor, ape: torch.Tensor, head_dim: int, compress_ratio: int,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Forward launch (arguments as the op); ``out`` (tests: a poisoned buffer) is allocated when None."""
    B, T = kv_score.shape[0], kv_score.shape[1]
    N = T // compress_ratio
    if out is None:
        out = kv_score.new_empty((B, N, head_dim))
    num_out = B * N
    if num_out == 0:
        return out
    q, rows, channels, warps = POOL_FWD_TILE[compress_ratio]
    channels = _channels(channels, head_dim)
    grid = (cdiv(num_out, q) * (head_dim // channels),)
    if compress_ratio == 4:
        launch(_pool4_fwd_kernel)[grid](kv_score, ape, out, T, N, num_out, HEAD_DIM=head_dim, BLOCK_Q=q,
                                        BLOCK_D=channels, num_warps=warps)
    else:
        launch(_pool128_fwd_kernel)[grid](kv_score, ape, out, T, N, num_out, HEAD_DIM=head_dim, BLOCK_Q=q,
                                          BLOCK_W=rows, BLOCK_D=channels, num_warps=warps)
    return out


def compress_train_backward(grad_out, kv_score, ape, head_dim: int, compress_ratio: int, grad_kv=None, grad_ape=None):
    """Backward launches: the gradient kernel, then the ordered ``d ape`` reduction.

    Every element of ``grad_kv`` / ``grad_ape`` is written (they may be passed in, uninitialized).
    """
    B, T = kv_score.shape[0], kv_score.shape[1]
    N = T // compress_ratio
    num_out = B * N
    if num_out == 0:
        return torch.zeros_like(kv_score), torch.zeros_like(ape)
    if grad_kv is None:
        grad_kv = torch.empty_like(kv_score)
    if grad_ape is None:
        grad_ape = torch.empty_like(ape)
    q, rows, channels, warps = POOL_BWD_TILE[compress_ratio]
    channels = _channels(channels, head_dim)
    grid = (cdiv(num_out, q) * (head_dim // channels),)
    partials = cdiv(num_out, q)
    ws = _workspace(partials, ape.shape[0], head_dim, device=kv_score.device)
    if compress_ratio == 4:
        launch(_pool4_bwd_kernel)[grid](kv_score, ape, grad_out, grad_kv, ws, T, N, num_out, HEAD_DIM=head_dim,
                                        BLOCK_Q=q, BLOCK_D=channels, num_warps=warps)
    else:
        launch(_pool128_bwd_kernel)[grid](kv_score, ape, grad_out, grad_kv, ws, T, N, num_out, HEAD_DIM=head_dim,
                                          BLOCK_Q=q, BLOCK_W=rows, BLOCK_D=channels, num_warps=warps)
    _sum_partials(ws, partials, grad_ape)
    return grad_kv, grad_ape


def _norm_blocks(head_dim: int):
    block_d = next_pow2(head_dim)
    return block_d, max(1, min(8, 2048 // block_d))


def norm_rope(x, weight, eps: float, freqs, positions, y=None):
    n, head_dim = x.shape
    if y is None:
        y = torch.empty_like(x)
    if n == 0:
        return y
    block_d, block_m = _norm_blocks(head_dim)
    launch(_norm_rope_fwd_kernel)[(cdiv(n, block_m),)](
        x, weight, freqs, positions, y, n, freqs.shape[0], eps, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_D=block_d,
        num_warps=4,
    )
    return y


def norm_rope_backward(grad_y, x, weight, eps: float, freqs, positions, grad_x=None, grad_w=None):
    n, head_dim = x.shape
    if grad_x is None:
        grad_x = torch.empty_like(x)
    if grad_w is None:
        grad_w = torch.empty_like(weight)
    if n == 0:
        return grad_x, torch.zeros_like(weight)
    block_d, block_m = _norm_blocks(head_dim)
    blocks = cdiv(n, block_m)
    per_program = cdiv(blocks, NORM_BWD_PROGRAMS)
    programs = cdiv(blocks, per_program)
    ws = _workspace(programs, head_dim, device=x.device)
    launch(_norm_rope_bwd_kernel)[(programs,)](
        x, weight, freqs, positions, grad_y, grad_x, ws, n, freqs.shape[0], eps, per_program,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4,
    )
    _sum_partials(ws, programs, grad_w)
    return grad_x, grad_w

