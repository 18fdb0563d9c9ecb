"""sglang-compatible Python API (mirrors ``sglang.jit_kernel.dsv4``).

A call site written for sglang keeps working with ``from dsv4ops import ...``:
the plan NamedTuples have the same fields, the same byte layouts and the same
``generate`` / ``generate_legacy`` / ``copy_`` / ``is_decode`` members, and the
two functions take the same arguments. Differences, all deliberate:

* prefill plans are always padded to ``num_q_tokens`` rows (sentinel rows after
  the valid ones), so shapes never depend on data; ``use_cuda_graph`` is accepted
  and has no further effect;
* output rows that produce no compressed token are zero, not uninitialised;
* ``generate`` takes an optional ``addressing`` (``"swa"`` or, for ratio 128,
  ``"request"``) to select the state-row formula of newer sglang versions;
* ``compress_norm_rope_store`` also accepts ``freq_cis`` as a real ``[max_pos, 64]``
  table (cos, sin interleaved), which is what the op consumes.

Everything here is a thin layer over ``torch.ops.dsv4ops.*`` and traces under
``torch.compile(fullgraph=True)`` and ``torch.export``.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Optional, Union

import torch

from . import _checks
from ._layout import Addressing

# Importing the op modules registers torch.ops.dsv4ops.*
from .compress import op as _compress_op  # noqa: F401
from .decode_step import op as _decode_step_op  # noqa: F401
from .online import op as _online_op  # noqa: F401
from .planner import op as _planner_op  # noqa: F401
from .store import op as _store_op  # noqa: F401

_ADDRESSING = {"swa": Addressing.SWA_PAGED, "request": Addressing.REQUEST}


def _addressing(name: str) -> int:
    if name not in _ADDRESSING:
        _checks.fail("plan", f"`addressing` must be 'swa' or 'request', got {name!r}")
    return int(_ADDRESSING[name])


def _eager_host_tensors(*tensors: torch.Tensor) -> bool:
    """True when the tensors are real CPU tensors outside of tracing: value checks are free."""
    if torch.compiler.is_compiling():
        return False
    return all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tensors)


class CompressorDecodePlan(NamedTuple):
    """Decode plan: one 16-byte DecodePlan row per request (``plan_d`` ``[bs, 16]`` uint8)."""

    compress_ratio: int
    plan_d: torch.Tensor

    def copy_(self, other: "CompressorDecodePlan") -> None:
        """Copy ``other``'s bytes into this plan's tensors (CUDA-graph input buffers)."""
        if not isinstance(other, CompressorDecodePlan) or other.compress_ratio != self.compress_ratio:
            raise ValueError("dsv4ops.CompressorDecodePlan.copy_: `other` must be a decode plan of the same ratio")
        self.plan_d.copy_(other.plan_d)

    @staticmethod
    def generate(
        compress_ratio: Literal[4, 128],
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        full_to_state: torch.Tensor,
        seq_lens: torch.Tensor,
        swa_page_size: int,
        ring_size: int,
        *,
        addressing: str = "swa",
    ) -> "CompressorDecodePlan":
        plan_d = torch.ops.dsv4ops.plan_decode(
            req_pool_indices, req_to_token, full_to_state, seq_lens.to(req_pool_indices.device),
            int(compress_ratio), int(swa_page_size), int(ring_size), _addressing(addressing),
        )
        return CompressorDecodePlan(int(compress_ratio), plan_d)

    @staticmethod
    def generate_legacy(
        compress_ratio: Literal[4, 128],
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> "CompressorDecodePlan":
        plan_d = torch.ops.dsv4ops.plan_decode(
            req_pool_indices, None, None, seq_lens.to(req_pool_indices.device),
            int(compress_ratio), 0, 0, int(Addressing.LEGACY),
        )
        return CompressorDecodePlan(int(compress_ratio), plan_d)

    @staticmethod
    def generate_online(
        seq_lens: torch.Tensor,
        req_pool_indices: torch.Tensor,
        req_to_token: Optional[torch.Tensor] = None,
        state_slot_offset: int = 0,
    ) -> "CompressorDecodePlan":
        """Plan for the online ratio-128 compressor: one state slot per request,
        ``req_pool_indices[b] + state_slot_offset`` (``req_to_token`` is accepted and unused)."""
        plan_d = torch.ops.dsv4ops.plan_online_decode(
            req_pool_indices, seq_lens.to(req_pool_indices.device), int(state_slot_offset)
        )
        return CompressorDecodePlan(128, plan_d)

    @property
    def is_decode(self) -> bool:
        return True


class CompressorPrefillPlan(NamedTuple):
    """Prefill plan: CompressPlan rows ``plan_c`` ``[num_q_tokens, 16]`` and WritePlan rows
    ``plan_w`` ``[num_q_tokens, 8]`` (uint8), valid rows first, sentinel rows after."""

    compress_ratio: int
    plan_c: torch.Tensor
    plan_w: torch.Tensor
    pin_buffer: Optional[torch.Tensor] = None  # kept for sglang compatibility; always None

    def copy_(self, other: "CompressorPrefillPlan") -> None:
        """Copy ``other``'s bytes into this plan's tensors (CUDA-graph input buffers)."""
        if not isinstance(other, CompressorPrefillPlan) or other.compress_ratio != self.compress_ratio:
            raise ValueError("dsv4ops.CompressorPrefillPlan.copy_: `other` must be a prefill plan of the same ratio")
        self.plan_c.copy_(other.plan_c)
        self.plan_w.copy_(other.plan_w)

    @staticmethod
    def _generate(compress_ratio, req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_state,
                  swa_page_size, ring_size, num_q_tokens, addressing) -> "CompressorPrefillPlan":
        if _eager_host_tensors(seq_lens, extend_lens):
            _checks.check_num_q_tokens("plan_prefill", num_q_tokens)
            _checks.check_tensor("plan_prefill", "seq_lens", seq_lens, dtypes=_checks.INDEX_DTYPES, ndim=1)
            _checks.check_tensor("plan_prefill", "extend_lens", extend_lens, dtypes=_checks.INDEX_DTYPES, ndim=1)
            _checks.check_prefill_lengths_host("plan_prefill", seq_lens, extend_lens, num_q_tokens)
        device = req_pool_indices.device
        plan_c, plan_w = torch.ops.dsv4ops.plan_prefill(
            req_pool_indices, req_to_token, full_to_state,
            seq_lens.to(device, non_blocking=True), extend_lens.to(device, non_blocking=True),
            num_q_tokens, int(compress_ratio), int(swa_page_size), int(ring_size), addressing,
        )
        return CompressorPrefillPlan(int(compress_ratio), plan_c, plan_w)

    @staticmethod
    def generate(
        compress_ratio: Literal[4, 128],
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        extend_lens: torch.Tensor,
        req_to_token: torch.Tensor,
        full_to_state: torch.Tensor,
        swa_page_size: int,
        ring_size: int,
        num_q_tokens: int,
        use_cuda_graph: bool = False,
        *,
        addressing: str = "swa",
    ) -> "CompressorPrefillPlan":
        return CompressorPrefillPlan._generate(
            compress_ratio, req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_state,
            swa_page_size, ring_size, num_q_tokens, _addressing(addressing),
        )

    @staticmethod
    def generate_legacy(
        compress_ratio: Literal[4, 128],
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        extend_lens: torch.Tensor,
        num_q_tokens: int,
        device: Optional[torch.device] = None,
        use_cuda_graph: bool = False,
    ) -> "CompressorPrefillPlan":
        if device is not None:
            req_pool_indices = req_pool_indices.to(device)
        return CompressorPrefillPlan._generate(
            compress_ratio, req_pool_indices, seq_lens, extend_lens, None, None, 0, 0, num_q_tokens,
            int(Addressing.LEGACY),
        )

    @staticmethod
    def generate_online(
        seq_lens: torch.Tensor,
        extend_lens: torch.Tensor,
        req_pool_indices: torch.Tensor,
        req_to_token: Optional[torch.Tensor] = None,
        num_q_tokens: int = 0,
        use_cuda_graph: bool = False,
        state_slot_offset: int = 0,
    ) -> "CompressorPrefillPlan":
        """Segment plans for the online ratio-128 compressor, padded to ``num_q_tokens`` rows
        (``plan_w`` holds 16-byte CompressPlan rows here, as in sglang)."""
        if _eager_host_tensors(seq_lens, extend_lens):
            _checks.check_num_q_tokens("plan_online_prefill", num_q_tokens)
            _checks.check_prefill_lengths_host("plan_online_prefill", seq_lens, extend_lens, num_q_tokens)
        device = req_pool_indices.device
        plan_c, plan_w = torch.ops.dsv4ops.plan_online_prefill(
            req_pool_indices, seq_lens.to(device, non_blocking=True), extend_lens.to(device, non_blocking=True),
            num_q_tokens, int(state_slot_offset),
        )
        return CompressorPrefillPlan(128, plan_c, plan_w)

    @property
    def is_decode(self) -> bool:
        return False


CompressPlan = Union[CompressorDecodePlan, CompressorPrefillPlan]


def _check_plan(op: str, plan, compress_ratio: Optional[int] = None) -> None:
    if not isinstance(plan, (CompressorDecodePlan, CompressorPrefillPlan)):
        _checks.fail(op, f"`plan` must be a CompressorDecodePlan or CompressorPrefillPlan, got {type(plan).__name__}", TypeError)
    if compress_ratio is not None and plan.compress_ratio != compress_ratio:
        _checks.fail(op, f"`plan` was built for compress_ratio={plan.compress_ratio} but `compress_ratio`={compress_ratio}")


def compress_forward(
    kv_score_buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    ape: torch.Tensor,
    plan: CompressPlan,
    *,
    head_dim: int,
    compress_ratio: Literal[4, 128],
    out: Optional[torch.Tensor] = None,
    is_online: bool = False,
) -> torch.Tensor:
    """Write ``kv_score_input`` into the state ring and pool every finished window.

    Returns ``out`` ``[plan rows, head_dim]`` (input dtype unless ``out`` is given);
    mutates ``kv_score_buffer``. See ``docs/compress_forward.md``.
    """
    _check_plan("compress_forward", plan, compress_ratio)
    if is_online:
        if compress_ratio != 128:  # (sglang's online kernel also fixes head_dim = 512; any multiple of 64 works here)
            _checks.fail("compress_forward", f"`is_online=True` needs compress_ratio=128, got {compress_ratio}")
        if out is None:
            out = kv_score_input.new_empty((plan[1].shape[0], head_dim))
        torch.ops.dsv4ops.compress_forward_online(
            kv_score_buffer, kv_score_input, ape, plan[1], None if plan.is_decode else plan[2], out, int(head_dim)
        )
        return out
    if out is None:
        out = kv_score_input.new_empty((plan[1].shape[0], head_dim))
    write_plan = None if plan.is_decode else plan[2]
    torch.ops.dsv4ops.compress_forward(
        kv_score_buffer, kv_score_input, ape, plan[1], write_plan, out, int(head_dim), int(compress_ratio)
    )
    return out


def freqs_table(freq_cis: torch.Tensor) -> torch.Tensor:
    """The op's real RoPE table ``[max_pos, 64]`` from sglang's complex ``[max_pos, 32]`` one."""
    if freq_cis.is_complex():
        return torch.view_as_real(freq_cis).flatten(-2).float().contiguous()
    return freq_cis


def compress_norm_rope_store(
    kv: torch.Tensor,
    plan: CompressPlan,
    *,
    norm_weight: torch.Tensor,
    norm_eps: float,
    freq_cis: torch.Tensor,
    out_loc: torch.Tensor,
    kvcache: torch.Tensor,
    page_size: int,
    use_fp4: bool = False,
    bf16_store: bool = False,
) -> None:
    """RMSNorm + RoPE (+ Hadamard) + quantize + paged store of compressed rows into ``kvcache``.

    See ``docs/compress_norm_rope_store.md`` for the cache layouts.
    """
    _check_plan("compress_norm_rope_store", plan)
    torch.ops.dsv4ops.compress_norm_rope_store(
        kv, plan[1], norm_weight, float(norm_eps), freqs_table(freq_cis), out_loc, kvcache,
        plan.is_decode, int(plan.compress_ratio), int(page_size), bool(use_fp4), bool(bf16_store),
    )


def compress_decode_step(
    kv_score_buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    ape: torch.Tensor,
    *,
    req_pool_indices: torch.Tensor,
    req_to_token: Optional[torch.Tensor],
    full_to_state: Optional[torch.Tensor],
    seq_lens: torch.Tensor,
    swa_page_size: int,
    ring_size: int,
    head_dim: int,
    compress_ratio: Literal[4, 128],
    norm_weight: torch.Tensor,
    norm_eps: float,
    freq_cis: torch.Tensor,
    out_loc: torch.Tensor,
    kvcache: torch.Tensor,
    page_size: int,
    use_fp4: bool = False,
    bf16_store: bool = False,
    addressing: str = "swa",
):
    """A whole decode step of one compressor in one op (dsv4ops extension; not in sglang).

    Equivalent to ``plan = CompressorDecodePlan.generate(...)``, ``kv = compress_forward(...,
    plan)`` and ``compress_norm_rope_store(kv, plan, ...)``, bit for bit, in one kernel launch
    for ratio 4 and two for ratio 128. Returns ``(plan, kv)``; the plan can be reused by
    another compressor of the same ratio (the indexer). Mutates ``kv_score_buffer`` and
    ``kvcache``.
    """
    plan_d = req_pool_indices.new_empty((req_pool_indices.shape[0], 16), dtype=torch.uint8)
    out = kv_score_input.new_empty((req_pool_indices.shape[0], head_dim))
    torch.ops.dsv4ops.compress_decode_step(
        kv_score_buffer, kv_score_input, ape, req_pool_indices, req_to_token, full_to_state,
        seq_lens.to(req_pool_indices.device), norm_weight, float(norm_eps), freqs_table(freq_cis), out_loc, kvcache,
        plan_d, out, int(head_dim), int(compress_ratio), int(swa_page_size), int(ring_size), _addressing(addressing),
        int(page_size), bool(use_fp4), bool(bf16_store),
    )
    return CompressorDecodePlan(int(compress_ratio), plan_d), out
