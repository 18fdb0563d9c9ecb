"""Argument validation shared by the eager API, the op implementations and the fake kernels.

Every check raises before any kernel runs, with a message of the form
``dsv4ops.<op>: `<argument>` ...`` so that a user can see which argument is wrong.
Checks on batch dimensions go through ``torch._check_with`` so that they also
work (as deferred runtime asserts) when those sizes are symbolic or unbacked.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from ._layout import MAX_Q_TOKENS, ROPE_DIM, SUPPORTED_RATIOS, Addressing, coff

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_DTYPES = (torch.float32, torch.bfloat16)


def _fmt_dtypes(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def fail(op: str, msg: str, exc: type = ValueError) -> None:
    raise exc(f"dsv4ops.{op}: {msg}")


def check(cond, op: str, msg, exc: type = ValueError) -> None:
    """Raise ``exc`` unless ``cond``.

    ``cond`` may be a SymBool (inside fake kernels and traced op bodies), in which
    case it becomes a guard or a deferred runtime assert.
    """
    if isinstance(cond, bool):
        if not cond:
            fail(op, msg() if callable(msg) else msg, exc)
        return
    torch._check_with(exc, cond, lambda: f"dsv4ops.{op}: {msg() if callable(msg) else msg}")


def check_tensor(
    op: str,
    name: str,
    t,
    *,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    ndim: Optional[int] = None,
    dims: Optional[dict] = None,
    device: Optional[torch.device] = None,
    contiguous: bool = False,
) -> None:
    """Type, dtype, rank, static dims (``{axis: size}``), device and contiguity of one tensor."""
    if not isinstance(t, torch.Tensor):
        fail(op, f"`{name}` must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if dtypes is not None and t.dtype not in dtypes:
        fail(op, f"`{name}` must have dtype {_fmt_dtypes(dtypes)}, got {str(t.dtype).replace('torch.', '')}", TypeError)
    if ndim is not None and t.dim() != ndim:
        fail(op, f"`{name}` must be {ndim}-D, got shape {tuple(t.shape)}")
    for axis, size in (dims or {}).items():
        check(t.shape[axis] == size, op, lambda: f"`{name}` must have size {size} in dim {axis}, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        fail(op, f"`{name}` is on {t.device} but the other inputs are on {device}")
    if contiguous and not t.is_contiguous():
        fail(op, f"`{name}` must be contiguous (got strides {tuple(t.stride())} for shape {tuple(t.shape)})")


def check_ratio(op: str, compress_ratio) -> None:
    if compress_ratio not in SUPPORTED_RATIOS:
        fail(op, f"`compress_ratio` must be 4 or 128, got {compress_ratio!r}")


def check_head_dim(op: str, head_dim, compress_ratio: int) -> None:
    multiple = 128 if compress_ratio == 4 else 64
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % multiple or head_dim > 1024:
        fail(
            op,
            f"`head_dim` must be a positive multiple of {multiple} and at most 1024 for ratio "
            f"{compress_ratio}, got {head_dim!r}",
        )


# ---------------------------------------------------------------------------
# planner
# ---------------------------------------------------------------------------


def check_addressing(op: str, compress_ratio: int, swa_page_size: int, ring_size: int, addressing: int) -> None:
    if addressing not in tuple(Addressing):
        fail(op, f"`addressing` must be one of {[a.name for a in Addressing]}, got {addressing!r}")
    if addressing == Addressing.LEGACY:
        return
    if not isinstance(ring_size, int) or ring_size <= 0 or ring_size % compress_ratio:
        fail(op, f"`ring_size` must be a positive multiple of compress_ratio={compress_ratio}, got {ring_size!r}")
    if addressing == Addressing.SWA_PAGED:
        if not isinstance(swa_page_size, int) or swa_page_size <= 0 or swa_page_size % ring_size:
            fail(op, f"`swa_page_size` must be a positive multiple of ring_size={ring_size}, got {swa_page_size!r}")
    elif compress_ratio != 128:
        fail(op, "request-scoped addressing (Addressing.REQUEST) is defined for compress_ratio=128 only")


def check_plan_inputs(
    op: str,
    req_pool_indices: torch.Tensor,
    req_to_token: Optional[torch.Tensor],
    full_to_state: Optional[torch.Tensor],
    seq_lens: torch.Tensor,
    extend_lens: Optional[torch.Tensor],
    compress_ratio: int,
    swa_page_size: int,
    ring_size: int,
    addressing: int,
) -> None:
    check_ratio(op, compress_ratio)
    check_addressing(op, compress_ratio, swa_page_size, ring_size, addressing)
    dev = req_pool_indices.device if isinstance(req_pool_indices, torch.Tensor) else None
    check_tensor(op, "req_pool_indices", req_pool_indices, dtypes=INDEX_DTYPES, ndim=1)
    check_tensor(op, "seq_lens", seq_lens, dtypes=INDEX_DTYPES, ndim=1, device=dev)
    bs = req_pool_indices.shape[0]
    check(seq_lens.shape[0] == bs, op, lambda: f"`seq_lens` has {seq_lens.shape[0]} entries but `req_pool_indices` has {bs}")
    if extend_lens is not None:
        check_tensor(op, "extend_lens", extend_lens, dtypes=INDEX_DTYPES, ndim=1, device=dev)
        check(extend_lens.shape[0] == bs, op, lambda: f"`extend_lens` has {extend_lens.shape[0]} entries but `req_pool_indices` has {bs}")
        check(bs <= MAX_Q_TOKENS, op, lambda: f"a prefill batch holds at most {MAX_Q_TOKENS} requests (batch ids are 16-bit), got {bs}")
    if addressing == Addressing.SWA_PAGED:
        if req_to_token is None or full_to_state is None:
            fail(op, "SWA-paged addressing needs `req_to_token` and `full_to_state`")
        check_tensor(op, "req_to_token", req_to_token, dtypes=INDEX_DTYPES, ndim=2, device=dev)
        check_tensor(op, "full_to_state", full_to_state, dtypes=INDEX_DTYPES, ndim=1, device=dev)
        if req_to_token.numel() == 0 or full_to_state.numel() == 0:
            fail(op, "`req_to_token` and `full_to_state` must not be empty")
        if req_to_token.stride(1) != 1:
            fail(op, f"`req_to_token` rows must be contiguous (stride(1) == 1), got strides {tuple(req_to_token.stride())}")


def check_num_q_tokens(op: str, num_q_tokens) -> None:
    check(num_q_tokens >= 0, op, lambda: f"`num_q_tokens` must be >= 0, got {num_q_tokens}")
    check(
        num_q_tokens <= MAX_Q_TOKENS,
        op,
        lambda: f"`num_q_tokens` must be <= {MAX_Q_TOKENS} (ragged ids are 16-bit), got {num_q_tokens}",
    )


def check_prefill_lengths_host(op: str, seq_lens: torch.Tensor, extend_lens: torch.Tensor, num_q_tokens: int) -> None:
    """Value checks that need the lengths on the host; run only for CPU tensors in eager mode."""
    seq = seq_lens.tolist()
    ext = extend_lens.tolist()
    for b, (s, e) in enumerate(zip(seq, ext)):
        if e < 0 or s < 0:
            fail(op, f"`extend_lens[{b}]`={e} and `seq_lens[{b}]`={s} must be non-negative")
        if e > s:
            fail(op, f"`extend_lens[{b}]`={e} is larger than `seq_lens[{b}]`={s}")
    total = sum(ext)
    if total > num_q_tokens:
        fail(op, f"sum(`extend_lens`)={total} exceeds `num_q_tokens`={num_q_tokens}")


# ---------------------------------------------------------------------------
# compress_forward
# ---------------------------------------------------------------------------


def check_compress_inputs(
    op: str,
    kv_score_buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    ape: torch.Tensor,
    plan: torch.Tensor,
    write_plan: Optional[torch.Tensor],
    out: torch.Tensor,
    head_dim: int,
    compress_ratio: int,
) -> None:
    check_ratio(op, compress_ratio)
    check_head_dim(op, head_dim, compress_ratio)
    width = 2 * coff(compress_ratio) * head_dim
    dev = kv_score_input.device if isinstance(kv_score_input, torch.Tensor) else None
    check_tensor(op, "kv_score_input", kv_score_input, dtypes=FLOAT_DTYPES, ndim=2, dims={1: width}, contiguous=True)
    check_tensor(op, "kv_score_buffer", kv_score_buffer, dtypes=STATE_DTYPES, device=dev, contiguous=True)
    if kv_score_buffer.dim() not in (2, 3) or kv_score_buffer.shape[-1] != width:
        fail(op, f"`kv_score_buffer` must be [num_pages, {compress_ratio}, {width}] or [num_rows, {width}], got shape {tuple(kv_score_buffer.shape)}")
    if kv_score_buffer.dim() == 3 and kv_score_buffer.shape[1] != compress_ratio:
        fail(op, f"`kv_score_buffer` must be viewed as [num_pages, {compress_ratio}, {width}] for ratio {compress_ratio}, got shape {tuple(kv_score_buffer.shape)}")
    window = 8 if compress_ratio == 4 else compress_ratio
    check_tensor(op, "ape", ape, dtypes=FLOAT_DTYPES, ndim=2, dims={0: window, 1: head_dim}, device=dev, contiguous=True)
    check_tensor(op, "plan", plan, dtypes=(torch.uint8,), ndim=2, dims={1: 16}, device=dev, contiguous=True)
    check_tensor(op, "out", out, dtypes=FLOAT_DTYPES, ndim=2, dims={1: head_dim}, device=dev, contiguous=True)
    check(out.shape[0] == plan.shape[0], op, lambda: f"`out` has {out.shape[0]} rows but the plan has {plan.shape[0]}")
    if write_plan is None:  # decode: one input row per plan row
        check(
            kv_score_input.shape[0] == plan.shape[0],
            op,
            lambda: f"decode: `kv_score_input` has {kv_score_input.shape[0]} rows but the plan has {plan.shape[0]}",
        )
    else:
        check_tensor(op, "write_plan", write_plan, dtypes=(torch.uint8,), ndim=2, dims={1: 8}, device=dev, contiguous=True)


# ---------------------------------------------------------------------------
# compress_norm_rope_store
# ---------------------------------------------------------------------------


def check_store_inputs(
    op: str,
    kv: torch.Tensor,
    plan: torch.Tensor,
    norm_weight: torch.Tensor,
    freqs: torch.Tensor,
    out_loc: torch.Tensor,
    kvcache: torch.Tensor,
    is_decode: bool,
    compress_ratio: int,
    page_size: int,
    use_fp4: bool,
    bf16_store: bool,
) -> None:
    check_ratio(op, compress_ratio)
    dev = kv.device if isinstance(kv, torch.Tensor) else None
    check_tensor(op, "kv", kv, dtypes=FLOAT_DTYPES, ndim=2, contiguous=True)
    head_dim = kv.shape[1]
    if head_dim not in (128, 512):
        fail(op, f"`kv` rows must have head_dim 512 (main compressor) or 128 (indexer), got {head_dim}")
    if use_fp4 and head_dim != 128:
        fail(op, f"`use_fp4=True` needs the 128-wide indexer rows, got head_dim {head_dim}")
    if use_fp4 and compress_ratio != 4:
        fail(op, f"`use_fp4=True` is defined for the ratio-4 indexer only, got compress_ratio {compress_ratio}")
    if bf16_store and head_dim != 512:
        fail(op, f"`bf16_store=True` needs head_dim 512, got {head_dim}")
    if use_fp4 and bf16_store:
        fail(op, "`use_fp4` and `bf16_store` are mutually exclusive")
    if not isinstance(page_size, int) or page_size <= 0 or page_size & (page_size - 1):
        fail(op, f"`page_size` must be a positive power of two, got {page_size!r}")
    check_tensor(op, "plan", plan, dtypes=(torch.uint8,), ndim=2, dims={1: 16}, device=dev, contiguous=True)
    check(plan.shape[0] == kv.shape[0], op, lambda: f"`plan` has {plan.shape[0]} rows but `kv` has {kv.shape[0]}")
    check_tensor(op, "norm_weight", norm_weight, dtypes=FLOAT_DTYPES, ndim=1, dims={0: head_dim}, device=dev, contiguous=True)
    check_tensor(op, "freqs", freqs, dtypes=(torch.float32,), ndim=2, dims={1: ROPE_DIM}, device=dev, contiguous=True)
    check_tensor(op, "out_loc", out_loc, dtypes=INDEX_DTYPES, ndim=1, device=dev, contiguous=True)
    if is_decode:
        check(out_loc.shape[0] >= kv.shape[0], op, lambda: f"decode: `out_loc` has {out_loc.shape[0]} entries for {kv.shape[0]} rows")
    check_tensor(op, "kvcache", kvcache, dtypes=(torch.uint8,), device=dev, contiguous=True)
