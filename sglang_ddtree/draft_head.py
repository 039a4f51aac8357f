"""Draft head: per-position top-K log-probs from the drafter's logits, optionally vocab-parallel.

The tree (``tree.py``) needs, for each draft depth, the K best tokens and their log-probs
log p = logit - logsumexp(all logits), in fp32. Under tensor parallelism each rank holds a vocab
shard of the lm_head output; log-softmax needs the full vocab, but only through two small things
per shard: its own top-K logits and its logsumexp. Ranks all-gather those ([R, T, K] and [R, T]),
and every rank merges them the same way, so every rank builds the same tree:

    lse   = logsumexp_r lse_r                              (exact identity)
    top-K = first K of the union by (logit desc, token id asc)
    logp  = logit - lse

Order of returned entries everywhere: value descending, then token id ascending. Entries that
do not exist (K larger than the vocab or shard) are -inf with id -1; -inf entries never become
tree nodes, so their ids are never read.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

_NEG_INF = float("-inf")


def _sort_desc_then_id(vals: torch.Tensor, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sort each row by (value desc, id asc) with two stable sorts (ids first, then values)."""
    ids, o = torch.sort(ids, dim=-1, stable=True)
    vals = vals.gather(-1, o)
    vals, o = torch.sort(vals, dim=-1, descending=True, stable=True)
    return vals, ids.gather(-1, o)


def _pad_k(vals: torch.Tensor, ids: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    missing = k - vals.shape[-1]
    if missing <= 0:
        return vals, ids
    shape = vals.shape[:-1] + (missing,)
    return (torch.cat([vals, vals.new_full(shape, _NEG_INF)], -1),
            torch.cat([ids, ids.new_full(shape, -1)], -1))


def _subtract_lse(vals: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    # -inf - (-inf) would be NaN when a whole row is masked; such entries stay -inf
    return torch.where(vals > _NEG_INF, vals - lse.unsqueeze(-1), _NEG_INF)


def topk_logprobs(logits: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k log-probs of full-vocab logits.

    Parameters
    ----------
    logits : [T, V] any float dtype (computed in fp32); k : python int >= 1.

    Returns
    -------
    logp : [T, k] float32 = logit - logsumexp(logits) in fp32, sorted descending;
    ids : [T, k] int64 token ids (ties: smaller id first among the returned entries; which of
        several equal logits at the k-th place is returned is up to ``torch.topk``).
    """
    if logits.dim() != 2 or not logits.is_floating_point() or k < 1:
        raise ValueError(f"topk_logprobs: expected float logits [T, V] and k >= 1, got "
                         f"{logits.dtype} {tuple(logits.shape)}, k={k}")
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    vals, ids = torch.topk(x, min(k, x.shape[-1]), dim=-1, sorted=True)
    vals, ids = _sort_desc_then_id(vals, ids)
    vals, ids = _pad_k(vals, ids, k)
    return _subtract_lse(vals, lse), ids


def shard_topk(logits_shard: torch.Tensor, k: int, vocab_offset: int,
               vocab_size: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rank's part of a vocab-parallel top-k: its own top-k raw logits and its logsumexp.

    Parameters
    ----------
    logits_shard : [T, V_shard] any float dtype; column c is global token ``vocab_offset + c``.
    k : python int >= 1; vocab_offset : python int.
    vocab_size : optional true vocab size; columns whose global id is >= it (the padding of a
        padded lm_head) are masked to -inf. Padding that already holds -inf needs no mask.

    Returns
    -------
    vals : [T, k] float32 raw logits (value desc, id asc; -inf / id -1 where V_shard < k);
    ids : [T, k] int64 global token ids; lse : [T] float32 logsumexp over the (unmasked) shard.
    """
    if logits_shard.dim() != 2 or not logits_shard.is_floating_point() or k < 1:
        raise ValueError(f"shard_topk: expected float logits_shard [T, V_shard] and k >= 1, got "
                         f"{logits_shard.dtype} {tuple(logits_shard.shape)}, k={k}")
    x = logits_shard.float()
    if vocab_size is not None:
        gid = vocab_offset + torch.arange(x.shape[-1], device=x.device)
        x = torch.where(gid < vocab_size, x, _NEG_INF)
    lse = torch.logsumexp(x, dim=-1)
    vals, ids = torch.topk(x, min(k, x.shape[-1]), dim=-1, sorted=True)
    vals, ids = _sort_desc_then_id(vals, ids + vocab_offset)
    vals, ids = _pad_k(vals, ids, k)
    return vals, ids, lse


def merge_vocab_parallel(vals: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, k: int
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge all ranks' ``shard_topk`` outputs (after all-gather) into the global top-k log-probs.

    Parameters
    ----------
    vals : [R, T, k'] float32 raw logits; ids : [R, T, k'] int64 global ids; lse : [R, T] float32;
    k : python int <= R * k'.

    Returns
    -------
    logp : [T, k] float32, ids : [T, k] int64, ordered by (logit desc, id asc): a deterministic
    function of the gathered inputs, hence the same on every rank. Equals ``topk_logprobs`` on the
    unsharded logits up to fp32 rounding of the combined logsumexp (ids exactly, when the top
    values are distinct).
    """
    if vals.dim() != 3 or ids.shape != vals.shape or lse.shape != vals.shape[:2]:
        raise ValueError(f"merge_vocab_parallel: expected vals/ids [R, T, k'] and lse [R, T], got "
                         f"{tuple(vals.shape)}, {tuple(ids.shape)}, {tuple(lse.shape)}")
    r, t, kk = vals.shape
    if not 1 <= k <= r * kk:
        raise ValueError(f"merge_vocab_parallel: expected 1 <= k <= R*k' = {r * kk}, got {k}")
    flat_vals = vals.float().permute(1, 0, 2).reshape(t, r * kk)
    flat_ids = ids.permute(1, 0, 2).reshape(t, r * kk)
    flat_vals, flat_ids = _sort_desc_then_id(flat_vals, flat_ids)
    total_lse = torch.logsumexp(lse.float(), dim=0)  # [T]
    return _subtract_lse(flat_vals[:, :k], total_lse), flat_ids[:, :k]
