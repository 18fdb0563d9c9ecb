"""An sglang-shaped call site (compressor_v2's all-in-one path) runs unchanged against dsv4ops."""

from __future__ import annotations

import torch

from dsv4ops import CompressorDecodePlan, CompressorPrefillPlan, compress_forward, compress_norm_rope_store
from dsv4ops.layer import rope_freqs_table
from dsv4ops.testing import PagedPools


def _forward_compress_all_in_one(*, kv_score_buffer, kv_score_input, ape, head_dim, norm_weight, norm_eps,
                                 freqs_cis_cache, kv_cache, compress_ratio, page_size, out_loc, plan,
                                 use_fp4_indexer=False, bf16_store=False):
    # the same sequence of calls and views sglang's CompressorBackendMixin makes
    coff = 2 if compress_ratio == 4 else 1
    last_dim = 2 * head_dim * coff
    assert kv_score_buffer.shape[-1] == last_dim
    kv_score_buffer = kv_score_buffer.view(-1, compress_ratio, last_dim)
    kv_compressed = compress_forward(kv_score_buffer=kv_score_buffer, kv_score_input=kv_score_input,
                                     ape=ape.view(-1, head_dim), plan=plan, compress_ratio=compress_ratio,
                                     head_dim=head_dim, is_online=False)
    compress_norm_rope_store(kv_compressed, plan, norm_weight=norm_weight, norm_eps=norm_eps,
                             freq_cis=freqs_cis_cache, out_loc=out_loc, kvcache=kv_cache, page_size=page_size,
                             use_fp4=use_fp4_indexer, bf16_store=bf16_store)
    return kv_compressed


def test_sglang_call_sequence():
    r, D = 4, 512
    pools = PagedPools(max_requests=3, max_seq_len=512, swa_page_size=128, full_page_size=256)
    state = torch.zeros(pools.state_rows(r, 8) * 4 * D)  # the flat pool sglang allocates
    ape = torch.randn(r, 2 * D)  # checkpoint layout [r, coff*D]; kernels view it as [8, D]
    freqs = rope_freqs_table(512)
    freqs_cis = torch.view_as_complex(freqs.view(512, 32, 2).contiguous())  # sglang keeps it complex
    cache = torch.zeros(pools.cache_pages(), 37440, dtype=torch.uint8)
    weight = torch.ones(D)
    # prefill as create_paged_compressor_data builds it: host lengths, GPU-style tensors elsewhere
    seq_lens_cpu, extend_lens_cpu = [37, 9], [37, 9]
    plan = CompressorPrefillPlan.generate(
        compress_ratio=r, req_pool_indices=torch.tensor([0, 1]).to(torch.int64),
        seq_lens=torch.tensor(seq_lens_cpu, dtype=torch.int64), extend_lens=torch.tensor(extend_lens_cpu, dtype=torch.int64),
        req_to_token=pools.req_to_token, full_to_state=pools.full_to_state.detach(), swa_page_size=128, ring_size=8,
        num_q_tokens=sum(extend_lens_cpu), use_cuda_graph=False,
    )
    rows = [(0, p) for p in range(37)] + [(1, p) for p in range(9)]
    out_loc = pools.out_loc([a for a, _ in rows], [b for _, b in rows], r)
    out = _forward_compress_all_in_one(kv_score_buffer=state.view(-1, 4 * D), kv_score_input=torch.randn(46, 4 * D),
                                       ape=ape, head_dim=D, norm_weight=weight, norm_eps=1e-6, freqs_cis_cache=freqs_cis,
                                       kv_cache=cache.view(dtype=torch.uint8), compress_ratio=r, page_size=64,
                                       out_loc=out_loc, plan=plan)
    assert out.shape == (46, D) and (cache != 0).any()
    decode = CompressorDecodePlan.generate(compress_ratio=r, req_pool_indices=torch.tensor([0, 1]),
                                           req_to_token=pools.req_to_token, full_to_state=pools.full_to_state,
                                           seq_lens=torch.tensor([38, 10]), swa_page_size=128, ring_size=8)
    out = _forward_compress_all_in_one(kv_score_buffer=state.view(-1, 4 * D), kv_score_input=torch.randn(2, 4 * D),
                                       ape=ape, head_dim=D, norm_weight=weight, norm_eps=1e-6, freqs_cis_cache=freqs_cis,
                                       kv_cache=cache, compress_ratio=r, page_size=64,
                                       out_loc=pools.out_loc([0, 1], [37, 9], r), plan=decode)
    assert out.shape == (2, D)
