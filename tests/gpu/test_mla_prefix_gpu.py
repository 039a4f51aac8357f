"""GPU tests of the MLA tree verify with the prefix on FlashMLA (``SGLANG_DDTREE_MLA_PREFIX=
flashmla``): FlashMLA's output and log-sum-exp against the fp32 prefix reference (the contract
``mla_prefix.py`` relies on: normalised output, natural-log LSE laid out [b, h, s]), and the merged
tree attention against the fp32 tree reference, eagerly and through a CUDA graph whose page table
and metadata are refreshed outside it. Kimi K2.6 TP8-rank shapes (8 heads, 512 + 64), bf16 KV
cache in pages of 64 tokens. Tolerance as test_tree_attention_gpu.py: bf16 2e-2 on outputs;
LSE within 2e-2 absolute (natural-log units).

Skipped where FlashMLA cannot run (not Hopper, or sgl_kernel without it).
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_kernels import compiled_kernels_where, graph_replay, rel_err

pytestmark = pytest.mark.gpu

HEADS, RANK, ROPE = 8, 512, 64
SM_SCALE = 192 ** -0.5
TOL = 2e-2


@pytest.fixture(scope="module")
def K():
    from sglang_ddtree.mla_prefix import machine_problems

    return compiled_kernels_where("FlashMLA", machine_problems)


def _case(K, seq_lens, n, seed):
    g = torch.Generator().manual_seed(seed)
    layout = K.reference.random_paged_layout(seq_lens, n, 64, g).to("cuda")
    mask = K.reference.random_tree_mask(len(seq_lens), n, g).cuda()
    cache = torch.randn(layout.num_slots, 1, RANK + ROPE, generator=g).bfloat16().cuda()
    q = torch.randn(len(seq_lens) * n, HEADS, RANK + ROPE, generator=g).bfloat16().cuda()
    return layout, mask, cache, q


def _prefix(n, width):
    from sglang_ddtree.mla_prefix import FlashMLAPrefix

    return FlashMLAPrefix(num_tree_tokens=n, num_heads=HEADS, context_width=width,
                          device="cuda")


@pytest.mark.parametrize("seq_lens,n", [([1, 64, 65, 300], 9), ([4000], 17), ([129, 2], 33),
                                        ([700, 5, 64], 129)])
def test_flashmla_prefix_contract(K, seq_lens, n):
    """What FlashMLAPrefix.run returns is the prefix-only attention and its natural-log LSE."""
    layout, _, cache, q = _case(K, seq_lens, n, seed=n)
    prefix = _prefix(n, layout.req_to_token.shape[1])
    prefix.prepare(layout.req_to_token, layout.req_pool_indices, layout.seq_lens, static=False)
    out, lse = prefix.run(q, cache, SM_SCALE)
    ref_out, ref_lse = K.reference.prefix_attention_reference(
        q, cache, cache[..., :RANK], n, sm_scale=SM_SCALE, **layout.table_kwargs())
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert rel_err(out, ref_out) < TOL, rel_err(out, ref_out)
    gap = (lse - ref_lse).abs().max().item()
    assert gap < 2e-2, f"LSE off by {gap} (natural log expected)"


@pytest.mark.parametrize("seq_lens,n", [([1, 64, 65, 300], 9), ([4000], 17), ([2047, 3], 33),
                                        ([700], 129)])
def test_merged_tree_attention_eager_and_graph(K, seq_lens, n):
    layout, mask, cache, q = _case(K, seq_lens, n, seed=100 + n)
    bs = len(seq_lens)
    attn = K.tree_attention_mla.TreeAttentionMLA.plan(
        max_batch_size=bs, num_tree_tokens=n, num_heads=HEADS, max_context_len=4096,
        device="cuda", sm_scale=SM_SCALE, kv_lora_rank=RANK, rope_dim=ROPE)
    prefix = _prefix(n, layout.req_to_token.shape[1])
    prefix.init_graph_buffers(bs)
    kw = layout.table_kwargs()
    ref = K.reference.mla_tree_attention_reference(q, cache, layout.out_cache_loc, mask,
                                                   kv_lora_rank=RANK, sm_scale=SM_SCALE, **kw)

    def call(o=None):
        p_out, p_lse = prefix.run(q, cache, SM_SCALE)
        return attn.run(q, cache, layout.out_cache_loc, mask, out=o, prefix_out=p_out,
                        prefix_lse=p_lse, **kw)

    prefix.prepare(layout.req_to_token, layout.req_pool_indices, layout.seq_lens, static=False)
    eager = call()
    assert rel_err(eager, ref) < TOL, rel_err(eager, ref)
    prefix.prepare(layout.req_to_token, layout.req_pool_indices, layout.seq_lens, static=True)
    assert torch.equal(graph_replay(call, eager), eager)
