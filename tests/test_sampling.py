"""Per-node sampling: top-k/top-p/min-p filtering and the exponential race's distribution."""

import types

import pytest
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


def test_seeded_rows_use_the_seeded_draw_with_positions():
    calls = {}

    def seeded(logprobs, seeds, positions):
        calls["seeds"], calls["positions"] = seeds.tolist(), positions.tolist()
        return logprobs.argmax(-1, keepdim=True)

    def filtered(*a):
        raise AssertionError("no filter in this batch: the vocabulary-order draw")

    logits = torch.randn(2 * 2, 7)
    pos = torch.tensor([5, 6, 9, 10])
    info = _info(2, [0.7, 0.7], [7, 7], seeds=torch.tensor([3, 4]))
    info.need_top_k_sampling = False
    sample_per_node(logits, info, 2, positions=pos, seeded_fns=(seeded, filtered))
    assert calls == {"seeds": [3, 3, 4, 4], "positions": [5, 6, 9, 10]}


@pytest.fixture
def sglang_sampler():
    """SGLang's sampler module, its torch.compile'd hash sampler run eagerly (CPU runner)."""
    sampler = pytest.importorskip("sglang.srt.layers.sampler")
    try:
        with torch._dynamo.config.patch(disable=True):
            sampler.multinomial_with_seed(torch.zeros(1, 2), torch.zeros(1, dtype=torch.int64),
                                          torch.zeros(1, dtype=torch.int64))
    except ImportError as e:  # 0.5.23 hashes with sgl_kernel, absent on a CPU-only runner
        pytest.skip(f"SGLang's seeded sampler needs {e.name}")
    with torch._dynamo.config.patch(disable=True):
        yield sampler


@pytest.mark.parametrize("filters", ["none", "top_k", "top_p"])
def test_seeded_draw_is_the_draw_sglang_makes_for_a_decode_step(filters, sglang_sampler):
    """Every node row draws what SGLang's own sampler (pytorch backend, deterministic mode)
    draws for a decode step with the same distribution, seed and position: a seeded DDTREE run
    then reproduces the target's own seeded output."""
    sampler = sglang_sampler
    g = torch.Generator().manual_seed(11)
    bs, n, vocab = 3, 4, 97
    logits = 2 * torch.randn(bs * n, vocab, generator=g)
    temps = torch.tensor([0.7, 1.0, 1.3])
    top_ks = torch.tensor({"top_k": [5, 20, 50]}.get(filters, [1 << 30] * 3), dtype=torch.int32)
    top_ps = torch.tensor({"top_p": [0.8, 0.9, 0.5]}.get(filters, [1.0] * 3))
    seeds = torch.tensor([7, 8, 123456789], dtype=torch.int64)
    info = types.SimpleNamespace(
        temperatures=temps.view(-1, 1), top_ks=top_ks, top_ps=top_ps, min_ps=torch.zeros(bs),
        need_top_k_sampling=filters == "top_k", need_top_p_sampling=filters == "top_p",
        need_min_p_sampling=False, sampling_seed=seeds)
    positions = torch.arange(bs * n) + 40
    got = sample_per_node(logits, info, n, positions=positions,
                          seeded_fns=(sampler.multinomial_with_seed,
                                      sampler.top_k_top_p_min_p_sampling_from_probs_torch))
    # SGLang's Sampler on the same rows as if each were one request's decode step
    rep = lambda t: t.repeat_interleave(n, dim=0)  # noqa: E731
    row_info = types.SimpleNamespace(
        temperatures=rep(temps.view(-1, 1)), top_ks=rep(top_ks), top_ps=rep(top_ps),
        min_ps=torch.zeros(bs * n), need_top_k_sampling=info.need_top_k_sampling,
        need_top_p_sampling=info.need_top_p_sampling, need_min_p_sampling=False,
        sampling_seed=rep(seeds))
    probs = torch.softmax(logits / row_info.temperatures, dim=-1)
    if filters == "none":
        want = sampler.sampling_from_probs_torch(probs, row_info.sampling_seed, positions)
    else:
        want = sampler.top_k_top_p_min_p_sampling_from_probs_torch(
            probs, row_info.top_ks, row_info.top_ps, row_info.min_ps, False,
            row_info.sampling_seed, positions)
    assert torch.equal(got, want.view(-1).long())
    # and it is a function of (seed, position, distribution) only: another seed differs
    info.sampling_seed = seeds + 1
    other = sample_per_node(logits, info, n, positions=positions,
                            seeded_fns=(sampler.multinomial_with_seed,
                                        sampler.top_k_top_p_min_p_sampling_from_probs_torch))
    assert not torch.equal(other, got)


def test_unseeded_rows_of_a_mixed_batch_keep_the_race():
    """request_seeds -1 (no seed) rows are drawn by the exponential race, seeded rows by the
    seeded draw."""
    def seeded(logprobs, seeds, positions):
        return torch.zeros(logprobs.shape[0], 1, dtype=torch.int64)  # token 0, recognisable

    logits = torch.full((2 * 2, 5), -5.0)
    logits[:, 3] = 5.0  # the race picks 3 almost surely
    info = _info(2, [1.0, 1.0], [5, 5])
    info.need_top_k_sampling = False
    out = sample_per_node(logits, info, 2, positions=torch.arange(4),
                          seeded_fns=(seeded, None), request_seeds=torch.tensor([-1, 9]))
    assert out.tolist() == [3, 3, 0, 0]


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


def test_chunked_rows_give_the_same_filter_and_draws(monkeypatch, sglang_sampler):
    """Big blocks run row-wise in chunks (bounded temporaries): same filtered probabilities,
    same seeded draws."""
    from sglang_ddtree import sampling

    g = torch.Generator().manual_seed(4)
    rows, vocab = 10, 64
    probs = torch.softmax(2 * torch.randn(rows, vocab, generator=g), -1)
    top_ks = torch.randint(1, vocab, (rows,), generator=g, dtype=torch.int32)
    top_ps = torch.rand(rows, generator=g) * 0.5 + 0.5
    min_ps = torch.rand(rows, generator=g) * 0.1
    info = types.SimpleNamespace(need_top_k_sampling=True, need_top_p_sampling=True,
                                 need_min_p_sampling=False)
    seeds = torch.arange(rows, dtype=torch.int64) + 11
    pos = torch.arange(rows) + 3
    fns = (sglang_sampler.multinomial_with_seed,
           sglang_sampler.top_k_top_p_min_p_sampling_from_probs_torch)
    whole = (sampling.filter_probs(probs, top_ks, top_ps, min_ps),
             sampling.seeded_draw(probs, top_ks, top_ps, min_ps, info, seeds, pos, fns))
    monkeypatch.setattr(sampling, "SORT_CHUNK_ELEMENTS", 3 * vocab)  # 3 rows per chunk
    assert sampling.row_chunks(rows, vocab) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    chunked = (sampling.filter_probs(probs, top_ks, top_ps, min_ps),
               sampling.seeded_draw(probs, top_ks, top_ps, min_ps, info, seeds, pos, fns))
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


class _FakeFlashinferSampler:
    """Records the calls SGLang's flashinfer branch makes; draws the argmax of what it gets."""

    def __init__(self):
        self.calls = []

    def top_k_top_p_sampling_from_probs(self, probs, top_ks, top_ps, filter_apply_order=None):
        self.calls.append(("joint", filter_apply_order, top_ks.tolist(), top_ps.tolist()))
        return probs.argmax(-1).to(torch.int32)

    def top_k_renorm_prob(self, probs, top_ks):
        self.calls.append(("k_renorm", top_ks.tolist()))
        return probs

    def top_p_renorm_prob(self, probs, top_ps):
        self.calls.append(("p_renorm", top_ps.tolist()))
        return probs

    def min_p_sampling_from_probs(self, probs, min_ps):
        self.calls.append(("min_p", min_ps.tolist()))
        return probs.argmax(-1).to(torch.int32)


def test_flashinfer_row_draw_mirrors_sglangs_flashinfer_branch():
    from sglang_ddtree.sampling import checked_row_draw, make_flashinfer_row_draw

    fake = _FakeFlashinferSampler()
    draw = make_flashinfer_row_draw(fake)
    logits = torch.randn(2 * 3, 9)
    info = _info(2, [0.7, 1.0], [5, 9])
    info.top_ps = torch.tensor([0.9, 0.5])
    out = sample_per_node(logits, info, 3, row_draw=draw)
    # one joint draw over the node rows, each with its request's parameters
    assert fake.calls == [("joint", "joint", [5, 5, 5, 9, 9, 9], pytest.approx([0.9] * 3 + [0.5] * 3))]
    assert out.dtype == torch.int64 and out.shape == (6,)
    # min-p: top-k renorm, top-p renorm, min-p draw, in SGLang's order
    fake.calls.clear()
    info.need_min_p_sampling = True
    info.min_ps = torch.tensor([0.1, 0.2])
    sample_per_node(logits, info, 3, row_draw=draw)
    assert [c[0] for c in fake.calls] == ["k_renorm", "p_renorm", "min_p"]
    # no filter in the batch: the race, not the kernels
    fake.calls.clear()
    info.need_top_k_sampling = info.need_min_p_sampling = False
    sample_per_node(logits, info, 3, row_draw=draw)
    assert fake.calls == []
    # a module without the kernels (CPU build): none; and the start-up check wants CUDA
    assert make_flashinfer_row_draw(object()) is None
    assert checked_row_draw(draw, "cpu") is None
