"""TreeBuildGraphs: graph replays equal eager build_tree on fresh inputs, per batch size."""

import pytest
import torch

from sglang_ddtree.tree import build_tree
from sglang_ddtree.tree_graph import TreeBuildGraphs

pytestmark = pytest.mark.gpu


def _inputs(bs, depth, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logp = torch.log_softmax(torch.randn(bs, depth, 64, device="cuda", generator=g), -1)
    logp = logp.topk(k, -1).values
    ids = torch.stack([torch.randperm(5000, device="cuda", generator=g)[:k]
                       for _ in range(bs * depth)]).view(bs, depth, k)
    roots = torch.randint(0, 5000, (bs,), device="cuda", generator=g)
    return roots, logp, ids


@pytest.mark.parametrize("budget,depth,k", [(8, 15, 8), (32, 15, 32), (64, 7, 16)])
def test_replay_matches_eager(budget, depth, k):
    graphs = TreeBuildGraphs(budget, depth, k, "cuda")
    for seed, bs in enumerate([1, 3, 1, 16, 3]):
        args = _inputs(bs, depth, k, seed)
        got = graphs(*args)
        want = build_tree(*args, budget)
        for name, t in want.tensors().items():
            assert torch.equal(getattr(got, name), t), (name, bs, seed)


@pytest.mark.parametrize("budget,depth,k", [(8, 15, 8), (32, 15, 32)])
def test_kernel_writes_the_same_layout_as_the_ops(budget, depth, k):
    """The worker's path: the fused kernel writes tree, positions and FULL_MASK in one launch;
    they equal build_tree + tree_positions + write_full_mask."""
    from sglang_ddtree.tree_backend import build_tree_auto, verified_tree_builder
    from sglang_ddtree.verify import full_mask_numel_bound, tree_positions, write_full_mask

    builder = verified_tree_builder(budget, depth, k, "cuda")
    if builder is not build_tree_auto:
        pytest.skip("the fused kernel is not available here")
    graphs = TreeBuildGraphs(budget, depth, k, "cuda", builder=builder)
    assert graphs.single_launch
    n = budget + 1
    for seed, bs in enumerate([1, 3, 16, 3]):
        roots, logp, ids = _inputs(bs, depth, k, seed)
        seq = torch.randint(0, 300, (bs,), device="cuda")
        numel = full_mask_numel_bound(n, int(seq.sum()), bs)
        mask = torch.zeros(numel + 64, dtype=torch.bool, device="cuda")
        tree, pos = graphs.build_with_layout(roots, logp, ids, seq, mask)
        want = build_tree(roots, logp, ids, budget)
        for name, t in want.tensors().items():
            assert torch.equal(getattr(tree, name), t), (name, bs, seed)
        want_mask = torch.zeros_like(mask)
        write_full_mask(want.ancestor_mask, seq, want_mask)
        assert torch.equal(mask, want_mask)
        assert torch.equal(pos, tree_positions(want.depths, seq))
