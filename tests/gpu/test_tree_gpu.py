"""GPU tests of build_tree / accept_walk / full_mask_layout: parity with the CPU oracles, no host
sync, and CUDA-graph capture replayed on fresh inputs.

Run: python -m pytest -q tests/gpu/test_tree_gpu.py
"""
from __future__ import annotations

import pytest
import torch

from sglang_ddtree.accept import accept_walk, accept_walk_reference
from sglang_ddtree.tree import (DraftTree, build_tree, build_tree_reference, full_mask_layout,
                                full_mask_offsets)
from tests._tree_inputs import random_inputs
from tests.test_tree import assert_same_tree

pytestmark = pytest.mark.gpu

# (bs, budget, D, K): budgets 1..1024 and batch 1..256, never both large (the oracle is Python)
CASES = [(1, 1, 15, 1), (3, 2, 3, 2), (7, 7, 7, 8), (1, 64, 15, 64), (16, 64, 15, 64),
         (256, 16, 15, 16), (64, 32, 7, 32), (32, 200, 7, 32), (5, 128, 15, 128),
         (2, 1024, 15, 1024), (1, 1024, 63, 64), (256, 1, 15, 8), (100, 33, 15, 5)]


def inputs(bs, depth, k, seed, mode=None):
    g = torch.Generator().manual_seed(seed)
    mode = seed % 4 if mode is None else mode
    vocab = max(3, k // 2) if mode == 3 else max(64, 2 * k)  # mode 3: -inf tails (vocab < K)
    return random_inputs(bs, depth, k, vocab, g, quant=4.0 if mode == 1 else None,
                         p_ninf=0.3 if mode == 2 else 0.0, scale=1.0 + (seed % 3))


def predicted_for(tree: DraftTree, seed: int) -> torch.Tensor:
    """Target tokens that follow an existing child 80% of the time (long accepted paths)."""
    g = torch.Generator().manual_seed(seed)
    bs, n = tree.tokens.shape
    pred = torch.randint(0, 50, (bs, n), generator=g)
    child = tree.retrive_next_token.clone()
    # pick the first or, half of the time, the second child when there is one
    second = tree.retrive_next_sibling.gather(1, child.clamp(min=0))
    use_second = (torch.rand(bs, n, generator=g) < 0.5) & (child >= 0) & (second >= 0)
    child = torch.where(use_second, second, child)
    follow = (torch.rand(bs, n, generator=g) < 0.8) & (child >= 0)
    return torch.where(follow, tree.tokens.gather(1, child.clamp(min=0)), pred)


@pytest.mark.parametrize("bs, budget, depth, k", CASES)
def test_build_tree_cuda_matches_reference(bs, budget, depth, k):
    for seed in range(2):
        roots, lp, ids = inputs(bs, depth, k, seed=budget * 7 + seed)
        ref = build_tree_reference(roots, lp, ids, budget)
        got = build_tree(roots.cuda(), lp.cuda(), ids.cuda(), budget)
        assert_same_tree(ref, got.to("cpu"), f"bs={bs} B={budget} D={depth} K={k} seed={seed}")
        pred = predicted_for(ref, seed)
        for a, b in zip(accept_walk_reference(ref, pred), accept_walk(got, pred.cuda())):
            assert torch.equal(a, b.cpu())


def test_no_host_sync():
    roots, lp, ids = (x.cuda() for x in inputs(8, 15, 32, seed=1))
    build_tree(roots, lp, ids, 64)  # warm the per-(budget, K) cache
    seq = torch.tensor([5, 0, 17, 3, 9, 1, 2, 8], device="cuda")
    flat = torch.empty(65 * (seq.sum().item() + 8 * 65), dtype=torch.bool, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tree = build_tree(roots, lp, ids, 64)
        accept_walk(tree, tree.tokens)
        full_mask_layout(tree.ancestor_mask, seq, flat, full_mask_offsets(seq, 65))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("bs, budget, depth, k", [(1, 1, 15, 1), (4, 64, 15, 64),
                                                  (32, 128, 7, 16), (256, 8, 15, 8),
                                                  (2, 1024, 15, 1024)])
def test_cuda_graph_replay_on_fresh_inputs(bs, budget, depth, k):
    n = budget + 1
    max_seq = 40
    s_roots = torch.zeros(bs, dtype=torch.int64, device="cuda")
    s_lp = torch.zeros(bs, depth, k, device="cuda")
    s_ids = torch.zeros(bs, depth, k, dtype=torch.int64, device="cuda")
    s_pred = torch.zeros(bs, n, dtype=torch.int64, device="cuda")
    s_seq = torch.zeros(bs, dtype=torch.int64, device="cuda")
    s_out = DraftTree.empty(bs, budget, "cuda")
    s_flat = torch.zeros(n * (bs * (max_seq + n)), dtype=torch.bool, device="cuda")

    def step():
        tree = build_tree(s_roots, s_lp, s_ids, budget, out=s_out)
        walk = accept_walk(tree, s_pred)
        full_mask_layout(tree.ancestor_mask, s_seq, s_flat, full_mask_offsets(s_seq, n))
        return walk

    r0, l0, i0 = inputs(bs, depth, k, seed=0, mode=0)
    s_roots.copy_(r0)
    s_lp.copy_(l0)
    s_ids.copy_(i0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warmup (fills the pairs cache) outside capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s_walk = step()

    for seed in range(1, 7):
        roots, lp, ids = inputs(bs, depth, k, seed=seed)
        ref = build_tree_reference(roots, lp, ids, budget)
        pred = predicted_for(ref, seed)
        seq = torch.randint(0, max_seq + 1, (bs,), generator=torch.Generator().manual_seed(seed))
        for dst, src in ((s_roots, roots), (s_lp, lp), (s_ids, ids), (s_pred, pred),
                         (s_seq, seq)):
            dst.copy_(src)
        s_out.tokens.fill_(-7)  # poison: the replay must rewrite everything
        s_out.ancestor_mask.fill_(True)
        graph.replay()
        torch.cuda.synchronize()
        s_out.max_depth = depth
        assert_same_tree(ref, s_out.to("cpu"), f"graph replay seed={seed}")
        for a, b in zip(accept_walk_reference(ref, pred), s_walk):
            assert torch.equal(a, b.cpu())
        expected = torch.cat([torch.cat([torch.ones(n, int(seq[b]), dtype=torch.bool),
                                         ref.ancestor_mask[b]], 1).reshape(-1)
                              for b in range(bs)])
        assert torch.equal(s_flat[: expected.numel()].cpu(), expected)
