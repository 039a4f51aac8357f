"""accept_and_commit (the accept/commit graph body) and its eager path on CPU."""

import random

import torch

from sglang_ddtree.accept import accept_walk, accept_walk_reference
from sglang_ddtree.commit import commit_from_path, kv_moves, move_accepted_kv
from sglang_ddtree.step_graph import AcceptCommitGraphs, accept_and_commit
from tests.test_commit import FakePool, _predict_path, _random_tree


def _walk(tree, predicted, width):
    return accept_walk(tree, predicted, width - 1)


def _case(bs, seed, rng, depth=7, k=3, budget=18):
    """A random tree, target tokens along a random path, prefix lengths, disjoint KV slots and
    two identical fake pools (one per path under comparison)."""
    tree = _random_tree(bs, depth, k, budget, seed)
    n = tree.tokens.shape[1]
    pred = _predict_path(tree, rng)
    prefix = torch.tensor([3, 0, 11, 40][:bs], dtype=torch.int32)
    slots = torch.arange(bs * (n + 2)).view(bs, n + 2) * 3 + 5
    pools = FakePool(int(slots.max()) + 1), FakePool(int(slots.max()) + 1)
    return tree, pred, prefix, slots, pools


def test_accept_and_commit_matches_the_step_by_step_composition():
    rng = random.Random(1)
    for seed in range(12):
        bs, depth = 4, 7
        block = depth + 1
        tree, pred, prefix, slots, (pool, ref_pool) = _case(bs, seed, rng, depth)
        n = tree.tokens.shape[1]

        got = accept_and_commit(tree, pred, slots, prefix, block, _walk, pool)

        accept_len, nodes, bonus = accept_walk_reference(tree, pred, depth)
        want = commit_from_path(tree, nodes, accept_len, bonus, prefix)
        dst, src = kv_moves(slots, want.path_nodes, accept_len)
        move_accepted_kv(ref_pool, dst, src)
        for name in ("out_tokens", "commit_lens", "new_seq_lens", "path_nodes", "bonus"):
            assert torch.equal(getattr(got.step, name), getattr(want, name)), (name, seed)
        for a, b in zip(pool.bufs, ref_pool.bufs):
            assert torch.equal(a, b)
        rows = (torch.arange(bs)[:, None] * n + want.path_nodes).reshape(-1)
        assert torch.equal(got.hidden_rows, rows)
        # the rows pick the accepted nodes in path order, root first
        for b in range(bs):
            kk = int(accept_len[b])
            assert got.hidden_rows.view(bs, -1)[b, : kk + 1].tolist() == \
                [b * n + int(x) for x in nodes[b, : kk + 1]]


def test_graph_wrapper_runs_eagerly_off_gpu_and_without_pool():
    tree = _random_tree(2, 5, 3, 9, 0)
    pred = _predict_path(tree, random.Random(0))
    slots = torch.arange(2 * 12).view(2, 12)
    prefix = torch.tensor([4, 9])
    graphs = AcceptCommitGraphs(6, _walk, use_graphs=True, device="cpu")
    assert not graphs.use_graphs
    got = graphs(tree, pred, slots, prefix, None)
    want = accept_and_commit(tree, pred, slots, prefix, 6, _walk, None)
    assert torch.equal(got.step.out_tokens, want.step.out_tokens)
    assert torch.equal(got.hidden_rows, want.hidden_rows)


def test_prewarm_is_a_no_op_off_gpu_and_the_tree_builder_has_no_static_buffers_there():
    from sglang_ddtree.tree_graph import TreeBuildGraphs

    trees = TreeBuildGraphs(8, 7, 4, "cpu")
    assert trees.static_tree(3) is None  # eager builds into fresh tensors: nothing to prewarm
    graphs = AcceptCommitGraphs(8, _walk, use_graphs=True, device="cpu")
    tree = _random_tree(3, 7, 4, 8, 0)
    before = {k: v.clone() for k, v in tree.tensors().items()}
    assert not graphs.prewarm(tree, 9, FakePool(64))
    assert not graphs._entries and not graphs.failed
    assert all(torch.equal(v, before[k]) for k, v in tree.tensors().items())  # left untouched


def test_fused_commit_equals_the_op_path_with_stats_and_kv():
    """accept_and_commit(fused=True): one walk_commit launch + the KV move gives the op path's
    outputs, hidden rows, KV and budget statistics (Triton interpreter on CPU)."""
    from sglang_ddtree.budget_stats import BudgetAcceptStats

    rng = random.Random(4)
    for seed in range(6):
        block, budget = 8, 18
        tree, pred, prefix, slots, pools = _case(3, seed, rng, block - 1, budget=budget)
        stats = BudgetAcceptStats(budget, "cpu"), BudgetAcceptStats(budget, "cpu")
        got = accept_and_commit(tree, pred, slots, prefix, block, _walk, pools[0],
                                stats=stats[0], fused=True)
        want = accept_and_commit(tree, pred, slots, prefix, block, _walk, pools[1],
                                 stats=stats[1])
        for name in ("out_tokens", "commit_lens", "new_seq_lens", "path_nodes", "bonus"):
            a, b = getattr(got.step, name), getattr(want.step, name)
            assert a.dtype == b.dtype and torch.equal(a, b), (name, seed)
        assert torch.equal(got.hidden_rows, want.hidden_rows)
        for a, b in zip(*(p.bufs for p in pools)):
            assert torch.equal(a, b)
        assert torch.equal(stats[0].totals, stats[1].totals)
    graphs = AcceptCommitGraphs(block, _walk, use_graphs=False, device="cpu", fused=True)
    got = graphs(tree, pred, slots, prefix, None)
    assert torch.equal(got.step.out_tokens, want.step.out_tokens)


def test_commit_switch():
    from sglang_ddtree import config as cfg

    assert cfg.commit_fused({}) is True  # default since it served losslessly on the H200
    assert cfg.commit_fused({cfg.ENV_COMMIT: "fused"}) is True
    assert cfg.commit_fused({cfg.ENV_COMMIT: " OPS "}) is False
    import pytest

    with pytest.raises(cfg.DDTreeConfigError, match="expected ops or fused"):
        cfg.commit_fused({cfg.ENV_COMMIT: "fast"})


def test_a_fused_commit_that_cannot_run_falls_back_to_the_op_path_once(monkeypatch, caplog):
    """SGLANG_DDTREE_COMMIT=fused is the default: where walk_commit cannot run (no Triton backend
    for the device, a compile error) the first call logs why, serves the op path's result, and
    every later call takes the op path without trying again."""
    import importlib
    import logging

    wc_mod = importlib.import_module("sglang_ddtree.triton_kernels.walk_commit")
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("no Triton backend here")

    monkeypatch.setattr(wc_mod, "walk_commit", broken)
    rng = random.Random(9)
    block = 8
    tree, pred, prefix, slots, pools = _case(3, 2, rng, block - 1)
    graphs = AcceptCommitGraphs(block, _walk, use_graphs=False, device="cpu", fused=True)
    with caplog.at_level(logging.ERROR, logger="sglang_ddtree.step_graph"):
        got = graphs(tree, pred, slots, prefix, pools[0])
    want = accept_and_commit(tree, pred, slots, prefix, block, _walk, pools[1])
    for name in ("out_tokens", "commit_lens", "new_seq_lens", "path_nodes", "bonus"):
        assert torch.equal(getattr(got.step, name), getattr(want.step, name)), name
    for a, b in zip(pools[0].bufs, pools[1].bufs):
        assert torch.equal(a, b)  # the KV moved once, by the op path
    assert graphs.fused is False and "no Triton backend here" in graphs.fused_error
    assert any("SGLANG_DDTREE_COMMIT=ops" in r.getMessage() for r in caplog.records)
    graphs(tree, pred, slots, prefix, pools[0])
    assert len(calls) == 1  # not retried


def test_pack_and_unpack_round_trip_with_their_dtypes():
    """The graph's outputs leave in one clone: int64 parts, then the int32 commit lengths."""
    from sglang_ddtree.commit import StepCommit
    from sglang_ddtree.step_graph import AcceptCommit, _pack, _unpack

    bs, width = 3, 5
    out = torch.arange(bs * width, dtype=torch.int64).view(bs, width) * 1_000_003
    step = StepCommit(out_tokens=out, commit_lens=torch.tensor([1, 5, 2], dtype=torch.int32),
                      new_seq_lens=torch.tensor([9, 10, 2**40]),
                      path_nodes=torch.zeros(bs, width, dtype=torch.int64),
                      bonus=torch.tensor([7, 8, 9]))
    packed = _pack(AcceptCommit(step=step, hidden_rows=torch.zeros(1)))
    assert packed.dtype == torch.uint8 and packed.numel() == 8 * (bs * width + 2 * bs) + 4 * bs
    o, lens, bonus, commit = _unpack(packed.clone(), bs, width)
    assert torch.equal(o, out) and torch.equal(lens, step.new_seq_lens)
    assert torch.equal(bonus, step.bonus) and torch.equal(commit, step.commit_lens)
    assert commit.dtype == torch.int32 and o.dtype == lens.dtype == bonus.dtype == torch.int64


def test_prewarm_rejects_buffers_of_the_wrong_shape_in_any_state():
    """The step-prep buffers handed to prewarm must be [bs, width] / [bs], checked before any
    early return (graphs off here), so a wrong pairing fails at start-up."""
    import pytest

    graphs = AcceptCommitGraphs(8, _walk, use_graphs=False, device="cpu")
    tree = _random_tree(3, 7, 4, 8, 0)
    good_slots = torch.zeros(3, 9, dtype=torch.int64)
    good_prefix = torch.zeros(3, dtype=torch.int64)
    assert not graphs.prewarm(tree, 9, FakePool(64), slots=good_slots, prefix=good_prefix)
    with pytest.raises(ValueError, match="not \\[3, 9\\]"):
        graphs.prewarm(tree, 9, FakePool(64), slots=torch.zeros(2, 9, dtype=torch.int64),
                       prefix=good_prefix)
    with pytest.raises(ValueError, match="not \\[3, 9\\]"):
        graphs.prewarm(tree, 9, FakePool(64), slots=good_slots,
                       prefix=torch.zeros(4, dtype=torch.int64))
