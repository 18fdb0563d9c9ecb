"""Training ops: ``compress_train`` and ``norm_rope`` (forward, backward, autograd, compile).

* a slow loop oracle written from spec-compressor.md section 1, in fp64, against the reference
  (forward, and the reference backward against autograd through the oracle);
* ``gradcheck`` of both ops in fp64;
* the Triton kernels against the reference (under ``TRITON_INTERPRET=1`` on CPU, natively
  on CUDA), outputs poisoned with NaN so every element must be written;
* opcheck of all four ops, ``torch.compile(fullgraph=True)`` of forward + backward,
  bit-reproducible ``d ape`` / ``d weight``, argument errors;
* every kernel variant compiled for sm_90 (``test_train_kernels_compile_for_sm90`` runs the
  ``variant`` tests of this file in a subprocess with ``TRITON_INTERPRET`` unset).
"""

from __future__ import annotations

import os

import pytest
import torch

from _sm90 import compile_sm90 as _compile, run_variants_in_subprocess

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICE = "cpu" if INTERPRETED else "cuda"
HAVE_KERNEL_DEVICE = INTERPRETED or torch.cuda.is_available()
needs_kernels = pytest.mark.skipif(not HAVE_KERNEL_DEVICE, reason="needs CUDA or TRITON_INTERPRET=1")
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _ops():
    import dsv4ops.train  # noqa: F401  (registers the ops)

    return torch.ops.dsv4ops


def _window(r):
    return 8 if r == 4 else r


def _inputs(B, T, D, r, dtype=torch.float32, device="cpu", ape_dtype=None, requires_grad=False, seed=0):
    """Random (never zero) rows and ape; scores spread enough that the softmax is not flat."""
    gen = torch.Generator().manual_seed(seed)
    c = 2 if r == 4 else 1
    x = torch.randn(B, T, 2 * c * D, generator=gen, dtype=torch.float64)
    x[..., c * D :] *= 2.0  # scores
    ape = torch.randn(_window(r), D, generator=gen, dtype=torch.float64)
    x = x.to(dtype).to(device).requires_grad_(requires_grad)
    ape = ape.to(ape_dtype or dtype).to(device).requires_grad_(requires_grad)
    return x, ape


# ---------------------------------------------------------------------------
# the loop oracle (spec-compressor.md section 1), fp64
# ---------------------------------------------------------------------------


def loop_compress(kv_score, ape, D, r):
    """Compressed tokens by explicit loops over sequences, tokens and window rows (fp64, differentiable)."""
    x = kv_score.double()
    a = ape.double()
    B, T = x.shape[0], x.shape[1]
    outs = []
    for b in range(B):
        tokens = []
        for n in range(T // r):
            values, scores = [], []
            if r == 128:
                for j in range(128):
                    t = 128 * n + j
                    values.append(x[b, t, 0:D])
                    scores.append(x[b, t, D : 2 * D] + a[j])
            else:
                for w in range(8):
                    if w < 4:  # A half of the previous chunk's token 4n-4+w
                        t = 4 * n - 4 + w
                        if t < 0:
                            continue  # masked: contributes nothing to the softmax
                        values.append(x[b, t, 0:D])
                        scores.append(x[b, t, 2 * D : 3 * D] + a[w])
                    else:  # B half of the current chunk's token 4n+w-4
                        t = 4 * n + w - 4
                        values.append(x[b, t, D : 2 * D])
                        scores.append(x[b, t, 3 * D : 4 * D] + a[w])
            s = torch.stack(scores)
            m = s.max(dim=0).values
            e = torch.exp(s - m)
            tokens.append((e * torch.stack(values)).sum(dim=0) / e.sum(dim=0))
        outs.append(torch.stack(tokens) if tokens else x.new_zeros(0, D))
    return torch.stack(outs)


def loop_norm_rope(x, w, eps, freqs, positions):
    """RMSNorm + RoPE row by row, pair by pair (fp64, differentiable)."""
    rows = []
    D = x.shape[1]
    for i in range(x.shape[0]):
        xi = x[i].double()
        y = xi / torch.sqrt((xi * xi).mean() + eps) * w.double()
        p = int(positions[i])
        parts = [y[: D - 64]]
        for k in range(32):
            a, b = y[D - 64 + 2 * k], y[D - 64 + 2 * k + 1]
            c, s = float(freqs[p, 2 * k]), float(freqs[p, 2 * k + 1])
            parts.append(torch.stack([a * c - b * s, a * s + b * c]))
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def _close(got, want, rel, msg=""):
    got, want = got.double(), want.double()
    assert got.shape == want.shape, f"{msg}: {got.shape} vs {want.shape}"
    assert not torch.isnan(got).any(), f"{msg}: NaN (an element was not written)"
    if want.numel() == 0:
        return
    scale = want.abs().max().clamp_min(1e-30)
    err = ((got - want).abs().max() / scale).item()
    assert err <= rel, f"{msg}: max error {err:.3g} of the max |value| (allowed {rel:.1g})"


REF_CASES = [(4, 64, 23), (4, 128, 16), (4, 64, 3), (128, 64, 300), (128, 64, 256)]


@pytest.mark.parametrize("r,D,T", REF_CASES)
def test_reference_matches_loop(r, D, T):
    ops = _ops()
    x, ape = _inputs(2, T, D, r, torch.float64, requires_grad=True)
    want = loop_compress(x, ape, D, r)
    got = ops.compress_train(x, ape, D, r)
    assert got.shape == (2, T // r, D) and got.dtype == torch.float64
    _close(got, want, 1e-12, "forward")
    if want.numel() == 0:
        return
    g = torch.randn_like(want)
    want_gx, want_ga = torch.autograd.grad(want, [x, ape], g)
    got_gx, got_ga = ops.compress_train_backward(g, x.detach(), ape.detach(), D, r)
    _close(got_gx, want_gx, 1e-12, "grad kv_score")
    _close(got_ga, want_ga, 1e-12, "grad ape")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_dtypes(dtype):
    ops = _ops()
    x, ape = _inputs(2, 21, 128, 4, dtype, ape_dtype=torch.float32)
    got = ops.compress_train(x, ape, 128, 4)
    assert got.dtype == dtype
    _close(got, loop_compress(x, ape, 128, 4), 1e-6 if dtype == torch.float32 else 8e-3)


def test_norm_rope_reference_matches_loop():
    from dsv4ops.layer import rope_freqs_table

    ops = _ops()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 128, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(128, generator=gen, dtype=torch.float64, requires_grad=True)
    freqs = rope_freqs_table(300)
    pos = torch.randint(0, 300, (7,), generator=gen)
    want = loop_norm_rope(x, w, 1e-6, freqs, pos)
    _close(ops.norm_rope(x, w, 1e-6, freqs, pos), want, 1e-12, "forward")
    g = torch.randn_like(want)
    want_gx, want_gw = torch.autograd.grad(want, [x, w], g)
    got_gx, got_gw = ops.norm_rope_backward(g, x.detach(), w.detach(), 1e-6, freqs, pos)
    _close(got_gx, want_gx, 1e-12, "grad x")
    _close(got_gw, want_gw, 1e-12, "grad weight")


# ---------------------------------------------------------------------------
# gradcheck (fp64, CPU)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("r,D,T", [(4, 64, 10), (4, 128, 16), (128, 64, 256), (128, 64, 131)])
def test_gradcheck_compress_train(r, D, T):
    """fast_mode (random projections of the Jacobian): the full Jacobian of 10^4 inputs is too slow here."""
    from dsv4ops.train import compress_train

    x, ape = _inputs(2, T, D, r, torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: compress_train(a, b, compress_ratio=r), (x, ape), fast_mode=True)


@pytest.mark.slow
def test_gradcheck_compress_train_full_jacobian():
    from dsv4ops.train import compress_train

    x, ape = _inputs(2, 10, 64, 4, torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: compress_train(a, b, compress_ratio=4), (x, ape))


def test_gradcheck_norm_rope():
    from dsv4ops.layer import rope_freqs_table
    from dsv4ops.train import norm_rope

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 128, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(128, generator=gen, dtype=torch.float64, requires_grad=True)
    freqs = rope_freqs_table(64)
    pos = torch.tensor([0, 3, 63, 17, 5])
    assert torch.autograd.gradcheck(lambda a, b: norm_rope(a, b, 1e-5, freqs, pos), (x, w))


# ---------------------------------------------------------------------------
# Triton kernels against the reference
# ---------------------------------------------------------------------------

KERNEL_CASES = [
    # r, D, B, T, dtype, ape dtype
    (4, 128, 2, 37, torch.float32, None),
    (4, 64, 3, 16, torch.float32, None),
    (4, 128, 2, 30, torch.bfloat16, None),
    (4, 64, 2, 22, torch.bfloat16, torch.float32),
    (4, 64, 2, 3, torch.float32, None),  # no complete chunk: all-zero gradient
    (128, 64, 3, 300, torch.float32, None),  # B * N = 6: a partial block of tokens, a partial chunk
    (128, 128, 1, 256, torch.float32, None),
    (128, 64, 2, 260, torch.bfloat16, torch.float32),
]


def _case_id(c):
    r, D, B, T, dt, adt = c
    return f"r{r}-D{D}-B{B}-T{T}-{str(dt)[6:]}" + (f"-ape{str(adt)[6:]}" if adt else "")


@needs_kernels
@pytest.mark.parametrize("case", KERNEL_CASES, ids=_case_id)
def test_compress_kernels_match_reference(case):
    from dsv4ops.train import kernels
    from dsv4ops.train.reference import compress_train_backward_reference, compress_train_reference

    r, D, B, T, dtype, ape_dtype = case
    x, ape = _inputs(B, T, D, r, dtype, KERNEL_DEVICE, ape_dtype, seed=T)
    N = T // r
    out = torch.full((B, N, D), float("nan"), dtype=dtype, device=KERNEL_DEVICE)
    got = kernels.compress_train(x, ape, D, r, out=out)
    want = compress_train_reference(x, ape, D, r)
    rel = 1e-5 if dtype == torch.float32 else 1e-2
    _close(got, want, rel, "forward")
    g = torch.randn(B, N, D, generator=torch.Generator().manual_seed(7)).to(dtype).to(KERNEL_DEVICE)
    gx = torch.full_like(x, float("nan"))
    ga = torch.full_like(ape, float("nan"))
    got_gx, got_ga = kernels.compress_train_backward(g, x, ape, D, r, grad_kv=gx, grad_ape=ga)
    want_gx, want_ga = compress_train_backward_reference(g, x, ape, D, r)
    _close(got_gx, want_gx, rel, "grad kv_score")
    _close(got_ga, want_ga, rel, "grad ape")
    # rows that feed no output get exactly zero
    assert (got_gx[:, N * r :] == 0).all()
    if r == 4 and N:
        assert (got_gx[:, 4 * N - 4 : 4 * N, 0:D] == 0).all() and (got_gx[:, 4 * N - 4 : 4 * N, 2 * D : 3 * D] == 0).all()


NORM_CASES = [(13, 512, torch.float32), (9, 128, torch.bfloat16), (5, 64, torch.float32), (6, 576, torch.float32),
              (33, 128, torch.float32)]


@needs_kernels
@pytest.mark.parametrize("n,D,dtype", NORM_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_norm_rope_kernels_match_reference(n, D, dtype):
    from dsv4ops.train import kernels
    from dsv4ops.train.reference import norm_rope_backward_reference, norm_rope_reference

    gen = torch.Generator().manual_seed(n + D)
    dev = KERNEL_DEVICE
    x = (torch.randn(n, D, generator=gen) * 3 + 0.5).to(dtype).to(dev)
    w = (torch.randn(D, generator=gen) + 1).to(dtype).to(dev)
    freqs = torch.randn(50, 64, generator=gen).to(dev)
    pos = torch.randint(-3, 55, (n,), generator=gen).to(dev)  # a few outside the table: not rotated
    y = kernels.norm_rope(x, w, 1e-6, freqs, pos, y=torch.full_like(x, float("nan")))
    rel = 1e-5 if dtype == torch.float32 else 1e-2
    _close(y, norm_rope_reference(x, w, 1e-6, freqs, pos), rel, "forward")
    g = torch.randn(n, D, generator=gen).to(dtype).to(dev)
    gx, gw = kernels.norm_rope_backward(g, x, w, 1e-6, freqs, pos, grad_x=torch.full_like(x, float("nan")),
                                        grad_w=torch.full_like(w, float("nan")))
    want_gx, want_gw = norm_rope_backward_reference(g, x, w, 1e-6, freqs, pos)
    _close(gx, want_gx, rel, "grad x")
    _close(gw, want_gw, rel, "grad weight")


@needs_kernels
def test_norm_rope_backward_many_programs(monkeypatch):
    """More row blocks than programs: each program loops over several blocks."""
    from dsv4ops.train import kernels
    from dsv4ops.train.reference import norm_rope_backward_reference

    monkeypatch.setattr(kernels, "NORM_BWD_PROGRAMS", 3)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(70, 128, generator=gen).to(KERNEL_DEVICE)
    w = torch.randn(128, generator=gen).to(KERNEL_DEVICE)
    freqs = torch.randn(80, 64, generator=gen).to(KERNEL_DEVICE)
    pos = torch.arange(70).to(KERNEL_DEVICE)
    g = torch.randn(70, 128, generator=gen).to(KERNEL_DEVICE)
    gx, gw = kernels.norm_rope_backward(g, x, w, 1e-6, freqs, pos)
    want_gx, want_gw = norm_rope_backward_reference(g, x, w, 1e-6, freqs, pos)
    _close(gx, want_gx, 1e-5, "grad x")
    _close(gw, want_gw, 1e-5, "grad weight")


@needs_kernels
@pytest.mark.parametrize("partials,size", [(1, 5), (63, 200), (64, 64), (130, 700)])
def test_sum_partials_kernels_match_reference(partials, size):
    """The ordered reduction of per-program partials: every column, partial counts below, at and
    above a chunk, and workspace rows past ``partials`` (NaN here) never read."""
    from dsv4ops.train import kernels

    ws = torch.randn(partials + 3, size, generator=torch.Generator().manual_seed(partials))
    ws[partials:] = float("nan")
    ws = ws.to(KERNEL_DEVICE)
    runs = []
    for _ in range(2):
        out = torch.full((size,), float("nan"), device=KERNEL_DEVICE)
        kernels._sum_partials(ws, partials, out)
        runs.append(out)
    _close(runs[0], ws[:partials].double().sum(0).float(), 1e-5, "sum of partials")
    assert _bits_equal(runs[0], runs[1])


# ---------------------------------------------------------------------------
# determinism: two backward runs, bit-identical gradients
# ---------------------------------------------------------------------------


def _bits_equal(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("r,D,T", [(4, 128, 64), (128, 64, 512)])
def test_backward_is_deterministic(device, r, D, T):
    from dsv4ops.train import compress_train

    x, ape = _inputs(4, T, D, r, torch.float32, device, requires_grad=True)
    g = torch.randn(4, T // r, D, device=device)
    runs = [torch.autograd.grad(compress_train(x, ape, compress_ratio=r), [x, ape], g) for _ in range(2)]
    assert _bits_equal(runs[0][0], runs[1][0]) and _bits_equal(runs[0][1], runs[1][1])


@needs_kernels
@pytest.mark.parametrize("r,D,T", [(4, 64, 64), (128, 64, 512)])
def test_kernel_backward_is_deterministic(r, D, T):
    from dsv4ops.train import kernels

    x, ape = _inputs(4, T, D, r, torch.float32, KERNEL_DEVICE)
    g = torch.randn(4, T // r, D).to(KERNEL_DEVICE)
    a = kernels.compress_train_backward(g, x, ape, D, r)
    b = kernels.compress_train_backward(g, x, ape, D, r)
    assert _bits_equal(a[0], b[0]) and _bits_equal(a[1], b[1])
    n = torch.randn(40, 128).to(KERNEL_DEVICE)
    w = torch.randn(128).to(KERNEL_DEVICE)
    f = torch.randn(40, 64).to(KERNEL_DEVICE)
    p = torch.arange(40).to(KERNEL_DEVICE)
    a = kernels.norm_rope_backward(n, n, w, 1e-6, f, p)
    b = kernels.norm_rope_backward(n, n, w, 1e-6, f, p)
    assert _bits_equal(a[0], b[0]) and _bits_equal(a[1], b[1])


# ---------------------------------------------------------------------------
# opcheck, autograd through the public functions, torch.compile
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("r,D,T", [(4, 128, 21), (128, 64, 260)])
def test_opcheck_compress_train(device, r, D, T):
    ops = _ops()
    x, ape = _inputs(2, T, D, r, torch.float32, device, requires_grad=True)
    torch.library.opcheck(ops.compress_train, (x, ape, D, r), test_utils=OPCHECK_UTILS)
    g = torch.randn(2, T // r, D, device=device)
    torch.library.opcheck(ops.compress_train_backward, (g, x.detach(), ape.detach(), D, r), test_utils=OPCHECK_UTILS)


def _norm_args(device, n=12, D=128, requires_grad=True, dtype=torch.float32):
    from dsv4ops.layer import rope_freqs_table

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(n, D, generator=gen).to(dtype).to(device).requires_grad_(requires_grad)
    w = torch.randn(D, generator=gen).to(dtype).to(device).requires_grad_(requires_grad)
    return x, w, 1e-6, rope_freqs_table(256).to(device), torch.randint(0, 256, (n,), generator=gen).to(device)


def test_opcheck_norm_rope(device):
    ops = _ops()
    x, w, eps, freqs, pos = _norm_args(device)
    torch.library.opcheck(ops.norm_rope, (x, w, eps, freqs, pos), test_utils=OPCHECK_UTILS)
    g = torch.randn_like(x).detach()
    torch.library.opcheck(ops.norm_rope_backward, (g, x.detach(), w.detach(), eps, freqs, pos), test_utils=OPCHECK_UTILS)


def test_autograd_through_public_functions(device):
    """Gradients of a small pipeline (compress, then norm_rope) match autograd through the loop oracles."""
    from dsv4ops.layer import rope_freqs_table
    from dsv4ops.train import ape_window_layout, compress_train, norm_rope

    D = 128
    x, _ = _inputs(2, 24, D, 4, torch.float64 if device.type == "cpu" else torch.float32, device, requires_grad=True)
    ape_param = torch.randn(4, 2 * D, dtype=x.dtype, device=device, requires_grad=True)  # checkpoint layout
    w = torch.randn(D, dtype=x.dtype, device=device, requires_grad=True)
    freqs = rope_freqs_table(64).to(device)
    pos = (torch.arange(6, device=device) * 4).repeat(2)

    def pipeline(compress, nr):
        out = compress(x, ape_window_layout(ape_param, 4))
        return nr(out.reshape(-1, D), w)

    got = pipeline(lambda a, b: compress_train(a, b, compress_ratio=4), lambda a, b: norm_rope(a, b, 1e-6, freqs, pos))
    want = pipeline(lambda a, b: loop_compress(a, b, D, 4), lambda a, b: loop_norm_rope(a, b, 1e-6, freqs.cpu(), pos.cpu()))
    rel = 1e-12 if x.dtype == torch.float64 else 1e-5
    _close(got, want, rel, "pipeline")
    g = torch.randn_like(want)
    for a, b, name in zip(torch.autograd.grad(got, [x, ape_param, w], g.to(got.dtype)),
                          torch.autograd.grad(want, [x, ape_param, w], g), ("x", "ape", "w")):
        _close(a, b, rel, f"grad {name}")


def _train_step(x, ape, w, nw, freqs, pos):
    from dsv4ops.train import compress_train, norm_rope

    out = compress_train(x, ape, compress_ratio=4)
    y = norm_rope(out.reshape(-1, out.shape[-1]), nw, 1e-6, freqs, pos)
    loss = (y * w).sum()
    return (loss.detach(),) + torch.autograd.grad(loss, [x, ape, nw])


def _train_inputs(device, T=40):
    from dsv4ops.layer import rope_freqs_table

    D = 128
    x, ape = _inputs(2, T, D, 4, torch.float32, device, requires_grad=True)
    nw = torch.randn(D, device=device, requires_grad=True)
    w = torch.randn(2 * (T // 4), D, device=device)
    pos = torch.arange(T // 4, device=device).repeat(2) * 4
    return x, ape, w, nw, rope_freqs_table(256).to(device), pos


def test_compile_forward_backward_fullgraph(device):
    """The whole step, autograd.grad included, in one graph; gradients match eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    if not hasattr(torch._dynamo.config, "trace_autograd_ops"):
        pytest.skip("this torch cannot trace torch.autograd.grad (no dynamo config trace_autograd_ops)")
    torch._dynamo.reset()
    args = _train_inputs(device)
    counter = CompileCounterWithBackend("inductor")
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        got = torch.compile(_train_step, backend=counter, fullgraph=True)(*args)
    want = _train_step(*args)
    assert counter.frame_count == 1
    for a, b in zip(got, want):
        _close(a, b, 1e-5)


class _Block(torch.nn.Module):
    def __init__(self, D, r, device):
        super().__init__()
        self.r = r
        self.ape = torch.nn.Parameter(torch.randn(_window(r), D, device=device))
        self.norm_weight = torch.nn.Parameter(torch.randn(D, device=device))
        self.register_buffer("freqs", torch.randn(1024, 64, device=device))

    def forward(self, x):
        from dsv4ops.train import compress_train, norm_rope

        out = compress_train(x, self.ape, compress_ratio=self.r)
        B, N, D = out.shape
        pos = (torch.arange(N, device=x.device) * self.r).repeat(B)
        return norm_rope(out.reshape(B * N, D), self.norm_weight, 1e-6, self.freqs, pos)


@pytest.mark.parametrize("r", [4, 128])
def test_compiled_module_backward_no_graph_breaks(device, r):
    """A compiled module (dynamic token count) and .backward() through it: no graph break, no recompile."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    D = 64
    block = _Block(D, r, device)
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    for T in ((2 * r + 3, 3 * r, 5 * r + 1) if r == 4 else (256, 300, 390)):
        x, _ = _inputs(2, T, D, r, torch.float32, device, requires_grad=True, seed=T)
        g = torch.randn(2 * (T // r), D, device=device)
        compiled(x).backward(g)
        got = (x.grad.clone(), block.ape.grad.clone(), block.norm_weight.grad.clone())
        for p in (x, block.ape, block.norm_weight):
            p.grad = None
        block(x).backward(g)
        for a, b in zip(got, (x.grad, block.ape.grad, block.norm_weight.grad)):
            _close(a, b, 1e-5)
        block.zero_grad(set_to_none=True)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1


# ---------------------------------------------------------------------------
# argument errors
# ---------------------------------------------------------------------------

COMPRESS_ERRORS = [
    # (description, kv_score, ape, head_dim, ratio, exception, message fragment)
    ("ratio", lambda: torch.randn(1, 8, 256), lambda: torch.randn(8, 64), 64, 8, ValueError, "`compress_ratio`"),
    ("head_dim", lambda: torch.randn(1, 8, 384), lambda: torch.randn(8, 96), 96, 4, ValueError, "`head_dim`"),
    ("head_dim0", lambda: torch.randn(1, 8, 0), lambda: torch.randn(8, 0), 0, 4, ValueError, "`head_dim`"),
    ("rank", lambda: torch.randn(8, 256), lambda: torch.randn(8, 64), 64, 4, ValueError, "`kv_score`"),
    ("width", lambda: torch.randn(1, 8, 128), lambda: torch.randn(8, 64), 64, 4, ValueError, "`kv_score`"),
    ("width128", lambda: torch.randn(1, 8, 256), lambda: torch.randn(128, 64), 64, 128, ValueError, "`kv_score`"),
    ("dtype", lambda: torch.ones(1, 8, 256, dtype=torch.int32), lambda: torch.randn(8, 64), 64, 4, TypeError, "`kv_score`"),
    ("ape_dtype", lambda: torch.randn(1, 8, 256), lambda: torch.ones(8, 64, dtype=torch.int64), 64, 4, TypeError, "`ape`"),
    ("ape_shape", lambda: torch.randn(1, 8, 256), lambda: torch.randn(4, 64), 64, 4, ValueError, "`ape`"),
    ("ape_shape128", lambda: torch.randn(1, 8, 128), lambda: torch.randn(8, 64), 64, 128, ValueError, "`ape`"),
    ("ape_device", lambda: torch.randn(1, 8, 256), lambda: torch.randn(8, 64, device="meta"), 64, 4, ValueError, "`ape`"),
    ("contiguous", lambda: torch.randn(1, 256, 8).transpose(1, 2), lambda: torch.randn(8, 64), 64, 4, ValueError,
     "contiguous"),
]


@pytest.mark.parametrize("case", COMPRESS_ERRORS, ids=lambda c: c[0])
def test_compress_train_errors(case):
    ops = _ops()
    _, kv, ape, D, r, exc, fragment = case
    with pytest.raises(exc, match="dsv4ops.compress_train: .*" + fragment):
        ops.compress_train(kv(), ape(), D, r)


def test_compress_train_backward_errors():
    ops = _ops()
    x, ape = _inputs(1, 8, 64, 4)
    with pytest.raises(ValueError, match="dsv4ops.compress_train_backward: `grad_out`"):
        ops.compress_train_backward(torch.randn(1, 3, 64), x, ape, 64, 4)
    with pytest.raises(TypeError, match="dsv4ops.compress_train_backward: `grad_out`"):
        ops.compress_train_backward(torch.ones(1, 2, 64, dtype=torch.int32), x, ape, 64, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_float64_is_cpu_only():
    ops = _ops()
    x, ape = _inputs(1, 8, 64, 4, torch.float64, "cuda")
    with pytest.raises(TypeError, match="dsv4ops.compress_train: `kv_score` must have dtype .*CPU-only"):
        ops.compress_train(x, ape, 64, 4)


def _norm_error_args(**override):
    args = dict(x=torch.randn(4, 128), weight=torch.randn(128), eps=1e-6, freqs=torch.randn(16, 64),
                positions=torch.arange(4))
    args.update(override)
    return args


NORM_ERRORS = [
    (dict(x=torch.randn(4, 32)), ValueError, "`x`"),
    (dict(x=torch.randn(4, 128, 1)), ValueError, "`x`"),
    (dict(x=torch.ones(4, 128, dtype=torch.int32)), TypeError, "`x`"),
    (dict(weight=torch.randn(64)), ValueError, "`weight`"),
    (dict(weight=torch.ones(128, dtype=torch.int64)), TypeError, "`weight`"),
    (dict(eps=-1.0), ValueError, "`eps`"),
    (dict(eps=float("nan")), ValueError, "`eps`"),
    (dict(freqs=torch.randn(16, 32)), ValueError, "`freqs`"),
    (dict(freqs=torch.randn(16, 64, dtype=torch.float64)), TypeError, "`freqs`"),
    (dict(positions=torch.arange(3)), ValueError, "`positions`"),
    (dict(positions=torch.zeros(4)), TypeError, "`positions`"),
    (dict(weight=torch.randn(128, device="meta")), ValueError, "`weight`"),
]


def _override_id(v):
    """Test id of an argument override: names, shapes, dtypes and devices, never values (ids must be
    the same in every pytest-xdist worker)."""
    if not isinstance(v, dict):
        return None
    describe = lambda t: f"{tuple(t.shape)}{str(t.dtype)[6:]}{t.device.type}" if isinstance(t, torch.Tensor) else t  # noqa: E731
    return "-".join(f"{k}{describe(t)}" for k, t in v.items())


@pytest.mark.parametrize("override,exc,fragment", NORM_ERRORS, ids=_override_id)
def test_norm_rope_errors(override, exc, fragment):
    ops = _ops()
    a = _norm_error_args(**override)
    with pytest.raises(exc, match="dsv4ops.norm_rope: .*" + fragment):
        ops.norm_rope(a["x"], a["weight"], a["eps"], a["freqs"], a["positions"])
    a = _norm_error_args()
    with pytest.raises(ValueError, match="dsv4ops.norm_rope_backward: `grad_y`"):
        torch.ops.dsv4ops.norm_rope_backward(torch.randn(4, 64), a["x"], a["weight"], 1e-6, a["freqs"], a["positions"])


# ---------------------------------------------------------------------------
# every kernel variant compiles for sm_90 (no GPU needed)
# ---------------------------------------------------------------------------


def test_train_kernels_compile_for_sm90():
    out = run_variants_in_subprocess(__file__)
    assert " passed" in out and "skipped" not in out, out[-2000:]


@pytest.mark.parametrize("ratio,head_dim", [(4, 512), (4, 128), (4, 64), (128, 512), (128, 64)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_variant_pool_kernels(ratio, head_dim, dtype):
    from dsv4ops.train import kernels as tk

    types = dict(x_ptr=f"*{dtype}", ape_ptr="*fp32", out_ptr=f"*{dtype}", g_ptr=f"*{dtype}", gx_ptr=f"*{dtype}",
                 ws_ptr="*fp32", T="i32", N="i32", num_out="i32")
    for tiles, fwd in ((tk.POOL_FWD_TILE, True), (tk.POOL_BWD_TILE, False)):
        q, rows, channels, warps = tiles[ratio]
        consts = dict(HEAD_DIM=head_dim, BLOCK_Q=q, BLOCK_D=tk._channels(channels, head_dim))
        if ratio == 4:
            fn = tk._pool4_fwd_kernel if fwd else tk._pool4_bwd_kernel
        else:
            fn = tk._pool128_fwd_kernel if fwd else tk._pool128_bwd_kernel
            consts["BLOCK_W"] = rows
        _compile(fn, types, consts, warps)


@pytest.mark.parametrize("head_dim", [512, 128, 64, 576])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_variant_norm_rope_kernels(head_dim, dtype):
    from dsv4ops.train import kernels as tk

    block_d, block_m = tk._norm_blocks(head_dim)
    types = dict(x_ptr=f"*{dtype}", w_ptr="*fp32", freqs_ptr="*fp32", pos_ptr="*i64", y_ptr=f"*{dtype}",
                 gy_ptr=f"*{dtype}", gx_ptr=f"*{dtype}", ws_ptr="*fp32", num_rows="i32", num_pos="i32", eps="fp32",
                 blocks_per_program="i32")
    consts = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_D=block_d)
    for eps in ("fp32", "fp64"):  # Inductor passes Python floats to user kernels as fp64
        types["eps"] = eps
        _compile(tk._norm_rope_fwd_kernel, types, consts)
        _compile(tk._norm_rope_bwd_kernel, types, consts)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_variant_sum_partials_kernel(dtype):
    from dsv4ops.train import kernels as tk

    _compile(tk._sum_partials_kernel, dict(ws_ptr="*fp32", out_ptr=f"*{dtype}", num_partials="i32", size="i32"),
             dict(BLOCK=tk.SUM_TILE[0], CHUNK=tk.SUM_TILE[1]))
