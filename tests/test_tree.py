"""Tree builders: batched ``build_tree`` == heap oracle == brute force, plus hand-made trees."""
import itertools

import pytest
import torch

from sglang_ddtree.tree import (DraftTree, build_tree, build_tree_reference, full_mask_layout,
                                full_mask_offsets)
from tests._tree_inputs import NEG_INF, brute_force_paths, random_inputs

FIELDS = ["tokens", "parents", "depths", "valid", "scores", "ancestor_mask", "retrive_index",
          "retrive_next_token", "retrive_next_sibling"]


def assert_same_tree(a: DraftTree, b: DraftTree, msg=""):
    for f in FIELDS:
        x, y = getattr(a, f).cpu(), getattr(b, f).cpu()
        assert x.dtype == y.dtype and x.shape == y.shape, (f, x.dtype, y.dtype, x.shape, y.shape)
        assert torch.equal(x, y), f"{msg} field {f} differs:\n{x}\n{y}"
    assert a.max_depth == b.max_depth


def poisoned_out(bs, budget):
    """Buffers full of garbage, to catch elements build_tree forgets to write."""
    t = DraftTree.empty(bs, budget, "cpu")
    for name, v in t.tensors().items():
        v.copy_(torch.full_like(v, True if v.dtype == torch.bool else 77))
    return t


def check_structure(tree: DraftTree, logp: torch.Tensor):
    """Invariants of any valid tree, checked with plain Python loops."""
    bs, n = tree.tokens.shape
    depth, k = logp.shape[1:]
    for b in range(bs):
        valid = tree.valid[b].tolist()
        nv = sum(valid) - 1
        # #reachable = sum_d prod_{i<=d} (#finite entries at depth i)
        finite = torch.isfinite(logp[b]).sum(-1).tolist()
        reach, prod = 0, 1
        for f in finite:
            prod *= f
            reach += prod
        assert nv == min(n - 1, reach)
        assert valid == [True] * (nv + 1) + [False] * (n - 1 - nv)
        par, dep, sc = tree.parents[b].tolist(), tree.depths[b].tolist(), tree.scores[b].tolist()
        assert par[0] == -1 and dep[0] == 0 and sc[0] == 0.0
        for i in range(1, nv + 1):
            assert 0 <= par[i] < i and valid[par[i]]  # parent before child, prefix-closed
            assert dep[i] == dep[par[i]] + 1 <= depth
            assert sc[i] <= sc[par[i]]
            assert (-sc[i], dep[i]) >= (-sc[i - 1], dep[i - 1])  # total order, first two keys
        for i in range(nv + 1, n):
            assert (par[i], dep[i], tree.tokens[b, i].item(), sc[i]) == (-1, 0, 0, NEG_INF)
        # ancestor mask == reflexive transitive closure of parent
        closure = torch.eye(n, dtype=torch.bool)
        for i in range(1, nv + 1):
            closure[i] |= closure[par[i]]
        assert torch.equal(tree.ancestor_mask[b], closure)
        # links: walking next_token / next_sibling from a node lists exactly its children
        first, sib = tree.retrive_next_token[b].tolist(), tree.retrive_next_sibling[b].tolist()
        for i in range(n):
            kids, c = [], first[i]
            while c != -1:
                kids.append(c)
                c = sib[c]
            assert kids == [j for j in range(1, nv + 1) if par[j] == i]
        for i in range(nv + 1, n):
            assert sib[i] == -1 and first[i] == -1
        assert tree.retrive_index[b].tolist() == list(range(b * n, (b + 1) * n))


# ---------------------------------------------------------------------------------------------
# Random parity: build_tree == build_tree_reference

SHAPES = [(1, 1), (3, 3), (8, 7), (3, 15), (1, 15), (8, 1)]


@pytest.mark.parametrize("budget", [1, 2, 7, 32, 64, 200])
@pytest.mark.parametrize("k", [1, 2, 8, 32])
def test_build_tree_matches_reference(budget, k):
    g = torch.Generator().manual_seed(1000 * budget + k)
    for case, (bs, depth) in enumerate(SHAPES[(budget + k) % 2::2]):
        mode = (budget + k + case) % 4
        vocab = 6 if mode == 3 else 50  # mode 3: vocab smaller than some K (-inf tails)
        roots, lp, ids = random_inputs(bs, depth, k, vocab, g, quant=4.0 if mode == 1 else None,
                                       p_ninf=0.3 if mode == 2 else 0.0)
        ref = build_tree_reference(roots, lp, ids, budget)
        got = build_tree(roots, lp, ids, budget, out=poisoned_out(bs, budget))
        assert_same_tree(ref, got, f"bs={bs} D={depth} K={k} B={budget} mode={mode}")
        check_structure(got, lp)


@pytest.mark.parametrize("quant", [1.0, 2.0])
def test_heavy_ties(quant):
    # log-probs rounded to multiples of 1 or 1/2: most scores tie and the rank path decides
    g = torch.Generator().manual_seed(7)
    for budget, k, depth in [(64, 8, 7), (200, 32, 3), (33, 5, 15)]:
        roots, lp, ids = random_inputs(4, depth, k, 40, g, quant=quant, scale=1.0)
        ref = build_tree_reference(roots, lp, ids, budget)
        assert_same_tree(ref, build_tree(roots, lp, ids, budget))
        check_structure(ref, lp)


def test_all_scores_equal_go_lexicographic():
    # every log-prob 0: all nodes tie on score, so the order is depth, then rank path
    lp = torch.zeros(1, 2, 3)
    ids = torch.tensor([[[10, 11, 12], [20, 21, 22]]])
    t = build_tree(torch.tensor([5]), lp, ids, 6)
    assert t.tokens[0].tolist() == [5, 10, 11, 12, 20, 21, 22]
    assert t.parents[0].tolist() == [-1, 0, 0, 0, 1, 1, 1]
    assert_same_tree(build_tree_reference(torch.tensor([5]), lp, ids, 6), t)


def test_matches_brute_force_enumeration():
    """The heap oracle itself against an enumeration of every path (small D, K)."""
    g = torch.Generator().manual_seed(3)
    for trial in range(12):
        depth, k, budget = 1 + trial % 3, 1 + trial % 4, [1, 3, 9, 40][trial % 4]
        roots, lp, ids = random_inputs(2, depth, k, 9, g, quant=[None, 2.0][trial % 2],
                                       p_ninf=0.2 * (trial % 3 == 2))
        ref = build_tree_reference(roots, lp, ids, budget)
        for b in range(2):
            paths = brute_force_paths(lp[b], budget)
            index = {(): 0}
            for i, (path, score) in enumerate(paths, start=1):
                index[path] = i
                assert ref.parents[b, i].item() == index[path[:-1]]
                assert ref.tokens[b, i].item() == ids[b, len(path) - 1, path[-1]].item()
                assert ref.scores[b, i].item() == score
            assert int(ref.valid[b].sum()) == len(paths) + 1


# ---------------------------------------------------------------------------------------------
# Hand-written trees (expected outputs written out by hand)


def test_chain():
    lp = torch.tensor([[[-0.5], [-0.25], [-1.0], [-0.125]]])
    ids = torch.tensor([[[10], [11], [12], [13]]])
    t = build_tree(torch.tensor([7]), lp, ids, 3)
    assert t.tokens.tolist() == [[7, 10, 11, 12]]
    assert t.parents.tolist() == [[-1, 0, 1, 2]]
    assert t.depths.tolist() == [[0, 1, 2, 3]]
    assert t.scores.tolist() == [[0.0, -0.5, -0.75, -1.75]]
    assert t.ancestor_mask[0].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert t.retrive_next_token.tolist() == [[1, 2, 3, -1]]
    assert t.retrive_next_sibling.tolist() == [[-1, -1, -1, -1]]
    t6 = build_tree(torch.tensor([7]), lp, ids, 6)  # only 4 reachable nodes: 2 padding slots
    assert t6.tokens.tolist() == [[7, 10, 11, 12, 13, 0, 0]]
    assert t6.parents.tolist() == [[-1, 0, 1, 2, 3, -1, -1]]
    assert t6.valid.tolist() == [[True] * 5 + [False] * 2]
    assert t6.scores[0, 4:].tolist() == [-1.875, NEG_INF, NEG_INF]
    assert t6.ancestor_mask[0, 5].tolist() == [0, 0, 0, 0, 0, 1, 0]
    assert t6.ancestor_mask[0, :, 5].tolist() == [0, 0, 0, 0, 0, 1, 0]
    for t_ in (t, t6):
        assert_same_tree(build_tree_reference(torch.tensor([7]), lp, ids, t_.budget), t_)


def test_star():
    lp = torch.tensor([[[-0.1, -0.2, -0.2, -3.0]]])
    ids = torch.tensor([[[5, 6, 4, 9]]])
    t = build_tree(torch.tensor([1]), lp, ids, 3)
    assert t.tokens.tolist() == [[1, 5, 6, 4]]  # equal -0.2: rank 1 before rank 2
    assert t.parents.tolist() == [[-1, 0, 0, 0]]
    assert t.retrive_next_token.tolist() == [[1, -1, -1, -1]]
    assert t.retrive_next_sibling.tolist() == [[-1, 2, 3, -1]]
    assert t.ancestor_mask[0].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]]
    assert_same_tree(build_tree_reference(torch.tensor([1]), lp, ids, 3), t)


def test_branching_deep_tree():
    # scores: (0) -.5, (1) -1, (0,0) -.75, (1,0) -1.25, (0,0,0) -1.25, (0,0,1) -1.5, (1,0,0) -1.75
    # (1,0) and (0,0,0) tie at -1.25: the shallower one goes first.
    lp = torch.tensor([[[-0.5, -1.0], [-0.25, -2.0], [-0.5, -0.75]]])
    ids = torch.tensor([[[1, 2], [3, 4], [5, 6]]])
    t = build_tree(torch.tensor([9]), lp, ids, 7)
    assert t.tokens.tolist() == [[9, 1, 3, 2, 3, 5, 6, 5]]
    assert t.parents.tolist() == [[-1, 0, 1, 0, 3, 2, 2, 4]]
    assert t.depths.tolist() == [[0, 1, 2, 1, 2, 3, 3, 3]]
    assert t.scores.tolist() == [[0.0, -0.5, -0.75, -1.0, -1.25, -1.25, -1.5, -1.75]]
    assert t.retrive_next_token.tolist() == [[1, 2, 5, 4, 7, -1, -1, -1]]
    assert t.retrive_next_sibling.tolist() == [[-1, 3, -1, -1, -1, 6, -1, -1]]
    rows = [{0}, {0, 1}, {0, 1, 2}, {0, 3}, {0, 3, 4}, {0, 1, 2, 5}, {0, 1, 2, 6}, {0, 3, 4, 7}]
    assert t.ancestor_mask[0].tolist() == [[j in r for j in range(8)] for r in rows]
    assert_same_tree(build_tree_reference(torch.tensor([9]), lp, ids, 7), t)


def test_rounding_tie_across_parents():
    """fp32 rounding makes children of parents with different scores tie; the rank path decides.

    Depth-2 nodes (0,1) = -1.5 - 2^-20 and (1,0) = -1.5: (1,0) scores higher but (0,1) is
    lexicographically first. Adding -1024 rounds both children to -1025.5, so (0,1)'s children go
    first. (0,1) is the 3rd best parent: (3) * (r + 1) <= 38 reaches r = 11 only, yet all 16 of its
    children belong to the tree -- a pure harmonic candidate bound would miss four of them.
    """
    k = 16
    lp = torch.full((1, 3, k), NEG_INF)
    lp[0, 0, :2] = torch.tensor([-1.0, -1.5])
    lp[0, 1, :2] = torch.tensor([0.0, -0.5 - 2.0**-20])
    lp[0, 2, :] = -1024.0
    ids = torch.stack([torch.arange(k) + 100 * d for d in range(3)]).unsqueeze(0)
    t = build_tree(torch.tensor([0]), lp, ids, 38)
    assert t.parents[0, 1:7].tolist() == [0, 1, 0, 3, 1, 3]  # (0) (0,0) (1) (1,0) (0,1) (1,1)
    assert t.parents[0, 7:23].tolist() == [2] * 16  # (0,0,r): -1025
    assert t.parents[0, 23:39].tolist() == [5] * 16  # (0,1,r): -1025.5, ties won by rank path
    assert t.tokens[0, 23:39].tolist() == list(range(200, 216))
    assert_same_tree(build_tree_reference(torch.tensor([0]), lp, ids, 38), t)


def test_unreachable_and_vocab_smaller_than_k():
    lp = torch.full((2, 3, 4), NEG_INF)
    lp[0, 0, 0] = -0.1  # request 0: a single reachable node
    lp[1, :, :2] = torch.tensor([-0.5, -0.7])  # request 1: 2 + 4 + 8 = 14 reachable
    ids = torch.arange(4).expand(2, 3, 4).contiguous()
    t = build_tree(torch.tensor([3, 4]), lp, ids, 20)
    assert t.valid.sum(1).tolist() == [2, 15]
    assert_same_tree(build_tree_reference(torch.tensor([3, 4]), lp, ids, 20), t)
    check_structure(t, lp)


def test_nan_and_negative_zero_inputs():
    lp = torch.tensor([[[-0.0, float("nan")], [0.0, -0.0]]])
    ids = torch.tensor([[[1, 2], [3, 4]]])
    t = build_tree(torch.tensor([0]), lp, ids, 4)  # NaN = unreachable, -0.0 == 0.0
    assert t.tokens.tolist() == [[0, 1, 3, 4, 0]]
    assert t.valid.tolist() == [[True, True, True, True, False]]


# ---------------------------------------------------------------------------------------------
# Layout helpers, dummies, errors


def test_full_mask_layout():
    g = torch.Generator().manual_seed(5)
    roots, lp, ids = random_inputs(3, 4, 3, 20, g)
    t = build_tree(roots, lp, ids, 6)
    seq = torch.tensor([2, 0, 5])
    offsets = full_mask_offsets(seq, t.num_nodes)
    n = t.num_nodes
    total = int((n * (seq + n)).sum())
    out = torch.zeros(total + 9, dtype=torch.bool)
    full_mask_layout(t.ancestor_mask, seq, out, offsets)
    expected = []
    for b in range(3):
        block = torch.cat([torch.ones(n, int(seq[b]), dtype=torch.bool), t.ancestor_mask[b]], 1)
        expected.append(block.reshape(-1))
    assert torch.equal(out[:total], torch.cat(expected))
    assert offsets.tolist() == [0, n * (2 + n), n * (2 + n) + n * n]


def test_make_dummy_is_a_valid_root_only_tree():
    t = DraftTree.make_dummy(2, 5, "cpu", max_depth=3, root_token=4)
    assert t.tokens[:, 0].tolist() == [4, 4] and t.valid.sum().item() == 2
    check_structure(t, torch.full((2, 3, 2), NEG_INF))
    copy = DraftTree.empty(2, 5, "cpu").copy_(t)
    assert_same_tree(t, copy)


def test_errors_name_the_tensor():
    lp, r = torch.zeros(1, 2, 3), torch.zeros(1, dtype=torch.int64)
    ids = torch.zeros(1, 2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="budget"):
        build_tree(r, lp, ids, 0)
    with pytest.raises(ValueError, match="budget"):
        build_tree(r, lp, ids, 1025)
    with pytest.raises(ValueError, match="topk_logp"):
        build_tree(r, lp.double(), ids, 4)
    with pytest.raises(ValueError, match="topk_ids"):
        build_tree(r, lp, ids[:, :1], 4)
    with pytest.raises(ValueError, match="root_ids"):
        build_tree(r.int(), lp, ids, 4)
    with pytest.raises(ValueError, match="out"):
        build_tree(r, lp, ids, 4, out=DraftTree.empty(1, 5, "cpu"))
    ids_ok = torch.arange(3).expand(1, 2, 3).contiguous()
    with pytest.raises(ValueError, match="sorted"):
        build_tree_reference(r, torch.tensor([[[-1.0, -0.5, -2.0], [0.0, -1.0, -2.0]]]), ids_ok, 4)
    with pytest.raises(ValueError, match="<= 0"):
        build_tree_reference(r, torch.tensor([[[0.5, -0.5, -2.0], [0.0, -1.0, -2.0]]]), ids_ok, 4)
    with pytest.raises(ValueError, match="distinct"):
        build_tree_reference(r, lp, ids, 4)


def test_budget_one_and_max_budget_shapes():
    g = torch.Generator().manual_seed(11)
    roots, lp, ids = random_inputs(2, 3, 4, 30, g)
    t = build_tree(roots, lp, ids, 1)
    assert t.tokens.shape == (2, 2) and t.depths[:, 1].tolist() == [1, 1]
    assert t.tokens[:, 1].tolist() == ids[:, 0, 0].tolist()
    roots, lp, ids = random_inputs(1, 15, 64, 80, g, scale=0.3)
    assert_same_tree(build_tree_reference(roots, lp, ids, 1024), build_tree(roots, lp, ids, 1024))


def test_pairs_enumeration():
    from sglang_ddtree.tree import _harmonic_pairs
    for b, kc in itertools.product([1, 2, 7, 64], [1, 3, 64]):
        pj, pr = _harmonic_pairs(b, min(kc, b), "cpu")
        want = [(j, r) for j in range(b) for r in range(min(kc, b)) if (j + 1) * (r + 1) <= b]
        assert list(zip(pj.tolist(), pr.tolist())) == want
