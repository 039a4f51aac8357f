"""Per-node sampling: top-k/top-p/min-p filtering and the exponential race's distribution."""

import types

import torch

from sglang_ddtree.sampling import exponential_race, filter_probs, sample_per_node


def test_filter_probs_semantics():
    p = torch.tensor([[0.5, 0.1, 0.25, 0.15]])
    one = torch.ones(1)
    assert filter_probs(p, torch.tensor([2]), one, None).tolist() == [[0.5, 0.0, 0.25, 0.0]]
    # top-p 0.7: keep tokens whose preceding cumulative mass is <= 0.7 -> 0.5, 0.25
    assert filter_probs(p, torch.tensor([4]), torch.tensor([0.7]), None).tolist() == \
        [[0.5, 0.0, 0.25, 0.0]]
    # min-p 0.4 of the top (0.5): keep >= 0.2
    assert filter_probs(p, torch.tensor([4]), one, torch.tensor([0.4])).tolist() == \
        [[0.5, 0.0, 0.25, 0.0]]


def test_exponential_race_matches_distribution():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 40000
    draws = exponential_race(p.repeat(n, 1), g)
    freq = torch.bincount(draws, minlength=4).float() / n
    # 4 sigma of a binomial proportion at n = 40000 is < 0.011
    assert torch.allclose(freq, p, atol=0.011), freq


def _info(bs, temps, top_ks, seeds=None):
    return types.SimpleNamespace(
        temperatures=torch.tensor(temps).view(-1, 1), top_ks=torch.tensor(top_ks),
        top_ps=torch.ones(bs), min_ps=torch.zeros(bs), need_top_k_sampling=True,
        need_top_p_sampling=False, need_min_p_sampling=False, sampling_seed=seeds)


def test_greedy_rows_in_a_mixed_batch_take_argmax():
    logits = torch.randn(2 * 3, 11)
    out = sample_per_node(logits, _info(2, [1.0, 1.0], [1, 11]), 3)
    assert torch.equal(out[:3], logits[:3].argmax(-1))


def test_seeded_rows_use_the_seeded_sampler_with_positions():
    calls = {}

    def seeded(logprobs, seeds, positions):
        calls["seeds"], calls["positions"] = seeds.tolist(), positions.tolist()
        return logprobs.argmax(-1, keepdim=True)

    logits = torch.randn(2 * 2, 7)
    pos = torch.tensor([5, 6, 9, 10])
    sample_per_node(logits, _info(2, [0.7, 0.7], [7, 7], seeds=torch.tensor([3, 4])), 2,
                    positions=pos, seeded_sampler=seeded)
    assert calls == {"seeds": [3, 3, 4, 4], "positions": [5, 6, 9, 10]}


def test_bounded_top_k_ranks_only_the_top_and_filters_the_same():
    g = torch.Generator().manual_seed(3)
    rows, vocab = 12, 300
    probs = torch.softmax(3 * torch.randn(rows, vocab, generator=g), -1)  # distinct values
    top_ks = torch.randint(1, 40, (rows,), generator=g)
    top_ps = torch.rand(rows, generator=g) * 0.6 + 0.4
    min_ps = torch.rand(rows, generator=g) * 0.2
    for mp in (None, min_ps):
        full = filter_probs(probs, top_ks, top_ps, mp)
        bounded = filter_probs(probs, top_ks, top_ps, mp, max_top_k=int(top_ks.max()))
        assert torch.equal(full, bounded)
    # a bound that does not limit anything (>= vocab) falls back to the full sort
    assert torch.equal(filter_probs(probs, top_ks, top_ps, None, max_top_k=vocab),
                       filter_probs(probs, top_ks, top_ps, None))


def test_host_max_top_k():
    from sglang_ddtree.sampling import host_max_top_k

    req = lambda k: types.SimpleNamespace(sampling_params=types.SimpleNamespace(top_k=k))  # noqa
    assert host_max_top_k([req(50), req(20)], 1000) == 50
    assert host_max_top_k([req(50), req(-1)], 1000) is None  # one request samples everything
    assert host_max_top_k([req(50), req(1 << 30)], 1000) is None  # SGLang's TOP_K_ALL
    assert host_max_top_k([], 1000) is None
