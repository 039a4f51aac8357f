"""Draft head: top-k log-probs, vocab-parallel shard + merge == unsharded."""
import pytest
import torch

from sglang_ddtree.draft_head import merge_vocab_parallel, shard_topk, topk_logprobs

NEG_INF = float("-inf")


def split_vocab(logits, ranks, pad_value=NEG_INF):
    """Contiguous vocab shards as a padded lm_head gives them: [R] x [T, ceil(V / R)]."""
    t, v = logits.shape
    per = -(-v // ranks)
    padded = torch.full((t, per * ranks), pad_value, dtype=logits.dtype)
    padded[:, :v] = logits
    return [padded[:, r * per:(r + 1) * per] for r in range(ranks)], per


def sharded(logits, k, ranks, vocab_size=None, pad_value=NEG_INF, k_local=None):
    shards, per = split_vocab(logits, ranks, pad_value)
    outs = [shard_topk(s, k_local or k, r * per, vocab_size) for r, s in enumerate(shards)]
    vals, ids, lse = (torch.stack(x) for x in zip(*outs))
    return merge_vocab_parallel(vals, ids, lse, k)


def distinct_logits(t, v, g):
    return torch.randn(t, v, generator=g, dtype=torch.float64).float() * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_topk_logprobs_matches_log_softmax(dtype):
    g = torch.Generator().manual_seed(0)
    t, v, k = 6, 200, 16
    # distinct values exactly representable in every dtype: k/8 for k < 200, shuffled
    logits = torch.stack([torch.randperm(v, generator=g) for _ in range(t)]).to(dtype) / 8
    logp, ids = topk_logprobs(logits, k)
    want_vals, want_ids = torch.log_softmax(logits.float(), -1).topk(k, -1)
    assert logp.dtype == torch.float32 and ids.dtype == torch.int64 and logp.shape == (t, k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(logp, want_vals, atol=1e-5, rtol=0)
    assert (logp[:, 1:] <= logp[:, :-1]).all()


def test_ties_order_by_token_id_and_k_above_vocab():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    logp, ids = topk_logprobs(logits, 4)
    assert ids.tolist() == [[1, 2, 4, 3]]
    lse = torch.logsumexp(logits, -1)
    torch.testing.assert_close(logp, (torch.tensor([[3.0, 3.0, 3.0, 2.0]]) - lse), atol=1e-6,
                               rtol=0)
    logp, ids = topk_logprobs(logits, 7)  # k > V: -inf entries with id -1
    assert ids[0, 5:].tolist() == [-1, -1] and torch.isneginf(logp[0, 5:]).all()
    assert ids[0, :5].tolist() == [1, 2, 4, 3, 0]


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("vocab", [1000, 997])
def test_vocab_parallel_equals_unsharded(ranks, vocab):
    g = torch.Generator().manual_seed(ranks * vocab)
    logits = distinct_logits(12, vocab, g)
    for k in (1, 5, 32):
        want_logp, want_ids = topk_logprobs(logits, k)
        got_logp, got_ids = sharded(logits, k, ranks)
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_logp, want_logp, atol=2e-5, rtol=0)


def test_vocab_padding_masked_by_vocab_size():
    # a padded lm_head produces real numbers (here large ones) in the padding columns
    g = torch.Generator().manual_seed(1)
    logits = distinct_logits(5, 101, g)
    want_logp, want_ids = topk_logprobs(logits, 8)
    got_logp, got_ids = sharded(logits, 8, 4, vocab_size=101, pad_value=50.0)
    assert torch.equal(got_ids, want_ids) and (got_ids < 101).all()
    torch.testing.assert_close(got_logp, want_logp, atol=2e-5, rtol=0)


def test_fully_padded_shard_and_tiny_shards():
    g = torch.Generator().manual_seed(2)
    logits = distinct_logits(3, 9, g)  # 9 tokens over 8 ranks: shards of 2, the last all padding
    want_logp, want_ids = topk_logprobs(logits, 6)
    got_logp, got_ids = sharded(logits, 6, 8)  # k = 6 > shard size 2: -inf pads per shard
    assert not torch.isnan(got_logp).any()
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_logp, want_logp, atol=2e-5, rtol=0)
    vals, ids, lse = shard_topk(torch.full((3, 2), NEG_INF), 4, 16)
    assert torch.isneginf(lse).all() and torch.isneginf(vals).all()


def test_merge_is_deterministic_with_cross_shard_ties():
    # integer logits: many ties across shards; the merge must order them by token id, whatever
    # the rank order of the gathered inputs
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 6, (4, 40), generator=g).float()
    shards, per = split_vocab(logits, 4)
    outs = [shard_topk(s, 40, r * per) for r, s in enumerate(shards)]  # k_local = whole shard
    vals, ids, lse = (torch.stack(x) for x in zip(*outs))
    logp, got = merge_vocab_parallel(vals, ids, lse, 12)
    for row in range(4):
        order = sorted(range(40), key=lambda i: (-logits[row, i].item(), i))[:12]
        assert got[row].tolist() == order
    perm = torch.tensor([2, 0, 3, 1])
    logp2, got2 = merge_vocab_parallel(vals[perm], ids[perm], lse[perm], 12)
    assert torch.equal(got, got2)
    torch.testing.assert_close(logp, logp2, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse.logsumexp(0), torch.logsumexp(logits, -1), atol=1e-5, rtol=0)


def test_errors_name_the_tensor():
    with pytest.raises(ValueError, match="topk_logprobs"):
        topk_logprobs(torch.zeros(3), 2)
    with pytest.raises(ValueError, match="shard_topk"):
        shard_topk(torch.zeros(2, 3, dtype=torch.int64), 2, 0)
    with pytest.raises(ValueError, match="merge_vocab_parallel"):
        merge_vocab_parallel(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4).long(), torch.zeros(2), 2)
    vals, ids = torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="R\\*k'"):
        merge_vocab_parallel(vals, ids, torch.zeros(2, 3), 9)
