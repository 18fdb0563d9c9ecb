"""compress_norm_rope_store: number formats, layouts, skip rules and bytes against the golden loop."""

from __future__ import annotations

import random

import pytest
import torch

import dsv4ops
from dsv4ops import CacheFormat, CacheLayout, CompressorDecodePlan, CompressorPrefillPlan, cache_page_bytes
from dsv4ops.layer import rope_freqs_table
from dsv4ops.store import quant
from dsv4ops.store.reference import norm_rope_store_reference

from _asserts import written_byte_mask
from golden import store_loop as golden

FORMATS = {
    "main-fp8": dict(head_dim=512),
    "main-bf16": dict(head_dim=512, bf16_store=True),
    "indexer-fp8": dict(head_dim=128),
    "indexer-fp4": dict(head_dim=128, use_fp4=True),
}


def _edge_floats(n=6000, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([
        torch.randn(n, generator=g) * torch.exp2(torch.randint(-12, 12, (n,), generator=g).float()),
        torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, 480.0, 1e9, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 1.5, 0.75,
                      2.5, 5.0, 6.0, 1.0e-30]),
    ])
    # midpoints between neighbouring e4m3 and bf16 values
    mags = torch.tensor(golden.E4M3_MAGNITUDES, dtype=torch.float64)
    mids = ((mags[1:] + mags[:-1]) / 2).float()
    return torch.cat([x, mids, -mids])


def test_e4m3_bytes_match_golden_encoder():
    x = _edge_floats()
    want = torch.tensor([golden.e4m3_encode(v) for v in x.tolist()], dtype=torch.uint8)
    assert torch.equal(quant.e4m3_bytes(x), want)


def test_bf16_rounding_matches_golden_encoder():
    x = _edge_floats() * 3.3
    want = torch.tensor([golden.bf16_encode(v) for v in x.tolist()], dtype=torch.int32)
    got_bytes = quant.bf16_bytes(x).view(torch.int16).int() & 0xFFFF
    assert torch.equal(got_bytes, want)
    assert torch.equal(quant.bf16_round(x).view(torch.int32) >> 16 & 0xFFFF, want)


def test_byte_packing_ignores_size_one_strides():
    """fp32/bf16 -> bytes for a one-row ``[1, 1]`` tensor whose size-1 dimensions carry stride 0, as
    Inductor may hand the reference at batch 1 (``view(torch.uint8)`` refuses a stride of 0 there)."""
    x = torch.randn(1).as_strided((1, 1), (0, 0))
    dense = x.clone(memory_format=torch.contiguous_format).reshape(1)
    assert torch.equal(quant.fp32_bytes(x), dense.view(torch.uint8)[None])
    assert torch.equal(quant.bf16_bytes(x), dense.to(torch.bfloat16).view(torch.uint8)[None])
    y = torch.randn(3, 5)  # and a plain batch: the little-endian bytes of each element
    assert torch.equal(quant.fp32_bytes(y), y.view(torch.uint8))
    assert torch.equal(quant.bf16_bytes(y), y.to(torch.bfloat16).view(torch.uint8))


def test_e2m1_and_ue8m0_match_golden():
    v = torch.cat([torch.linspace(-7, 7, 2001), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.1])])
    want = torch.tensor([golden.e2m1_encode(a) for a in v.tolist()], dtype=torch.int32)
    assert torch.equal(quant.e2m1_codes(v), want)
    s = torch.cat([torch.rand(3000) * 10, torch.exp2(torch.arange(-30, 30).float())])
    want = torch.tensor([golden.ue8m0_ceil(a) for a in s.tolist()], dtype=torch.int32)
    assert torch.equal(quant.ue8m0_ceil(s), want)


def test_page_bytes_match_spec_table():
    assert cache_page_bytes(512, 64) == 37440
    assert cache_page_bytes(512, 2) == 1728
    assert cache_page_bytes(128, 64) == 8448
    assert cache_page_bytes(128, 64, use_fp4=True) == 4352
    assert cache_page_bytes(512, 1, bf16_store=True) == 1024
    assert CacheLayout(CacheFormat.MAIN_FP8, 64).scale_base == 36864


def _case(fmt: str, is_decode: bool, n: int, page_size: int, device, seed=0):
    """Random rows and a plan exercising every skip rule, plus a cache poisoned with 0xA5."""
    g = torch.Generator().manual_seed(seed)
    cfg = FORMATS[fmt]
    D, r = cfg["head_dim"], 4
    layout = CacheLayout(dsv4ops._layout.cache_format(D, cfg.get("use_fp4", False), cfg.get("bf16_store", False)), page_size)
    num_pages, max_pos = max(6, -(-(n + 8) // page_size)), 300
    kv = torch.randn(n, D, generator=g) * torch.exp2(torch.randint(-3, 4, (n, 1), generator=g).float())
    kv[0] = 1e-3 * torch.randn(D, generator=g)  # a row whose groups hit the 1e-4 amax floor
    weight = 1 + 0.3 * torch.randn(D, generator=g)
    slots = torch.randperm(num_pages * page_size, generator=g)[: n + 4]
    out_loc = slots.clone()
    seq = (torch.randint(1, max_pos // r, (n,), generator=g) * r).to(torch.int64)
    rng = random.Random(seed)
    words = torch.zeros(n, 4, dtype=torch.int64)
    for i in range(n):
        kind = rng.random()
        s = int(seq[i])
        if kind < 0.1:
            s += 1  # decode: not at a boundary
        elif kind < 0.15:
            s = 0
        elif kind < 0.2:
            out_loc[i if is_decode else i + 1] = -1
        elif kind < 0.25:
            out_loc[i if is_decode else i + 1] = num_pages * page_size + 3  # past the last page
        elif kind < 0.3:
            s = max_pos + r  # RoPE position past the table
        words[i, 0] = s
        words[i, 1] = i + 1  # extend: ragged id
    if not is_decode:
        words[rng.sample(range(n), 2), 0] = -1  # padding rows
        words[rng.randrange(n), 1] = n + 50  # ragged id past out_loc
    plan = words.to(torch.int32).view(torch.uint8).reshape(n, 16)
    cache = torch.full((num_pages, layout.page_bytes), 0xA5, dtype=torch.uint8)
    freqs = rope_freqs_table(max_pos)
    to = lambda t: t.to(device)  # noqa: E731
    return dict(kv=to(kv), plan=to(plan), weight=to(weight), freqs=to(freqs), out_loc=to(out_loc), cache=to(cache),
                layout=layout, cfg=cfg, r=r)


def kernel_and_reference_bytes(store, fmt: str, is_decode: bool, page_size: int, device):
    """``_case(fmt, is_decode, 20, page_size, seed=page_size + 1)`` stored by ``store`` (a kernels
    module's ``norm_rope_store``) on ``device`` and by the reference: (the kernel's cache on the
    CPU, the reference's cache, the poisoned cache before either, the case's layout)."""
    c = _case(fmt, is_decode, 20, page_size, "cpu", seed=page_size + 1)
    flags = (c["cfg"].get("use_fp4", False), c["cfg"].get("bf16_store", False))
    poison = c["cache"].clone()
    want = c["cache"].clone()
    norm_rope_store_reference(c["kv"], c["plan"], c["weight"], 1e-6, c["freqs"], c["out_loc"], want,
                              is_decode, 4, page_size, *flags)
    got = c["cache"].to(device)
    store(c["kv"].to(device), c["plan"].to(device), c["weight"].to(device), 1e-6, c["freqs"].to(device),
          c["out_loc"].to(device), got, is_decode, 4, page_size, *flags)
    return got.cpu(), want, poison, c["layout"]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("is_decode", [True, False], ids=["decode", "extend"])
@pytest.mark.parametrize("page_size", [1, 2, 64])
def test_store_bytes_match_golden(fmt, is_decode, page_size, device):
    c = _case(fmt, is_decode, 40, page_size, device, seed=page_size)
    want = c["cache"].cpu().clone()
    golden.store_loop(c["kv"].cpu(), c["plan"].cpu(), c["weight"].cpu(), 1e-6, c["freqs"].cpu(), c["out_loc"].cpu(), want,
                      is_decode, c["r"], page_size, c["cfg"].get("use_fp4", False), c["cfg"].get("bf16_store", False))
    plan = (CompressorDecodePlan(4, c["plan"]) if is_decode else CompressorPrefillPlan(4, c["plan"], c["plan"][:, :8]))
    dsv4ops.compress_norm_rope_store(
        c["kv"], plan, norm_weight=c["weight"], norm_eps=1e-6, freq_cis=c["freqs"], out_loc=c["out_loc"],
        kvcache=c["cache"], page_size=page_size, **{k: v for k, v in c["cfg"].items() if k != "head_dim"},
    )
    diff = (c["cache"].cpu() != want).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ from the golden store, first {diff[:4].tolist()}"
    assert (want != 0xA5).any(), "the case stored something"


def test_skipped_rows_and_padding_bytes_untouched():
    c = _case("main-fp8", False, 30, 64, "cpu")
    before = c["cache"].clone()
    torch.ops.dsv4ops.compress_norm_rope_store(c["kv"], c["plan"], c["weight"], 1e-6, c["freqs"], c["out_loc"],
                                               c["cache"], False, 4, 64, False, False)
    changed = c["cache"] != before
    layout = c["layout"]
    # byte 7 of every scale record and the page tail past 584 * page_size are never written
    scale7 = layout.scale_base + torch.arange(64) * 8 + 7
    assert not changed[:, scale7].any() and not changed[:, 584 * 64:].any()
    # only bytes of the slots of rows that were stored may change
    assert not (changed & ~written_byte_mask(c["cache"], c["out_loc"], layout)).any()


def test_out_loc_int32_and_complex_freqs_are_equivalent():
    c = _case("indexer-fp8", False, 24, 64, "cpu")
    a, b = c["cache"].clone(), c["cache"].clone()
    plan = CompressorPrefillPlan(4, c["plan"], c["plan"][:, :8])
    common = dict(norm_weight=c["weight"], norm_eps=1e-6, page_size=64)
    dsv4ops.compress_norm_rope_store(c["kv"], plan, freq_cis=c["freqs"], out_loc=c["out_loc"], kvcache=a, **common)
    complex_freqs = torch.view_as_complex(c["freqs"].view(-1, 32, 2).contiguous())
    dsv4ops.compress_norm_rope_store(c["kv"], plan, freq_cis=complex_freqs, out_loc=c["out_loc"].int(), kvcache=b, **common)
    assert torch.equal(a, b)


def test_compiled_store_writes_the_same_bytes(device):
    """The pinned numerics survive Inductor's rewrites (no bf16 round-trip folding, no reassociation).
    On CUDA the op is Inductor's user-defined Triton kernel (its inline PTX included)."""
    for fmt in FORMATS:
        c = _case(fmt, False, 32, 64, device, seed=5)
        flags = (c["cfg"].get("use_fp4", False), c["cfg"].get("bf16_store", False))

        def store(kv, plan, w, freqs, out_loc, cache):
            torch.ops.dsv4ops.compress_norm_rope_store(kv, plan, w, 1e-6, freqs, out_loc, cache, False, 4, 64, *flags)

        a, b = c["cache"].clone(), c["cache"].clone()
        store(c["kv"], c["plan"], c["weight"], c["freqs"], c["out_loc"], a)
        torch.compile(store, fullgraph=True)(c["kv"], c["plan"], c["weight"], c["freqs"], c["out_loc"], b)
        assert torch.equal(a, b), fmt


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_reference_compiles_dynamic_for_one_row(fmt, device):
    """The reference compiled as the benchmark compiles it (``dynamic=True``), on one decode row:
    the same bytes as eager. On CUDA this is the case whose compile passed a CPU copy of a format
    constant to a CUDA kernel, before the constants became device scalars (``quant.scalar_like``)."""
    c = _case(fmt, True, 1, 64, device, seed=0)  # its one row is stored
    flags = (c["cfg"].get("use_fp4", False), c["cfg"].get("bf16_store", False))
    want, got = c["cache"].clone(), c["cache"].clone()
    args = (c["kv"], c["plan"], c["weight"], 1e-6, c["freqs"], c["out_loc"])
    norm_rope_store_reference(*args, want, True, 4, 64, *flags)
    torch._dynamo.reset()
    torch.compile(norm_rope_store_reference, dynamic=True)(*args, got, True, 4, 64, *flags)
    assert (want != 0xA5).any(), "the row is stored"
    assert torch.equal(want, got), fmt


def test_bf16_kv_and_weight_accepted():
    c = _case("main-fp8", True, 16, 64, "cpu")
    a, b = c["cache"].clone(), c["cache"].clone()
    kv16, w16 = c["kv"].bfloat16(), c["weight"].bfloat16()
    torch.ops.dsv4ops.compress_norm_rope_store(kv16, c["plan"], w16, 1e-6, c["freqs"], c["out_loc"], a, True, 4, 64)
    torch.ops.dsv4ops.compress_norm_rope_store(kv16.float(), c["plan"], w16.float(), 1e-6, c["freqs"], c["out_loc"], b, True, 4, 64)
    assert torch.equal(a, b)
