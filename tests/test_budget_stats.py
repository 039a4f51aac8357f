"""BudgetAcceptStats: the accept length a smaller budget would have had, from the big tree."""

import random

import torch

from sglang_ddtree.accept import accept_walk_reference
from sglang_ddtree.budget_stats import BudgetAcceptStats, candidate_budgets
from sglang_ddtree.commit import commit_from_path
from sglang_ddtree.tree import build_tree_reference


def test_candidates():
    assert candidate_budgets(1) == [1]
    assert candidate_budgets(8) == [1, 2, 4, 8]
    assert candidate_budgets(48) == [1, 2, 4, 8, 16, 32, 48]


def _inputs(bs, depth, k, seed):
    g = torch.Generator().manual_seed(seed)
    # peaked rows so that trees go deep and paths cross the smaller budgets' boundaries
    logits = torch.randn(bs, depth, 40, generator=g) * 3
    logp = torch.log_softmax(logits, -1).topk(k, -1).values
    ids = torch.stack([torch.stack([torch.randperm(500, generator=g)[:k] for _ in range(depth)])
                       for _ in range(bs)])
    return torch.randint(0, 500, (bs,), generator=g), logp, ids


def _predict(tree, rng):
    bs, n = tree.tokens.shape
    pred = torch.full((bs, n), 10_000, dtype=torch.int64)
    for b in range(bs):
        cand = [i for i in range(1, n) if tree.valid[b, i]]
        node = rng.choice(cand) if cand else 0
        while node > 0:
            par = int(tree.parents[b, node])
            pred[b, par] = tree.tokens[b, node]
            node = par
    return pred


def test_counts_equal_walking_each_smaller_tree():
    rng = random.Random(0)
    budget, depth, k = 24, 7, 24
    stats = BudgetAcceptStats(budget, "cpu")
    want = {b: 0 for b in stats.candidates}
    steps = 0
    for seed in range(30):
        bs = 3
        roots, logp, ids = _inputs(bs, depth, k, seed)
        big = build_tree_reference(roots, logp, ids, budget)
        pred = _predict(big, rng)
        accept_len, nodes, bonus = accept_walk_reference(big, pred, depth)
        step = commit_from_path(big, nodes, accept_len, bonus, torch.zeros(bs, dtype=torch.int64))
        stats.update(step.path_nodes, accept_len)
        steps += bs
        for b in stats.candidates:
            small = build_tree_reference(roots, logp, ids, b)
            # the small tree is the big tree's first b + 1 nodes
            assert torch.equal(small.tokens, big.tokens[:, : b + 1])
            acc_small, _, _ = accept_walk_reference(small, pred[:, : b + 1], depth)
            want[b] += int(acc_small.sum())
    assert stats.report() is None  # first call: nothing copied yet
    got = stats.report()
    for b in stats.candidates:
        assert abs(got[b] - (1 + want[b] / steps)) < 1e-4, (b, got[b], want[b] / steps)  # 4 decimals
    assert got[stats.candidates[0]] <= got[budget]  # bigger trees never accept less
