"""The pure-PyTorch DDTree step (``reference_step``) against plain autoregressive decoding.

Target: a tiny random fp64 transformer (2 layers, RoPE, paged KV pool with shuffled slots).
Drafters: a noisy copy of the target ("good", mean accept length tau > 2) and an unrelated random
model ("bad", tau ~ 1). tau = tokens emitted per step = accepted draft nodes + the bonus token.
"""
import collections
import functools

import pytest
import torch

from sglang_ddtree import reference_step as rs
from sglang_ddtree.accept import accept_walk
from sglang_ddtree.commit import commit_from_path, kv_moves, move_accepted_kv
from sglang_ddtree.tree import build_tree_reference

CFG = rs.TinyConfig(logit_scale=2.0)
MAX_NEW = 20
PROMPT_LENS = (3, 7, 5)
BUDGETS = (1, 4, 16, 40)
BLOCKS = (4, 8)
SEEDS = (0, 1, 2)
FP64_TOL = 1e-9  # fp64 KV after different attention summation orders: ~1e-15 in practice


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Thousands of tiny ops: one intra-op thread is faster, and steady on a shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.lru_cache(maxsize=None)
def _case(seed):
    target = rs.TinyTransformer.random(CFG, seed)
    g = torch.Generator().manual_seed(100 + seed)
    prompts = tuple(tuple(torch.randint(0, CFG.vocab, (n,), generator=g).tolist())
                    for n in PROMPT_LENS)
    drafters = {"good": target.noisy_copy(0.05, seed + 7),
                "bad": rs.TinyTransformer.random(CFG, seed + 1000)}
    return target, prompts, drafters


@functools.lru_cache(maxsize=None)
def _ar(seed, bs):
    target, prompts, _ = _case(seed)
    return rs.ar_generate(target, prompts[:bs], MAX_NEW, slot_seed=seed + 1)


@functools.lru_cache(maxsize=None)
def _dd(seed, bs, kind, budget, block):
    target, prompts, drafters = _case(seed)
    drafter = rs.ChainDrafter(drafters[kind])
    res = rs.ddtree_generate(target, drafter, prompts[:bs], MAX_NEW, budget, block,
                             slot_seed=seed + 2)  # checks=True: tree/walk/mask oracles agree
    return res, drafter


def _tau(res):
    return float(torch.cat(res.accept_lens).double().mean()) + 1.0


@pytest.mark.parametrize("bs", [1, 3])
def test_greedy_ddtree_equals_ar(bs):
    hist = {"good": collections.Counter(), "bad": collections.Counter()}
    off_chain = 0
    for seed in SEEDS:
        ar = _ar(seed, bs)
        assert len(set(sum(ar.outputs, []))) >= 4, "degenerate target: output barely varies"
        for kind in ("good", "bad"):
            for budget in BUDGETS:
                for block in BLOCKS:
                    res, _ = _dd(seed, bs, kind, budget, block)
                    assert res.outputs == ar.outputs, (seed, kind, budget, block)
                    hist[kind].update(torch.cat(res.accept_lens).tolist())
                    tau = _tau(res)
                    if kind == "bad":
                        assert tau < 1.5, (seed, budget, block, tau)
                    else:
                        off_chain += res.off_chain
                        assert tau > (2.0 if budget >= 4 else 1.5), (seed, budget, block, tau)
    for kind, h in hist.items():
        n = sum(h.values())
        mean = sum(k * c for k, c in h.items()) / n
        print(f"\nbs={bs} {kind} drafter: accepted drafts per step {dict(sorted(h.items()))}, "
              f"tau = {mean + 1:.2f} over {n} request-steps")
    assert hist["good"][0] > 0 and max(hist["good"]) >= 4  # both rejections and long paths
    assert off_chain > 0  # some accepted paths go through a non-first child


def _toy_grammar(vocab):
    """A constrained decoder's mask whose allowed set depends on the last three tokens, not the
    last alone (a node's mask needs its whole path): token t may follow history h iff
    (5 * sum(h[-3:]) + t) % 3 != 0; the first token must be below vocab // 2."""
    tokens = torch.arange(vocab)

    def constrain(histories, logits):
        for row, h in enumerate(histories):
            ok = tokens < vocab // 2 if not h else (5 * sum(h[-3:]) + tokens) % 3 != 0
            logits[row].masked_fill_(~ok, float("-inf"))

    return constrain, lambda h, t: (t < vocab // 2) if not h else (5 * sum(h[-3:]) + t) % 3 != 0


@pytest.mark.parametrize("bs", [1, 3])
def test_greedy_ddtree_equals_ar_under_a_grammar(bs):
    """Every tree node's logits masked with its own path's history, as the worker masks each
    node with a grammar's bitmask: DDTREE's output is the constrained AR output, token for
    token, and obeys the constraint; the constraint changes the output (it bites)."""
    constrain, allowed = _toy_grammar(CFG.vocab)
    for seed in SEEDS:
        target, prompts, drafters = _case(seed)
        ar = rs.ar_generate(target, prompts[:bs], MAX_NEW, slot_seed=seed + 1,
                            constrain=constrain)
        assert ar.outputs != _ar(seed, bs).outputs
        for out in ar.outputs:
            assert all(allowed(out[:i], t) for i, t in enumerate(out))
        for kind in ("good", "bad"):
            for budget in (4, 16, 40):
                res = rs.ddtree_generate(target, rs.ChainDrafter(drafters[kind]),
                                         prompts[:bs], MAX_NEW, budget, 8,
                                         slot_seed=seed + 2, constrain=constrain)
                assert res.outputs == ar.outputs, (seed, kind, budget)


@pytest.mark.parametrize("bs", [1, 3])
def test_kv_pools_match_ar(bs):
    """Target KV at each request's first seq_len positions equals AR's pool and a cache-free
    forward; the drafter's context K/V equal its projections of the AR target's hidden states."""
    for seed in SEEDS[:2]:
        target, prompts, _ = _case(seed)
        ar = _ar(seed, bs)
        for kind, budget, block in (("good", 4, 4), ("good", 16, 8), ("good", 40, 8),
                                    ("bad", 16, 4), ("good", 1, 8)):
            res, drafter = _dd(seed, bs, kind, budget, block)
            for b in range(bs):
                s = int(ar.rt.seq_lens[b])
                assert int(res.rt.seq_lens[b]) >= s
                toks = torch.tensor(prompts[b] + tuple(ar.outputs[b]))[:s]
                _, hid, k_dense, v_dense = target.forward_dense(toks)
                dd_slots = res.rt.req_to_token[b, :s]
                ar_slots = ar.rt.req_to_token[b, :s]
                assert not torch.equal(dd_slots, ar_slots)  # shuffled free lists differ
                for l in range(CFG.layers):
                    for dd_buf, ar_buf, dense in ((res.rt.pool.k[l], ar.rt.pool.k[l], k_dense[l]),
                                                  (res.rt.pool.v[l], ar.rt.pool.v[l], v_dense[l])):
                        got = dd_buf[dd_slots]
                        assert not got.isnan().any()
                        torch.testing.assert_close(got, ar_buf[ar_slots], atol=FP64_TOL, rtol=0)
                        torch.testing.assert_close(got, dense, atol=FP64_TOL, rtol=0)
                    dk, dv = drafter.model.kv_from_hidden(l, hid[:, l], torch.arange(s))
                    torch.testing.assert_close(drafter.pool.k[l][dd_slots], dk, atol=FP64_TOL,
                                               rtol=0)
                    torch.testing.assert_close(drafter.pool.v[l][dd_slots], dv, atol=FP64_TOL,
                                               rtol=0)


# ----------------------------------------------------------------------------------------------
# KV move ordering


def _one_shot_move(pool, dst, src):
    """The tempting shortcut: every path column in one move_kv_cache call."""
    pool.move_kv_cache(dst.reshape(-1).contiguous(), src.reshape(-1).contiguous())


def _hazard(path_nodes, accept_len) -> bool:
    """A live move j reads slot p_j that another live, non-self move writes (p_j <= k)."""
    for row, k in zip(path_nodes.tolist(), accept_len.tolist()):
        if any(row[j] != j and row[j] <= k and row[row[j]] != row[j] for j in range(1, k + 1)):
            return True
    return False


def test_kv_move_order_constructed():
    # depth 1 ranks score -0.25, -0.5; depth 2 rank 0 -0.5: budget 4 gives nodes
    # 1=(0) -0.25, 2=(1) -0.5, 3=(0,0) -0.75, 4=(1,0) -1.0 (exact binary fractions, no ties)
    logp = torch.tensor([[[-0.25, -0.5], [-0.5, -4.0], [-0.5, -4.0]]])
    ids = torch.tensor([[[10, 11], [20, 21], [30, 31]]])
    tree = build_tree_reference(torch.tensor([7]), logp, ids, 4)
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 2]]
    predicted = torch.tensor([[11, 0, 20, 0, 99]])  # root -> node 2 (11) -> node 4 (20), bonus 99
    accept_len, nodes, bonus = accept_walk(tree, predicted)
    step = commit_from_path(tree, nodes, accept_len, bonus, torch.tensor([3]))
    assert step.path_nodes.tolist() == [[0, 2, 4, 0]] and _hazard(step.path_nodes, accept_len)
    slots = torch.tensor([[12, 5, 9, 2, 14]])  # width max(N=5, block=4)
    dst, src = kv_moves(slots, step.path_nodes, accept_len)
    cfg = rs.TinyConfig(layers=1, heads=1, head_dim=2)
    expect = [12.0, 9.0, 14.0]  # slots of path positions 0..2: root stays, then nodes 2 and 4
    for order, mover, ok in ((None, move_accepted_kv, True), ("forward", move_accepted_kv, True),
                             ("reverse", move_accepted_kv, True), (None, _one_shot_move, True),
                             ("forward", _one_shot_move, True), ("reverse", _one_shot_move, False)):
        pool = rs.KVPool(16, cfg, order)
        pool.k[0].copy_(torch.arange(16.0)[:, None, None].expand(16, 1, 2))
        pool.v[0].copy_(-pool.k[0])
        mover(pool, dst, src)
        got = pool.k[0][slots[0, :3], 0, 0].tolist()
        assert (got == expect) == ok, (order, mover.__name__, got)
        assert torch.equal(pool.v[0], -pool.k[0])


def test_kv_move_order_end_to_end(monkeypatch):
    """Reverse-order in-place moves (a legal schedule of an in-place copy kernel): the package's
    per-column move_accepted_kv keeps the pool equal to AR's; one call for all columns does not."""
    seed, bs = 0, 3
    target, prompts, drafters = _case(seed)
    ar = _ar(seed, bs)
    hazards = []
    real_kv_moves = rs.kv_moves

    def spy(slots, path_nodes, accept_len):
        hazards.append(_hazard(path_nodes, accept_len))
        return real_kv_moves(slots, path_nodes, accept_len)

    monkeypatch.setattr(rs, "kv_moves", spy)

    def run():
        return rs.ddtree_generate(target, rs.ChainDrafter(drafters["good"]), prompts, MAX_NEW, 16,
                                  8, checks=False, kv_move_order="reverse")

    def pool_matches(res):
        return all(torch.allclose(res.rt.pool.k[l][res.rt.req_to_token[b, :s]],
                                  ar.rt.pool.k[l][ar.rt.req_to_token[b, :s]], atol=FP64_TOL, rtol=0)
                   for b in range(bs) for s in [int(ar.rt.seq_lens[b])]
                   for l in range(CFG.layers))

    good = run()
    assert good.outputs == ar.outputs and pool_matches(good)
    assert any(hazards), "no step accepted a path whose one-shot move could collide"
    monkeypatch.setattr(rs, "move_accepted_kv", _one_shot_move)
    bad = run()
    assert not pool_matches(bad)
    print(f"\n{sum(hazards)} of {len(hazards)} steps had a colliding path; one-shot reverse move "
          f"corrupts KV; outputs still equal AR: {bad.outputs == ar.outputs}")


# ----------------------------------------------------------------------------------------------
# Sampling (temperature 1)

S_CFG = rs.TinyConfig(vocab=8, hidden=16, heads=2, head_dim=8, layers=2, ffn=32,
                      dtype=torch.float32)
S_PROMPT = [1, 5, 2, 7]
ALPHA = 1e-3  # a correct sampler fails with probability 0.1% per fixed seed


def _exact_first3(target):
    """P(t1, t2, t3) [V, V, V] fp64 under AR sampling at temperature 1, from cache-free passes."""
    v = S_CFG.vocab

    def probs(seq):
        return torch.softmax(target.forward_dense(torch.tensor(seq))[0][-1].double(), -1)

    p = torch.zeros(v, v, v, dtype=torch.float64)
    p1 = probs(S_PROMPT)
    for a in range(v):
        p2 = probs(S_PROMPT + [a])
        for b in range(v):
            p[a, b] = p1[a] * p2[b] * probs(S_PROMPT + [a, b])
    return p


def _chi_square(counts, p):
    """Pearson goodness of fit; cells expecting < 5 pooled into one. Returns (stat, df, p)."""
    c = counts.flatten().double()
    e = p.flatten() * c.sum()
    big = e >= 5
    stat = ((c[big] - e[big]) ** 2 / e[big]).sum()
    bins = int(big.sum())
    if e[~big].sum() > 0:
        stat += (c[~big].sum() - e[~big].sum()) ** 2 / e[~big].sum()
        bins += 1
    df = bins - 1
    pval = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2)
    return float(stat), df, float(pval)


def _shared_noise_sampler(logits, generator):
    """BUG on purpose: one exponential-race noise vector per request, reused at every node."""
    probs = torch.softmax(logits.float(), -1)
    noise = torch.empty(probs.shape[0], 1, probs.shape[2]).exponential_(1.0, generator=generator)
    return (probs / noise).argmax(-1)


def _sample_counts(gen_fn, runs, seed):
    v = S_CFG.vocab
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(v ** 3, dtype=torch.int64)
    in_tree = 0
    for _ in range(runs // 4000):
        res = gen_fn([S_PROMPT] * 4000, g)
        o = torch.tensor(res.outputs)
        counts.index_add_(0, (o[:, 0] * v + o[:, 1]) * v + o[:, 2], torch.ones(len(o),
                                                                               dtype=torch.int64))
        if res.accept_lens:
            in_tree += int((res.accept_lens[0] >= 1).sum())
    return counts.view(v, v, v), in_tree / runs


def test_sampled_first_tokens_match_ar_distribution():
    """t1 (prefill) and t2, t3 (the first two tokens the tree steps emit) over 24000 runs:
    chi-square vs the exact AR probabilities; AR sampling passes too; a sampler that shares one
    noise vector across a request's nodes (not lossless) is rejected."""
    target = rs.TinyTransformer.random(S_CFG, 3)
    drafter = rs.ChainDrafter(target.noisy_copy(0.1, 11))
    p = _exact_first3(target)

    def dd(sampler):
        return lambda prompts, g: rs.ddtree_generate(target, drafter, prompts, 3, 6, 4,
                                                     mode="sampled", generator=g, sampler=sampler,
                                                     checks=False)

    counts, in_tree = _sample_counts(dd(None), 24000, seed=5)
    stat, df, pval = _chi_square(counts, p)
    print(f"\nDDTree sampled: chi2={stat:.1f} df={df} p={pval:.3g}; t3 from the first tree step "
          f"in {in_tree:.0%} of runs")
    assert pval > ALPHA
    assert in_tree > 0.5  # t3 mostly comes from an accepted tree node, not the next step's root

    ar_counts, _ = _sample_counts(
        lambda prompts, g: rs.ar_generate(target, prompts, 3, mode="sampled", generator=g),
        24000, seed=6)
    ar_stat, ar_df, ar_p = _chi_square(ar_counts, p)
    print(f"AR sampled:     chi2={ar_stat:.1f} df={ar_df} p={ar_p:.3g}")
    assert ar_p > ALPHA

    bad_counts, _ = _sample_counts(dd(_shared_noise_sampler), 8000, seed=7)
    bad_stat, bad_df, bad_p = _chi_square(bad_counts, p)
    print(f"shared-noise control: chi2={bad_stat:.1f} df={bad_df} p={bad_p:.3g}")
    assert bad_p < 1e-9
