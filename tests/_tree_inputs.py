"""Random and hand-made inputs for the tree / accept tests (shared by CPU and GPU tests)."""
from __future__ import annotations

import itertools
from typing import Optional

import torch

NEG_INF = float("-inf")


def random_inputs(bs: int, depth: int, k: int, vocab: int, g: torch.Generator, *,
                  quant: Optional[float] = None, p_ninf: float = 0.0, scale: float = 3.0):
    """(root_ids [bs], topk_logp [bs, D, K] sorted desc, topk_ids [bs, D, K]) on the CPU.

    quant: round log-probs to multiples of 1/quant (exact fp32 sums, many exact ties).
    p_ninf: fraction of entries forced to -inf (rows stay sorted). vocab < k gives -inf tails.
    """
    logits = torch.randn(bs, depth, vocab, generator=g) * scale
    logp = torch.log_softmax(logits, -1)
    if quant is not None:
        logp = ((logp * quant).round() / quant).clamp(max=0.0)
    kk = min(k, vocab)
    # random tie order among equal values: shuffle the vocab before a stable sort
    perm = torch.stack([torch.randperm(vocab, generator=g) for _ in range(bs * depth)])
    perm = perm.view(bs, depth, vocab)
    vals, o = torch.sort(logp.gather(-1, perm), dim=-1, descending=True, stable=True)
    vals, ids = vals[..., :kk], perm.gather(-1, o)[..., :kk]
    if k > vocab:  # vocab smaller than K: -inf tail with distinct (unused) ids
        vals = torch.cat([vals, torch.full((bs, depth, k - vocab), NEG_INF)], -1)
        ids = torch.cat([ids, torch.arange(vocab, k).expand(bs, depth, k - vocab)], -1)
    if p_ninf > 0:
        kill = torch.rand(bs, depth, k, generator=g) < p_ninf
        vals = torch.where(kill, NEG_INF, vals)
        vals, o = torch.sort(vals, dim=-1, descending=True, stable=True)
        ids = ids.gather(-1, o)
    roots = torch.randint(0, max(vocab, 1), (bs,), generator=g)
    return roots, vals.contiguous(), ids.contiguous()


def brute_force_paths(logp_b: torch.Tensor, budget: int):
    """All reachable rank paths of one request sorted by the tie-break, first ``budget`` of them.

    Independent of any heap: enumerates every path (small D, K only), fp32 scores accumulated
    depth by depth.
    """
    depth, k = logp_b.shape
    lp = logp_b.tolist()
    nodes = []
    for d in range(1, depth + 1):
        for path in itertools.product(range(k), repeat=d):
            s = torch.tensor(0.0, dtype=torch.float32)
            for i, r in enumerate(path):
                s = s + torch.tensor(lp[i][r], dtype=torch.float32)
            if s.item() > NEG_INF:
                nodes.append((-s.item(), d, path))
    nodes.sort()
    return [(p, -ns) for ns, _, p in nodes[:budget]]
