"""AcceptCommitGraphs on the GPU: replays equal the eager path, KV moved the same, outputs owned."""

import random

import pytest
import torch

from sglang_ddtree.accept import accept_walk
from sglang_ddtree.step_graph import AcceptCommitGraphs, accept_and_commit
from sglang_ddtree.tree_graph import TreeBuildGraphs

pytestmark = pytest.mark.gpu


class GpuPool:
    """An SGLang-like KV pool: per-layer [slots, H] buffers, one gather/scatter per call."""

    def __init__(self, slots, layers=3, h=8, seed=0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.bufs = [torch.randn(slots, h, device="cuda", generator=g) for _ in range(layers)]

    def move_kv_cache(self, tgt, src):
        for buf in self.bufs:
            buf[tgt] = buf[src]


def _walk(tree, predicted, width):
    return accept_walk(tree, predicted, width - 1)


def _inputs(bs, depth, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logp = torch.log_softmax(3 * torch.randn(bs, depth, 64, device="cuda", generator=g), -1)
    logp, ids = logp.topk(k, -1)
    roots = torch.randint(0, 64, (bs,), device="cuda", generator=g)
    return roots, logp, ids


def _predict(tree, rng):
    """Target tokens that follow a random path of the tree (copied to CPU: test only)."""
    t = tree.tokens.cpu()
    par, valid = tree.parents.cpu(), tree.valid.cpu()
    bs, n = t.shape
    pred = torch.full((bs, n), 10_000, dtype=torch.int64)
    for b in range(bs):
        cand = [i for i in range(1, n) if valid[b, i]]
        node = rng.choice(cand) if cand else 0
        while node > 0:
            pred[b, par[b, node]] = t[b, node]
            node = int(par[b, node])
    return pred.cuda()


def _step_both(trees, graphs, pools, inputs, rng, block, width):
    """One step through the graphs and through the eager path on twin pools; asserts they agree
    (outputs and KV) and returns (graph result, eager result)."""
    pool_g, pool_e = pools
    tree = trees(*inputs)
    bs = tree.tokens.shape[0]
    pred = _predict(tree, rng)
    slots = (torch.randperm(bs * width * 2, device="cuda")[: bs * width] + 1).view(bs, width)
    prefix = torch.randint(0, 100, (bs,), device="cuda")
    got = graphs(tree, pred, slots, prefix, pool_g)
    want = accept_and_commit(tree, pred, slots, prefix, block, _walk, pool_e)
    for name in ("out_tokens", "commit_lens", "new_seq_lens", "path_nodes", "bonus"):
        assert torch.equal(getattr(got.step, name), getattr(want.step, name)), (name, bs)
    for a, b in zip(pool_g.bufs, pool_e.bufs):
        assert torch.equal(a, b)
    return got, want


@pytest.mark.parametrize("commit", ["ops", "fused"])
@pytest.mark.parametrize("budget,depth,k", [(8, 7, 4), (32, 15, 8)])
def test_replay_equals_eager(budget, depth, k, commit):
    """Graph replays (the PyTorch-op body, or the one-launch walk_commit body) equal the eager
    PyTorch ops: outputs, hidden rows and KV."""
    rng = random.Random(0)
    block = depth + 1
    trees = TreeBuildGraphs(budget, depth, k, "cuda")
    graphs = AcceptCommitGraphs(block, _walk, use_graphs=True, device="cuda",
                                fused=commit == "fused")
    n = budget + 1
    width = max(n, block)
    kept = []
    size = 9 * width * 2 + 1
    pool_g, pool_e = GpuPool(size), GpuPool(size)  # both evolve identically, step after step
    for seed, bs in enumerate([1, 4, 1, 4, 9, 4]):
        got, want = _step_both(trees, graphs, (pool_g, pool_e), _inputs(bs, depth, k, seed),
                               rng, block, width)
        assert torch.equal(got.hidden_rows, want.hidden_rows)
        kept.append((got.step.new_seq_lens, want.step.new_seq_lens.clone()))
    assert not graphs.failed
    assert len(graphs._entries) == 3  # bs 1, 4, 9 -- captured once each
    # returned lengths are owned: later replays at the same batch size did not overwrite them
    for got_lens, want_lens in kept:
        assert torch.equal(got_lens, want_lens)


def test_lazy_capture_neither_synchronizes_nor_flushes_the_allocator(monkeypatch):
    """Captures happen mid-serving: no torch.cuda.synchronize / empty_cache / gc per capture."""
    import gc

    def forbidden(*_a, **_k):
        raise AssertionError("called during a lazy capture")

    trees = TreeBuildGraphs(8, 7, 4, "cuda")
    graphs = AcceptCommitGraphs(8, _walk, use_graphs=True, device="cuda")
    tree = trees(*_inputs(3, 7, 4, 0))  # builder warm-up outside the patch
    pool = GpuPool(3 * 9 * 2 + 1)
    pred = _predict(tree, random.Random(0))
    slots = (torch.randperm(3 * 9 * 2, device="cuda")[: 3 * 9] + 1).view(3, 9)
    prefix = torch.randint(0, 50, (3,), device="cuda")
    want = accept_and_commit(tree, pred, slots, prefix, 8, _walk, GpuPool(3 * 9 * 2 + 1))
    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    monkeypatch.setattr(torch.cuda, "empty_cache", forbidden)
    monkeypatch.setattr(gc, "collect", forbidden)
    got = graphs(tree, pred, slots, prefix, pool)
    trees(*_inputs(5, 7, 4, 1))  # a new batch size for the tree graph too
    monkeypatch.undo()
    assert not graphs.failed and len(graphs._entries) == 1
    assert torch.equal(got.step.out_tokens, want.step.out_tokens)


@pytest.mark.parametrize("commit", ["ops", "fused"])
def test_budget_stats_count_the_same_in_graph_and_eager(commit):
    from sglang_ddtree.budget_stats import BudgetAcceptStats

    rng = random.Random(1)
    budget, depth, k, block = 32, 15, 8, 16
    trees = TreeBuildGraphs(budget, depth, k, "cuda")
    s_graph, s_eager = BudgetAcceptStats(budget, "cuda"), BudgetAcceptStats(budget, "cuda")
    graphs = AcceptCommitGraphs(block, _walk, use_graphs=True, device="cuda", stats=s_graph,
                                fused=commit == "fused")
    width = budget + 1
    pool_g, pool_e = GpuPool(8 * width * 2 + 1), GpuPool(8 * width * 2 + 1)
    for seed, bs in enumerate([2, 2, 8, 2, 8]):
        tree = trees(*_inputs(bs, depth, k, seed))
        pred = _predict(tree, rng)
        slots = (torch.randperm(bs * width * 2, device="cuda")[: bs * width] + 1).view(bs, width)
        prefix = torch.randint(0, 100, (bs,), device="cuda")
        graphs(tree, pred, slots, prefix, pool_g)
        accept_and_commit(tree, pred, slots, prefix, block, _walk, pool_e, stats=s_eager)
    torch.cuda.synchronize()
    assert torch.equal(s_graph.totals, s_eager.totals)  # captures' warm-ups were not counted
    assert float(s_graph.totals[-1]) == 2 + 2 + 8 + 2 + 8


@pytest.mark.parametrize("fused", [False, True])
def test_prewarm_captures_at_start_up_and_serving_only_replays(fused, monkeypatch):
    """The worker's start-up prewarm: every batch size's graphs exist before the first step, a
    step then captures nothing (a capture mid-serving stalled a step by 50-400 ms) and equals
    the eager path."""
    rng = random.Random(2)
    budget, depth, k = 16, 7, 8
    block = depth + 1
    builder = None
    if fused:
        from sglang_ddtree.tree_backend import verified_tree_builder

        builder = verified_tree_builder(budget, depth, k, "cuda")
        if not getattr(builder, "single_launch", False):
            pytest.skip("the fused CUDA tree builder did not build here")
    trees = TreeBuildGraphs(budget, depth, k, "cuda", **({"builder": builder} if fused else {}))
    graphs = AcceptCommitGraphs(block, _walk, use_graphs=True, device="cuda")
    n = budget + 1
    width = max(n, block)
    size = 5 * width * 2 + 1
    pool_g, pool_e = GpuPool(size), GpuPool(size)
    for bs in (1, 2, 5):
        assert graphs.prewarm(trees.static_tree(bs), width, pool_g)
        assert not graphs.prewarm(trees.static_tree(bs), width, pool_g)  # once per batch size
    assert len(graphs._entries) == 3 and not graphs.failed

    def no_capture(*_a, **_k):
        raise AssertionError("captured while serving")

    monkeypatch.setattr(graphs, "_capture", no_capture)
    for seed, bs in enumerate([5, 1, 2, 5]):
        _step_both(trees, graphs, (pool_g, pool_e), _inputs(bs, depth, k, seed), rng, block,
                   width)
    assert len(graphs._entries) == 3 and not graphs.failed


def test_target_tokens_written_in_place_equal_a_copied_tensor():
    """The worker writes its argmax straight into ``predicted_buffer`` (no copy into the
    graph's input): same outputs and KV as the eager path; no buffer before a capture, for
    another tree, or with graphs off."""
    rng = random.Random(3)
    budget, depth, k = 16, 7, 8
    block = depth + 1
    trees = TreeBuildGraphs(budget, depth, k, "cuda")
    graphs = AcceptCommitGraphs(block, _walk, use_graphs=True, device="cuda")
    width = budget + 1
    size = 4 * width * 2 + 1
    pool_g, pool_e = GpuPool(size), GpuPool(size)
    for seed in range(3):
        tree = trees(*_inputs(4, depth, k, seed))
        pred = _predict(tree, rng)
        slots = (torch.randperm(4 * width * 2, device="cuda")[: 4 * width] + 1).view(4, width)
        prefix = torch.randint(0, 100, (4,), device="cuda")
        buf = graphs.predicted_buffer(tree, slots, prefix, pool_g)
        if seed == 0:
            assert buf is None  # not captured yet
            got = graphs(tree, pred, slots, prefix, pool_g)
        else:
            assert buf is not None and buf.shape == pred.shape
            buf.copy_(pred)  # what argmax(out=buf) does
            got = graphs(tree, buf, slots, prefix, pool_g)
        want = accept_and_commit(tree, pred, slots, prefix, block, _walk, pool_e)
        for name in ("out_tokens", "commit_lens", "new_seq_lens", "path_nodes", "bonus"):
            assert torch.equal(getattr(got.step, name), getattr(want.step, name)), name
        for a, b in zip(pool_g.bufs, pool_e.bufs):
            assert torch.equal(a, b)
    # another builder's tree buffers: the graph does not read them, so no buffer either
    other = TreeBuildGraphs(budget, depth, k, "cuda")(*_inputs(4, depth, k, 9))
    assert other.tokens.data_ptr() != tree.tokens.data_ptr()
    assert graphs.predicted_buffer(other, slots, prefix, pool_g) is None
    off = AcceptCommitGraphs(block, _walk, use_graphs=False, device="cuda")
    assert off.predicted_buffer(tree, slots, prefix, pool_g) is None


@pytest.mark.parametrize("commit", ["ops", "fused"])
def test_step_prep_buffers_read_in_place_equal_copied_inputs(commit):
    """The worker hands prewarm its step-prep buffers: the graph reads each step's slots and
    prefix lengths where that kernel wrote them (no copy in). Same outputs and KV as the eager
    path, over steps that rewrite the buffers; the packed outputs (int32 commit_lens among
    int64) come back with their dtypes and owned."""
    from sglang_ddtree.step_prep import StepPrep

    rng = random.Random(4)
    budget, depth, k = 16, 7, 8
    block = depth + 1
    trees = TreeBuildGraphs(budget, depth, k, "cuda")
    graphs = AcceptCommitGraphs(block, _walk, use_graphs=True, device="cuda",
                                fused=commit == "fused")
    width = budget + 1
    prep = StepPrep(width, block, 4097, "cuda")
    rows, cols = 6, 4 * width * 2 + 400
    # distinct slots everywhere (as SGLang's pool hands out): KV moves never collide
    req_to_token = (torch.randperm(rows * cols, device="cuda") + 1).view(rows, cols).to(
        torch.int32)
    pool_g, pool_e = GpuPool(rows * cols + 1), GpuPool(rows * cols + 1)
    bufs = prep.buffers(4)
    assert graphs.prewarm(trees.static_tree(4), width, pool_g, slots=bufs[0], prefix=bufs[3])
    kept = []
    for seed in range(4):
        tree = trees(*_inputs(4, depth, k, seed))
        pred = _predict(tree, rng)
        rpi = torch.randperm(rows, device="cuda")[:4]
        seq = torch.randint(0, 300, (4,), device="cuda")
        slots, _, _, prefix64 = prep(req_to_token, rpi, seq, tree.tokens[:, 0])
        assert slots.data_ptr() == bufs[0].data_ptr() and prefix64.data_ptr() == bufs[3].data_ptr()
        got = graphs(tree, pred, slots, prefix64, pool_g)
        want = accept_and_commit(tree, pred, slots.clone(), seq, block, _walk, pool_e)
        for name in ("out_tokens", "commit_lens", "new_seq_lens", "path_nodes", "bonus"):
            a, b = getattr(got.step, name), getattr(want.step, name)
            assert a.dtype == b.dtype and torch.equal(a, b), (name, seed)
        for a, b in zip(pool_g.bufs, pool_e.bufs):
            assert torch.equal(a, b)
        kept.append((got.step.commit_lens, want.step.commit_lens.clone()))
    assert len(graphs._entries) == 1 and not graphs.failed
    for a, b in kept:
        assert torch.equal(a, b)
