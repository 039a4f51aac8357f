"""GPU tests of the tree-verify attention kernels: all sizes, long contexts, CUDA-graph replay.

Tolerance (max |kernel - fp32 reference| / max |reference|): bf16 2e-2, fp16 5e-3, fp8 KV cache
(reference on the dequantised cache, bf16 queries) 2e-2. Compiled kernels round the softmax
probabilities to the input dtype before P @ V, hence looser than the CPU interpreter tests.
Graph replays must equal an eager run of the same plan bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_kernels import load_kernels

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
FP8_TOL = 2e-2


@pytest.fixture(scope="module")
def K():
    return load_kernels(interpret=False)


def rel_err(out, ref):
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def make_case(K, seq_lens, n, page, seed, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    layout = K.reference.random_paged_layout(seq_lens, n, page, g)
    mask = K.reference.random_tree_mask(len(seq_lens), n, g)
    return g, layout.to(device), mask.to(device)


def poison_unused_(cache, layout):
    used = torch.zeros(cache.shape[0], dtype=torch.bool, device=cache.device)
    used[layout.req_to_token[layout.req_pool_indices].long().flatten()] = True
    used[layout.out_cache_loc] = True
    used[0] = False
    if cache.dtype in (torch.float8_e4m3fn, torch.uint8):
        cache.view(torch.uint8)[~used] = 0x7F
    else:
        cache[~used] = float("nan")
    return cache


MHA = [
    # (seq_lens, N, Hq, Hkv, D, page, dtype, splits)
    ([1], 2, 32, 8, 128, 1, torch.bfloat16, None),                       # budget 1, prefix 1
    ([2047, 1, 300], 9, 32, 8, 128, 16, torch.bfloat16, None),           # budget 8
    ([5000, 77], 129, 32, 8, 128, 64, torch.bfloat16, None),             # budget 128
    ([65536], 65, 32, 8, 128, 16, torch.bfloat16, None),                 # long context
    ([16001], 33, 28, 4, 128, 1, torch.float16, 5),                      # G = 7, forced splits
    ([123] * 8, 17, 40, 40, 64, 32, torch.float16, 1),                   # MHA, no split
    ([999, 3], 65, 16, 2, 96, 8, torch.bfloat16, None),                  # head dim 96
    ([300, 5], 9, 8, 4, 256, 16, torch.bfloat16, None),                  # head dim 256
]


@pytest.mark.parametrize("case", MHA, ids=[f"mha{i}" for i in range(len(MHA))])
def test_mha_gpu(K, case):
    seq_lens, n, hq, hkv, d, page, dtype, splits = case
    g, layout, mask = make_case(K, seq_lens, n, page, seed=n + d)
    k = poison_unused_(torch.randn(layout.num_slots, hkv, d, device="cuda", dtype=dtype), layout)
    v = poison_unused_(torch.randn(layout.num_slots, hkv, d, device="cuda", dtype=dtype), layout)
    q = torch.randn(len(seq_lens) * n, hq, d, device="cuda", dtype=dtype)
    attn = K.tree_attention.TreeAttention.plan(
        max_batch_size=len(seq_lens), num_tree_tokens=n, num_q_heads=hq, num_kv_heads=hkv,
        head_dim=d, max_context_len=max(seq_lens), device="cuda", num_kv_splits=splits)
    attn.part_o.fill_(float("nan"))
    out = torch.full((q.shape[0], hq, d), float("nan"), device="cuda", dtype=dtype)
    attn.run(q, k, v, layout.out_cache_loc, mask, out=out, **layout.table_kwargs())
    ref = K.reference.tree_attention_reference(q, k, v, layout.out_cache_loc, mask,
                                               **layout.table_kwargs())
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype]
    out2 = attn.run(q, k, v, layout.out_cache_loc, mask, **layout.indptr_kwargs())
    assert torch.equal(out, out2)


MLA_CASES = [
    # (seq_lens, N, H, kv dtype, splits)
    ([1, 4096], 9, 8, torch.bfloat16, None),
    ([32768], 65, 8, torch.bfloat16, None),
    ([777, 2], 129, 16, torch.bfloat16, 3),
    ([20000], 33, 8, torch.float8_e4m3fn, None),
    ([3000, 150], 33, 8, torch.bfloat16, None),  # budget 32, batch 2: 128-key splits
    ([100] * 4, 17, 128, torch.float8_e4m3fn, 1),
]


@pytest.mark.parametrize("case", MLA_CASES, ids=[f"mla{i}" for i in range(len(MLA_CASES))])
def test_mla_gpu(K, case):
    seq_lens, n, h, kv_dtype, splits = case
    g, layout, mask = make_case(K, seq_lens, n, 16, seed=n + h)
    scale = 0.5 if kv_dtype != torch.bfloat16 else 1.0
    cache = (torch.randn(layout.num_slots, 1, 576, device="cuda") / scale).to(kv_dtype)
    poison_unused_(cache, layout)
    q = torch.randn(len(seq_lens) * n, h, 576, device="cuda", dtype=torch.bfloat16)
    sm_scale = 192 ** -0.5
    attn = K.tree_attention_mla.TreeAttentionMLA.plan(
        max_batch_size=len(seq_lens), num_tree_tokens=n, num_heads=h,
        max_context_len=max(seq_lens), device="cuda", sm_scale=sm_scale, num_kv_splits=splits)
    out = torch.full((q.shape[0], h, 512), float("nan"), device="cuda", dtype=torch.bfloat16)
    attn.run(q, cache, layout.out_cache_loc, mask, kv_scale=scale, out=out,
             **layout.table_kwargs())
    ref = K.reference.mla_tree_attention_reference(
        q, cache, layout.out_cache_loc, mask, kv_lora_rank=512, sm_scale=sm_scale,
        kv_scale=scale, **layout.table_kwargs())
    assert not out.isnan().any()
    assert rel_err(out, ref) < (TOL[torch.bfloat16] if scale == 1.0 else FP8_TOL)
    # SGLang's split convention (mla_split): q_nope W_UK as a transposed bmm output, q_rope a
    # slice of the wider per-head row; the same loads and dots, so bitwise the same output
    t = q.shape[0]
    q_nope = q[..., :512].transpose(0, 1).contiguous().transpose(0, 1)
    wide = torch.empty(t, h, 192, device="cuda", dtype=torch.bfloat16)
    wide[..., 128:] = q[..., 512:]
    out_split = torch.full_like(out, float("nan"))
    attn.run(q_nope, cache, layout.out_cache_loc, mask, kv_scale=scale, out=out_split,
             q_pe=wide[..., 128:], **layout.table_kwargs())
    assert torch.equal(out, out_split)


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("budget,bs", [(4, 1), (16, 8), (128, 2)])
def test_graph_replay_matches_eager(K, kind, budget, bs):
    """Capture run() once, replay on fresh inputs copied into the captured buffers."""
    n, max_ctx, page = budget + 1, 3000, 16
    if kind == "mha":
        hq, hkv, dq, dv = 32, 8, 128, 128
        attn = K.tree_attention.TreeAttention.plan(
            max_batch_size=bs, num_tree_tokens=n, num_q_heads=hq, num_kv_heads=hkv,
            head_dim=dq, max_context_len=max_ctx, device="cuda")
    else:
        hq, hkv, dq, dv = 8, 1, 576, 512
        attn = K.tree_attention_mla.TreeAttentionMLA.plan(
            max_batch_size=bs, num_tree_tokens=n, num_heads=hq, max_context_len=max_ctx,
            device="cuda", sm_scale=0.1)
    g = torch.Generator().manual_seed(budget * 100 + bs)
    slots = bs * (max_ctx + n) + 8 * page
    kc = torch.randn(slots, hkv, dq, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(slots, hkv, dv, device="cuda", dtype=torch.bfloat16)
    # static inputs of the graph
    q = torch.zeros(bs * n, hq, dq, device="cuda", dtype=torch.bfloat16)
    r2t = torch.zeros(bs + 2, max_ctx + n, dtype=torch.int32, device="cuda")
    rows = torch.zeros(bs, dtype=torch.int64, device="cuda")
    lens = torch.ones(bs, dtype=torch.int64, device="cuda")
    loc = torch.zeros(bs * n, dtype=torch.int64, device="cuda")
    mask = torch.eye(n, dtype=torch.bool, device="cuda").repeat(bs, 1, 1)
    out = torch.zeros(bs * n, hq, dv, device="cuda", dtype=torch.bfloat16)

    def call(o):
        if kind == "mha":
            return attn.run(q, kc, vc, loc, mask, req_to_token=r2t, req_pool_indices=rows,
                            seq_lens=lens, out=o)
        return attn.run(q, kc, loc, mask, req_to_token=r2t, req_pool_indices=rows,
                        seq_lens=lens, out=o)

    call(out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(out)
    for trial in range(3):
        seq = torch.randint(1, max_ctx + 1, (bs,), generator=g).tolist()
        layout = K.reference.random_paged_layout(seq, n, page, g, max_ctx=max_ctx + n)
        assert layout.num_slots <= slots
        layout = layout.to("cuda")
        q.copy_(torch.randn(q.shape, generator=g).to(q))
        r2t.zero_()
        r2t[: layout.req_to_token.shape[0]].copy_(layout.req_to_token)
        rows.copy_(layout.req_pool_indices)
        lens.copy_(layout.seq_lens)
        loc.copy_(layout.out_cache_loc)
        mask.copy_(K.reference.random_tree_mask(bs, n, g))
        out.fill_(float("nan"))
        graph.replay()
        eager = call(None)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"trial {trial}: graph != eager"
        if kind == "mha":
            ref = K.reference.tree_attention_reference(q, kc, vc, loc, mask,
                                                       **layout.table_kwargs())
        else:
            ref = K.reference.mla_tree_attention_reference(
                q, kc, loc, mask, kv_lora_rank=512, sm_scale=0.1, **layout.table_kwargs())
        assert rel_err(out, ref) < TOL[torch.bfloat16]
