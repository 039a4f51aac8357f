"""The step's tree + verify layout (positions, FULL_MASK): one builder call when the builder
writes the layout itself (the fused kernel), the verify ops otherwise; both give the same."""

import torch

from sglang_ddtree.tree import build_tree
from sglang_ddtree.tree_backend import build_tree_auto
from sglang_ddtree.tree_graph import TreeBuildGraphs
from sglang_ddtree.verify import full_mask_numel_bound, tree_positions, write_full_mask
from tests._tree_inputs import random_inputs


def _expected(roots, lp, ids, budget, seq):
    tree = build_tree(roots, lp, ids, budget)
    n = budget + 1
    mask = torch.zeros(full_mask_numel_bound(n, int(seq.sum()), len(seq)), dtype=torch.bool)
    write_full_mask(tree.ancestor_mask, seq, mask)
    return tree, tree_positions(tree.depths, seq), mask


def test_layout_from_ops_and_from_a_layout_writing_builder_agree():
    g = torch.Generator().manual_seed(5)
    budget, depth, k = 12, 6, 4
    ops = TreeBuildGraphs(budget, depth, k, "cpu", builder=build_tree, use_graphs=False)
    fused = TreeBuildGraphs(budget, depth, k, "cpu", builder=build_tree_auto, use_graphs=False)
    fused.single_launch = True  # as on a GPU with the kernel: one call writes tree + layout
    for bs in (1, 3, 3):
        roots, lp, ids = random_inputs(bs, depth, k, 50, g, quant=4.0, p_ninf=0.2)
        seq = torch.randint(0, 40, (bs,), generator=g, dtype=torch.int32)
        want_tree, want_pos, want_mask = _expected(roots, lp, ids, budget, seq)
        for graphs in (ops, fused):
            mask = torch.zeros_like(want_mask)
            tree, pos = graphs.build_with_layout(roots, lp, ids, seq, mask)
            for name, t in want_tree.tensors().items():
                assert torch.equal(getattr(tree, name), t), name
            assert torch.equal(pos, want_pos) and pos.dtype == torch.int64
            assert torch.equal(mask, want_mask)
        # the layout-writing path hands out one positions buffer per batch size (static for
        # the accept/commit graph), and no mask when none is asked for
        _, pos_again = fused.build_with_layout(roots, lp, ids, seq, None)
        assert pos_again.data_ptr() == pos.data_ptr()


def test_auto_builder_refuses_a_layout_without_lengths():
    g = torch.Generator().manual_seed(1)
    roots, lp, ids = random_inputs(2, 4, 3, 20, g)
    try:
        build_tree_auto(roots, lp, ids, 5, positions=torch.empty(2, 6, dtype=torch.int64))
    except ValueError as e:
        assert "need seq_lens" in str(e)
    else:
        raise AssertionError("expected a ValueError")
