"""GPU tests of the MHA tree verify with the prefix on FA3 (``SGLANG_DDTREE_MHA_PREFIX=fa3``):
FA3's output and log-sum-exp against the fp32 prefix reference (the contract ``mha_prefix.py``
relies on: normalised output, natural-log LSE laid out [b, hq, s]), and the merged tree attention
against the fp32 tree reference, eagerly and through a CUDA graph whose page table and lengths
are refreshed outside it. Qwen3-8B shapes (32 q heads, 8 KV heads, 128 dims) and the tiny pair's
(4 / 2, 64), pages of 1 and 16 tokens. Tolerance as test_tree_attention_gpu.py: bf16 2e-2 on
outputs; LSE within 2e-2 absolute (natural-log units).

Skipped where FA3 cannot run (not Hopper, or sgl_kernel without it).
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_kernels import compiled_kernels_where, graph_replay, rel_err

pytestmark = pytest.mark.gpu

TOL = 2e-2
SHAPES = {"qwen3_8b": (32, 8, 128), "tiny": (4, 2, 64)}


@pytest.fixture(scope="module")
def K():
    from sglang_ddtree.mha_prefix import machine_problems

    return compiled_kernels_where("FA3", machine_problems)


def _case(K, seq_lens, n, page, shape, seed):
    hq, hkv, d = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    layout = K.reference.random_paged_layout(seq_lens, n, page, g).to("cuda")
    mask = K.reference.random_tree_mask(len(seq_lens), n, g).cuda()
    slots = -(-layout.num_slots // page) * page
    k = torch.randn(slots, hkv, d, generator=g).bfloat16().cuda()
    v = torch.randn(slots, hkv, d, generator=g).bfloat16().cuda()
    q = torch.randn(len(seq_lens) * n, hq, d, generator=g).bfloat16().cuda()
    return layout, mask, k, v, q, d ** -0.5


def _prefix(layout, n, page, bs):
    """FA3Prefix prepared as the verify backend prepares a graph batch: on its own snapshot of
    the batch's req_to_token rows (rows 0..bs-1)."""
    from sglang_ddtree.mha_prefix import FA3Prefix

    table = layout.req_to_token.index_select(0, layout.req_pool_indices).contiguous()
    prefix = FA3Prefix(num_tree_tokens=n, page_size=page, device="cuda",
                       context_width=table.shape[1], table_dtype=table.dtype)
    prefix.init_graph_buffers(bs)
    return prefix, table, torch.arange(bs, device="cuda")


CASES = [([1, 64, 65, 300], 9, 1, "qwen3_8b"), ([4000], 17, 1, "qwen3_8b"),
         ([129, 2], 33, 16, "qwen3_8b"), ([700, 5, 64], 17, 16, "tiny"), ([2047, 3], 65, 1, "tiny")]


@pytest.mark.parametrize("seq_lens,n,page,shape", CASES)
def test_fa3_prefix_contract(K, seq_lens, n, page, shape):
    """What FA3Prefix.run returns is the prefix-only attention and its natural-log LSE."""
    layout, _, k, v, q, scale = _case(K, seq_lens, n, page, shape, seed=n + page)
    prefix, table, rows = _prefix(layout, n, page, len(seq_lens))
    prefix.prepare(table, rows, layout.seq_lens, static=False)
    out, lse = prefix.run(q, k, v, scale)
    ref_out, ref_lse = K.reference.prefix_attention_reference(
        q, k, v, n, sm_scale=scale, **layout.table_kwargs())
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert rel_err(out, ref_out) < TOL, rel_err(out, ref_out)
    gap = (lse - ref_lse).abs().max().item()
    assert gap < 2e-2, f"LSE off by {gap} (natural log expected)"


@pytest.mark.parametrize("seq_lens,n,page,shape", CASES)
def test_merged_tree_attention_eager_and_graph(K, seq_lens, n, page, shape):
    layout, mask, k, v, q, scale = _case(K, seq_lens, n, page, shape, seed=100 + n)
    hq, hkv, d = SHAPES[shape]
    bs = len(seq_lens)
    attn = K.tree_attention.TreeAttention.plan(
        max_batch_size=bs, num_tree_tokens=n, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
        max_context_len=4096, device="cuda", sm_scale=scale)
    prefix, table, rows = _prefix(layout, n, page, bs)
    kw = layout.table_kwargs()
    ref = K.reference.tree_attention_reference(q, k, v, layout.out_cache_loc, mask,
                                               sm_scale=scale, **kw)

    def call(o=None):
        p_out, p_lse = prefix.run(q, k, v, scale)
        return attn.run(q, k, v, layout.out_cache_loc, mask, out=o, prefix_out=p_out,
                        prefix_lse=p_lse, **kw)

    prefix.prepare(table, rows, layout.seq_lens, static=False)
    eager = call()
    assert rel_err(eager, ref) < TOL, rel_err(eager, ref)
    prefix.prepare(table, rows, layout.seq_lens, static=True)
    assert torch.equal(graph_replay(call, eager), eager)
