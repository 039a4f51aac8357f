"""Accepted path -> emitted tokens, lengths, KV relocation and drafter context rows."""

import random

import torch

from sglang_ddtree.accept import accept_walk_reference
from sglang_ddtree.commit import commit_from_path, kv_moves, move_accepted_kv, path_hidden
from sglang_ddtree.tree import build_tree_reference


def _random_tree(bs, depth, k, budget, seed):
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(bs, depth, 50, generator=g), -1).topk(k, -1).values
    ids = torch.stack([torch.stack([torch.randperm(1000, generator=g)[:k] for _ in range(depth)])
                       for _ in range(bs)])
    roots = torch.randint(0, 1000, (bs,), generator=g)
    return build_tree_reference(roots, logp, ids, budget)


def _predict_path(tree, rng):
    """A `predicted` array whose walk follows a random root-to-node path, then stops."""
    bs, n = tree.tokens.shape
    pred = torch.full((bs, n), 999_999, dtype=torch.int64)
    parents = tree.parents.tolist()
    for b in range(bs):
        valid = [i for i in range(1, n) if tree.valid[b, i]]
        target = rng.choice(valid) if valid and rng.random() < 0.9 else 0
        node = target
        while node != 0:
            par = parents[b][node]
            pred[b, par] = tree.tokens[b, node]
            node = par
    return pred


class FakePool:
    """Stands in for an SGLang KV pool: one [slots, H] buffer per layer, parallel copies."""

    def __init__(self, slots, layers=3, h=4):
        g = torch.Generator().manual_seed(0)
        self.bufs = [torch.randn(slots, h, generator=g) for _ in range(layers)]

    def move_kv_cache(self, tgt, src):
        for buf in self.bufs:
            # a parallel kernel reads in any order: emulate the worst, writes interleaved with reads
            for i in reversed(range(tgt.numel())):
                buf[tgt[i]] = buf[src[i]].clone()


def test_commit_and_kv_relocation():
    rng = random.Random(0)
    for seed in range(20):
        bs, depth, k, budget = 3, 6, 4, 20
        tree = _random_tree(bs, depth, k, budget, seed)
        pred = _predict_path(tree, rng)
        accept_len, nodes, bonus = accept_walk_reference(tree, pred, depth)
        seq_lens = torch.tensor([5, 0, 17])
        step = commit_from_path(tree, nodes, accept_len, bonus, seq_lens)
        n = tree.tokens.shape[1]
        assert torch.equal(step.commit_lens.long(), accept_len + 1)
        assert torch.equal(step.new_seq_lens, seq_lens + accept_len + 1)
        for b in range(bs):
            kk = int(accept_len[b])
            path = nodes[b, 1:kk + 1].tolist()
            assert step.out_tokens[b, :kk].tolist() == tree.tokens[b, path].tolist()
            assert int(step.out_tokens[b, kk]) == int(bonus[b])
        # KV: slot table per request, disjoint across requests
        slots = torch.arange(bs * n).view(bs, n) * 2 + 7
        pool = FakePool(int(slots.max()) + 1)
        before = [buf.clone() for buf in pool.bufs]
        dst, src = kv_moves(slots, step.path_nodes, accept_len)
        move_accepted_kv(pool, dst, src)
        for b in range(bs):
            for j in range(1, int(accept_len[b]) + 1):
                node = int(nodes[b, j])
                for buf, old in zip(pool.bufs, before):
                    assert torch.equal(buf[slots[b, j]], old[slots[b, node]])


def test_path_hidden_rows():
    tree = _random_tree(2, 4, 3, 9, 1)
    pred = _predict_path(tree, random.Random(3))
    accept_len, nodes, bonus = accept_walk_reference(tree, pred, 4)
    step = commit_from_path(tree, nodes, accept_len, bonus, torch.zeros(2, dtype=torch.long))
    n = tree.tokens.shape[1]
    hidden = torch.arange(2 * n, dtype=torch.float32)[:, None].repeat(1, 3)
    rows = path_hidden(hidden, step.path_nodes, n).view(2, -1, 3)
    for b in range(2):
        for j in range(int(accept_len[b]) + 1):
            assert rows[b, j, 0] == b * n + int(nodes[b, j])


def test_tree_hash_sees_any_difference():
    from sglang_ddtree.worker import tree_hash

    tree = _random_tree(2, 4, 3, 9, 5)
    pred = torch.randint(0, 1000, tree.tokens.shape)
    h = tree_hash(tree, pred)
    pred2 = pred.clone()
    pred2[1, 3] += 1
    assert tree_hash(tree, pred2) != h
    tree.parents[0, 2] = 0 if int(tree.parents[0, 2]) != 0 else 1
    assert tree_hash(tree, pred) != h


def test_rank_check_raises_on_disagreement():
    import pytest

    from sglang_ddtree.worker import RankConsistencyCheck

    class FakeGroup:
        world_size = 2

        def __init__(self, other):
            self.other = other

        def all_gather_into_tensor(self, out, inp):
            out[0] = inp[0]
            out[1] = inp[0] + self.other

    tree = _random_tree(1, 3, 2, 5, 6)
    pred = torch.zeros_like(tree.tokens)
    RankConsistencyCheck(FakeGroup(0), 1).step(tree, pred)  # agree: silent
    with pytest.raises(RuntimeError, match="rank consistency"):
        RankConsistencyCheck(FakeGroup(1), 1).step(tree, pred)
