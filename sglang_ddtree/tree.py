"""Draft tree of DDTree: selection of the ``budget`` best draft paths, on any device.

DDTree (arXiv 2604.12989) turns the per-position distributions of a DFlash block-diffusion drafter
(arXiv 2602.06036) into a tree of draft tokens that the target verifies in one forward pass.
Words used throughout this package, defined once here:

- **depth** d (1..D): the position after the root that a draft token fills; D = block_size - 1.
  The drafter gives, per request and depth, its top-K log-probs ``topk_logp[b, d-1, :]`` (fp32,
  logit - logsumexp over the whole vocab, sorted descending, possibly -inf) and their token ids.
- **node**: a path of ranks (r1..rd), 0 <= r_i < K. Its token is ``topk_ids[b, d-1, r_d]``, its
  **parent** is (r1..r_{d-1}) (the root when d = 1).
- **root / bonus token**: the last token the target emitted; node 0 of every tree, depth 0.
- **score**: the node's log-prob under the drafter's factorised distribution, accumulated in fp32
  depth by depth: ``score(child) = fp32(score(parent) + topk_logp[b, d-1, r_d])``, root 0.0. A node
  is *reachable* iff its score is finite. Every builder here uses exactly this rounding, so exact
  ties are the same ties everywhere.
- **tie-break** (the total order on nodes): score descending, then depth ascending, then rank path
  lexicographically ascending.
- **budget** B (1..1024): the number of draft nodes; the tree is the first min(B, #reachable) nodes
  in the total order. A child never precedes its parent (log-probs are <= 0, and equal scores go to
  the shallower node), so the set is prefix-closed: a tree. It is what the paper's best-first heap
  pops. N = B + 1 verify tokens per request (root first).
- **accepted path**: the root and the chain of nodes whose tokens the target reproduced, walking
  down from the root (see ``accept.py``); the token the target emits after its last node is the
  next bonus token.

Node order inside a tree: index 0 = root, 1..n_valid = the selected nodes in the total order
(parent before child), then padding up to N. ``DraftTree`` documents every field.

Two builders share that contract. ``build_tree_reference`` is the paper's best-first heap in plain
Python, one request at a time: the oracle. ``build_tree`` is batched torch with static shapes and no
host synchronisation, so it runs inside a CUDA graph; it works level by level (why that is exact is
written above ``build_tree``). ``full_mask_layout`` turns the ancestor mask into the FULL_MASK
layout that SGLang's tree-capable attention backends read.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, fields
from typing import Dict, Optional, Tuple

import numpy as np
import torch

MAX_BUDGET = 1024
_MAX_DEPTH = 2048  # the merge key reserves 11 bits for the depth
_NEG_INF = float("-inf")


@dataclass
class DraftTree:
    """One step's draft trees for a batch; every tensor has a static shape (N = budget + 1).

    Invalid (padding) nodes have token 0, parent -1, depth 0, score -inf, no links.
    """

    tokens: torch.Tensor  # [bs, N] int64; [:, 0] = root (bonus) token, padding 0
    parents: torch.Tensor  # [bs, N] int64; parent node index, -1 for root and padding
    depths: torch.Tensor  # [bs, N] int64; 0 for root and padding, d for a node of depth d
    valid: torch.Tensor  # [bs, N] bool; root and selected nodes
    scores: torch.Tensor  # [bs, N] float32; root 0.0, padding -inf
    ancestor_mask: torch.Tensor  # [bs, N, N] bool; [b, i, j] iff j == i or j is an ancestor of i
    retrive_index: torch.Tensor  # [bs, N] int64; b * N + i
    retrive_next_token: torch.Tensor  # [bs, N] int64; first (smallest-index) child, -1 if none
    retrive_next_sibling: torch.Tensor  # [bs, N] int64; next larger index with the same parent, -1
    max_depth: Optional[int] = None  # D of the step (python int): accept_walk iterates D times

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        """N = budget + 1."""
        return self.tokens.shape[1]

    @property
    def budget(self) -> int:
        return self.tokens.shape[1] - 1

    @classmethod
    def empty(cls, bs: int, budget: int, device, max_depth: Optional[int] = None) -> "DraftTree":
        """Uninitialised buffers (e.g. the static ``out`` of a CUDA graph)."""
        _check_budget(budget)
        n = budget + 1
        i64 = dict(dtype=torch.int64, device=device)
        return cls(
            tokens=torch.empty(bs, n, **i64),
            parents=torch.empty(bs, n, **i64),
            depths=torch.empty(bs, n, **i64),
            valid=torch.empty(bs, n, dtype=torch.bool, device=device),
            scores=torch.empty(bs, n, dtype=torch.float32, device=device),
            ancestor_mask=torch.empty(bs, n, n, dtype=torch.bool, device=device),
            retrive_index=torch.empty(bs, n, **i64),
            retrive_next_token=torch.empty(bs, n, **i64),
            retrive_next_sibling=torch.empty(bs, n, **i64),
            max_depth=max_depth,
        )

    @classmethod
    def make_dummy(cls, bs: int, budget: int, device, max_depth: int = 1,
                   root_token: int = 0) -> "DraftTree":
        """A valid root-only tree (all draft slots padding): input for warmup and graph capture."""
        t = cls.empty(bs, budget, device, max_depth)
        n = t.num_nodes
        t.tokens.zero_()
        t.tokens[:, 0] = root_token
        t.parents.fill_(-1)
        t.depths.zero_()
        t.valid.zero_()
        t.valid[:, 0] = True
        t.scores.fill_(_NEG_INF)
        t.scores[:, 0] = 0.0
        t.ancestor_mask.copy_(torch.eye(n, dtype=torch.bool, device=device).expand(bs, n, n))
        t.retrive_index.copy_(torch.arange(bs * n, device=device).view(bs, n))
        t.retrive_next_token.fill_(-1)
        t.retrive_next_sibling.fill_(-1)
        return t

    def tensors(self) -> Dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "max_depth"}

    def copy_(self, other: "DraftTree") -> "DraftTree":
        """Copy ``other`` into these buffers in place (shapes must match); returns self."""
        for name, dst in self.tensors().items():
            src = getattr(other, name)
            if dst.shape != src.shape:
                raise ValueError(f"DraftTree.{name}: expected shape {tuple(dst.shape)}, got "
                                 f"{tuple(src.shape)}")
            dst.copy_(src)
        self.max_depth = other.max_depth
        return self

    def to(self, device) -> "DraftTree":
        return DraftTree(**{k: v.to(device) for k, v in self.tensors().items()},
                         max_depth=self.max_depth)


# ----------------------------------------------------------------------------------------------
# Input checks (shapes and dtypes only: the GPU path must not read data on the host).


def _check_budget(budget) -> None:
    if not isinstance(budget, int) or not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget: expected a python int in [1, {MAX_BUDGET}], got {budget!r}")


def _check_inputs(root_ids, topk_logp, topk_ids, budget) -> Tuple[int, int, int]:
    _check_budget(budget)
    if topk_logp.dim() != 3:
        raise ValueError(f"topk_logp: expected [bs, D, K], got shape {tuple(topk_logp.shape)}")
    bs, d, k = topk_logp.shape
    if topk_logp.dtype != torch.float32:
        raise ValueError(f"topk_logp: expected float32, got {topk_logp.dtype}")
    if topk_ids.shape != topk_logp.shape or topk_ids.dtype != torch.int64:
        raise ValueError(f"topk_ids: expected int64 {tuple(topk_logp.shape)}, got "
                         f"{topk_ids.dtype} {tuple(topk_ids.shape)}")
    if root_ids.shape != (bs,) or root_ids.dtype != torch.int64:
        raise ValueError(f"root_ids: expected int64 ({bs},), got {root_ids.dtype} "
                         f"{tuple(root_ids.shape)}")
    if not 1 <= d <= _MAX_DEPTH or k < 1:
        raise ValueError(f"topk_logp: expected 1 <= D <= {_MAX_DEPTH} and K >= 1, got D={d}, K={k}")
    for name, t in (("topk_ids", topk_ids), ("root_ids", root_ids)):
        if t.device != topk_logp.device:
            raise ValueError(f"{name}: expected device {topk_logp.device}, got {t.device}")
    return bs, d, k


def _normalize_logp(logp: torch.Tensor) -> torch.Tensor:
    # NaN counts as unreachable (-inf); +0.0 replaces -0.0 so the bit-pattern sort keys below see
    # the equal scores as equal; log-probs > 0 (misuse) are clamped so the output stays a tree.
    return torch.where(logp == logp, logp.clamp(max=0.0) + 0.0, _NEG_INF)


# ----------------------------------------------------------------------------------------------
# Oracle: the paper's best-first heap, plain Python, one request at a time.


def _heap_select(logp: np.ndarray, budget: int):
    """Best-first pops for one request. logp: [D, K] float32, rows sorted descending.

    Returns [(path, score)] in pop order. Popping a node pushes its next sibling (same parent,
    rank + 1) and its first child (rank 0). Each node's generator (previous sibling, or parent for
    rank 0) precedes it in the total order, so the pops come out in exactly that order.
    """
    depth, k = logp.shape
    heap = []

    def push(path, parent_score):
        score = parent_score + logp[len(path) - 1, path[-1]]  # float32 + float32 -> float32
        if score > _NEG_INF:
            # the tuple compares as the tie-break: -score, then depth, then the rank path
            heapq.heappush(heap, (-float(score), len(path), path, score, parent_score))

    push((0,), np.float32(0.0))
    out = []
    while heap and len(out) < budget:
        _, d, path, score, parent_score = heapq.heappop(heap)
        out.append((path, score))
        if path[-1] + 1 < k:
            push(path[:-1] + (path[-1] + 1,), parent_score)
        if d < depth:
            push(path + (0,), score)
    return out


def build_tree_reference(root_ids: torch.Tensor, topk_logp: torch.Tensor, topk_ids: torch.Tensor,
                         budget: int) -> DraftTree:
    """The oracle: best-first heap per request in plain Python (CPU, slow, syncs freely).

    Parameters
    ----------
    root_ids : [bs] int64, the bonus tokens (tree node 0).
    topk_logp : [bs, D, K] float32, per-depth draft log-probs, sorted descending along K.
    topk_ids : [bs, D, K] int64, their token ids (distinct among the finite entries of a row).
    budget : python int in [1, 1024].

    Returns
    -------
    DraftTree on the CPU with ``max_depth = D``. Raises ValueError on unsorted rows, positive
    log-probs or duplicate ids (the GPU builder cannot check those without a host sync).
    """
    bs, depth, k = _check_inputs(root_ids, topk_logp, topk_ids, budget)
    raw = topk_logp.detach().cpu()
    if (raw > 0).any():
        raise ValueError(f"topk_logp: expected log-probs <= 0, got max {raw.nan_to_num(-1).max()}")
    lp = _normalize_logp(raw)
    if not bool((lp[..., 1:] <= lp[..., :-1]).all()):
        raise ValueError("topk_logp: expected every [b, d, :] row sorted descending along K")
    ids = topk_ids.detach().cpu().numpy()
    lp_np = lp.numpy()
    for b in range(bs):
        for d in range(depth):
            row = ids[b, d][np.isfinite(lp_np[b, d])]
            if len(set(row.tolist())) != len(row):
                raise ValueError(f"topk_ids[{b}, {d}]: expected distinct ids among finite entries")

    n = budget + 1
    tokens = np.zeros((bs, n), np.int64)
    parents = np.full((bs, n), -1, np.int64)
    depths = np.zeros((bs, n), np.int64)
    valid = np.zeros((bs, n), bool)
    scores = np.full((bs, n), _NEG_INF, np.float32)
    anc = np.zeros((bs, n, n), bool)
    next_token = np.full((bs, n), -1, np.int64)
    next_sibling = np.full((bs, n), -1, np.int64)
    roots = root_ids.detach().cpu().numpy()
    for b in range(bs):
        tokens[b, 0], valid[b, 0], scores[b, 0] = roots[b], True, 0.0
        anc[b, np.arange(n), np.arange(n)] = True
        index = {(): 0}  # rank path -> node index
        last_child = {}  # node index -> its latest child so far (children arrive in index order)
        for i, (path, score) in enumerate(_heap_select(lp_np[b], budget), start=1):
            p = index[path[:-1]]  # KeyError here would mean a non-prefix-closed selection
            index[path] = i
            tokens[b, i] = ids[b, len(path) - 1, path[-1]]
            parents[b, i], depths[b, i], valid[b, i], scores[b, i] = p, len(path), True, score
            anc[b, i] |= anc[b, p]
            if p in last_child:
                next_sibling[b, last_child[p]] = i
            else:
                next_token[b, p] = i
            last_child[p] = i
    t = lambda a: torch.from_numpy(a)  # noqa: E731
    return DraftTree(tokens=t(tokens), parents=t(parents), depths=t(depths), valid=t(valid),
                     scores=t(scores), ancestor_mask=t(anc),
                     retrive_index=torch.arange(bs * n, dtype=torch.int64).view(bs, n),
                     retrive_next_token=t(next_token), retrive_next_sibling=t(next_sibling),
                     max_depth=depth)


# ----------------------------------------------------------------------------------------------
# Batched builder.


def _desc_score_key(score: torch.Tensor) -> torch.Tensor:
    """int64 in [0, 2^32) that sorts ascending as ``score`` sorts descending (-inf last).

    The fp32 bit pattern, read as int32, is monotone for non-negative floats and reversed for
    negative ones; flipping the 31 magnitude bits of negatives makes it monotone everywhere.
    Needs +0.0 for zero (see ``_normalize_logp``) and no NaN.
    """
    bits = score.contiguous().view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (2**31 - 1) - ordered.to(torch.int64)


_PAIRS_CACHE: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = {}


def _harmonic_pairs(budget: int, kc: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """All (j, r) with j < B, r < kc, (j + 1) * (r + 1) <= B, j-major: two [M] int64 tensors.

    Built with device ops only (no host->device copy), so it may run inside graph capture. Cached
    only when made outside capture: a tensor made during capture holds nothing until the graph
    replays, while a cached eager one is valid inside any graph.
    """
    key = (budget, kc, str(torch.device(device)))
    if key in _PAIRS_CACHE:
        return _PAIRS_CACHE[key]
    capturing = torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()
    m = sum(min(kc, budget // (j + 1)) for j in range(budget))
    j = torch.arange(budget, device=device)
    count = torch.clamp(budget // (j + 1), max=kc)
    end = count.cumsum(0)
    p = torch.arange(m, device=device)
    pj = torch.searchsorted(end, p, right=True)
    pr = p - (end - count)[pj]
    if not capturing:
        _PAIRS_CACHE[key] = (pj, pr)
    return pj, pr


def _select_depth(s, order, lp, pairs, budget):
    """Exact top-``budget`` children of the kept parents of one depth.

    s : [bs, B] fp32 parent scores, slot layout (slot = lexicographic rank among kept parents);
    order : [bs, B] int64, slots sorted by (score desc, slot asc); lp : [bs, Kc] fp32, this depth's
    log-probs. Returns (child score [bs, B], parent slot [bs, B], rank [bs, B]) in the children's
    own slot layout (lexicographic: parent slot, then rank), padding -inf at the end.
    """
    bs, b = s.shape
    pj, pr = pairs
    slots = torch.arange(b, device=s.device)
    # tau = score of the B-th best child, found on the "harmonic" pairs (j-th best parent, rank r)
    # with (j + 1) * (r + 1) <= B: about B ln B candidates instead of B x Kc. Exact because the
    # children scoring >= tau form a down-set of the (j, r) grid (scores fall weakly in j and in r:
    # rows are sorted and fp32 rounding is monotone), and a down-set of >= B cells contains B cells
    # whose rectangle [0..j] x [0..r] has <= B cells, i.e. B harmonic pairs scoring >= tau.
    cand = s.gather(1, order)[:, pj] + lp[:, pr]  # [bs, M]
    tau = cand.topk(b, dim=1).values[:, b - 1:b]  # [bs, 1]
    # Exact per-parent counts over all B x Kc children. Which equal-score children are kept is
    # decided by the rank path, and rounding can tie children of parents whose scores differ, so
    # ties at tau are counted in full rather than trusted to the harmonic pairs.
    full = s[:, :, None] + lp[:, None, :]  # [bs, B, Kc]
    tau3 = tau[:, :, None]
    n_gt = (full > tau3).sum(-1)  # [bs, B]
    n_eq = torch.where(tau > _NEG_INF, (full >= tau3).sum(-1) - n_gt, 0)
    quota = b - n_gt.sum(1, keepdim=True)  # slots left for score == tau, lexicographic order
    before = n_eq.cumsum(1) - n_eq
    take = n_gt + torch.minimum((quota - before).clamp(min=0), n_eq)  # children kept per parent
    end = take.cumsum(1)
    kept = slots < end[:, -1:]
    parent = torch.searchsorted(end, slots.expand(bs, b).contiguous(), right=True).clamp(max=b - 1)
    rank = torch.where(kept, slots - (end.gather(1, parent) - take.gather(1, parent)), 0)
    score = torch.where(kept, s.gather(1, parent) + lp.gather(1, rank), _NEG_INF)
    return score, parent, rank


def build_tree(root_ids: torch.Tensor, topk_logp: torch.Tensor, topk_ids: torch.Tensor,
               budget: int, out: Optional[DraftTree] = None) -> DraftTree:
    """Batched tree builder: equals ``build_tree_reference`` exactly, on any device.

    Static shapes, no host synchronisation, no data-dependent shapes: safe inside CUDA-graph
    capture. An eager call caches a small index table per (budget, K, device); capture without
    a prior eager call rebuilds it inside the graph (a few extra tiny kernels per replay).

    Parameters
    ----------
    root_ids : [bs] int64; topk_logp : [bs, D, K] float32 sorted descending along K (not checked
        here: that would need a sync); topk_ids : [bs, D, K] int64; budget : python int 1..1024.
    out : optional ``DraftTree.empty(bs, budget, device)`` buffers; every element is written.

    Why level by level is exact: the tree S is a prefix of the total order and prefix-closed, so
    its depth-d nodes are children of its depth-(d-1) nodes, and at most B - 1 nodes precede any
    of them. Keeping, at each depth, the top-B children of the previous depth's kept nodes
    therefore keeps every node of S; the top-B of the union over depths is S. Memory per depth:
    bs x B x min(K, B) fp32 (the exact tie count in ``_select_depth``).
    """
    bs, depth, k = _check_inputs(root_ids, topk_logp, topk_ids, budget)
    dev = topk_logp.device
    b, n = budget, budget + 1
    kc = min(k, b)  # a child of rank r has r siblings before it: r >= B never makes the tree
    n_levels = min(depth, b)  # a node of depth d needs d - 1 ancestors among the B nodes
    if out is None:
        out = DraftTree.empty(bs, b, dev)
    elif out.tokens.shape != (bs, n) or out.tokens.device != dev:
        raise ValueError(f"out: expected DraftTree buffers for bs={bs}, budget={b} on {dev}, got "
                         f"tokens {tuple(out.tokens.shape)} on {out.tokens.device}")
    out.max_depth = depth
    lp = _normalize_logp(topk_logp[:, :n_levels, :kc])
    pairs = _harmonic_pairs(b, kc, dev)
    slots = torch.arange(b, device=dev)

    # depth 0: only the root, in slot 0
    s = torch.where(slots == 0, 0.0, _NEG_INF).expand(bs, b)
    order = slots.expand(bs, b)
    level_score, level_parent, level_rank = [], [], []
    for d in range(n_levels):
        s, parent, rank = _select_depth(s, order, lp[:, d], pairs, b)
        order = torch.sort(_desc_score_key(s) * 1024 + slots, dim=1).indices
        level_score.append(s)
        level_parent.append(parent)
        level_rank.append(rank)
    all_score = torch.stack(level_score, 1).view(bs, n_levels * b)
    all_parent = torch.stack(level_parent, 1).view(bs, n_levels * b)
    all_rank = torch.stack(level_rank, 1).view(bs, n_levels * b)

    # Global top-B of the union; the key is (score desc, depth asc, slot = lexicographic rank).
    flat = torch.arange(n_levels * b, device=dev)
    key = _desc_score_key(all_score) * (1 << 21) + (flat // b) * 1024 + flat % b
    sel = torch.topk(key, b, dim=1, largest=False, sorted=True).indices  # [bs, B]
    node_score = all_score.gather(1, sel)
    node_valid = node_score > _NEG_INF
    node_level = sel // b  # depth - 1
    node_index = torch.arange(1, n, device=dev).expand(bs, b)
    where_is = torch.full((bs, n_levels * b), -1, dtype=torch.int64, device=dev)
    where_is.scatter_(1, sel, node_index)  # union position -> node index
    parent_pos = (node_level - 1) * b + all_parent.gather(1, sel)
    parent_node = torch.where(node_level == 0, 0, where_is.gather(1, parent_pos.clamp(min=0)))
    node_token = topk_ids.reshape(bs, depth * k).gather(1, node_level * k + all_rank.gather(1, sel))

    out.tokens[:, 0].copy_(root_ids)
    out.tokens[:, 1:].copy_(torch.where(node_valid, node_token, 0))
    out.parents[:, 0].fill_(-1)
    out.parents[:, 1:].copy_(torch.where(node_valid, parent_node, -1))
    out.depths[:, 0].fill_(0)
    out.depths[:, 1:].copy_(torch.where(node_valid, node_level + 1, 0))
    out.valid[:, 0].fill_(True)
    out.valid[:, 1:].copy_(node_valid)
    out.scores[:, 0].fill_(0.0)
    out.scores[:, 1:].copy_(node_score)
    _write_links(out, n_levels)
    return out


def _write_links(tree: DraftTree, n_levels: int) -> None:
    """ancestor_mask and retrive_* from parents/valid, vectorised (n_levels = deepest depth)."""
    bs, n = tree.parents.shape
    dev = tree.parents.device
    idx = torch.arange(n, device=dev)
    parents = tree.parents
    tree.retrive_index.copy_(torch.arange(bs * n, device=dev).view(bs, n))

    mask = tree.ancestor_mask
    mask.copy_(torch.eye(n, dtype=torch.bool, device=dev).expand(bs, n, n))
    anc = parents
    for _ in range(n_levels):  # pointer chase: after t steps anc = the t-th ancestor (or -1)
        col = torch.where(anc >= 0, anc, idx)  # -1: write the (already set) diagonal instead
        mask.scatter_(2, col.unsqueeze(-1), True)
        anc = torch.where(anc >= 0, parents.gather(1, anc.clamp(min=0)), -1)

    # Children grouped by parent, ascending index: key = parent * (N + 1) + index, sorted.
    has_parent = parents >= 0  # padding and root have none
    group = torch.where(has_parent, parents, n)
    first = torch.full((bs, n + 1), n, dtype=torch.int64, device=dev)
    first.scatter_reduce_(1, group, idx.expand(bs, n), reduce="amin", include_self=True)
    tree.retrive_next_token.copy_(torch.where(first[:, :n] < n, first[:, :n], -1))
    sorted_key, by_parent = torch.sort(group * (n + 1) + idx, dim=1)
    g = sorted_key // (n + 1)
    same = (g[:, 1:] == g[:, :-1]) & (g[:, :-1] < n)
    nxt = torch.cat([torch.where(same, by_parent[:, 1:], -1),
                     torch.full((bs, 1), -1, dtype=torch.int64, device=dev)], 1)
    tree.retrive_next_sibling.scatter_(1, by_parent, nxt)


# ----------------------------------------------------------------------------------------------
# Verify-side layouts.


def full_mask_offsets(seq_lens: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Start of each request's block in the FULL_MASK flat buffer, on device, no sync.

    offset_b = sum_{j<b} N * (seq_lens[j] + N). seq_lens [bs] int -> [bs] int64.
    """
    sizes = num_nodes * (seq_lens.to(torch.int64) + num_nodes)
    return sizes.cumsum(0) - sizes


def full_mask_layout(ancestor_mask: torch.Tensor, seq_lens: torch.Tensor, out_flat: torch.Tensor,
                     mask_offsets: torch.Tensor) -> torch.Tensor:
    """Write SGLang's FULL_MASK tree mask into a preallocated flat bool buffer (graph-safe).

    Request b owns an [N, seq_lens[b] + N] row-major block at ``mask_offsets[b]``: its first
    seq_lens[b] columns are True (the prefix), the last N are ``ancestor_mask[b]``.

    Parameters
    ----------
    ancestor_mask : [bs, N, N] bool; seq_lens : [bs] int (prefix lengths, tree excluded);
    out_flat : [L] bool with L >= sum_b N * (seq_lens[b] + N) (not checked: needs a sync);
    mask_offsets : [bs] int64 from ``full_mask_offsets``.
    The whole of ``out_flat`` is set True first (prefix columns need no index list), so entries
    past the used length end up True. Returns ``out_flat``.
    """
    bs, n, n2 = ancestor_mask.shape
    if n != n2 or out_flat.dtype != torch.bool or out_flat.dim() != 1:
        raise ValueError(f"full_mask_layout: expected ancestor_mask [bs, N, N] and a 1-D bool "
                         f"out_flat, got {tuple(ancestor_mask.shape)} and {out_flat.dtype} "
                         f"{tuple(out_flat.shape)}")
    seq = seq_lens.to(torch.int64)
    i = torch.arange(n, device=ancestor_mask.device)
    row_start = mask_offsets.to(torch.int64)[:, None] + i * (seq + n)[:, None] + seq[:, None]
    out_flat.fill_(True)
    out_flat.scatter_(0, (row_start[:, :, None] + i).reshape(-1), ancestor_mask.reshape(-1))
    return out_flat
