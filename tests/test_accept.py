"""Accept walk: hand-made greedy cases, vectorised == reference, and statistical losslessness."""
import pytest
import torch

from sglang_ddtree.accept import accept_walk, accept_walk_reference, emitted_tokens
from sglang_ddtree.tree import DraftTree, build_tree
from tests._tree_inputs import random_inputs

# Tree from test_tree.test_branching_deep_tree (D = 3):
#   node:    0  1  2  3  4  5  6  7
#   token:   9  1  3  2  3  5  6  5
#   parent: -1  0  1  0  3  2  2  4
HAND_LP = torch.tensor([[[-0.5, -1.0], [-0.25, -2.0], [-0.5, -0.75]]])
HAND_IDS = torch.tensor([[[1, 2], [3, 4], [5, 6]]])


def hand_tree() -> DraftTree:
    t = build_tree(torch.tensor([9]), HAND_LP, HAND_IDS, 7)
    assert t.tokens.tolist() == [[9, 1, 3, 2, 3, 5, 6, 5]]
    return t


def both_walks(tree, predicted):
    ref = accept_walk_reference(tree, predicted)
    got = accept_walk(tree, predicted)
    for a, b in zip(ref, got):
        assert torch.equal(a, b), (ref, got)
    return got


@pytest.mark.parametrize("pred, accept_len, nodes, bonus, emitted", [
    # root's children carry tokens 1 and 2: target says 7 -> nothing accepted, 7 is the bonus
    ([7, 0, 0, 0, 0, 0, 0, 0], 0, [0, -1, -1, -1], 7, [7, -1, -1, -1]),
    # through the second (non-first) child of the root, then a miss at node 4
    ([2, 0, 0, 3, 8, 0, 0, 0], 2, [0, 3, 4, -1], 8, [2, 3, 8, -1]),
    # full depth, ending in node 2's second child
    ([1, 3, 6, 0, 0, 0, 11, 0], 3, [0, 1, 2, 6], 11, [1, 3, 6, 11]),
    # full depth along first children, bonus from the leaf
    ([1, 3, 5, 0, 0, 4, 0, 0], 3, [0, 1, 2, 5], 4, [1, 3, 5, 4]),
])
def test_greedy_hand_cases(pred, accept_len, nodes, bonus, emitted):
    t = hand_tree()
    al, an, bo = both_walks(t, torch.tensor([pred]))
    assert al.tolist() == [accept_len] and an.tolist() == [nodes] and bo.tolist() == [bonus]
    assert emitted_tokens(t, al, an, bo).tolist() == [emitted]


def test_padding_nodes_never_match():
    # one reachable node; padding nodes carry token 0 and must not be walked into
    lp = torch.full((1, 2, 2), float("-inf"))
    lp[0, 0, 0] = -0.1
    t = build_tree(torch.tensor([3]), lp, torch.tensor([[[4, 5], [6, 7]]]), 4)
    assert t.tokens.tolist() == [[3, 4, 0, 0, 0]]
    al, an, bo = both_walks(t, torch.tensor([[4, 0, 0, 0, 0]]))
    assert al.tolist() == [1] and an.tolist() == [[0, 1, -1]] and bo.tolist() == [0]
    al, _, bo = both_walks(t, torch.tensor([[0, 0, 0, 0, 0]]))
    assert al.tolist() == [0] and bo.tolist() == [0]


def test_vectorised_matches_reference_on_random_trees():
    g = torch.Generator().manual_seed(21)
    for trial in range(30):
        bs, depth, k, budget = 1 + trial % 5, [1, 3, 7, 15][trial % 4], [1, 2, 8][trial % 3], \
            [1, 2, 7, 32, 64][trial % 5]
        roots, lp, ids = random_inputs(bs, depth, k, 12, g, scale=1.0)
        t = build_tree(roots, lp, ids, budget)
        # target follows a random existing child 85% of the time, else a random token
        n = t.num_nodes
        follow = torch.randint(0, 12, (bs, n), generator=g)
        for b in range(bs):
            for i in range(n):
                kids = [j for j in range(n) if t.parents[b, j] == i]
                if kids and torch.rand(1, generator=g).item() < 0.85:
                    follow[b, i] = t.tokens[b, kids[torch.randint(len(kids), (1,), generator=g)]]
        al, an, bo = both_walks(t, follow)
        assert (al <= min(depth, budget)).all()


def test_walk_needs_max_depth():
    t = hand_tree()
    t.max_depth = None
    with pytest.raises(ValueError, match="max_depth"):
        accept_walk(t, torch.zeros(1, 8, dtype=torch.int64))
    assert accept_walk(t, torch.zeros(1, 8, dtype=torch.int64), max_depth=3)[1].shape == (1, 4)
    with pytest.raises(ValueError, match="predicted"):
        accept_walk(hand_tree(), torch.zeros(1, 7, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------
# Losslessness at temperature > 0: sample one token per node from the target, walk, and check that
# emitted tokens follow the target's conditionals exactly (chi-square, significance 1e-3).

V, D, K, BUDGET, TRIALS, L = 5, 3, 3, 8, 20000, 3
CTX0, ROOT0 = 1, 3


def chi2_pvalue(stat: float, df: int) -> float:
    """Upper tail of the chi-square distribution: Q(df/2, stat/2), regularised gamma."""
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                   torch.tensor(stat / 2, dtype=torch.float64)).item()


def test_chi2_pvalue_matches_table():
    # textbook critical values at significance 1e-3
    assert abs(chi2_pvalue(18.467, 4) - 1e-3) < 2e-6
    assert abs(chi2_pvalue(149.449, 100) - 1e-3) < 2e-6


def target_table(g):
    """p(x | a, b) = table[a, b]: a fixed conditional on the last two tokens, all probs >= 0.1."""
    return 0.5 * torch.softmax(torch.randn(V, V, V, generator=g) * 1.5, -1) + 0.5 / V


def draft(bs, g):
    logp = torch.log_softmax(torch.randn(bs, D, V, generator=g) * 1.5, -1)
    vals, ids = logp.topk(K, -1)
    return vals.contiguous(), ids.contiguous()


def node_context(tree, ctx):
    """(token before, token) of every node: the target's conditional at node i is table[pair]."""
    prev = torch.where(tree.parents >= 0, tree.tokens.gather(1, tree.parents.clamp(min=0)), 0)
    prev[:, 0] = ctx
    return prev, tree.tokens


def sample_target(table, prev, cur, g):
    probs = table[prev, cur]  # [bs, N, V]
    return torch.multinomial(probs.view(-1, V), 1, generator=g).view(prev.shape)


def simulate(table, g, mode="correct", trials=TRIALS):
    """First L emitted tokens per trial, running as many tree steps as needed."""
    out = torch.full((trials, L), -1, dtype=torch.int64)
    count = torch.zeros(trials, dtype=torch.int64)
    ctx = torch.full((trials,), CTX0)
    root = torch.full((trials,), ROOT0)
    for _ in range(L):
        lp, ids = draft(trials, g)
        tree = build_tree(root, lp, ids, BUDGET)
        prev, cur = node_context(tree, ctx)
        if mode == "wrong_context":  # bug: each node sampled with its parent's context
            up = tree.parents.clamp(min=0)
            prev, cur = prev.gather(1, up), cur.gather(1, up)
        predicted = sample_target(table, prev, cur, g)
        if mode == "draft_argmax":  # bug: trust the draft's top token instead of the target
            nxt_depth = tree.depths.clamp(max=D - 1)
            predicted = ids[:, :, 0].gather(1, nxt_depth)
        al, an, bo = accept_walk(tree, predicted)
        em = emitted_tokens(tree, al, an, bo)
        for j in range(D + 1):
            pos = count + j
            ok = (j <= al) & (pos < L)
            out[ok, pos[ok]] = em[ok, j]
        last_accepted = torch.where(al >= 1, em.gather(1, (al - 1).clamp(min=0)[:, None])[:, 0],
                                    root)
        ctx, root = last_accepted, bo
        count = count + al + 1
    assert (out >= 0).all()
    return out


def chi2_conditional(x, given, table_rows):
    """Chi-square of x against table_rows(key) within each group of equal ``given`` rows
    (one group when ``given`` has no columns); returns the p-value."""
    keys = torch.unique(given, dim=0) if given.shape[1] else given[:1]
    stat, df = 0.0, 0
    for key in keys:
        sel = (given == key).all(1)
        n = int(sel.sum())
        obs = torch.bincount(x[sel], minlength=V).double()
        exp = table_rows(key).double() * n
        stat += float(((obs - exp) ** 2 / exp).sum())
        df += V - 1
    return chi2_pvalue(stat, df)


def emitted_pvalues(seq, table):
    """p-values of x1 ~ p(.|ctx, root), x2 ~ p(.|root, x1), x3 ~ p(.|x1, x2)."""
    p1 = chi2_conditional(seq[:, 0], seq[:, :0], lambda k: table[CTX0, ROOT0])
    p2 = chi2_conditional(seq[:, 1], seq[:, :1], lambda k: table[ROOT0, k[0]])
    p3 = chi2_conditional(seq[:, 2], seq[:, :2], lambda k: table[k[0], k[1]])
    return p1, p2, p3


def test_sampled_walk_is_lossless():
    g = torch.Generator().manual_seed(2024)
    table = target_table(g)
    seq = simulate(table, g)
    p1, p2, p3 = emitted_pvalues(seq, table)
    assert min(p1, p2, p3) > 1e-3, (p1, p2, p3)


@pytest.mark.parametrize("mode, which", [("draft_argmax", 0), ("wrong_context", 1)])
def test_statistical_test_rejects_biased_walks(mode, which):
    g = torch.Generator().manual_seed(2024)
    table = target_table(g)
    # the biases are gross: a fifth of the trials already gives p-values far below 1e-3
    pvals = emitted_pvalues(simulate(table, g, mode, trials=TRIALS // 5), table)
    assert pvals[which] < 1e-3, pvals
