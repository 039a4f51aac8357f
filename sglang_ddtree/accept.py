"""Accept walk: keep the longest draft path the target agrees with (words: see ``tree.py``).

``predicted[b, i]`` is the target's token at node i (computed from the target's logits at that
node, i.e. given the node's path): its argmax for greedy decoding, or one sample from the target's
processed distribution for temperature > 0. Starting at the root, move to the child whose token
equals ``predicted[current]``; stop when no child matches. The tokens emitted this step are the
accepted nodes' tokens then ``predicted`` at the last accepted node (the bonus token).

Why sampling is lossless without rejection: the first emitted token is ``predicted[root]``, a
sample of the target's conditional. If it equals some child's token, the walk moves there and the
next emitted token is ``predicted[child]``, a fresh sample of the target's conditional given that
token; otherwise the step ends and the next step starts from it. Either way every token is drawn
from the target's own conditional given everything emitted before it; the draft only decides how
many of those samples one target forward pass produces.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .tree import DraftTree


def _depth_of(tree: DraftTree, max_depth: Optional[int]) -> int:
    d = tree.max_depth if max_depth is None else max_depth
    if d is None:
        raise ValueError("accept_walk: tree.max_depth is unset; pass max_depth (D) explicitly")
    return d


def _check_predicted(tree: DraftTree, predicted: torch.Tensor) -> None:
    if predicted.shape != tree.tokens.shape or predicted.dtype != torch.int64:
        raise ValueError(f"predicted: expected int64 {tuple(tree.tokens.shape)}, got "
                         f"{predicted.dtype} {tuple(predicted.shape)}")


def accept_walk_reference(tree: DraftTree, predicted: torch.Tensor,
                          max_depth: Optional[int] = None
                          ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CPU loops over SGLang's child/sibling links (the oracle).

    Parameters
    ----------
    tree : DraftTree; predicted : [bs, N] int64; max_depth : D (defaults to ``tree.max_depth``).

    Returns
    -------
    accept_len [bs] int64 (0..D), accepted_nodes [bs, D + 1] int64 (root first, -1 padded),
    bonus [bs] int64 = predicted at the last accepted node.
    """
    _check_predicted(tree, predicted)
    depth = _depth_of(tree, max_depth)
    tokens = tree.tokens.cpu().tolist()
    first = tree.retrive_next_token.cpu().tolist()
    sibling = tree.retrive_next_sibling.cpu().tolist()
    pred = predicted.cpu().tolist()
    bs = len(tokens)
    accept_len = torch.zeros(bs, dtype=torch.int64)
    nodes = torch.full((bs, depth + 1), -1, dtype=torch.int64)
    bonus = torch.zeros(bs, dtype=torch.int64)
    for b in range(bs):
        cur, path = 0, [0]
        while len(path) <= depth:
            child = first[b][cur]
            while child != -1 and tokens[b][child] != pred[b][cur]:
                child = sibling[b][child]
            if child == -1:
                break
            cur = child
            path.append(cur)
        accept_len[b] = len(path) - 1
        nodes[b, : len(path)] = torch.tensor(path)
        bonus[b] = pred[b][cur]
    return accept_len, nodes, bonus


def accept_walk(tree: DraftTree, predicted: torch.Tensor, max_depth: Optional[int] = None
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Vectorised accept walk: D static iterations over [bs, N], no host sync (graph-safe).

    Same parameters and returns as ``accept_walk_reference``. Sibling tokens are distinct (ids are
    distinct within a top-K row), so at most one child matches. Once a step finds no match the
    current node stays put and every later step finds none again, so no "done" flag is needed.
    """
    _check_predicted(tree, predicted)
    depth = _depth_of(tree, max_depth)
    bs, n = tree.tokens.shape
    dev = tree.tokens.device
    idx = torch.arange(n, device=dev)
    cur = torch.zeros(bs, 1, dtype=torch.int64, device=dev)
    accept_len = torch.zeros(bs, dtype=torch.int64, device=dev)
    nodes = torch.full((bs, depth + 1), -1, dtype=torch.int64, device=dev)
    nodes[:, 0] = 0
    for t in range(min(depth, n - 1)):
        want = predicted.gather(1, cur)  # [bs, 1]
        match = (tree.parents == cur) & (tree.tokens == want) & tree.valid  # [bs, N]
        nxt = torch.where(match, idx, n).amin(1, keepdim=True)  # n: no matching child
        hit = nxt < n
        cur = torch.where(hit, nxt, cur)
        accept_len += hit.squeeze(1)
        nodes[:, t + 1] = torch.where(hit, nxt, -1).squeeze(1)
    return accept_len, nodes, predicted.gather(1, cur).squeeze(1)


def emitted_tokens(tree: DraftTree, accept_len: torch.Tensor, accepted_nodes: torch.Tensor,
                   bonus: torch.Tensor) -> torch.Tensor:
    """Tokens emitted this step, [bs, D + 1] int64, -1 padded: accepted nodes 1..accept_len, then
    the bonus token at column accept_len (accept_len + 1 tokens per request)."""
    nodes = accepted_nodes[:, 1:]
    toks = torch.where(nodes >= 0, tree.tokens.gather(1, nodes.clamp(min=0)), -1)
    toks = torch.cat([toks, torch.full_like(bonus[:, None], -1)], 1)
    return toks.scatter(1, accept_len[:, None], bonus[:, None])
