"""GPU tests of the fused CUDA tree builder (``cuda_ext/tree_build.cu`` via
``tree_backend.build_tree_cuda``): bit-exact parity with the CPU oracle ``build_tree_reference``
and the torch-op ``build_tree`` on random inputs, exact ties, -inf, budgets 1..1024 and batch
1..256; the FULL_MASK layout and positions; CUDA-graph capture + replay on fresh inputs; no
allocation and no host sync per call. Every output buffer is poisoned first.

Run: python -m pytest -q tests/gpu/test_cuda_ext_tree_gpu.py  (the first test JIT-builds the
extension, ~1 min, cached afterwards).
"""
from __future__ import annotations

import pytest
import torch

from sglang_ddtree import tree_backend
from sglang_ddtree.tree import DraftTree, build_tree, build_tree_reference, full_mask_layout
from tests._tree_inputs import random_inputs
from tests.test_tree import assert_same_tree

pytestmark = pytest.mark.gpu

NEG_INF = float("-inf")
MODES = ["random", "ties", "ninf", "short_vocab", "peaked", "round", "dead_depth", "flat", "far", "fan"]


@pytest.fixture(scope="module", autouse=True)
def ext():
    """Build (or load) the extension once; a build failure fails here with the compiler output."""
    return tree_backend._loader().load_tree_build_ext(required=True)


@pytest.fixture(autouse=True, params=["levelwise", "frontier", "merge", "deferred",
                                      "deferred_warp"])
def kernel_algo(request, monkeypatch):
    """Every test runs on each kernel (``SGLANG_DDTREE_TREE_KERNEL``); budgets above 287 go to
    the level-wise kernel either way, above 128 the merge variant and above 256 the deferred
    variant are the level-wise kernel."""
    monkeypatch.setenv(tree_backend.ENV_KERNEL, request.param)
    return request.param


def _sorted_with_perm_ids(lp, g):
    """(roots, lp sorted descending along K, distinct ids per row) for hand-made log-probs."""
    bs, depth, k = lp.shape
    ids = torch.stack([torch.randperm(max(k, 2), generator=g)[:k] for _ in range(bs * depth)])
    return (torch.randint(0, 100, (bs,), generator=g),
            lp.sort(-1, descending=True).values.contiguous(), ids.view(bs, depth, k).contiguous())


def make_inputs(bs, depth, k, seed, mode):
    """(roots [bs], topk_logp [bs, D, K] sorted desc, topk_ids [bs, D, K]) on the CPU."""
    g = torch.Generator().manual_seed(seed)
    if mode == "round":
        # depth-1 scores a few ulps apart, deeper log-probs so large that the sums round onto
        # exact ties between children of different parents (the rank path must decide)
        lp = torch.empty(bs, depth, k)
        lp[:, 0] = -1.0 - torch.randint(0, 6, (bs, k), generator=g).float() * 1.2e-7
        lp[:, 1:] = -3000.0 - torch.randint(0, 3, (bs, depth - 1, k), generator=g).float() * 1e-4
        return _sorted_with_perm_ids(lp, g)
    if mode in ("flat", "far"):
        # flat: close log-probs, so many more nodes score within a bin of the B-th best than B
        # (the deferred variant's G overflows); far: scores beyond the deferred variant's
        # histogram range (-512 nats) after a few depths
        base, spread = (0.0, 0.08) if mode == "flat" else (-130.0, 4.0)
        return _sorted_with_perm_ids(base - torch.rand(bs, depth, k, generator=g) * spread * k / 8,
                                     g)
    if mode == "fan":
        # two or three finite depth-1 ranks, then flat rows: a narrow level of a few parents
        # whose children (up to 3 K) overflow a warp run's candidates (deferred_warp's
        # few-parent count hands such a level to the block)
        lp = -torch.rand(bs, depth, k, generator=g) * 1e-3 * k
        lp[:, 0, 2 + seed % 2:] = NEG_INF
        return _sorted_with_perm_ids(lp, g)
    kw = dict(scale=1.0 + seed % 3)
    vocab = max(64, 2 * k)
    if mode == "ties":
        kw["quant"] = 4.0
    elif mode == "ninf":
        kw["p_ninf"] = 0.3
    elif mode == "short_vocab":
        vocab = max(3, k // 2)
    elif mode == "peaked":
        kw["scale"] = 9.0  # top-1 probability near 1: deep, chain-like trees
    roots, lp, ids = random_inputs(bs, depth, k, vocab, g, **kw)
    if mode == "dead_depth":  # one depth entirely unreachable, some requests with empty trees
        lp[:, min(2, depth - 1)] = NEG_INF
        lp[::3, 0] = NEG_INF
    return roots, lp, ids


def poisoned(bs, budget):
    out = DraftTree.empty(bs, budget, "cuda")
    for v in out.tensors().values():
        if v.dtype == torch.bool:
            v.fill_(True)
        elif v.dtype == torch.float32:
            v.fill_(float("nan"))
        else:
            v.fill_(77)
    return out


def check_parity(bs, budget, depth, k, seed, mode, threads=0, torch_too=True):
    roots, lp, ids = make_inputs(bs, depth, k, seed, mode)
    ref = build_tree_reference(roots, lp, ids, budget)
    got = tree_backend.build_tree_cuda(roots.cuda(), lp.cuda(), ids.cuda(), budget,
                                       poisoned(bs, budget), threads=threads)
    tag = f"bs={bs} B={budget} D={depth} K={k} seed={seed} mode={mode} threads={threads}"
    assert_same_tree(ref, got.to("cpu"), tag)
    if torch_too:
        assert_same_tree(build_tree(roots.cuda(), lp.cuda(), ids.cuda(), budget).to("cpu"),
                         got.to("cpu"), tag + " (vs torch build_tree)")
    return ref, got


# (bs, budget, D, K): budgets 1..1024 and batch 1..256, never both large (the oracle is Python)
SMALL = [(1, 1, 15, 1), (2, 1, 15, 64), (3, 2, 3, 2), (7, 7, 7, 8), (1, 16, 15, 16),
         (8, 64, 15, 64), (64, 64, 15, 64), (5, 100, 15, 100), (3, 40, 100, 8),
         (100, 33, 15, 5), (256, 1, 15, 8)]
# (2, 200, 50, 200): K x D > 8192, so every depth's log-probs are staged when it is reached, at a
# budget the deferred variant takes
LARGE = [(256, 16, 15, 16), (128, 64, 15, 64), (4, 256, 15, 256), (2, 512, 15, 512),
         (2, 1024, 15, 1024), (1, 1024, 31, 1024), (1, 1024, 63, 64), (2, 1000, 10, 3),
         (2, 200, 50, 200)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bs, budget, depth, k", SMALL)
def test_parity_small(bs, budget, depth, k, mode):
    check_parity(bs, budget, depth, k, seed=budget * 31 + bs, mode=mode)


@pytest.mark.parametrize("bs, budget, depth, k", LARGE)
def test_parity_large(bs, budget, depth, k):
    for i, mode in enumerate(("random", "peaked", "ties", "round", "ninf")):
        check_parity(bs, budget, depth, k, seed=budget + i, mode=mode)


def test_many_candidates_per_level():
    """Steep depth 1, flat deeper depths: ~B x K candidates survive the pruning at depth 2."""
    bs, budget, depth, k = 1, 1024, 4, 1024
    r = torch.arange(k, dtype=torch.float32)
    lp = torch.stack([-0.01 * r] + [-1e-6 * r] * (depth - 1)).expand(bs, depth, k).contiguous()
    ids = torch.arange(k).expand(bs, depth, k).contiguous()
    roots = torch.tensor([5])
    ref = build_tree_reference(roots, lp, ids, budget)
    got = tree_backend.build_tree_cuda(roots.cuda(), lp.cuda(), ids.cuda(), budget,
                                       poisoned(bs, budget))
    assert_same_tree(ref, got.to("cpu"))


@pytest.mark.parametrize("threads", [32, 64, 128, 256, 512, 1024])
def test_any_block_size_gives_the_same_tree(threads):
    for bs, budget, depth, k, mode in [(4, 64, 15, 64, "peaked"), (3, 300, 7, 300, "ties"),
                                       (2, 1024, 5, 1024, "random")]:
        check_parity(bs, budget, depth, k, seed=threads + budget, mode=mode, threads=threads,
                     torch_too=False)


def test_strided_inputs():
    """topk_logp / topk_ids as views with strides in batch and depth (no copy is made)."""
    bs, budget, depth, k = 6, 64, 9, 64
    roots, lp, ids = make_inputs(bs, depth, k, seed=3, mode="peaked")
    big_lp = torch.full((2 * bs, depth + 3, k), -5.0)
    big_ids = torch.zeros(2 * bs, depth + 3, k, dtype=torch.int64)
    big_lp[::2, 1:depth + 1] = lp
    big_ids[::2, 1:depth + 1] = ids
    lp_v, ids_v = big_lp.cuda()[::2, 1:depth + 1], big_ids.cuda()[::2, 1:depth + 1]
    assert not lp_v.is_contiguous()
    got = tree_backend.build_tree_cuda(roots.cuda(), lp_v, ids_v, budget, poisoned(bs, budget))
    assert_same_tree(build_tree_reference(roots, lp, ids, budget), got.to("cpu"))


def full_mask_case(bs, budget, depth, k, seed):
    roots, lp, ids = make_inputs(bs, depth, k, seed, ["random", "peaked", "ninf"][seed % 3])
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, 300, (bs,), generator=g)
    seq[0] = 0  # an empty prefix too
    return roots, lp, ids, seq


def expected_verify_layout(ref, seq):
    n = ref.num_nodes
    used = int((n * (seq + n)).sum())
    sizes = n * (seq + n)
    flat = torch.zeros(used, dtype=torch.bool)
    full_mask_layout(ref.ancestor_mask, seq, flat, sizes.cumsum(0) - sizes)
    return flat, seq[:, None] + ref.depths


@pytest.mark.parametrize("bs, budget, depth, k", [(1, 1, 15, 4), (5, 64, 15, 64),
                                                  (3, 257, 7, 64), (2, 1024, 15, 1024)])
def test_full_mask_and_positions(bs, budget, depth, k):
    roots, lp, ids, seq = full_mask_case(bs, budget, depth, k, seed=budget)
    ref = build_tree_reference(roots, lp, ids, budget)
    exp_flat, exp_pos = expected_verify_layout(ref, seq)
    slack = 100
    raw = torch.full((exp_flat.numel() + slack,), 2, dtype=torch.uint8, device="cuda")
    pos = torch.full((bs, budget + 1), 77, dtype=torch.int64, device="cuda")
    got = tree_backend.build_tree_cuda(roots.cuda(), lp.cuda(), ids.cuda(), budget,
                                       poisoned(bs, budget), seq_lens=seq.cuda(), positions=pos,
                                       full_mask=raw.view(torch.bool))
    assert_same_tree(ref, got.to("cpu"))
    raw = raw.cpu()
    assert torch.equal(raw[:exp_flat.numel()], exp_flat.to(torch.uint8))
    assert bool((raw[exp_flat.numel():] == 2).all()), "wrote past the FULL_MASK length"
    assert torch.equal(pos.cpu(), exp_pos)


@pytest.mark.parametrize("bs, budget, depth, k", [(1, 1, 15, 1), (4, 64, 15, 64),
                                                  (32, 128, 7, 16), (256, 8, 15, 8),
                                                  (2, 1024, 15, 1024)])
def test_cuda_graph_replay_on_fresh_inputs(bs, budget, depth, k):
    n = budget + 1
    max_seq = 300
    s_roots = torch.zeros(bs, dtype=torch.int64, device="cuda")
    s_lp = torch.full((bs, depth, k), NEG_INF, device="cuda")
    s_ids = torch.zeros(bs, depth, k, dtype=torch.int64, device="cuda")
    s_seq = torch.zeros(bs, dtype=torch.int64, device="cuda")
    out = poisoned(bs, budget)
    pos = torch.empty(bs, n, dtype=torch.int64, device="cuda")
    flat = torch.empty(bs * n * (max_seq + n), dtype=torch.bool, device="cuda")
    run = lambda: tree_backend.build_tree_cuda(s_roots, s_lp, s_ids, budget, out,  # noqa: E731
                                               seq_lens=s_seq, positions=pos, full_mask=flat)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for seed in range(3):
        roots, lp, ids, seq = full_mask_case(bs, budget, depth, k, seed=100 + seed)
        for dst, src in ((s_roots, roots), (s_lp, lp), (s_ids, ids), (s_seq, seq)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        ref = build_tree_reference(roots, lp, ids, budget)
        assert_same_tree(ref, out.to("cpu"), f"replay seed {seed}")
        exp_flat, exp_pos = expected_verify_layout(ref, seq)
        assert torch.equal(flat[:exp_flat.numel()].cpu(), exp_flat)
        assert torch.equal(pos.cpu(), exp_pos)


def test_no_allocation_and_no_host_sync_per_call():
    bs, budget, depth, k = 16, 64, 15, 64
    roots, lp, ids, seq = (x.cuda() for x in full_mask_case(bs, budget, depth, k, seed=7))
    out = poisoned(bs, budget)
    pos = torch.empty(bs, budget + 1, dtype=torch.int64, device="cuda")
    flat = torch.empty(bs * (budget + 1) * (300 + budget + 1), dtype=torch.bool, device="cuda")
    call = lambda: tree_backend.build_tree_cuda(roots, lp, ids, budget, out,  # noqa: E731
                                                seq_lens=seq, positions=pos, full_mask=flat)
    call()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


def test_dispatcher_picks_the_kernel(monkeypatch):
    env = tree_backend._loader().ENV_BACKEND
    try:
        for value, expected in (("auto", tree_backend.build_tree_auto),
                                ("cuda", tree_backend.build_tree_cuda), ("torch", build_tree)):
            monkeypatch.setenv(env, value)
            tree_backend._choice["builder"] = None
            assert tree_backend.get_tree_builder() is expected
        # auto: shapes the kernel cannot take (min(D, budget) > 63) go to the torch builder
        roots, lp, ids = make_inputs(2, 70, 4, seed=1, mode="peaked")
        got = tree_backend.build_tree_auto(roots.cuda(), lp.cuda(), ids.cuda(), 80)
        assert_same_tree(build_tree_reference(roots, lp, ids, 80), got.to("cpu"))
    finally:
        tree_backend._choice["builder"] = None


def test_boundary_errors_name_the_tensor():
    roots, lp, ids = (x.cuda() for x in make_inputs(2, 5, 8, seed=0, mode="random"))
    bad = DraftTree.empty(2, 9, "cuda")  # buffers for budget 9, called with budget 8
    with pytest.raises(RuntimeError, match=r"tokens must have shape \[2, 9\], got \[2, 10\]"):
        tree_backend.build_tree_cuda(roots, lp, ids, 8, bad)
    with pytest.raises(RuntimeError, match="positions and full_mask need seq_lens"):
        tree_backend.build_tree_cuda(roots, lp, ids, 8,
                                     positions=torch.empty(2, 9, dtype=torch.int64, device="cuda"))


def test_every_host_check_raises_and_the_extension_still_works(ext):
    """Each argument check of tree_build.cpp returns its message (no C++ exception: one thrown
    through the binding crashed the process on the H200 image), the CUDA state stays clean, and
    later launches give exact trees."""
    bs, budget, depth, k = 2, 8, 5, 8
    roots, lp, ids = (x.cuda() for x in make_inputs(bs, depth, k, seed=3, mode="random"))
    out = poisoned(bs, budget)

    def call(budget_=budget, roots_=roots, lp_=lp, ids_=ids, threads=0, **replace):
        t = {**out.tensors(), **replace}
        err = ext.tree_build(roots_, lp_, ids_, budget_, t["tokens"], t["parents"], t["depths"],
                             t["valid"], t["scores"], t["ancestor_mask"], t["retrive_index"],
                             t["retrive_next_token"], t["retrive_next_sibling"], threads=threads)
        if err:  # the extension returns its message (it never throws)
            raise RuntimeError(err)

    i64 = dict(dtype=torch.int64, device="cuda")
    cases = [
        (r"topk_logp must be a CUDA tensor", dict(lp_=lp.cpu())),
        (r"topk_logp must be float32", dict(lp_=lp.double())),
        (r"topk_ids must be int64", dict(ids_=ids.int())),
        (r"root_ids must be contiguous int64 \[2\]", dict(roots_=roots[:1])),
        (r"budget must be in \[1, 1024\], got 0", dict(budget_=0)),
        (r"budget must be in \[1, 1024\], got 1025", dict(budget_=1025)),
        (r"parents must have shape \[2, 9\], got \[2, 10\]",
         dict(parents=torch.empty(bs, budget + 2, **i64))),
        (r"scores must be Float, got Double",
         dict(scores=torch.empty(bs, budget + 1, dtype=torch.float64, device="cuda"))),
        (r"retrive_index must be contiguous",
         dict(retrive_index=torch.empty(budget + 1, bs, **i64).t())),
        (r"threads must be a multiple of 32 in \[32, 1024\], got 33", dict(threads=33)),
    ]
    for pattern, kwargs in cases:
        with pytest.raises(RuntimeError, match=pattern):
            call(**kwargs)
    torch.cuda.synchronize()
    # After the errors: a small launch and one that needs the > 48 KB shared-memory opt-in.
    check_parity(bs, budget, depth, k, seed=4, mode="random")
    assert ext.smem_bytes(1024, 1024, 15) > 48 * 1024
    check_parity(2, 1024, 15, 1024, seed=5, mode="ties", torch_too=False)
