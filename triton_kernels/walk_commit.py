"""The accept walk and the step's commit bookkeeping in one Triton launch.

After the verify forward, a step walks the tree against the target's tokens and turns the
accepted path into the step's outputs: emitted tokens, commit and sequence lengths, the bonus
token, the path's node indices, the verify hidden-state rows the drafter's KV append reads, the
(dst, src) KV slot pairs that make the path contiguous and, when counted, the accept length every
smaller budget would have had (``budget_stats.py``). As PyTorch ops that is SGLang's
``verify_tree_greedy`` plus about forty small kernels; inside the accept/commit CUDA graph each
still costs its own launch slot on the GPU (the ``commit`` stage's 0.07-0.11 ms per step on the
H200, session 8). Here one program per request does all of it; only the KV copy itself stays a
separate launch (``kv_move.py``), because it fans out over layers.

The walk: from the root, move to the valid child whose token equals the target's token at the
current node, at most ``width - 1`` times (the drafter block B bounds a path). Among several
matching children the smallest index wins, as in SGLang's walk over first-child / next-sibling
links, whose sibling order is index order (sibling tokens are distinct anyway: they are distinct
ids of one top-K row).

Reference: :func:`walk_commit_reference`, the PyTorch composition the accept/commit graph runs
otherwise (``accept_walk``, ``commit_from_path``, ``kv_moves``, ``BudgetAcceptStats.update``).
All outputs are integers: the kernel must match it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl


@dataclass
class WalkCommit:
    out_tokens: torch.Tensor  # [bs, B] int64: path tokens 1..k, the bonus at column k, then 0
    commit_lens: torch.Tensor  # [bs] int32: k + 1
    new_seq_lens: torch.Tensor  # [bs] int64: prefix + k + 1
    path_nodes: torch.Tensor  # [bs, B] int64: root, the k accepted nodes, then 0
    bonus: torch.Tensor  # [bs] int64: the target's token at the last accepted node
    hidden_rows: torch.Tensor  # [bs * B] int64: b * N + path_nodes[b, j]
    kv_dst: torch.Tensor  # [bs, B - 1] int64: slots[b, j] for path position j = 1..B-1
    kv_src: torch.Tensor  # [bs, B - 1] int64: slots[b, path_nodes[b, j]] if j <= k, else dst


@triton.jit
def _walk_commit_kernel(
    tokens_ptr, parents_ptr, valid_ptr,  # [bs, N] int64, int64, bool (as int8)
    pred_ptr,  # [bs, N] int64: the target's token at every node
    slots_ptr,  # [bs, >= B] int64 KV slots of positions prefix .. prefix + W - 1
    prefix_ptr,  # [bs] prefix lengths (any integer dtype)
    out_tokens_ptr, commit_lens_ptr, new_lens_ptr, path_ptr, bonus_ptr, rows_ptr,
    dst_ptr, src_ptr,
    budgets_ptr,  # [NUM_BUDGETS] int64 candidate budgets (stats), unused when 0
    totals_ptr,  # [NUM_BUDGETS + 1] int64: accepted nodes within each budget, then requests
    N, stride_slots,
    WIDTH: tl.constexpr,  # B: path columns (root included)
    N_PAD: tl.constexpr,
    NUM_BUDGETS: tl.constexpr,
    B_PAD: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, N_PAD)
    inb = offs < N
    row = b * N
    par = tl.load(parents_ptr + row + offs, mask=inb, other=-2)
    tok = tl.load(tokens_ptr + row + offs, mask=inb, other=0)
    live = inb & (tl.load(valid_ptr + row + offs, mask=inb, other=0) != 0)
    srow = b * stride_slots
    cidx = tl.arange(0, B_PAD)
    budgets = tl.load(budgets_ptr + cidx, mask=cidx < NUM_BUDGETS, other=-1)
    counts = tl.zeros((B_PAD,), dtype=tl.int64)
    cur = b * 0  # int64 scalars
    acc = b * 0
    tl.store(path_ptr + b * WIDTH, cur)
    tl.store(rows_ptr + b * WIDTH, row)
    for t in tl.static_range(1, WIDTH):
        want = tl.load(pred_ptr + row + cur)
        match = live & (par == cur) & (tok == want)
        nxt = tl.min(tl.where(match, offs, N_PAD), axis=0)
        hit = nxt < N_PAD
        node = tl.where(hit, nxt, 0).to(tl.int64)
        first_miss = (nxt >= N_PAD) & (acc == t - 1)
        cur = tl.where(hit, node, cur)
        acc += hit.to(tl.int64)
        tl.store(path_ptr + b * WIDTH + t, node)
        tl.store(rows_ptr + b * WIDTH + t, row + node)
        # column t - 1: the node's token on a hit; the bonus (= want, the target's token at the
        # final node) at the first miss; 0 after it -- each column is written once
        emitted = tl.load(tokens_ptr + row + node)
        # (clamped at 0 like the op path's emitted tokens; real target tokens are never < 0)
        col = tl.where(hit, emitted, tl.where(first_miss, tl.maximum(want, 0), 0))
        tl.store(out_tokens_ptr + b * WIDTH + t - 1, col)
        d = tl.load(slots_ptr + srow + t)
        s = tl.load(slots_ptr + srow + node)
        tl.store(dst_ptr + b * (WIDTH - 1) + t - 1, d)
        tl.store(src_ptr + b * (WIDTH - 1) + t - 1, tl.where(hit, s, d))
        counts += (hit & (node <= budgets)).to(tl.int64)
    bonus = tl.load(pred_ptr + row + cur)
    # the last column holds the bonus only when the whole block was accepted
    tl.store(out_tokens_ptr + b * WIDTH + WIDTH - 1,
             tl.where(acc == WIDTH - 1, tl.maximum(bonus, 0), 0))
    tl.store(bonus_ptr + b, bonus)
    tl.store(commit_lens_ptr + b, (acc + 1).to(tl.int32))
    tl.store(new_lens_ptr + b, tl.load(prefix_ptr + b).to(tl.int64) + acc + 1)
    if NUM_BUDGETS > 0:
        tl.atomic_add(totals_ptr + cidx, counts, mask=cidx < NUM_BUDGETS)
        tl.atomic_add(totals_ptr + NUM_BUDGETS, b * 0 + 1)


def _check(tree, predicted, slots, prefix, width):
    bs, n = tree.tokens.shape
    if predicted.shape != (bs, n) or predicted.dtype != torch.int64:
        raise ValueError(f"walk_commit: predicted must be int64 {(bs, n)}, got "
                         f"{predicted.dtype} {tuple(predicted.shape)}")
    if slots.dim() != 2 or slots.shape[0] != bs or slots.shape[1] < max(width, n) or \
            slots.dtype != torch.int64:
        raise ValueError(f"walk_commit: slots must be int64 [{bs}, >= {max(width, n)}], got "
                         f"{slots.dtype} {tuple(slots.shape)}")
    if prefix.shape != (bs,):
        raise ValueError(f"walk_commit: prefix must be [{bs}], got {tuple(prefix.shape)}")
    if width < 1:
        raise ValueError(f"walk_commit: path width must be >= 1, got {width}")


def walk_commit(tree, predicted: torch.Tensor, slots: torch.Tensor, prefix: torch.Tensor,
                width: int, budgets: Optional[torch.Tensor] = None,
                totals: Optional[torch.Tensor] = None) -> WalkCommit:
    """One launch: walk ``tree`` (a ``DraftTree``, [bs, N]) against ``predicted`` ([bs, N]
    int64) and return the step's :class:`WalkCommit`. ``slots``: [bs, W >= max(B, N)] int64;
    ``prefix``: [bs]; ``width``: B. With ``budgets`` ([C] int64) and ``totals`` ([C + 1] int64,
    contiguous), adds the accepted nodes within each budget and the request count to ``totals``
    (``BudgetAcceptStats``). Fixed shapes, no host sync: CUDA-graph capturable."""
    _check(tree, predicted, slots, prefix, width)
    bs, n = tree.tokens.shape
    dev = tree.tokens.device
    i64 = dict(dtype=torch.int64, device=dev)
    out = WalkCommit(
        out_tokens=torch.empty(bs, width, **i64),
        commit_lens=torch.empty(bs, dtype=torch.int32, device=dev),
        new_seq_lens=torch.empty(bs, **i64),
        path_nodes=torch.empty(bs, width, **i64),
        bonus=torch.empty(bs, **i64),
        hidden_rows=torch.empty(bs * width, **i64),
        kv_dst=torch.empty(bs, width - 1, **i64),
        kv_src=torch.empty(bs, width - 1, **i64),
    )
    if bs == 0:
        return out
    num_budgets = 0 if budgets is None else budgets.numel()
    if num_budgets:
        if totals is None or totals.dtype != torch.int64 or totals.numel() != num_budgets + 1 \
                or not totals.is_contiguous() or budgets.dtype != torch.int64:
            raise ValueError("walk_commit: budgets must be int64 [C] and totals int64 [C + 1], "
                             "contiguous")
    else:
        budgets = totals = out.bonus  # never read or written (NUM_BUDGETS = 0)
    tokens = tree.tokens.contiguous()
    _walk_commit_kernel[(bs,)](
        tokens, tree.parents.contiguous(), tree.valid.contiguous().view(torch.int8),
        predicted.contiguous(), slots, prefix.contiguous(),
        out.out_tokens, out.commit_lens, out.new_seq_lens, out.path_nodes, out.bonus,
        out.hidden_rows, out.kv_dst, out.kv_src, budgets, totals,
        n, slots.stride(0),
        WIDTH=width, N_PAD=triton.next_power_of_2(n), NUM_BUDGETS=num_budgets,
        B_PAD=triton.next_power_of_2(max(num_budgets, 1)),
        num_warps=1 if n <= 64 else 4,
    )
    return out


def walk_commit_reference(tree, predicted: torch.Tensor, slots: torch.Tensor,
                          prefix: torch.Tensor, width: int,
                          budgets: Optional[torch.Tensor] = None,
                          totals: Optional[torch.Tensor] = None) -> WalkCommit:
    """The same outputs from the PyTorch ops the accept/commit graph otherwise runs."""
    from ..accept import accept_walk
    from ..budget_stats import accepted_within_budgets
    from ..commit import commit_from_path, kv_moves

    _check(tree, predicted, slots, prefix, width)
    accept_len, nodes, bonus = accept_walk(tree, predicted, width - 1)
    step = commit_from_path(tree, nodes, accept_len, bonus, prefix)
    dst, src = kv_moves(slots, step.path_nodes, accept_len)
    bs, n = tree.tokens.shape
    if budgets is not None and budgets.numel():
        totals[:-1] += accepted_within_budgets(step.path_nodes, accept_len, budgets)
        totals[-1:] += bs
    base = torch.arange(bs, device=slots.device, dtype=torch.int64)[:, None] * n
    return WalkCommit(out_tokens=step.out_tokens, commit_lens=step.commit_lens,
                      new_seq_lens=step.new_seq_lens, path_nodes=step.path_nodes,
                      bonus=step.bonus, hidden_rows=(base + step.path_nodes).reshape(-1),
                      kv_dst=dst.contiguous(), kv_src=src.contiguous())
