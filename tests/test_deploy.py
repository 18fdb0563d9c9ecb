"""Deployment: a DeepSeekV4Compressor prefill step and decode step exported with dynamic token
count / batch size / pool sizes, packaged with AOTInductor and run in a fresh process.

The state ring and the paged cache are inputs of the exported programs, written in place and
owned by the caller (the serving memory pool), so one state/cache is shared by the prefill and
the decode package and carried across steps. docs/deployment.md explains the design and why the
module buffers are not left to AOTI as constants; ``test_module_buffers_as_aoti_constants``
records how AOTI treats such buffers.

CPU runs in CI (one small configuration by default, larger ones with --runslow); the same tests
run on CUDA when a GPU is present. Set DSV4OPS_DEPLOY_ARTIFACTS=DIR to keep the packages, jobs
and fresh-process logs (useful when the fresh process crashes).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.export import Dim

import dsv4ops  # noqa: F401  (registers torch.ops.dsv4ops for export; the fresh process does not need it)
from dsv4ops._layout import CacheLayout, cache_format
from dsv4ops.deploy import ensure_aoti_compiler, links_libstdcxx_statically
from dsv4ops.layer import DeepSeekV4Compressor
from dsv4ops.testing import PagedPools, make_batch

from _asserts import assert_caches_equivalent, assert_same_bits

HIDDEN = 64
RUNNER = Path(__file__).with_name("_aoti_runner.py")
POISON = 0xA5


# ---------------------------------------------------------------------------
# The exported step modules: state and cache are inputs, mutated in place
# ---------------------------------------------------------------------------

class _StatelessStep(torch.nn.Module):
    """Holds a copy of ``layer`` without its ``state`` / ``kvcache`` buffers; ``forward`` puts the
    caller's tensors in their place (``torch.func.functional_call``) for the duration of the call,
    so the layer's in-place writes land in them and the buffers are never captured as constants."""

    def __init__(self, layer: DeepSeekV4Compressor):
        super().__init__()
        self.layer = copy.deepcopy(layer)
        del self.layer.state, self.layer.kvcache

    def _run(self, state, kvcache, *args):
        return torch.func.functional_call(self.layer, {"state": state, "kvcache": kvcache}, args, strict=False)


class PrefillStep(_StatelessStep):
    def forward(self, state, kvcache, hidden, req_pool_indices, seq_lens, extend_lens, req_to_token,
                full_to_state, out_loc):
        return self._run(state, kvcache, hidden, req_pool_indices, seq_lens, extend_lens, req_to_token,
                         full_to_state, out_loc)


class DecodeStep(_StatelessStep):
    def forward(self, state, kvcache, hidden, req_pool_indices, seq_lens, req_to_token, full_to_state, out_loc):
        return self._run(state, kvcache, hidden, req_pool_indices, seq_lens, None, req_to_token, full_to_state,
                         out_loc)


TOKENS = Dim("tokens", min=0, max=65535)  # ragged ids are 16-bit in the plans
BATCH = Dim("batch", min=0, max=1024)
POOL = {"state": {0: Dim("state_rows")}, "kvcache": {0: Dim("cache_pages")},
        "req_to_token": {0: Dim("requests"), 1: Dim("context")}, "full_to_state": {0: Dim("slots")}}
PREFILL_DYNAMIC = (POOL["state"], POOL["kvcache"], {0: TOKENS}, {0: BATCH}, {0: BATCH}, {0: BATCH},
                   POOL["req_to_token"], POOL["full_to_state"], {0: TOKENS})
DECODE_DYNAMIC = (POOL["state"], POOL["kvcache"], {0: BATCH}, {0: BATCH}, {0: BATCH},
                  POOL["req_to_token"], POOL["full_to_state"], {0: BATCH})


# ---------------------------------------------------------------------------
# Configurations and the step sequence
# ---------------------------------------------------------------------------

def _cfg(device, r, D, slow=False, **kw):
    marks = [pytest.mark.gpu] if device == "cuda" else []
    if slow:
        marks.append(pytest.mark.slow)
    kid = "-".join([device, f"r{r}", f"D{D}"] + [k for k, v in kw.items() if v])
    return pytest.param(dict(device=device, r=r, D=D, **kw), id=kid, marks=marks)


CONFIGS = [
    _cfg("cpu", 4, 128),
    _cfg("cpu", 4, 512, slow=True),
    _cfg("cpu", 128, 512, slow=True),
    _cfg("cuda", 4, 128),
    _cfg("cuda", 4, 512),
    _cfg("cuda", 128, 512),
]


def _pools(r, device, *, small=False):
    if small:  # the export example: a pool unlike the serving one (pool sizes are dynamic)
        return PagedPools(max_requests=2, max_seq_len=256, swa_page_size=128, full_page_size=256, seed=7, device=device)
    return PagedPools(max_requests=8, max_seq_len=512, swa_page_size=128, full_page_size=256, device=device)


def _layer(r, D, pools, device, **kw):
    torch.manual_seed(1234)
    return DeepSeekV4Compressor(
        HIDDEN, D, r, state_rows=pools.state_rows(r, 8 if r == 4 else 128), cache_pages=pools.cache_pages(),
        cache_page_size=256 // r, swa_page_size=128, max_positions=512, device=device, **kw,
    )


def _schedule(r):
    """(kind, requests): chunked prefills of different sizes, decodes of different batch sizes
    (some crossing a compression boundary), a mixed extend with a new request, an empty decode."""
    if r == 4:
        first, second, late = [13, 6, 9, 3, 22], {0: 7, 2: 5, 4: 10}, 9
    else:  # r = 128: requests 1 and 3 and, after the second chunk, 0 reach a boundary while decoding
        first, second, late = [200, 126, 90, 127, 300], {0: 55, 2: 61, 4: 41}, 130
    return [
        ("prefill", [(i, n) for i, n in enumerate(first)]),
        ("prefill", list(second.items())),
        ("decode", [0, 1, 2, 3, 4]),
        ("decode", [1, 3]),
        ("decode", [2]),
        ("decode", []),
        ("prefill", [(5, late), (1, 1), (3, 2)]),
        ("decode", [0, 1, 2, 3, 4, 5]),
    ]


def _step_args(pools, batch, r, gen, device):
    hidden = torch.randn(batch.num_q_tokens, HIDDEN, generator=gen).to(device)
    out_loc = pools.out_loc([a for a, _ in batch.rows], [b for _, b in batch.rows], r)
    rpi, seq_lens = batch.req_pool_indices.to(device), batch.seq_lens.to(device)
    if batch.is_decode:
        return (hidden, rpi, seq_lens, pools.req_to_token, pools.full_to_state, out_loc)
    return (hidden, rpi, seq_lens, batch.extend_lens.to(device), pools.req_to_token, pools.full_to_state, out_loc)


def _eager_call(layer, kind, args):
    if kind == "decode":
        hidden, rpi, seq_lens, r2t, f2s, out_loc = args
        return layer(hidden, rpi, seq_lens, None, r2t, f2s, out_loc)
    return layer(*args)


def _aoti_package(ep, path: Path) -> str:
    """``aoti_compile_and_package``. Inductor assumes dynamic sizes >= 2 and the optional runtime
    input check (AOTI_RUNTIME_CHECK_INPUTS=1) would reject batch sizes 0 and 1, which the exported
    program allows and the compiled code handles (tested below): drop that lower-bound check."""
    ensure_aoti_compiler()  # a compiler that links libstdc++ statically builds packages that crash at load
    configs = {}
    if hasattr(torch._inductor.config.aot_inductor, "check_lowerbound"):
        configs["aot_inductor.check_lowerbound"] = False
    return torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs=configs)


def _artifacts_dir(tmp_path_factory, name):
    root = os.environ.get("DSV4OPS_DEPLOY_ARTIFACTS")
    if root:
        path = Path(root) / name
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp(name)


def _run_fresh(job, workdir: Path, tag: str):
    """Run the job in a fresh interpreter; returns (result or None, log text)."""
    tag = f"{workdir.name}-{tag}"
    job_path, result_path = workdir / f"{tag}-job.pt", workdir / f"{tag}-result.pt"
    torch.save(job, job_path)
    env = dict(os.environ, AOTI_RUNTIME_CHECK_INPUTS="1", TORCH_SHOW_CPP_STACKTRACES="1", PYTHONFAULTHANDLER="1")
    proc = subprocess.run([sys.executable, "-X", "faulthandler", str(RUNNER), str(job_path), str(result_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    log = f"returncode {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    (workdir / f"{tag}-log.txt").write_text(log)
    if proc.returncode != 0:
        return None, log
    return torch.load(result_path), log


def _failure(log: str, workdir: Path) -> str:
    stages = [line for line in log.splitlines() if line.startswith("stage:")]
    last = stages[-1] if stages else "(no stage reached)"
    return f"fresh process failed at [{last}]; full log in {workdir}\n{log[-8000:]}"


# ---------------------------------------------------------------------------
# Export + package once per configuration, compute eager expectations
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module", params=CONFIGS)
def deployed(request, tmp_path_factory):
    c = dict(request.param)
    device, r, D = c.pop("device"), c.pop("r"), c.pop("D")
    tag = "-".join([device, f"r{r}", f"D{D}"] + [k for k, v in c.items() if v])
    workdir = _artifacts_dir(tmp_path_factory, f"deploy-{tag}")
    gen = torch.Generator().manual_seed(5)
    pools = _pools(r, device)
    eager = _layer(r, D, pools, device, **c)
    eager.state.fill_(float("nan"))  # no step may read a row that no step wrote
    eager.kvcache.fill_(POISON)
    state0, kvcache0 = eager.state.clone(), eager.kvcache.clone()

    # export from a small pool and short batches: every pool size and batch/token count is dynamic
    small = _pools(r, device, small=True)
    ex_layer = _layer(r, D, small, device, **c)
    prefill_ex = _step_args(small, make_batch([(0, 9), (1, 14)], {}, decode=False), r, gen, device)
    decode_ex = _step_args(small, make_batch([(0, 1), (1, 1)], {0: 9, 1: 14}, decode=True), r, gen, device)
    packages = {}
    for name, module, example, dyn in (("prefill", PrefillStep(eager), prefill_ex, PREFILL_DYNAMIC),
                                       ("decode", DecodeStep(eager), decode_ex, DECODE_DYNAMIC)):
        ep = torch.export.export(module, (ex_layer.state, ex_layer.kvcache) + example, dynamic_shapes=dyn, strict=False)
        assert not any(n.startswith("layer.state") or n.startswith("layer.kvcache") for n in ep.state_dict)
        packages[name] = _aoti_package(ep, workdir / f"{name}.pt2")

    # the serving sequence in eager mode, on the layer's own buffers
    steps, want, locs, seq = [], [], [], {}
    for kind, reqs in _schedule(r):
        decode = kind == "decode"
        batch = make_batch([(rid, 1) for rid in reqs] if decode else reqs, seq, decode=decode)
        args = _step_args(pools, batch, r, gen, device)
        want.append(_eager_call(eager, kind, args).cpu())
        steps.append({"package": kind, "args": [a.cpu() for a in args]})
        locs.append(args[-1].cpu())
        for rid, pos in batch.rows:
            seq[rid] = pos + 1
    assert sum(int((w.abs().sum(1) > 0).sum()) for w in want[2:6]) > 0, "no decode step emitted a token"
    job = {"device": device, "mode": "inputs", "packages": packages, "steps": steps,
           "state": state0.cpu(), "kvcache": kvcache0.cpu()}
    layout = CacheLayout(cache_format(D, eager.use_fp4, eager.bf16_store), eager.cache_page_size)
    return dict(device=device, job=job, want=want, state=eager.state.cpu(), kvcache=eager.kvcache.cpu(),
                locs=torch.cat(locs), layout=layout, workdir=workdir, state0=state0, kvcache0=kvcache0)


def _check_run(d, outputs, state, kvcache):
    assert len(outputs) == len(d["want"])
    for k, (got, want) in enumerate(zip(outputs, d["want"])):
        assert got.shape == want.shape, f"step {k}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {k}: {m}")
    # the state holds copies only: bit-exact, NaN poison included; the cache may differ by a rounding
    # step where Inductor's pooled rows differ from eager in the last ulp
    assert_same_bits(state, d["state"], "state")
    assert_caches_equivalent(kvcache, d["kvcache"], d["locs"], d["layout"])


def test_package_runs_in_a_fresh_process(deployed):
    """Both packages loaded in a new interpreter that never imports dsv4ops; one caller-owned
    state/cache pair carried through chunked prefills and decodes of different sizes."""
    result, log = _run_fresh(deployed["job"], deployed["workdir"], "inputs")
    assert result is not None, _failure(log, deployed["workdir"])
    print("\n".join(line for line in log.splitlines() if line.startswith("diag: {")))
    _check_run(deployed, result["outputs"], result["state"], result["kvcache"])
    assert "dsv4ops" not in result["imported_at_exit"], "the package needed dsv4ops at run time"
    for name, fqns in result["constant_fqns"].items():  # weights only: the state and cache are inputs
        assert not any("state" in f or "kvcache" in f for f in fqns), (name, fqns)


def test_package_runs_in_process(deployed):
    """The same packages loaded in the exporting process (a crash only in the fresh process would
    point at process start-up; a crash here too, at the package itself)."""
    d, job = deployed, deployed["job"]
    runners = {name: torch._inductor.aoti_load_package(path) for name, path in job["packages"].items()}
    state, kvcache = d["state0"].clone(), d["kvcache0"].clone()
    outputs = []
    for step in job["steps"]:
        got = runners[step["package"]](state, kvcache, *[a.to(d["device"]) for a in step["args"]])
        outputs.append((got[0] if isinstance(got, (list, tuple)) else got).cpu())
    _check_run(d, outputs, state.cpu(), kvcache.cpu())


# ---------------------------------------------------------------------------
# What AOTI does with mutated module buffers (the design not chosen)
# ---------------------------------------------------------------------------

class _BufferedDecodeStep(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = copy.deepcopy(layer)

    def forward(self, hidden, req_pool_indices, seq_lens, req_to_token, full_to_state, out_loc):
        return self.layer(hidden, req_pool_indices, seq_lens, None, req_to_token, full_to_state, out_loc)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_module_buffers_as_aoti_constants(device, tmp_path_factory):
    """With ``state`` / ``kvcache`` left as module buffers, AOTI bakes their export-time values into
    the package as constants owned by the runner: the runner updates them in place from call to call
    (no Python API reads them back), and ``load_constants(..., user_managed=True)`` makes it write
    into caller tensors instead. Each package has its own copy, so a prefill and a decode package do
    not share a state unless the caller points both at the same tensors."""
    r, D = 4, 128
    workdir = _artifacts_dir(tmp_path_factory, f"constants-{device}")
    gen = torch.Generator().manual_seed(9)
    pools = _pools(r, device)
    layer = _layer(r, D, pools, device)
    layer.state.fill_(float("nan"))
    layer.kvcache.fill_(POISON)
    seq = {}
    prompt = [(i, 21 + 6 * i) for i in range(4)]
    layer(*_step_args(pools, make_batch(prompt, seq, decode=False), r, gen, device))
    seq.update(prompt)
    example = _step_args(pools, make_batch([(i, 1) for i in range(4)], seq, decode=True), r, gen, device)
    ep = torch.export.export(_BufferedDecodeStep(layer), example, strict=False, dynamic_shapes=(
        {0: BATCH}, {0: BATCH}, {0: BATCH}, None, None, {0: BATCH}))
    package = _aoti_package(ep, workdir / "decode-buffers.pt2")
    state0, kvcache0 = layer.state.cpu().clone(), layer.kvcache.cpu().clone()
    steps, want, locs = [], [], []
    for size in (4, 2, 4, 3, 4):
        batch = make_batch([(i, 1) for i in range(size)], seq, decode=True)
        args = _step_args(pools, batch, r, gen, device)
        want.append(_eager_call(layer, "decode", args).cpu())
        steps.append({"package": "decode", "args": [a.cpu() for a in args]})
        locs.append(args[-1].cpu())
        for rid, pos in batch.rows:
            seq[rid] = pos + 1
    job = {"device": device, "mode": "constants", "packages": {"decode": package}, "steps": steps,
           "state": state0, "kvcache": kvcache0, "state_fqn": "layer.state", "kvcache_fqn": "layer.kvcache"}
    result, log = _run_fresh(job, workdir, "constants")
    assert result is not None, _failure(log, workdir)
    assert {"layer.state", "layer.kvcache"} <= set(result["constant_fqns"]["decode"])
    d = dict(want=want, state=layer.state.cpu(), kvcache=layer.kvcache.cpu(), locs=torch.cat(locs),
             layout=CacheLayout(cache_format(D, False, False), layer.cache_page_size))
    for k, (got, w) in enumerate(zip(result["outputs_runner_owned"], want)):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"runner-owned step {k}: {m}")
    _check_run(d, result["outputs"], result["state"], result["kvcache"])


# ---------------------------------------------------------------------------
# The toolchain: a compiler that links libstdc++ statically (the H200 image's g++ wrapper)
# ---------------------------------------------------------------------------

def _static_libstdcxx_wrapper(tmp_path) -> str:
    """A ``g++`` that adds ``-static-libstdc++`` to every shared link, like the H200 image's wrapper."""
    gxx = shutil.which("g++")
    if gxx is None or shutil.which("readelf") is None:
        pytest.skip("needs g++ and readelf")
    archive = subprocess.run([gxx, "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(archive):
        pytest.skip("g++ has no libstdc++.a")
    wrapper = tmp_path / "g++"
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -shared "*) exec {gxx} "$@" -static-libstdc++;; esac\n'
                       f'exec {gxx} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_static_libstdcxx_compiler_is_replaced(tmp_path, monkeypatch):
    wrapper = _static_libstdcxx_wrapper(tmp_path)
    assert links_libstdcxx_statically(wrapper) is True
    assert links_libstdcxx_statically("g++") is False
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", (None, wrapper))
    with pytest.raises(RuntimeError, match="links libstdc\\+\\+ statically"):
        ensure_aoti_compiler(candidates=())
    with pytest.warns(UserWarning, match="Using .*g\\+\\+ instead"):
        chosen = ensure_aoti_compiler(candidates=("g++",))
    assert chosen == shutil.which("g++") and torch._inductor.config.cpp.cxx == (None, chosen)
    assert ensure_aoti_compiler() == chosen  # a dynamic compiler is left alone


class _Tiny(torch.nn.Module):
    def forward(self, x):
        return (x * 2 + 1).sum(0)


@pytest.mark.slow
def test_static_libstdcxx_package_fails_to_load_and_the_check_prevents_it(tmp_path, monkeypatch):
    """The failure on record (docs/deployment.md): a package built by a static-libstdc++ compiler
    does not load in a fresh process; after ``ensure_aoti_compiler`` it does."""
    wrapper = _static_libstdcxx_wrapper(tmp_path)
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", (None, wrapper))
    load = ("import sys, torch; r = torch._inductor.aoti_load_package(sys.argv[1]); "
            "print(r(torch.arange(6.0).view(2, 3)).tolist())")
    ep = torch.export.export(_Tiny(), (torch.randn(2, 3),))
    results = []
    for name in ("static", "checked"):
        if name == "checked":
            with pytest.warns(UserWarning):
                ensure_aoti_compiler(candidates=("g++",))
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / f"{name}.pt2"))
        proc = subprocess.run([sys.executable, "-c", load, path], capture_output=True, text=True, timeout=300)
        results.append((proc.returncode, proc.stdout.strip()))
    assert results[0][0] != 0, "the static-libstdc++ package loaded: the failure mode is not reproduced here"
    assert results[1] == (0, "[8.0, 12.0, 16.0]"), results[1]
