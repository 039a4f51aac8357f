"""CPU tests (Triton interpreter) of the tree-verify attention kernels against the fp32 reference.

Tolerance: max |kernel - reference| / max |reference| below 1e-2 for bf16 outputs and 2e-3 for
fp16 (under the interpreter the dots run in fp32, so the error is the output rounding: 2^-8 and
2^-11 relative). Outputs and split partials are poisoned with NaN and every KV slot that belongs to
no request is NaN, so an unwritten output element or a read outside a request's keys fails.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.triton_kernels import load_kernels

K = load_kernels(interpret=True)
TA, MLA, REF = K.tree_attention, K.tree_attention_mla, K.reference

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
# The interpreter's tile with splits of any length (default: at least 256 keys a split), so that
# these short prefixes are split as the tests ask
SHORT_SPLITS = TA.KernelConfig(block_m=16, block_n=16, num_warps=1, num_stages=1,
                               min_split_keys=1)


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    # the interpreter consults TRITON_INTERPRET at launch too (lazy imports inside triton)
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def poison_unused(cache: torch.Tensor, layout) -> torch.Tensor:
    """NaN into every slot no request owns (page 0, spare pages, page tails)."""
    used = torch.zeros(cache.shape[0], dtype=torch.bool)
    for b in range(layout.seq_lens.numel()):
        used[layout.req_to_token[layout.req_pool_indices[b]].long()] = True
    used[layout.out_cache_loc] = True
    used[0] = False  # req_to_token rows are zero-padded: slot 0 is nobody's
    cache = cache.clone()
    if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8):
        cache.view(torch.uint8)[~used] = 0x7F  # NaN in e4m3 and in e5m2
    else:
        cache[~used] = float("nan")
    return cache


def make_layout(seq_lens, n, page_size, seed):
    g = torch.Generator().manual_seed(seed)
    layout = REF.random_paged_layout(seq_lens, n, page_size, g)
    mask = REF.random_tree_mask(len(seq_lens), n, g)
    return g, layout, mask


MHA_CASES = [
    # (name, seq_lens, N, Hq, Hkv, D, page, splits, mode, dtype, cap)
    ("page1_prefix1", [1, 23], 5, 4, 2, 32, 1, 1, "table", torch.bfloat16, 0.0),
    ("page4_ragged_odd_group", [17, 1, 40], 3, 3, 1, 24, 4, 3, "indptr", torch.bfloat16, 0.0),
    ("budget1_mha", [9], 2, 1, 1, 16, 1, None, "table", torch.float16, 0.0),
    ("gqa8_multi_mblock", [33, 2], 9, 8, 1, 16, 16, 2, "table", torch.bfloat16, 0.0),
    ("wide_tree_splits", [3, 50], 20, 2, 2, 16, 2, 4, "indptr", torch.float16, 0.0),
    ("odd_heads_cap", [30], 6, 5, 5, 16, 8, 1, "table", torch.float16, 5.0),
    ("many_splits_short", [5, 7], 4, 4, 2, 16, 1, 8, "table", torch.bfloat16, 0.0),
]


@pytest.mark.parametrize("case", MHA_CASES, ids=[c[0] for c in MHA_CASES])
def test_mha_matches_reference(case):
    name, seq_lens, n, hq, hkv, d, page, splits, mode, dtype, cap = case
    g, layout, mask = make_layout(seq_lens, n, page, seed=sum(map(ord, name)))
    bs = len(seq_lens)
    k = poison_unused(torch.randn(layout.num_slots, hkv, d, generator=g), layout).to(dtype)
    v = poison_unused(torch.randn(layout.num_slots, hkv, d, generator=g), layout).to(dtype)
    q = (torch.randn(bs * n, hq, d, generator=g) * (4.0 if cap else 1.0)).to(dtype)
    kv = layout.table_kwargs() if mode == "table" else layout.indptr_kwargs()
    attn = TA.TreeAttention.plan(max_batch_size=bs + 1, num_tree_tokens=n, num_q_heads=hq,
                                 num_kv_heads=hkv, head_dim=d, max_context_len=64,
                                 device="cpu", logit_cap=cap, num_kv_splits=splits,
                                 config=SHORT_SPLITS)
    attn.part_o.fill_(float("nan"))
    attn.part_lse.fill_(float("nan"))
    out = torch.full((bs * n, hq, d), float("nan"), dtype=dtype)
    attn.run(q, k, v, layout.out_cache_loc, mask, out=out, **kv)
    ref = REF.tree_attention_reference(q, k, v, layout.out_cache_loc, mask, logit_cap=cap, **kv)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_mha_fp8_kv_with_scales(fp8):
    """fp8 KV caches with scales: e4m3 (V as SGLang's uint8 storage), and e5m2, the one
    --kv-cache-dtype the verify backend takes before sm_89 (a cache handed over as uint8 is read
    as e4m3: SGLang's pools hand theirs over in their fp8 dtype)."""
    g, layout, mask = make_layout([13, 26], 4, 4, seed=3)
    k32 = torch.randn(layout.num_slots, 2, 32, generator=g)
    v32 = torch.randn(layout.num_slots, 2, 32, generator=g)
    k_scale, v_scale = 0.25, 2.0
    k8 = poison_unused((k32 / k_scale).to(fp8), layout)
    v8 = poison_unused((v32 / v_scale).to(fp8), layout)
    if fp8 == torch.float8_e4m3fn:
        v8 = v8.view(torch.uint8)
    q = torch.randn(8, 4, 32, generator=g).bfloat16()
    kv = layout.table_kwargs()
    out = TA.tree_attention(q, k8, v8, layout.out_cache_loc, mask, num_kv_splits=2,
                            k_scale=k_scale, v_scale=v_scale, **kv)
    ref = REF.tree_attention_reference(q, k8, v8, layout.out_cache_loc, mask, k_scale=k_scale,
                                       v_scale=v_scale, **kv)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


TAIL_CASES = [
    # (name, seq_lens, N, Hq, Hkv, page, splits, mode, cap, ordered, blocks): rows = N x group
    ("one_block_plus_4", [13, 40], 5, 4, 1, 1, 1, "table", 0.0, True, 1),    # 20 = 16 + 4
    ("two_blocks_plus_2_split", [3, 50], 17, 2, 1, 4, 3, "indptr", 0.0, True, 2),  # 34 = 32 + 2
    ("plus_12_cap_split", [21], 7, 8, 2, 2, 2, "table", 5.0, True, 1),     # 28 = 16 + 12
    ("unordered_plus_3", [9, 2], 19, 1, 1, 1, 2, "table", 0.0, False, 1),  # 19 = 16 + 3
]


@pytest.mark.parametrize("case", TAIL_CASES, ids=[c[0] for c in TAIL_CASES])
def test_tail_rows_ride_with_the_last_block(case):
    """config.tail_m: a tree of k x block_m rows plus a few runs k programs, the last
    attending the leftover rows in a tail tile over the keys it already loaded (several blocks,
    splits, a logit cap, an unordered mask); every element written, as the reference."""
    name, seq_lens, n, hq, hkv, page, splits, mode, cap, ordered, blocks = case
    g, layout, mask = make_layout(seq_lens, n, page, seed=sum(map(ord, name)))
    if not ordered:
        mask = torch.rand(len(seq_lens), n, n, generator=g) < 0.5
        mask |= torch.eye(n, dtype=torch.bool)
    bs, d = len(seq_lens), 32
    k = poison_unused(torch.randn(layout.num_slots, hkv, d, generator=g), layout).bfloat16()
    v = poison_unused(torch.randn(layout.num_slots, hkv, d, generator=g), layout).bfloat16()
    q = (torch.randn(bs * n, hq, d, generator=g) * (4.0 if cap else 1.0)).bfloat16()
    kv = layout.table_kwargs() if mode == "table" else layout.indptr_kwargs()
    attn = TA.TreeAttention.plan(max_batch_size=bs, num_tree_tokens=n, num_q_heads=hq,
                                 num_kv_heads=hkv, head_dim=d, max_context_len=64,
                                 device="cpu", logit_cap=cap, num_kv_splits=splits,
                                 config=TA.KernelConfig(16, 16, 1, 1, min_split_keys=1,
                                                        tail_m=16),
                                 ordered_mask=ordered)
    assert (attn.num_blocks_m(bs), attn.tail_rows(bs)) == (blocks, 16)
    attn.part_o.fill_(float("nan"))
    attn.part_lse.fill_(float("nan"))
    out = torch.full((bs * n, hq, d), float("nan"), dtype=torch.bfloat16)
    attn.run(q, k, v, layout.out_cache_loc, mask, out=out, **kv)
    ref = REF.tree_attention_reference(q, k, v, layout.out_cache_loc, mask, logit_cap=cap, **kv)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[torch.bfloat16], rel_err(out, ref)


def test_tail_rows_only_where_the_leftover_fits():
    """tail_m applies to k x block_m + 1..tail_m rows with k >= 1; elsewhere the usual blocks.
    Refused with rope dims (MLA) or dk_chunk."""
    def blocks(n, g, tail=16, bm=32):
        attn = TA.TreeAttention.plan(max_batch_size=1, num_tree_tokens=n, num_q_heads=g,
                                     num_kv_heads=1, head_dim=32, max_context_len=64,
                                     device="cpu", config=TA.KernelConfig(bm, 16, 1, 1,
                                                                          tail_m=tail))
        return attn.num_blocks_m(1), attn.tail_rows(1)
    assert blocks(9, 4) == (1, 16)    # 36 = 32 + 4
    assert blocks(12, 4) == (1, 16)   # 48 = 32 + 16
    assert blocks(13, 4) == (2, 0)    # 52 = 32 + 20: a second block
    assert blocks(5, 4) == (1, 0)     # 20 < 32: one partial block
    assert blocks(16, 4) == (2, 0)    # 64: whole blocks
    assert blocks(17, 4, tail=0) == (3, 0)
    assert blocks(17, 4) == (2, 16)   # 68 = 64 + 4
    with pytest.raises(ValueError, match="tail_m"):
        blocks(9, 4, tail=8)
    with pytest.raises(ValueError, match="tail_m"):
        TA.TreeAttention.plan(max_batch_size=1, num_tree_tokens=9, num_q_heads=4,
                              num_kv_heads=1, head_dim=32, max_context_len=64, device="cpu",
                              config=TA.KernelConfig(32, 16, 1, 1, dk_chunk=16, tail_m=16))
    with pytest.raises(ValueError, match="tail_m"):
        MLA.TreeAttentionMLA.plan(max_batch_size=1, num_tree_tokens=9, num_heads=4,
                                  max_context_len=64, device="cpu", sm_scale=0.2,
                                  kv_lora_rank=32, rope_dim=16,
                                  config=TA.KernelConfig(32, 16, 1, 1, tail_m=16))


@pytest.mark.parametrize("splits", [1, 3])
def test_unordered_mask_reads_keys_after_the_row(splits):
    """``ordered_mask=False`` (the drafter's block): any mask, rows attending later tokens too,
    with N wider than the key tile (40 > 16) and GQA rows spanning several row blocks. The
    default (a tree's order) would skip those keys."""
    n, hq, hkv, d = 40, 4, 1, 16
    g, layout, _ = make_layout([7, 30], n, 4, seed=40 + splits)
    mask = torch.rand(2, n, n, generator=g) < 0.5
    mask |= torch.eye(n, dtype=torch.bool)  # every row sees at least itself
    k = poison_unused(torch.randn(layout.num_slots, hkv, d, generator=g), layout).bfloat16()
    v = poison_unused(torch.randn(layout.num_slots, hkv, d, generator=g), layout).bfloat16()
    q = torch.randn(2 * n, hq, d, generator=g).bfloat16()
    kv = layout.table_kwargs()
    ref = REF.tree_attention_reference(q, k, v, layout.out_cache_loc, mask, **kv)
    for ordered in (False, True):
        attn = TA.TreeAttention.plan(max_batch_size=2, num_tree_tokens=n, num_q_heads=hq,
                                     num_kv_heads=hkv, head_dim=d, max_context_len=64,
                                     device="cpu", num_kv_splits=splits, config=SHORT_SPLITS,
                                     ordered_mask=ordered)
        out = attn.run(q, k, v, layout.out_cache_loc, mask, **kv)
        err = rel_err(out, ref)
        if ordered:  # the tree bound drops keys this mask admits: the test can see it
            assert err > 0.1, err
        else:
            assert not out.isnan().any() and err < TOL[torch.bfloat16], err


def test_tree_verify_and_the_drafter_block_launch_their_own_binaries(monkeypatch):
    """Tree verify launches the twin that does not specialize N and the mask strides (one
    binary for every budget); the drafter's block keeps the specializing kernel its benchmarks
    timed. Both are the same source (what each compiles to: tests/test_tree_verify_static.py)."""
    assert TA._tree_attn_verify_kernel.fn is TA._tree_attn_fwd_kernel.fn
    used = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **k: used.append(self.name)

    monkeypatch.setattr(TA, "_tree_attn_verify_kernel", Recorder("verify"))
    monkeypatch.setattr(TA, "_tree_attn_fwd_kernel", Recorder("block"))
    g, layout, mask = make_layout([5], 4, 1, seed=3)
    k = torch.randn(layout.num_slots, 1, 16, generator=g).bfloat16()
    q = torch.randn(4, 2, 16, generator=g).bfloat16()
    for ordered in (True, False):
        attn = TA.TreeAttention.plan(max_batch_size=1, num_tree_tokens=4, num_q_heads=2,
                                     num_kv_heads=1, head_dim=16, max_context_len=16,
                                     device="cpu", num_kv_splits=1, ordered_mask=ordered)
        attn.run(q, k, k, layout.out_cache_loc, mask, **layout.table_kwargs())
    assert used == ["verify", "block"]


def test_plan_is_data_independent():
    """One plan serves different prefix lengths and trees (what a replayed graph needs)."""
    attn = TA.TreeAttention.plan(max_batch_size=2, num_tree_tokens=3, num_q_heads=2,
                                 num_kv_heads=1, head_dim=16, max_context_len=128,
                                 device="cpu", num_kv_splits=3)
    for seed, seq_lens in ((0, [40, 2]), (1, [1, 70])):
        g, layout, mask = make_layout(seq_lens, 3, 2, seed)
        k = torch.randn(layout.num_slots, 1, 16, generator=g).half()
        v = torch.randn(layout.num_slots, 1, 16, generator=g).half()
        q = torch.randn(6, 2, 16, generator=g).half()
        out = attn.run(q, k, v, layout.out_cache_loc, mask, **layout.table_kwargs())
        ref = REF.tree_attention_reference(q, k, v, layout.out_cache_loc, mask,
                                           **layout.table_kwargs())
        assert rel_err(out, ref) < TOL[torch.float16]


def test_auto_splits_mha_shrink_with_batch():
    """MHA splits shrink as the batch grows (the interpreter's "GPU": 4 SMs, 8 slots)."""
    attn = TA.TreeAttention.plan(max_batch_size=32, num_tree_tokens=9, num_q_heads=4,
                                 num_kv_heads=1, head_dim=16, max_context_len=4096,
                                 device="cpu")
    splits = [attn.num_splits(bs) for bs in (1, 2, 8, 32)]
    assert splits == sorted(splits, reverse=True) and splits[0] > 1 and splits[-1] == 1
    assert attn.max_splits == splits[0]


def test_auto_splits_mla_whole_waves_capped_by_context_and_partial_bytes():
    """MLA latent rows (512 + 64) take split_count's whole waves, within the planned context
    (one split per 256 keys) and _PARTIAL_BYTES of fp32 partial outputs per launch."""
    attn = MLA.TreeAttentionMLA.plan(max_batch_size=64, num_tree_tokens=65, num_heads=8,
                                     max_context_len=1 << 17, device="cpu", sm_scale=0.1)
    sms = TA._num_sms(torch.device("cpu"))
    for bs in (1, 2, 8):
        programs = bs * attn.num_blocks_m(bs)
        cap_bytes = min(64, TA._PARTIAL_BYTES // (bs * 65 * 8 * 512 * 4))  # 15 at batch 8
        assert attn.num_splits(bs) == TA.split_count(programs, 2 * sms, (1 << 17) // 256,
                                                     max_splits=cap_bytes)
    assert attn.num_splits(8) == 15
    per_split = 64 * 65 * 8 * 512 * 4  # batch 64: 68 MB of partials a split
    assert attn.num_splits(64) <= TA._PARTIAL_BYTES // per_split == 1
    short = MLA.TreeAttentionMLA.plan(max_batch_size=1, num_tree_tokens=9, num_heads=8,
                                      max_context_len=1024, device="cpu", sm_scale=0.1)
    assert short.num_splits(1) <= 1024 // 256


@pytest.mark.parametrize("chunk,splits", [(1, 1), (1, 5), (1, 13), (8, 1), (8, 5), (8, 13),
                                          (64, 33), (64, 64), (64, 70)])
def test_split_reduce_matches_torch(chunk, splits):
    """The split reduce (one split per step, or CHUNK_S at a time as MLA launches it, or all
    of them in one step as wide MHA splits launch it) against
    the log-sum-exp merge in torch, with empty splits (-inf, partial never written: NaN) and a
    row that saw no key at all (zeros)."""
    g = torch.Generator().manual_seed(splits * 10 + chunk)
    t, hq, dv = 3, 2, 24
    lse = torch.randn(t, hq, splits, generator=g) * 4
    lse[0, 0, ::2] = float("-inf")
    lse[1, 1, :] = float("-inf")  # a row with no key
    part = torch.randn(t, hq, splits, dv, generator=g)
    part[torch.isinf(lse)] = float("nan")  # never written
    out = torch.empty(t, hq, dv, dtype=torch.float16)
    TA._tree_attn_reduce_kernel[(t, hq)](
        part, lse, out, 0.5, out.stride(0), out.stride(1), hq, splits,
        BLOCK_S=max(2, 1 << (splits - 1).bit_length()), DV=dv, BLOCK_DV=32, INTERPRET=True,
        CHUNK_S=chunk, num_warps=1)
    w = torch.softmax(lse * math.log(2.0), -1).nan_to_num(0.0)
    ref = 0.5 * (w[..., None] * part.nan_to_num(0.0)).sum(-2)
    assert not out.isnan().any()
    assert torch.allclose(out.float(), ref, atol=2e-3, rtol=2e-3)
    assert TA._reduce_chunk(512) == 8 and TA._reduce_chunk(128) == 1
    # 128-dim rows: one split a step up to 32 splits, then all of them in one step (<= 64)
    assert [TA._reduce_chunk(128, s) for s in (1, 16, 32, 33, 64, 100)] == [1, 1, 1, 64, 64, 64]
    assert TA._reduce_chunk(512, 64) == 8
    # at most 8,192 fp32 values a step: 256-dim rows sum 32 splits a step
    assert TA._reduce_chunk(256, 64) == 32 and TA._reduce_chunk(64, 40) == 64


def test_validation_names_tensor():
    attn = TA.TreeAttention.plan(max_batch_size=2, num_tree_tokens=3, num_q_heads=2,
                                 num_kv_heads=1, head_dim=16, max_context_len=16, device="cpu")
    g, layout, mask = make_layout([4, 5], 3, 1, 0)
    k = torch.randn(layout.num_slots, 1, 16).half()
    with pytest.raises(ValueError, match=r"q shape: expected \[bs\*3, 2, 16\]"):
        attn.run(torch.zeros(6, 2, 8).half(), k, k, layout.out_cache_loc, mask,
                 **layout.table_kwargs())
    with pytest.raises(ValueError, match="tree_mask shape"):
        attn.run(torch.zeros(6, 2, 16).half(), k, k, layout.out_cache_loc, mask[:, :2],
                 **layout.table_kwargs())
    with pytest.raises(ValueError, match="kv index mode"):
        attn.run(torch.zeros(6, 2, 16).half(), k, k, layout.out_cache_loc, mask)


def test_reference_chain_equals_causal_sdpa():
    """A chain tree over a contiguous cache is plain causal attention over prefix + chain."""
    g, layout, _ = make_layout([7], 5, 1, 1)
    mask = torch.tril(torch.ones(1, 5, 5, dtype=torch.bool))
    k = torch.randn(layout.num_slots, 2, 16, generator=g)
    v = torch.randn(layout.num_slots, 2, 16, generator=g)
    q = torch.randn(5, 4, 16, generator=g)
    ref = REF.tree_attention_reference(q, k, v, layout.out_cache_loc, mask,
                                       **layout.table_kwargs())
    slots = layout.req_to_token[layout.req_pool_indices[0], :12].long()
    kk = k[slots].repeat_interleave(2, 1).transpose(0, 1)    # [Hq, 12, D]
    vv = v[slots].repeat_interleave(2, 1).transpose(0, 1)
    allowed = torch.ones(5, 12, dtype=torch.bool).tril(diagonal=7)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), kk, vv, attn_mask=allowed).transpose(0, 1)
    torch.testing.assert_close(ref, sdpa, atol=1e-5, rtol=1e-5)


MLA_CASES = [
    # (name, seq_lens, N, H, rank, rope, page, splits, kv dtype, scale)
    ("bf16_page1_nosplit", [5, 40], 4, 3, 64, 16, 1, 1, torch.bfloat16, 1.0),
    ("bf16_page1_split", [5, 40], 4, 3, 64, 16, 1, 4, torch.bfloat16, 1.0),
    ("fp8_page8_budget8", [1, 19], 9, 2, 64, 16, 8, None, torch.float8_e4m3fn, 0.5),
    ("fp8_uint8_storage", [12], 3, 5, 32, 16, 4, 2, torch.uint8, 2.0),
    ("fp8_e5m2", [7, 21], 5, 2, 64, 16, 4, 3, torch.float8_e5m2, 0.5),
    ("kimi_dims", [20], 2, 2, 512, 64, 16, 2, torch.bfloat16, 1.0),
]


@pytest.mark.parametrize("case", MLA_CASES, ids=[c[0] for c in MLA_CASES])
def test_mla_matches_reference(case):
    name, seq_lens, n, h, rank, rope, page, splits, kv_dtype, scale = case
    g, layout, mask = make_layout(seq_lens, n, page, seed=sum(map(ord, name)))
    bs = len(seq_lens)
    latent = torch.randn(layout.num_slots, 1, rank + rope, generator=g)
    if kv_dtype == torch.bfloat16:
        cache = poison_unused(latent, layout).bfloat16()
    else:
        fp8 = torch.float8_e5m2 if kv_dtype == torch.float8_e5m2 else torch.float8_e4m3fn
        cache = poison_unused((latent / scale).to(fp8), layout)
        if kv_dtype == torch.uint8:
            cache = cache.view(torch.uint8)
    q = torch.randn(bs * n, h, rank + rope, generator=g).bfloat16()
    sm_scale = 1.0 / math.sqrt(192)
    attn = MLA.TreeAttentionMLA.plan(max_batch_size=bs, num_tree_tokens=n, num_heads=h,
                                     max_context_len=64, device="cpu", sm_scale=sm_scale,
                                     kv_lora_rank=rank, rope_dim=rope, num_kv_splits=splits,
                                     config=SHORT_SPLITS)
    attn.part_o.fill_(float("nan"))
    out = torch.full((bs * n, h, rank), float("nan"), dtype=torch.bfloat16)
    attn.run(q, cache, layout.out_cache_loc, mask, kv_scale=scale, out=out,
             **layout.table_kwargs())
    ref = REF.mla_tree_attention_reference(q, cache, layout.out_cache_loc, mask,
                                           kv_lora_rank=rank, sm_scale=sm_scale,
                                           kv_scale=scale, **layout.table_kwargs())
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[torch.bfloat16], rel_err(out, ref)


@pytest.mark.parametrize("dk_chunk,splits", [(0, 1), (0, 3), (32, 2)])
def test_mla_split_query_reads_both_parts_where_they_lie(dk_chunk, splits):
    """SGLang's split MLA convention: ``q_nope W_UK`` as a transposed bmm output (token stride
    rank, head stride tokens x rank) and the rope part as a slice of a wider per-head row, as
    the model hands them over. The kernel reads both without a concatenated copy and gives
    bitwise the result of the concatenated query (the same loads and dots)."""
    g, layout, mask = make_layout([9, 30], 4, 4, seed=21)
    bs, n, h, rank, rope = 2, 4, 3, 64, 16
    t = bs * n
    cache = poison_unused(torch.randn(layout.num_slots, 1, rank + rope, generator=g),
                          layout).bfloat16()
    q_nope = torch.randn(h, t, rank, generator=g).bfloat16().transpose(0, 1)  # [T, H, rank]
    wide = torch.randn(t, h, 48 + rope, generator=g).bfloat16()  # [nope 48 | rope] rows
    q_pe = wide[..., 48:]
    assert not q_nope.is_contiguous() and not q_pe.is_contiguous()
    q_cat = torch.cat([q_nope, q_pe], dim=-1)
    attn = MLA.TreeAttentionMLA.plan(max_batch_size=bs, num_tree_tokens=n, num_heads=h,
                                     max_context_len=64, device="cpu", sm_scale=0.1,
                                     kv_lora_rank=rank, rope_dim=rope, num_kv_splits=splits,
                                     config=TA.KernelConfig(16, 16, 1, 1, dk_chunk=dk_chunk,
                                                            min_split_keys=1))
    outs = []
    for q, pe in ((q_cat, None), (q_nope, q_pe)):
        attn.part_o.fill_(float("nan"))
        out = torch.full((t, h, rank), float("nan"), dtype=torch.bfloat16)
        attn.run(q, cache, layout.out_cache_loc, mask, out=out, q_pe=pe,
                 **layout.table_kwargs())
        outs.append(out)
    ref = REF.mla_tree_attention_reference(q_cat, cache, layout.out_cache_loc, mask,
                                           kv_lora_rank=rank, sm_scale=0.1,
                                           **layout.table_kwargs())
    assert not outs[1].isnan().any()
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[1], ref) < TOL[torch.bfloat16], rel_err(outs[1], ref)


def test_mla_split_query_shapes_are_checked():
    g, layout, mask = make_layout([5], 3, 1, seed=22)
    cache = torch.randn(layout.num_slots, 1, 80, generator=g).bfloat16()
    attn = MLA.TreeAttentionMLA.plan(max_batch_size=1, num_tree_tokens=3, num_heads=2,
                                     max_context_len=8, device="cpu", sm_scale=0.1,
                                     kv_lora_rank=64, rope_dim=16)
    q = torch.randn(3, 2, 64).bfloat16()
    with pytest.raises(ValueError, match="q_pe shape"):
        attn.run(q, cache, layout.out_cache_loc, mask, q_pe=torch.randn(3, 2, 8).bfloat16(),
                 **layout.table_kwargs())
    with pytest.raises(ValueError, match="q shape"):  # the whole row with q_pe given
        attn.run(torch.randn(3, 2, 80).bfloat16(), cache, layout.out_cache_loc, mask,
                 q_pe=torch.randn(3, 2, 16).bfloat16(), **layout.table_kwargs())
    with pytest.raises(ValueError, match="q_pe dtype"):
        attn.run(q, cache, layout.out_cache_loc, mask, q_pe=torch.randn(3, 2, 16).half(),
                 **layout.table_kwargs())


def test_mla_one_shot_indptr():
    g, layout, mask = make_layout([3, 11], 3, 2, seed=9)
    cache = poison_unused(torch.randn(layout.num_slots, 1, 48, generator=g), layout).bfloat16()
    q = torch.randn(6, 4, 48, generator=g).bfloat16()
    out = MLA.tree_attention_mla(q, cache, layout.out_cache_loc, mask, sm_scale=0.2,
                                 kv_lora_rank=32, num_kv_splits=2, **layout.indptr_kwargs())
    ref = REF.mla_tree_attention_reference(q, cache, layout.out_cache_loc, mask, kv_lora_rank=32,
                                           sm_scale=0.2, **layout.indptr_kwargs())
    assert out.shape == (6, 4, 32)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("splits", [1, 3])
def test_padded_request_gives_zeros_not_nan(splits):
    """CUDA-graph padding: a request with no prefix and an all-false mask row must not NaN."""
    g, layout, mask = make_layout([6, 0], 3, 1, seed=5)
    mask[1] = False
    k = torch.randn(layout.num_slots, 1, 16, generator=g).half()
    q = torch.randn(6, 2, 16, generator=g).half()
    out = TA.tree_attention(q, k, k, layout.out_cache_loc, mask, num_kv_splits=splits,
                            **layout.table_kwargs())
    assert not out.isnan().any()
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    ref = REF.tree_attention_reference(q, k, k, layout.out_cache_loc, mask,
                                       **layout.table_kwargs())
    assert rel_err(out[:3], ref[:3]) < TOL[torch.float16]


@pytest.mark.parametrize("dv_split,splits,dk_chunk", [(2, 1, 0), (2, 3, 0), (4, 2, 0),
                                                     (1, 1, 16), (2, 3, 32)])
def test_mha_output_columns_split_across_programs(dv_split, splits, dk_chunk):
    """config.dv_split: each program writes v_head_dim / dv_split output columns (and the split
    partials' slices); config.dk_chunk: the scores summed over head-dim slices. Every element
    written, same result as the reference."""
    g, layout, mask = make_layout([9, 30], 5, 4, seed=11)
    bs, n, hq, hkv, d = 2, 5, 4, 2, 64
    k = poison_unused(torch.randn(layout.num_slots, hkv, d, generator=g), layout).bfloat16()
    v = poison_unused(torch.randn(layout.num_slots, hkv, d, generator=g), layout).bfloat16()
    q = torch.randn(bs * n, hq, d, generator=g).bfloat16()
    attn = TA.TreeAttention.plan(max_batch_size=bs, num_tree_tokens=n, num_q_heads=hq,
                                 num_kv_heads=hkv, head_dim=d, max_context_len=64, device="cpu",
                                 num_kv_splits=splits,
                                 config=TA.KernelConfig(16, 16, 1, 1, dv_split=dv_split,
                                                        dk_chunk=dk_chunk))
    attn.part_o.fill_(float("nan"))
    attn.part_lse.fill_(float("nan"))
    out = torch.full((bs * n, hq, d), float("nan"), dtype=torch.bfloat16)
    attn.run(q, k, v, layout.out_cache_loc, mask, out=out, **layout.table_kwargs())
    ref = REF.tree_attention_reference(q, k, v, layout.out_cache_loc, mask,
                                       **layout.table_kwargs())
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[torch.bfloat16], rel_err(out, ref)


@pytest.mark.parametrize("dv_split,splits,kv_dtype,dk_chunk", [
    (2, 1, torch.bfloat16, 0), (4, 3, torch.bfloat16, 0), (2, 2, torch.uint8, 0),
    (1, 1, torch.bfloat16, 16), (1, 3, torch.uint8, 32), (2, 2, torch.bfloat16, 32)])
def test_mla_output_columns_split_across_programs(dv_split, splits, kv_dtype, dk_chunk):
    """Absorbed MLA with dv_split / dk_chunk: a program re-reads its slice of the latent row
    as V (and the query and key slices for the scores)."""
    g, layout, mask = make_layout([7, 33], 4, 8, seed=12)
    bs, n, h, rank, rope, scale = 2, 4, 3, 64, 16, 0.5
    latent = torch.randn(layout.num_slots, 1, rank + rope, generator=g)
    if kv_dtype == torch.bfloat16:
        cache, scale = poison_unused(latent, layout).bfloat16(), 1.0
    else:
        cache = poison_unused((latent / scale).to(torch.float8_e4m3fn), layout).view(torch.uint8)
    q = torch.randn(bs * n, h, rank + rope, generator=g).bfloat16()
    attn = MLA.TreeAttentionMLA.plan(max_batch_size=bs, num_tree_tokens=n, num_heads=h,
                                     max_context_len=64, device="cpu", sm_scale=0.1,
                                     kv_lora_rank=rank, rope_dim=rope, num_kv_splits=splits,
                                     config=TA.KernelConfig(16, 16, 1, 1, dv_split=dv_split,
                                                            dk_chunk=dk_chunk))
    attn.part_o.fill_(float("nan"))
    out = torch.full((bs * n, h, rank), float("nan"), dtype=torch.bfloat16)
    attn.run(q, cache, layout.out_cache_loc, mask, kv_scale=scale, out=out,
             **layout.table_kwargs())
    ref = REF.mla_tree_attention_reference(q, cache, layout.out_cache_loc, mask,
                                           kv_lora_rank=rank, sm_scale=0.1, kv_scale=scale,
                                           **layout.table_kwargs())
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[torch.bfloat16], rel_err(out, ref)


def test_dv_split_and_dk_chunk_must_divide_the_head():
    plan = lambda cfg: TA.TreeAttention.plan(  # noqa: E731
        max_batch_size=1, num_tree_tokens=2, num_q_heads=1, num_kv_heads=1, head_dim=32,
        max_context_len=8, device="cpu", config=cfg)
    with pytest.raises(ValueError, match="dv_split"):
        plan(TA.KernelConfig(16, 16, 1, 1, dv_split=3))
    with pytest.raises(ValueError, match="dk_chunk"):
        plan(TA.KernelConfig(16, 16, 1, 1, dk_chunk=64))


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_split_count_sized_for_long_contexts_on_short_prefixes(kind):
    """Served plans size the split count from the server's longest context (static for CUDA
    graphs), so a short prefix leaves most splits empty: chunks stay >= 256 keys, an empty
    split writes nothing but its -inf log-sum-exp and the reduce kernel never reads its
    (NaN-poisoned) partial. Prefixes below, at and above one chunk, and one past two."""
    seq_lens, n = [300, 20, 256, 530], 3
    g, layout, mask = make_layout(seq_lens, n, 1, seed=11)
    bs = len(seq_lens)
    if kind == "mha":
        k = poison_unused(torch.randn(layout.num_slots, 1, 16, generator=g), layout).bfloat16()
        v = poison_unused(torch.randn(layout.num_slots, 1, 16, generator=g), layout).bfloat16()
        q = torch.randn(bs * n, 2, 16, generator=g).bfloat16()
        attn = TA.TreeAttention.plan(max_batch_size=bs, num_tree_tokens=n, num_q_heads=2,
                                     num_kv_heads=1, head_dim=16, max_context_len=1 << 17,
                                     device="cpu", num_kv_splits=6)
    else:
        k = poison_unused(torch.randn(layout.num_slots, 1, 48, generator=g), layout).bfloat16()
        q = torch.randn(bs * n, 2, 48, generator=g).bfloat16()
        attn = MLA.TreeAttentionMLA.plan(max_batch_size=bs, num_tree_tokens=n, num_heads=2,
                                         max_context_len=1 << 17, device="cpu",
                                         sm_scale=0.2, kv_lora_rank=32, rope_dim=16,
                                         num_kv_splits=6)
    assert attn.config_for(bs).min_split_keys == 256  # 6 splits: more than these prefixes have chunks
    attn.part_o.fill_(float("nan"))
    attn.part_lse.fill_(float("nan"))
    out = torch.full((bs * n, 2, 16 if kind == "mha" else 32), float("nan"),
                     dtype=torch.bfloat16)
    if kind == "mha":
        attn.run(q, k, v, layout.out_cache_loc, mask, out=out, **layout.table_kwargs())
        ref = REF.tree_attention_reference(q, k, v, layout.out_cache_loc, mask,
                                           **layout.table_kwargs())
    else:
        attn.run(q, k, layout.out_cache_loc, mask, out=out, **layout.table_kwargs())
        ref = REF.mla_tree_attention_reference(q, k, layout.out_cache_loc, mask,
                                               kv_lora_rank=32, sm_scale=0.2,
                                               **layout.table_kwargs())
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[torch.bfloat16], rel_err(out, ref)
    # the partials of empty splits were never written: still the poison
    splits = attn.num_splits(bs)
    lse = attn.part_lse[: bs * n * 2 * splits].view(bs * n, 2, splits)
    assert bool(torch.isneginf(lse[n:2 * n, :, 1:-1]).all())  # prefix 20: split 0 and the last
    part = attn.part_o[: bs * n * 2 * splits * out.shape[-1]].view(bs * n, 2, splits, -1)
    assert bool(part[n:2 * n, :, 1:-1].isnan().all())


def test_per_batch_size_configs_size_buffers_and_match_reference(monkeypatch):
    """Batch sizes with their own config (here: batch 1 gets 8-row tiles and 4-key splits) plan
    their own split counts, the shared partial buffers hold every batch size's, and each batch
    size's output matches the reference."""
    small = TA.KernelConfig(block_m=8, block_n=16, num_warps=1, num_stages=1, min_split_keys=4)
    monkeypatch.setattr(TA, "_batch_config",
                        lambda dk, dpe, dv, rows, groups, device: small if groups == 1 else None)
    n = 3
    attn = MLA.TreeAttentionMLA.plan(max_batch_size=3, num_tree_tokens=n, num_heads=2,
                                     max_context_len=64, device="cpu", sm_scale=0.2,
                                     kv_lora_rank=32, rope_dim=16)
    assert attn.config_for(1) == small and attn.config_for(2) == attn.config_for(3) == attn.config
    assert attn.num_blocks_m(1) == 1 and attn.num_splits(1) > attn.num_splits(3)
    rows_needed = max(bs * attn.num_splits(bs) for bs in (1, 2, 3)) * n * 2
    assert attn.part_lse.numel() >= rows_needed
    for seq_lens in ([29], [5, 40, 12]):
        bs = len(seq_lens)
        g, layout, mask = make_layout(seq_lens, n, 1, seed=7 + bs)
        k = poison_unused(torch.randn(layout.num_slots, 1, 48, generator=g), layout).bfloat16()
        q = torch.randn(bs * n, 2, 48, generator=g).bfloat16()
        attn.part_o.fill_(float("nan"))
        out = torch.full((bs * n, 2, 32), float("nan"), dtype=torch.bfloat16)
        attn.run(q, k, layout.out_cache_loc, mask, out=out, **layout.table_kwargs())
        ref = REF.mla_tree_attention_reference(q, k, layout.out_cache_loc, mask,
                                               kv_lora_rank=32, sm_scale=0.2,
                                               **layout.table_kwargs())
        assert not out.isnan().any()
        assert rel_err(out, ref) < TOL[torch.bfloat16], (bs, rel_err(out, ref))


# --- the prefix part given by another kernel (FlashMLA's for MLA), merged in the epilogue ------

# a merging launch's own tile, other than SHORT_SPLITS' rows (as on Hopper, where the merge
# tile of MLA differs from the full launch's): rows of one block span several tree tokens
MERGE_TILE = TA.KernelConfig(block_m=32, block_n=16, num_warps=1, num_stages=1)


@pytest.mark.parametrize("kind,seq_lens,n,page,plan_splits,merge", [
    ("mla", [1, 37, 130], 5, 64, 4, None),  # page 64 as FlashMLA reads it; planned splits
    ("mla", [64], 17, 64, None, None),     # budget 16, Kimi-like: the prefix ends on a page edge
    ("mla", [1, 37, 130], 5, 64, 4, MERGE_TILE),
    ("mha", [9, 2], 4, 1, 3, None),
    ("mha", [9, 2], 4, 1, 3, MERGE_TILE),
])
def test_given_prefix_merges_to_the_full_attention(kind, seq_lens, n, page, plan_splits, merge):
    """The tree kernel with the prefix part handed in (output + natural-log LSE, as FlashMLA
    returns them) equals the whole tree attention; prefix keys are poisoned in the cache the
    kernel reads, so reading any of them fails. ``merge``: a tile of the merging launch's own
    (``merge_config``), which that launch alone takes."""
    g, layout, mask = make_layout(seq_lens, n, page, seed=len(seq_lens) * 31 + n)
    bs = len(seq_lens)
    kw = layout.table_kwargs()
    if kind == "mla":
        rank, rope, h = 32, 16, 8
        cache = poison_unused(torch.randn(layout.num_slots, 1, rank + rope, generator=g),
                              layout).bfloat16()
        q = torch.randn(bs * n, h, rank + rope, generator=g).bfloat16()
        sm = 0.15
        attn = MLA.TreeAttentionMLA.plan(max_batch_size=bs, num_tree_tokens=n, num_heads=h,
                                         max_context_len=256, device="cpu", sm_scale=sm,
                                         kv_lora_rank=rank, rope_dim=rope,
                                         num_kv_splits=plan_splits, config=SHORT_SPLITS,
                                         merge_config=merge)
        ref = REF.mla_tree_attention_reference(q, cache, layout.out_cache_loc, mask,
                                               kv_lora_rank=rank, sm_scale=sm, **kw)
        p_out, p_lse = REF.prefix_attention_reference(q, cache, cache[..., :rank], n,
                                                      sm_scale=sm, **kw)
        dv = rank
    else:
        h, hkv, d = 4, 2, 16
        k = poison_unused(torch.randn(layout.num_slots, hkv, d, generator=g), layout).half()
        v = poison_unused(torch.randn(layout.num_slots, hkv, d, generator=g), layout).half()
        q = torch.randn(bs * n, h, d, generator=g).half()
        attn = TA.TreeAttention.plan(max_batch_size=bs, num_tree_tokens=n, num_q_heads=h,
                                     num_kv_heads=hkv, head_dim=d, max_context_len=64,
                                     device="cpu", num_kv_splits=plan_splits,
                                     config=SHORT_SPLITS, merge_config=merge)
        ref = REF.tree_attention_reference(q, k, v, layout.out_cache_loc, mask, **kw)
        p_out, p_lse = REF.prefix_attention_reference(q, k, v, n, **kw)
        dv = d
    rows = n * (h if kind == "mla" else h // hkv)
    assert attn.merge_config_for(bs) == (merge or attn.config_for(bs))
    assert attn.num_blocks_m(bs, merge=True) == -(-rows // attn.merge_config_for(bs).block_m)
    assert attn.num_blocks_m(bs) == -(-rows // SHORT_SPLITS.block_m)
    # the kernel must not touch a prefix key: NaN every prefix slot of the cache it reads
    prefix_slots = torch.cat([layout.req_to_token[layout.req_pool_indices[b], :seq_lens[b]]
                              for b in range(bs)]).long()
    out = torch.full((bs * n, h, dv), float("nan"), dtype=q.dtype)
    if kind == "mla":
        blind = cache.clone()
        blind[prefix_slots] = float("nan")
        attn.run(q, blind, layout.out_cache_loc, mask, out=out, prefix_out=p_out.bfloat16(),
                 prefix_lse=p_lse, **kw)
    else:
        kb, vb = k.clone(), v.clone()
        kb[prefix_slots] = float("nan")
        vb[prefix_slots] = float("nan")
        # a strided lse view (FlashMLA's [bs, H, N] layout need not be contiguous here)
        lse_t = p_lse.transpose(1, 2).contiguous().transpose(1, 2)
        attn.run(q, kb, vb, layout.out_cache_loc, mask, out=out, prefix_out=p_out.half(),
                 prefix_lse=lse_t, **kw)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[q.dtype], rel_err(out, ref)


def test_given_prefix_empty_prefix_rows_and_validation():
    """An empty prefix (lse -inf, output NaN as a kernel may leave it) contributes nothing; a
    lone prefix_out, a wrong lse shape and a logit cap are refused."""
    g, layout, mask = make_layout([0, 5], 3, 1, seed=3)
    kw = layout.table_kwargs()
    cache = torch.randn(layout.num_slots, 1, 48, generator=g).bfloat16()
    q = torch.randn(6, 2, 48, generator=g).bfloat16()
    attn = MLA.TreeAttentionMLA.plan(max_batch_size=2, num_tree_tokens=3, num_heads=2,
                                     max_context_len=16, device="cpu", sm_scale=0.2,
                                     kv_lora_rank=32, rope_dim=16)
    p_out, p_lse = REF.prefix_attention_reference(q, cache, cache[..., :32], 3, sm_scale=0.2,
                                                  **kw)
    p_out[:3] = float("nan")  # request 0 has no prefix: whatever its output holds is unread
    out = attn.run(q, cache, layout.out_cache_loc, mask, prefix_out=p_out, prefix_lse=p_lse,
                   **kw)
    ref = REF.mla_tree_attention_reference(q, cache, layout.out_cache_loc, mask,
                                           kv_lora_rank=32, sm_scale=0.2, **kw)
    assert not out.isnan().any() and rel_err(out, ref) < TOL[torch.bfloat16]
    with pytest.raises(ValueError, match="prefix_out / prefix_lse"):
        attn.run(q, cache, layout.out_cache_loc, mask, prefix_out=p_out, **kw)
    with pytest.raises(ValueError, match="prefix_lse"):
        attn.run(q, cache, layout.out_cache_loc, mask, prefix_out=p_out,
                 prefix_lse=p_lse.transpose(1, 2), **kw)
    capped = MLA.TreeAttentionMLA.plan(max_batch_size=2, num_tree_tokens=3, num_heads=2,
                                       max_context_len=16, device="cpu", sm_scale=0.2,
                                       kv_lora_rank=32, rope_dim=16, logit_cap=30.0)
    with pytest.raises(ValueError, match="logit cap"):
        capped.run(q, cache, layout.out_cache_loc, mask, prefix_out=p_out, prefix_lse=p_lse,
                   **kw)
