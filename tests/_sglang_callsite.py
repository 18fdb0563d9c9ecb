"""sglang's compressor call site, retyped against dsv4ops (used by tests/test_migration.py).

This mirrors, call for call and keyword for keyword, the CUDA path of
``sglang/srt/layers/attention/dsv4/compressor_v2.py``: ``CompressorBackendMixin.forward_unified``
-> ``_forward_compress_all_in_one`` and the plan builders ``create_paged_compressor_data`` /
``_create_online_paged_compressor_data``. The one deliberate change from sglang is the import
line below (sglang: ``from sglang.jit_kernel.dsv4 import ...``).

Left out, because the objects they need do not exist outside sglang: the HIP branch, the
unified-KV Triton store, the hisparse location translation and the MTP prefix-state hook.
``envs`` stands in for ``sglang.srt.environ.envs``.
"""

from __future__ import annotations

from typing import List, Literal, Optional, Union

import torch

from dsv4ops import CompressorDecodePlan, CompressorPrefillPlan, compress_forward, compress_norm_rope_store

CompressMetadata = Union[CompressorDecodePlan, CompressorPrefillPlan]


class _EnvFlag:
    def __init__(self, value: bool = False):
        self.value = value

    def get(self) -> bool:
        return self.value


class envs:  # noqa: N801  (named like sglang's module-level object)
    SGLANG_OPT_USE_ONLINE_COMPRESS = _EnvFlag(False)


def _use_online_compress(compress_ratio: int) -> bool:
    return compress_ratio == 128 and envs.SGLANG_OPT_USE_ONLINE_COMPRESS.get()


def is_overlap_compress(compress_ratio: int) -> bool:
    return compress_ratio == 4


class CompressorBackendMixin:
    """Needs ``forward_metadata`` (``c{r}_compress_metadata``, ``core_metadata.c{r}_out_loc``),
    ``token_to_kv_pool`` and ``enable_deepseek_v4_fp4_indexer`` on the backend."""

    def _get_paged_compress_metadata(self, compress_ratio: int) -> CompressMetadata:
        return getattr(self.forward_metadata, f"c{compress_ratio}_compress_metadata")

    def _get_out_loc(self, compress_ratio: int) -> torch.Tensor:
        return getattr(self.forward_metadata.core_metadata, f"c{compress_ratio}_out_loc")

    def _forward_compress_all_in_one(
        self,
        *,
        kv_score_buffer: torch.Tensor,
        kv_score_input: torch.Tensor,
        ape: torch.Tensor,
        head_dim: int,
        norm,
        freqs_cis_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        is_indexer: bool,
        rotate: bool,
        compress_ratio: int,
        page_size: int,
        out_loc: torch.Tensor,
        use_fp4_indexer: bool = False,
        bf16_store: bool = False,
    ) -> None:
        assert compress_ratio in (4, 128)
        assert rotate == is_indexer == (head_dim == 128)
        if use_fp4_indexer:
            assert is_indexer and compress_ratio == 4 and head_dim == 128

        plan = self._get_paged_compress_metadata(compress_ratio)
        is_online = _use_online_compress(compress_ratio)
        if is_online:
            kv_score_buffer = kv_score_buffer.view(-1, 1, head_dim * 3)
        else:
            coff = 2 if is_overlap_compress(compress_ratio) else 1
            last_dim = 2 * head_dim * coff
            assert kv_score_buffer.shape[-1] == last_dim
            kv_score_buffer = kv_score_buffer.view(-1, compress_ratio, last_dim)

        kv_compressed = compress_forward(
            kv_score_buffer=kv_score_buffer,
            kv_score_input=kv_score_input,
            ape=ape.view(-1, head_dim),
            plan=plan,
            compress_ratio=compress_ratio,
            head_dim=head_dim,
            is_online=is_online,
        )
        compress_norm_rope_store(
            kv_compressed,
            plan,
            norm_weight=norm.weight,
            norm_eps=norm.variance_epsilon,
            freq_cis=freqs_cis_cache,
            out_loc=out_loc,
            kvcache=kv_cache,
            page_size=page_size,
            use_fp4=use_fp4_indexer,
            bf16_store=bf16_store,
        )

    def forward_unified(self, x: torch.Tensor, forward_batch, layer_id: int, compressor) -> None:
        if forward_batch.forward_mode.is_idle():
            return
        token_to_kv_pool = self.token_to_kv_pool
        kv_score_input = compressor.compute_kv_score(x, forward_batch)
        state_pool = compressor.get_state_pool(self)
        out_loc = self._get_out_loc(compressor.ratio)
        use_fp4_indexer = compressor.is_in_indexer and self.enable_deepseek_v4_fp4_indexer
        bf16_store = False
        if compressor.is_in_indexer:
            kv_cache = token_to_kv_pool.get_index_k_with_scale_buffer(layer_id)
            page_size = token_to_kv_pool.get_index_k_page_size()
        else:
            _, _, compress_kv_pool = token_to_kv_pool.layer_mapping[layer_id]
            assert compress_kv_pool is not None
            kv_cache = token_to_kv_pool.get_extra_key_buffer(layer_id)
            page_size = token_to_kv_pool.get_extra_key_page_size(layer_id)
        self._forward_compress_all_in_one(
            kv_score_buffer=state_pool.kv_score_buffer.kv_score,
            kv_score_input=kv_score_input,
            ape=compressor.ape,
            head_dim=compressor.head_dim,
            norm=compressor.norm,
            freqs_cis_cache=compressor.freqs_cis,
            kv_cache=kv_cache.view(dtype=torch.uint8),
            is_indexer=compressor.is_in_indexer,
            rotate=compressor.rotate,
            compress_ratio=compressor.ratio,
            page_size=page_size,
            out_loc=out_loc,
            use_fp4_indexer=use_fp4_indexer,
            bf16_store=bf16_store,
        )


def create_paged_compressor_data(
    compress_ratio: Literal[4, 128],
    *,
    is_prefill: bool,
    token_to_kv_pool,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: Optional[torch.Tensor] = None,
    seq_lens_cpu: Optional[List[int]] = None,
    extend_lens_cpu: Optional[List[int]] = None,
    use_prefill_cuda_graph: bool = False,
    num_q_tokens: Optional[int] = None,
    online_state_slot_offset: int = 0,
) -> CompressMetadata:
    if _use_online_compress(compress_ratio):
        return _create_online_paged_compressor_data(
            is_prefill=is_prefill,
            token_to_kv_pool=token_to_kv_pool,
            req_to_token=req_to_token,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            extend_lens=extend_lens,
            seq_lens_cpu=seq_lens_cpu,
            extend_lens_cpu=extend_lens_cpu,
            use_prefill_cuda_graph=use_prefill_cuda_graph,
            num_q_tokens=num_q_tokens,
            online_state_slot_offset=online_state_slot_offset,
        )

    swa_page_size = token_to_kv_pool.swa_page_size
    ring_size = token_to_kv_pool.get_ring_size(compress_ratio=compress_ratio)
    full_to_swa = token_to_kv_pool.full_to_swa_index_mapping.detach()
    req_pool_indices_i64 = req_pool_indices.to(torch.int64)

    if is_prefill:
        assert extend_lens is not None
        if seq_lens_cpu is not None:  # host lengths
            assert extend_lens_cpu is not None
            seq_lens_planner = torch.tensor(seq_lens_cpu, dtype=torch.int64)
            extend_lens_planner = torch.tensor(extend_lens_cpu, dtype=torch.int64)
            num_q_tokens = sum(extend_lens_cpu)
        else:  # device lengths, caller-given token count (CUDA-graph prefill)
            assert num_q_tokens is not None
            seq_lens_planner = seq_lens.to(torch.int64)
            extend_lens_planner = extend_lens.to(torch.int64)
        return CompressorPrefillPlan.generate(
            compress_ratio=compress_ratio,
            req_pool_indices=req_pool_indices_i64,
            seq_lens=seq_lens_planner,
            extend_lens=extend_lens_planner,
            req_to_token=req_to_token,
            full_to_state=full_to_swa,
            swa_page_size=swa_page_size,
            ring_size=ring_size,
            num_q_tokens=num_q_tokens,
            use_cuda_graph=use_prefill_cuda_graph,
        )
    return CompressorDecodePlan.generate(
        compress_ratio=compress_ratio,
        req_pool_indices=req_pool_indices_i64,
        req_to_token=req_to_token,
        full_to_state=full_to_swa,
        seq_lens=seq_lens.to(torch.int64),
        swa_page_size=swa_page_size,
        ring_size=ring_size,
    )


def _create_online_paged_compressor_data(
    *,
    is_prefill: bool,
    token_to_kv_pool,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: Optional[torch.Tensor],
    seq_lens_cpu: Optional[List[int]],
    extend_lens_cpu: Optional[List[int]],
    use_prefill_cuda_graph: bool,
    num_q_tokens: Optional[int],
    online_state_slot_offset: int = 0,
) -> CompressMetadata:
    req_pool_indices = req_pool_indices.to(torch.int64)
    if is_prefill:
        assert extend_lens is not None
        if seq_lens_cpu is not None:
            assert extend_lens_cpu is not None
            seq_lens_planner = torch.tensor(seq_lens_cpu, dtype=torch.int64)
            extend_lens_planner = torch.tensor(extend_lens_cpu, dtype=torch.int64)
            num_q_tokens_planner = sum(extend_lens_cpu)
        else:
            assert num_q_tokens is not None
            seq_lens_planner = seq_lens.to(torch.int64)
            extend_lens_planner = extend_lens.to(torch.int64)
            num_q_tokens_planner = num_q_tokens
        return CompressorPrefillPlan.generate_online(
            seq_lens=seq_lens_planner,
            extend_lens=extend_lens_planner,
            req_pool_indices=req_pool_indices,
            req_to_token=req_to_token,
            num_q_tokens=int(num_q_tokens_planner),
            use_cuda_graph=use_prefill_cuda_graph,
            state_slot_offset=online_state_slot_offset,
        )
    return CompressorDecodePlan.generate_online(
        seq_lens=seq_lens.to(torch.int64),
        req_pool_indices=req_pool_indices,
        req_to_token=req_to_token,
        state_slot_offset=online_state_slot_offset,
    )
