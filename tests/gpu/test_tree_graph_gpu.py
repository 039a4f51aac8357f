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
