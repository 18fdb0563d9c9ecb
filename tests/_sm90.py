"""Compile Triton kernels for sm_90 (H100/H200) without a GPU, and read the compiler's resource use.

Used by ``tests/test_kernels_compile.py`` and ``tests/test_train.py``. The kernels must be
imported with ``TRITON_INTERPRET`` unset, so each of those files runs its ``variant`` tests
in a clean subprocess (``run_variants_in_subprocess``).

With ``DSV4OPS_SM90_REPORT=<file>`` set, every compiled variant appends one line to that file:
kernel, constexprs and pointer types, warps, registers per thread, stack frame bytes, how many of its
global loads / stores are 128 bits wide, and how many instructions its SASS has (static, padding
included). docs/performance.md quotes that table.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_variants_in_subprocess(test_file: str) -> str:
    """Run ``test_file``'s ``variant`` tests without the interpreter; fail with their output."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
                             os.path.abspath(test_file), "-k", "variant"], env=env, capture_output=True, text=True,
                            timeout=1200, cwd=REPO)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    return result.stdout


@contextlib.contextmanager
def sm90_driver():
    """Triton's active driver is an sm_90 target for the duration (no GPU needed): what Inductor's
    kernel analysis and ``torch.compile`` of a ``wrap_triton`` launch ask the driver about."""
    import triton
    from triton.backends.compiler import GPUTarget

    class _Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, *args):
            return 0

    driver = triton.runtime.driver
    active = driver.__dict__.get("_active")
    driver.set_active(_Sm90())
    try:
        yield
    finally:
        driver._active = active


def compile_for_sm90(fn, types: dict, constexprs: dict, num_warps: int = 4, multiples_of_16: tuple = ()):
    """``fn`` compiled for sm_90 as a launch specializes it: pointers (and the integer arguments named
    in ``multiples_of_16``) 16-byte aligned; ``types`` gives every other argument's Triton type."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {name: ("constexpr" if name in constexprs else types[name]) for name in names}
    aligned = [n for n in names if signature[n].startswith("*") or n in multiples_of_16]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def compile_sm90(fn, types: dict, constexprs: dict, num_warps: int = 4, max_stack: int = 0,
                 multiples_of_16: tuple = ()):
    """Compile ``fn`` for sm_90 with 16-byte aligned pointers (what a real launch specializes them to),
    check that it spills nothing and keeps at most ``max_stack`` bytes of stack frame, and report its
    resource use (see the module docstring). ``multiples_of_16`` names integer arguments that real
    launches pass as multiples of 16: Triton specializes those at launch too, and address arithmetic
    built on them can then use wide accesses, so leaving them out would misreport the kernel."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter mode: the variants are compiled in a subprocess without TRITON_INTERPRET")
    compiled = compile_for_sm90(fn, types, constexprs, num_warps, multiples_of_16)
    signature = {name: ("constexpr" if name in constexprs else types[name]) for name in fn.arg_names}
    interleaved = interleaved_lane_reductions(compiled.asm["ttgir"])
    assert not interleaved, f"{compiled.metadata.name} reduces along interleaved lane bits: {interleaved}"
    across = accesses_across_rows(compiled.asm["ttgir"])
    assert not across, f"{compiled.metadata.name} has loads / stores whose lanes run across rows: {across}"
    usage = resource_usage(compiled)
    if usage is not None:
        _report(compiled, constexprs, num_warps, usage, signature)
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, f"{compiled.metadata.name} spills: {usage}"
        assert usage["stack"] <= max_stack, f"{compiled.metadata.name} has a stack frame: {usage}"
    return compiled


def interleaved_lane_reductions(ttgir: str) -> list:
    """The ``tt.reduce`` ops of a kernel's TTGIR that reduce a linear layout (``#linear*``) along
    lanes that are not the lowest lane bits: ``(axis, layout name, reduced lane bits)`` of each.

    Triton 3.6 lowers such a reduction with butterfly shuffles over the lowest lane bits, so where
    the layout puts another axis's bit among the reduced axis's, the shuffles add the wrong lanes:
    the GPU's result is wrong and the interpreter's is not. The fourteenth session's reshape of a
    ``[2, 8, 64]`` tile to ``[2, 512]`` before its row sum did this (the row at lane bit 3, columns at
    bits 0-2 and 4; Triton later builds the shuffle mask from the layout's bases). Blocked layouts
    are lowered by another path and are not flagged."""
    import ast

    lanes = {}
    for name, bases in re.findall(r"^(#linear\d*) = #ttg\.linear<\{.*?lane = (\[\[.*?\]\])", ttgir, re.M):
        lanes[name] = ast.literal_eval(bases)
    found = []
    lines = ttgir.splitlines()
    for i, line in enumerate(lines):
        if '"tt.reduce"' not in line:
            continue
        axis = int(re.search(r"axis = (\d+)", line).group(1))
        closing = next(l for l in lines[i + 1:] if l.strip().startswith("}) :"))
        operands = closing.split("->")[0]
        for name in set(re.findall(r"(#linear\d*)>", operands)):
            reduced = [bit for bit, basis in enumerate(lanes[name]) if basis[axis] != 0]
            if reduced != list(range(len(reduced))):
                found.append((axis, name, reduced))
    return found


def accesses_across_rows(ttgir: str) -> list:
    """The global loads and stores of a kernel's TTGIR whose blocked layout varies fastest along
    another axis than the last (of those longer than 1): ``(op, shape, layout name, order)`` of each.

    Every kernel here keeps a tile's last axis contiguous in memory, so such an access has
    neighbouring lanes (and a thread's registers) a row apart: uncoalesced. Triton picks that
    order when it cannot prove the last axis contiguous, e.g. for offsets of 4 bytes on a byte
    pointer cast to an int32 pointer (the main bf16 store's words until the sixteenth session,
    3.7x the FP8 store's time for 1.8x its bytes) or for even / odd elements read as two tiles."""
    layouts = {}
    for name, body in re.findall(r"^(#\w+) = #ttg\.blocked<\{(.*?)\}>", ttgir, re.M):
        layouts[name] = [int(v) for v in re.search(r"order = \[([\d, ]+)\]", body).group(1).split(",")]
    found = []
    for op, shape, layout in re.findall(r"tt\.(store|load) .*: tensor<([\dx]+)x!tt\.ptr<\w+>, (#\w+)>", ttgir):
        dims = [int(d) for d in shape.split("x")]
        order = [axis for axis in layouts.get(layout, []) if dims[axis] > 1]
        if order and order[0] != len(dims) - 1:
            found.append((op, shape, layout, layouts[layout]))
    return found


def _tool(name: str) -> str | None:
    """The ptxas / cuobjdump Triton itself uses (``TRITON_PTXAS_PATH`` etc., else the bundled one):
    the PTX version Triton emits follows that ptxas, so another one may reject it."""
    from triton import knobs

    try:
        return getattr(knobs.nvidia, name).path
    except RuntimeError:
        return None


def _run_on(data, suffix: str, *command) -> str:
    with tempfile.NamedTemporaryFile(suffix=suffix, mode="wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        done = subprocess.run([*command, f.name], capture_output=True, text=True)
        return done.stdout + done.stderr


@functools.lru_cache(maxsize=8)
def _sass(cubin: bytes) -> str:
    """cuobjdump's SASS listing of a cubin (kept for the next check of the same variant)."""
    return _run_on(cubin, ".cubin", _tool("cuobjdump"), "-sass")


def resource_usage(compiled) -> dict | None:
    """ptxas's registers, stack frame and spill bytes (sm_90a, the PTX's target) and the number of
    global loads / stores in the SASS, and of those 128 bits wide; None without Triton's ptxas and cuobjdump."""
    ptxas, cuobjdump = _tool("ptxas"), _tool("cuobjdump")
    if ptxas is None or cuobjdump is None:
        return None
    info = _run_on(compiled.asm["ptx"], ".ptx", ptxas, "-v", "--gpu-name", "sm_90a", "-o", os.devnull)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", info)
    regs = re.search(r"Used (\d+) registers", info)
    assert frame and regs, info
    out = dict(reg=int(regs.group(1)), stack=int(frame.group(1)), spill_stores=int(frame.group(2)),
               spill_loads=int(frame.group(3)))
    sass = _sass(compiled.asm["cubin"])
    out["instructions"] = len(re.findall(r"/\*[0-9a-f]{4}\*/\s+[@A-Z]", sass))  # static: each instruction once
    for op in ("LDG", "STG"):
        accesses = re.findall(rf"\b{op}\.E[.\w]*", sass)
        out[op.lower()] = len(accesses)
        out[op.lower() + "128"] = sum(".128" in a for a in accesses)
    return out


def innermost_loops(compiled) -> list | None:
    """The instruction counts of the innermost loops of a compiled kernel's SASS (a backward branch
    and the instructions from its target to it, with no other backward branch among them; ``NOP``
    padding left out), in address order; None without Triton's cuobjdump. A software-pipelined tile
    loop is one such loop: its count is the instructions each warp issues per tile."""
    if _tool("cuobjdump") is None:
        return None
    return innermost_loops_in(_sass(compiled.asm["cubin"]))


def innermost_loops_in(sass: str) -> list:
    """``innermost_loops`` of a SASS listing."""
    code = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    branches = []
    for address, op in code:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", op)
        if target and int(target.group(1), 16) < address:
            branches.append((int(target.group(1), 16), address))
    loops = []
    for start, end in branches:
        if any(start <= other_start and other_end <= end and (other_start, other_end) != (start, end)
               for other_start, other_end in branches):
            continue
        loops.append(sum(1 for a, op in code if start <= a <= end and not op.lstrip().startswith("NOP")))
    return loops


def fused_fp32_multiply_adds(compiled) -> list | None:
    """The SASS ``FFMA`` instructions of a compiled kernel that fuse a real product into a real
    add (neither multiplicand nor the addend the zero register), or None without Triton's
    cuobjdump. ptxas fuses a PTX ``mul.f32`` into a following ``add.f32`` on its own (its
    ``--fmad`` default), so a kernel whose PTX has no ``fma.rn.f32`` can still skip the rounding
    of a product; ``FFMA Rd, RZ, ...`` (the fp64 division and square root's range checks) and
    ``FFMA Rd, a, b, RZ`` (a product alone) round as the unfused operations do."""
    if _tool("cuobjdump") is None:
        return None
    return fused_multiply_adds_in(_sass(compiled.asm["cubin"]))


def fused_multiply_adds_in(sass: str) -> list:
    """The ``FFMA`` instructions of a SASS listing none of whose three sources is the zero register."""
    fused = []
    for m in re.finditer(r"\bFFMA(?:\.\w+)* [^,]+, ([^,]+), ([^,]+), ([^;]+);", sass):
        a, b, c = (operand.strip().lstrip("-|") for operand in m.groups())
        if "RZ" not in (a, b, c):
            fused.append(m.group(0))
    return fused


def _report(compiled, constexprs: dict, num_warps: int, usage: dict, signature: dict) -> None:
    path = os.environ.get("DSV4OPS_SM90_REPORT")
    if not path:
        return
    # the pointer element types tell apart variants with the same constexprs (fp32 / bf16 state, ...)
    pointers = " ".join(f"{name.removesuffix('_ptr')}:{kind[1:]}" for name, kind in signature.items()
                        if kind.startswith("*"))
    consts = " ".join(f"{k}={v}" for k, v in constexprs.items()) + f" [{pointers}]"
    with open(path, "a") as f:
        f.write(f"| {compiled.metadata.name} | {consts} | {num_warps} | {usage['reg']} | {usage['stack']} | "
                f"{usage['ldg128']} of {usage['ldg']} | {usage['stg128']} of {usage['stg']} | "
                f"{usage['instructions']} |\n")
