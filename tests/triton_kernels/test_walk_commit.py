"""walk_commit (one Triton launch for the accept walk and the commit bookkeeping) == the PyTorch
ops it replaces, exactly (integers only), on random trees, every path length, padding nodes,
budget statistics and odd shapes. CPU: Triton interpreter (conftest); GPU: the compiled kernel."""

import random

import pytest
import torch

from sglang_ddtree.accept import accept_walk_reference
from sglang_ddtree.budget_stats import candidate_budgets
from sglang_ddtree.tree import DraftTree
from sglang_ddtree.triton_kernels.walk_commit import walk_commit, walk_commit_reference
from tests.test_commit import _predict_path, _random_tree

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FIELDS = ("out_tokens", "commit_lens", "new_seq_lens", "path_nodes", "bonus", "hidden_rows",
          "kv_dst", "kv_src")


def _to(tree, dev):
    return DraftTree(**{k: (v.to(dev) if isinstance(v, torch.Tensor) else v)
                        for k, v in tree.__dict__.items()})


def _case(bs, depth, k, budget, seed, width=None, extra=3, stats=True, prefix_dtype=torch.int64):
    rng = random.Random(seed)
    tree = _random_tree(bs, depth, k, budget, seed)
    pred = _predict_path(tree, rng)
    n = tree.tokens.shape[1]
    width = depth + 1 if width is None else width
    w = max(width, n) + extra
    perm = torch.randperm(bs * w, generator=torch.Generator().manual_seed(seed))
    slots = (perm + 1).view(bs, w)
    prefix = torch.randint(0, 5000, (bs,), generator=torch.Generator().manual_seed(seed)) \
        .to(prefix_dtype)
    tree, pred, slots, prefix = _to(tree, DEV), pred.to(DEV), slots.to(DEV), prefix.to(DEV)
    budgets = torch.tensor(candidate_budgets(budget), dtype=torch.int64, device=DEV) \
        if stats else None
    got_t = torch.zeros(budgets.numel() + 1, dtype=torch.int64, device=DEV) if stats else None
    want_t = got_t.clone() if stats else None
    got = walk_commit(tree, pred, slots, prefix, width, budgets, got_t)
    want = walk_commit_reference(tree, pred, slots, prefix, width, budgets, want_t)
    return tree, pred, got, want, got_t, want_t


@pytest.mark.parametrize("bs,depth,k,budget", [(1, 1, 1, 1), (3, 6, 4, 20), (5, 7, 3, 18),
                                               (2, 15, 8, 64), (4, 15, 16, 128),
                                               (2, 15, 32, 300)])
def test_matches_the_pytorch_composition(bs, depth, k, budget):
    for seed in range(6):
        tree, pred, got, want, got_t, want_t = _case(bs, depth, k, budget, seed)
        for name in FIELDS:
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), (name, seed, a, b)
        assert torch.equal(got_t, want_t), (got_t, want_t)
        # and the walk is the oracle's (CPU loops over SGLang's child / sibling links)
        acc, nodes, bonus = accept_walk_reference(_to(tree, "cpu"), pred.cpu(), depth)
        assert torch.equal(got.commit_lens.cpu().long(), acc + 1)
        assert torch.equal(got.bonus.cpu(), bonus)


def test_full_paths_wider_blocks_int32_prefix_and_no_stats():
    # a predicted array that follows the deepest path: the whole block accepted (bonus in the
    # last column); a block wider than the tree's depth; an int32 prefix; stats off
    for seed in range(4):
        bs, depth, k, budget = 3, 5, 2, 40
        tree = _random_tree(bs, depth, k, budget, seed)
        n = tree.tokens.shape[1]
        pred = torch.full((bs, n), 777_777, dtype=torch.int64)
        for b in range(bs):
            deepest = max(range(n), key=lambda i: (int(tree.depths[b, i]), -i))
            node = deepest
            while node != 0:
                par = int(tree.parents[b, node])
                pred[b, par] = tree.tokens[b, node]
                node = par
        slots = torch.arange(bs * (n + 8)).view(bs, n + 8) + 1
        for width in (1, depth + 1, depth + 4):  # 1: a block of the root alone
            prefix = torch.tensor([0, 9, 2**20], dtype=torch.int32)
            args = (_to(tree, DEV), pred.to(DEV), slots.to(DEV), prefix.to(DEV), width)
            got, want = walk_commit(*args), walk_commit_reference(*args)
            for name in FIELDS:
                assert torch.equal(getattr(got, name), getattr(want, name)), (name, width)
            if width == depth + 1:
                assert bool((got.commit_lens == depth + 1).all())  # whole block accepted
                assert torch.equal(got.out_tokens[:, -1], got.bonus)


def test_negative_target_tokens_are_emitted_as_zero_like_the_op_path():
    # the op path clamps emitted tokens at 0; the bonus field itself keeps the raw value
    tree = _random_tree(3, 5, 3, 12, 4)
    n = tree.tokens.shape[1]
    pred = _predict_path(tree, random.Random(4))
    pred[pred == 999_999] = -5
    slots = torch.arange(3 * (n + 2)).view(3, n + 2) + 1
    args = (_to(tree, DEV), pred.to(DEV), slots.to(DEV), torch.zeros(3, dtype=torch.int64,
                                                                      device=DEV), 6)
    got, want = walk_commit(*args), walk_commit_reference(*args)
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert bool((got.bonus == -5).any()) and bool((got.out_tokens >= 0).all())


def test_padding_nodes_never_match_and_bad_inputs_are_refused():
    tree = _random_tree(2, 4, 3, 6, 0)
    n = tree.tokens.shape[1]
    # a padding node (valid False, parent -1) whose token equals the root's prediction
    tree.valid[0, n - 1] = False
    tree.parents[0, n - 1] = -1
    pred = torch.full((2, n), 5, dtype=torch.int64)
    tree.tokens[0, n - 1] = 5
    slots = torch.arange(2 * (n + 2)).view(2, n + 2)
    prefix = torch.zeros(2, dtype=torch.int64)
    args = (_to(tree, DEV), pred.to(DEV), slots.to(DEV), prefix.to(DEV), 5)
    got, want = walk_commit(*args), walk_commit_reference(*args)
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    with pytest.raises(ValueError, match="predicted must be int64"):
        walk_commit(args[0], args[1].int(), *args[2:])
    with pytest.raises(ValueError, match="slots must be int64"):
        walk_commit(args[0], args[1], args[2][:, :3], *args[3:])
