"""``DeepSeekV4Compressor``: one DeepSeek-V4 KV compressor as an ``nn.Module``.

fp32 projection of hidden states to kv/score rows -> plan -> ``compress_forward``
into a state ring held as a module buffer -> ``compress_norm_rope_store`` into a
paged cache held as a module buffer. The whole forward is made of dsv4ops custom
ops and plain tensor code, so it compiles with ``torch.compile(fullgraph=True)``
and exports with ``torch.export``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ._layout import Addressing, CacheLayout, cache_format, state_row_width, window_len
from .api import (
    CompressorDecodePlan,
    CompressorPrefillPlan,
    compress_decode_step,
    compress_forward,
    compress_norm_rope_store,
)

_ADDRESSING_NAMES = {Addressing.SWA_PAGED: "swa", Addressing.REQUEST: "request"}


def rope_freqs_table(
    max_positions: int,
    *,
    rope_dim: int = 64,
    theta: float = 160000.0,
    yarn_factor: float = 16.0,
    original_max_positions: int = 65536,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """Real RoPE table ``[max_positions, rope_dim]`` fp32: ``(cos t0, sin t0, cos t1, ...)``.

    DeepSeek-V4's compressed layers use ``compress_rope_theta`` with YaRN frequency
    interpolation (no magnitude scaling). ``yarn_factor <= 1`` disables YaRN.
    """
    half = rope_dim // 2
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim))
    if yarn_factor > 1 and max_positions > original_max_positions:

        def correction_dim(rotations: float) -> float:
            return rope_dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
        ramp = ((torch.arange(half, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        keep = 1 - ramp
        freqs = freqs / yarn_factor * (1 - keep) + freqs * keep
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * freqs[None, :]
    return torch.stack([angles.cos(), angles.sin()], dim=-1).reshape(max_positions, rope_dim).float()


class DeepSeekV4Compressor(nn.Module):
    """A DeepSeek-V4 KV compressor (core: head_dim 512, ratio 4 or 128; indexer: head_dim 128, ratio 4).

    Buffers: ``state`` ``[state_rows, 2*coff*head_dim]`` (the ring), ``kvcache``
    ``[cache_pages, page_bytes]`` uint8 (the paged compressed cache), ``freqs``
    ``[max_positions, 64]``. Both ``state`` and ``kvcache`` are updated in place by
    ``forward``.

    ``online=True`` (ratio 128 only; sglang's ``SGLANG_OPT_USE_ONLINE_COMPRESS``) keeps one
    running-softmax row per request instead of the ring: ``state`` is ``[state_rows, 3*head_dim]``
    fp32 (``max | sum | kv``), row ``req_pool_indices[b]`` for request ``b``, so ``state_rows``
    is the number of request slots. A decode step then reads one state row, not a 128-row
    window (docs/online.md). The compressed tokens are the same up to float rounding.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        compress_ratio: int,
        *,
        state_rows: int,
        cache_pages: int,
        cache_page_size: int,
        swa_page_size: int,
        ring_size: Optional[int] = None,
        addressing: Addressing = Addressing.SWA_PAGED,
        state_dtype: torch.dtype = torch.float32,
        use_fp4: bool = False,
        bf16_store: bool = False,
        norm_eps: float = 1e-6,
        max_positions: int = 65536,
        rope_theta: float = 160000.0,
        fused_decode: bool = True,
        online: bool = False,
        device: Optional[torch.device] = None,
    ):
        super().__init__()
        if online and (compress_ratio != 128 or state_dtype != torch.float32):
            raise ValueError("dsv4ops.DeepSeekV4Compressor: `online=True` needs compress_ratio=128 and a float32 state, "
                             f"got compress_ratio={compress_ratio}, state_dtype={state_dtype}")
        #: the online ratio-128 state (one running-softmax row per request) instead of the ring
        self.online = online
        #: decode steps without a shared plan run as one ``compress_decode_step`` op
        self.fused_decode = fused_decode
        self.head_dim = head_dim
        self.compress_ratio = compress_ratio
        self.swa_page_size = swa_page_size
        self.ring_size = ring_size if ring_size is not None else window_len(compress_ratio)
        if Addressing(addressing) not in _ADDRESSING_NAMES:
            raise ValueError("dsv4ops.DeepSeekV4Compressor: `addressing` must be SWA_PAGED or REQUEST (legacy plans "
                             "have no req_to_token/full_to_state; call CompressorPrefillPlan.generate_legacy directly)")
        self.addressing = _ADDRESSING_NAMES[Addressing(addressing)]
        self.cache_page_size = cache_page_size
        self.use_fp4 = use_fp4
        self.bf16_store = bf16_store
        self.norm_eps = norm_eps
        width = state_row_width(head_dim, compress_ratio)
        factory = dict(device=device, dtype=torch.float32)
        self.wkv_gate = nn.Linear(hidden_size, width, bias=False, **factory)
        # ape in the kernel layout [W, D] (for ratio 4: rows 0..3 apply to the previous chunk).
        self.ape = nn.Parameter(torch.randn(window_len(compress_ratio), head_dim, **factory) * 0.5)
        self.norm_weight = nn.Parameter(1 + 0.1 * torch.randn(head_dim, **factory))
        self.register_buffer("freqs", rope_freqs_table(max_positions, theta=rope_theta).to(device))
        state_width = 3 * head_dim if online else width
        self.register_buffer("state", torch.zeros(state_rows, state_width, device=device, dtype=state_dtype))
        layout = CacheLayout(cache_format(head_dim, use_fp4, bf16_store), cache_page_size)
        self.register_buffer("kvcache", torch.zeros(cache_pages, layout.page_bytes, device=device, dtype=torch.uint8))

    def plan(self, req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_state, num_q_tokens):
        r = self.compress_ratio
        if self.online:
            if extend_lens is None:
                return CompressorDecodePlan.generate_online(seq_lens, req_pool_indices)
            return CompressorPrefillPlan.generate_online(seq_lens, extend_lens, req_pool_indices,
                                                         num_q_tokens=num_q_tokens)
        if extend_lens is None:
            return CompressorDecodePlan.generate(
                r, req_pool_indices, req_to_token, full_to_state, seq_lens, self.swa_page_size, self.ring_size,
                addressing=self.addressing,
            )
        return CompressorPrefillPlan.generate(
            r, req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_state, self.swa_page_size,
            self.ring_size, num_q_tokens, addressing=self.addressing,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        extend_lens: Optional[torch.Tensor],
        req_to_token: torch.Tensor,
        full_to_state: torch.Tensor,
        out_loc: torch.Tensor,
        plan=None,
    ) -> torch.Tensor:
        """One forward step. ``extend_lens is None`` means decode (one token per request).

        ``hidden_states`` ``[num_q_tokens, hidden]``; ``out_loc`` ``[num_q_tokens]`` cache slot
        of every token that completes a chunk. ``plan`` may be passed in when several
        compressors of the same ratio share it (sglang plans once per ratio per forward).
        Without a plan, a decode step is one fused op (``fused_decode``, default on; not for
        the online state, whose decode step is plan, compress and store).
        Returns the pooled rows (before norm) ``[rows, head_dim]``.
        """
        kv_score = self.wkv_gate(hidden_states.float())
        if extend_lens is None and plan is None and self.fused_decode and not self.online:
            _, pooled = compress_decode_step(
                self.state, kv_score, self.ape, req_pool_indices=req_pool_indices, req_to_token=req_to_token,
                full_to_state=full_to_state, seq_lens=seq_lens, swa_page_size=self.swa_page_size,
                ring_size=self.ring_size, head_dim=self.head_dim, compress_ratio=self.compress_ratio,
                norm_weight=self.norm_weight, norm_eps=self.norm_eps, freq_cis=self.freqs, out_loc=out_loc,
                kvcache=self.kvcache, page_size=self.cache_page_size, use_fp4=self.use_fp4,
                bf16_store=self.bf16_store, addressing=self.addressing,
            )
            return pooled
        if plan is None:
            plan = self.plan(req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_state, hidden_states.shape[0])
        pooled = compress_forward(
            self.state, kv_score, self.ape, plan, head_dim=self.head_dim, compress_ratio=self.compress_ratio,
            is_online=self.online,
        )
        compress_norm_rope_store(
            pooled, plan, norm_weight=self.norm_weight, norm_eps=self.norm_eps, freq_cis=self.freqs,
            out_loc=out_loc, kvcache=self.kvcache, page_size=self.cache_page_size,
            use_fp4=self.use_fp4, bf16_store=self.bf16_store,
        )
        return pooled


def mark_dynamic_tokens(*tensors: Optional[torch.Tensor]) -> None:
    """Mark dim 0 (batch or token count) of each tensor as unbacked for ``torch.compile``.

    Unbacked sizes are not specialized on 0 or 1, so one compiled graph serves every
    batch size and token count (no recompiles). Call it on the step inputs before
    the first compiled call; ``None`` entries are ignored.
    """
    for t in tensors:
        if t is not None:
            torch._dynamo.decorators.mark_unbacked(t, 0)
