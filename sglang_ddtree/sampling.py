"""Temperature > 0: one token per tree node, drawn from the target's processed distribution.

Walking the tree with these tokens (the same walk as greedy) emits, at every position, a sample
of the target's own conditional given the accepted prefix -- lossless without rejection
sampling, and without any draft probabilities. Sampling is an exponential race
(argmax p / E, E ~ Exp(1)), which needs no host sync.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch


# Sorting a whole [rows, vocab] block at once needs several times its size in temporaries
# (values, int64 indices, cumsum): with a tree's bs * (budget + 1) rows and a 160k vocabulary that
# is gigabytes per step. Row-wise work runs in chunks of at most this many elements instead.
SORT_CHUNK_ELEMENTS = 1 << 25


def row_chunks(rows: int, vocab: int, limit: Optional[int] = None):
    """Row ranges [a, b) covering 0..rows, each at most ``limit`` (default
    ``SORT_CHUNK_ELEMENTS``) elements, at least one row; decided from host-side shapes only."""
    step = max(1, (SORT_CHUNK_ELEMENTS if limit is None else limit) // max(vocab, 1))
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def filter_probs(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                 min_ps: Optional[torch.Tensor], max_top_k: Optional[int] = None) -> torch.Tensor:
    """Zero what top-k / top-p / min-p exclude (SGLang's semantics); rows: [R, V] fp32.

    top_ks: [R] int (>= vocab means off); top_ps: [R] float (1.0 off); min_ps: [R] or None.
    max_top_k: a host-side bound on every row's top_k, if known (e.g. all requests ask for
    top_k <= 50). Then only the top ``max_top_k`` probabilities are ranked (``topk``) instead of
    the whole vocabulary (``sort``): a tree verify has budget+1 rows per request, and a full
    sort of [bs * (budget+1), V] dominates the step at large vocabularies. The result is the
    same: tokens past rank max_top_k are outside every row's top-k anyway. A full sort runs
    over :func:`row_chunks` of the rows.
    """
    vocab = probs.shape[-1]
    bounded = max_top_k is not None and 1 <= max_top_k < vocab
    if not bounded:
        chunks = row_chunks(probs.shape[0], vocab)
        if len(chunks) > 1:  # each chunk's call sorts its rows in one piece
            return torch.cat([filter_probs(probs[a:b], top_ks[a:b], top_ps[a:b],
                                           None if min_ps is None else min_ps[a:b])
                              for a, b in chunks])
        sorted_p, idx = probs.sort(dim=-1, descending=True)
    else:
        sorted_p, idx = probs.topk(max_top_k, dim=-1, largest=True, sorted=True)
    ranks = torch.arange(sorted_p.shape[-1], device=probs.device)[None, :]
    keep = ranks < top_ks.view(-1, 1)
    cum_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep &= cum_before <= top_ps.view(-1, 1)
    if min_ps is not None:
        keep &= sorted_p >= (sorted_p[:, :1] * min_ps.view(-1, 1))
    keep[:, 0] = True  # the top token always survives
    out = torch.zeros_like(probs)
    out.scatter_(1, idx, torch.where(keep, sorted_p, torch.zeros_like(sorted_p)))
    return out


def exponential_race(probs: torch.Tensor, generator: Optional[torch.Generator] = None):
    """One sample per row of (unnormalised) probs: argmax p / E with E ~ Exp(1)."""
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return torch.argmax(probs / noise, dim=-1)


def seeded_draw(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                min_ps: torch.Tensor, sampling_info, seeds: torch.Tensor,
                positions: torch.Tensor, sglang_fns) -> torch.Tensor:
    """[R] int64: SGLang's own seeded draw (its pytorch sampling backend), row by row.

    probs: [R, V] softmax(logits / temperature), unfiltered. ``sglang_fns``: SGLang's
    ``(multinomial_with_seed, top_k_top_p_min_p_sampling_from_probs_torch)``. The draw depends
    only on (seed, position, distribution), through the very code SGLang's sampler runs for a
    plain decode step: without filters, the hash-based Gumbel draw over the vocabulary; with
    top-k / top-p, the same draw over the sorted, filtered probabilities. So a node whose
    distribution equals the target's at that position draws the token the target alone would
    draw there with the same seed. min-p with a seed: SGLang refuses it (an assert in its
    sampler); here the filtered probabilities get the vocabulary-order draw (reproducible, not
    comparable with anything SGLang does).
    """
    multinomial_with_seed, filtered_seeded = sglang_fns
    chunks = row_chunks(probs.shape[0], probs.shape[-1])
    if len(chunks) > 1:  # row-wise draws: the same tokens, bounded temporaries
        return torch.cat([seeded_draw(probs[a:b], top_ks[a:b], top_ps[a:b], min_ps[a:b],
                                      sampling_info, seeds[a:b], positions[a:b], sglang_fns)
                          for a, b in chunks])
    need_filter = sampling_info.need_top_k_sampling or sampling_info.need_top_p_sampling
    if sampling_info.need_min_p_sampling:
        kept = filter_probs(probs, top_ks, top_ps, min_ps)
        return multinomial_with_seed(kept.double().log(), seeds, positions).view(-1).long()
    if not need_filter:
        return multinomial_with_seed(torch.log(probs), seeds, positions).view(-1).long()
    return filtered_seeded(probs, top_ks, top_ps, min_ps, False, seeds,
                           positions).view(-1).long()


def make_flashinfer_row_draw(sampler_module):
    """SGLang's flashinfer sampling backend (``Sampler._sample_from_probs``, its filtered branch)
    as a per-row draw: ``draw(probs, top_ks, top_ps, min_ps, sampling_info) -> [R] int64``, or
    None where the module lacks its kernels (no CUDA, or FlashInfer missing).

    Same calls, same order as SGLang's: with min-p, top-k renorm -> top-p renorm -> min-p draw;
    otherwise the fused top-k/top-p draw with ``filter_apply_order="joint"``. So each node draws
    with the server's own sampling semantics, and top-p needs no sort of the vocabulary.
    """
    try:
        fns = (sampler_module.top_k_top_p_sampling_from_probs, sampler_module.top_k_renorm_prob,
               sampler_module.top_p_renorm_prob, sampler_module.min_p_sampling_from_probs)
    except AttributeError:
        return None
    joint, k_renorm, p_renorm, min_p_draw = fns

    def draw(probs, top_ks, top_ps, min_ps, sampling_info):
        if sampling_info.need_min_p_sampling:
            kept = p_renorm(k_renorm(probs, top_ks), top_ps)
            return min_p_draw(kept, min_ps).view(-1).long()
        return joint(probs.contiguous(), top_ks, top_ps,
                     filter_apply_order="joint").view(-1).long()

    return draw


def checked_row_draw(draw, device):
    """``draw`` if it runs on ``device`` and keeps every row's draw inside that row's top-k (six
    random rows, min-p path included); otherwise None and the reason logged. Synchronizes:
    call at start-up only."""
    import types

    if draw is None or torch.device(device).type != "cuda":
        return None
    try:
        g = torch.Generator().manual_seed(0)
        vocab = 257
        probs = torch.softmax(3 * torch.randn(6, vocab, generator=g), -1).to(device)
        top_ks = torch.tensor([1, 3, vocab, 1 << 30, 10, 50], dtype=torch.int32, device=device)
        top_ps = torch.tensor([1.0, 1.0, 0.5, 0.9, 1.0, 0.3], device=device)
        min_ps = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.0], device=device)
        for need_min_p in (False, True):
            info = types.SimpleNamespace(need_min_p_sampling=need_min_p)
            out = draw(probs, top_ks, top_ps, min_ps, info)
            if out.shape != (6,) or out.dtype != torch.int64:
                raise RuntimeError(f"draw returned {out.dtype} {tuple(out.shape)}")
            larger = (probs > probs.gather(1, out[:, None])).sum(1)  # rank of each draw
            if not bool((larger < top_ks.clamp(max=vocab).long()).all()):
                raise RuntimeError(f"a draw outside its row's top-k (min_p={need_min_p})")
    except Exception as e:  # noqa: BLE001 -- logged, then the pytorch-semantics path serves
        logging.getLogger(__name__).error(
            "sglang_ddtree: SGLang's flashinfer sampling failed the start-up check (%s: %s); "
            "T > 0 nodes use the pytorch-backend filter instead", type(e).__name__, e)
        return None
    return draw


def sample_per_node(logits: torch.Tensor, sampling_info, num_tokens: int,
                    positions: Optional[torch.Tensor] = None, seeded_fns=None,
                    request_seeds: Optional[torch.Tensor] = None,
                    generator: Optional[torch.Generator] = None,
                    max_top_k: Optional[int] = None, row_draw=None) -> torch.Tensor:
    """[bs * N] int64 tokens: node rows of request b use request b's sampling params.

    ``row_draw``: :func:`make_flashinfer_row_draw`'s draw, for servers whose sampling backend is
    flashinfer; it serves the unseeded rows when the batch filters (top-k / top-p / min-p).
    Otherwise the filter is SGLang's pytorch-backend semantics (:func:`filter_probs`) and the
    draw an exponential race.

    ``max_top_k``: see :func:`filter_probs` (host-side bound on every request's top_k).

    logits: [bs * N, V] after SGLang's logit adjustments (penalties, bias) for the verify rows.
    Greedy requests in a mixed batch (top_k == 1) get their argmax. Rows of requests with a seed
    (SGLang's deterministic-mode ``sampling_info.sampling_seed``, else ``request_seeds`` >= 0)
    get :func:`seeded_draw` with ``seeded_fns`` at their node's position (the position of the
    node's own token, as SGLang passes for a decode step): reproducible, and the same draw as
    the target alone makes with that seed.
    """
    rep = lambda t: t.repeat_interleave(num_tokens, dim=0)  # noqa: E731
    temps = rep(sampling_info.temperatures.view(-1, 1).float())
    probs = torch.softmax(logits.float() / temps, dim=-1)
    top_ks = rep(sampling_info.top_ks.view(-1))
    seeds = getattr(sampling_info, "sampling_seed", None)
    if seeds is None:
        seeds = request_seeds
    seeded = None
    if seeds is not None and seeded_fns is not None and positions is not None:
        row_seeds = rep(seeds.view(-1))
        seeded = seeded_draw(probs, top_ks, rep(sampling_info.top_ps.view(-1)),
                             rep(sampling_info.min_ps.view(-1)), sampling_info,
                             row_seeds.clamp(min=0), positions, seeded_fns)
    filtered = (sampling_info.need_top_k_sampling or sampling_info.need_top_p_sampling
                or sampling_info.need_min_p_sampling)
    if filtered and row_draw is not None:
        sampled = row_draw(probs, top_ks, rep(sampling_info.top_ps.view(-1)),
                           rep(sampling_info.min_ps.view(-1)), sampling_info)
    else:
        if filtered:
            probs = filter_probs(
                probs, top_ks, rep(sampling_info.top_ps.view(-1)),
                rep(sampling_info.min_ps.view(-1)) if sampling_info.need_min_p_sampling
                else None,
                max_top_k=max_top_k,
            )
        sampled = exponential_race(probs, generator)
    if seeded is not None:
        sampled = torch.where(row_seeds >= 0, seeded, sampled)
    greedy = torch.argmax(logits, dim=-1)
    return torch.where(top_ks == 1, greedy, sampled)


def host_max_top_k(reqs, vocab: int) -> Optional[int]:
    """max top_k over the batch's requests from their host-side params, or None when any
    request samples from the whole vocabulary (top_k -1 / >= vocab). No device access."""
    best = 0
    for r in reqs:
        k = int(getattr(r.sampling_params, "top_k", -1))
        if k <= 0 or k >= vocab:
            return None
        best = max(best, k)
    return best or None
