"""After the accept walk: emitted tokens, new lengths, KV relocation and drafter context rows.

All on the GPU, fixed shapes, no host sync. Shapes: ``bs`` requests, ``N`` verify tokens,
``B`` = drafter block size (the accepted path has at most B nodes: the root + B-1 depths).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .accept import emitted_tokens
from .tree import DraftTree


@dataclass
class StepCommit:
    out_tokens: torch.Tensor  # [bs, B] int64: path tokens 1..k, then the bonus at column k, then 0
    commit_lens: torch.Tensor  # [bs] int32: k + 1 tokens emitted (accepted drafts + bonus)
    new_seq_lens: torch.Tensor  # [bs] int64: prefix + commit_len
    path_nodes: torch.Tensor  # [bs, B] int64: node index at each path position, root (0) padded
    bonus: torch.Tensor  # [bs] int64: next step's root token


def commit_from_path(
    tree: DraftTree,
    accepted_nodes: torch.Tensor,
    accept_len: torch.Tensor,
    bonus: torch.Tensor,
    seq_lens: torch.Tensor,
) -> StepCommit:
    """Turn an accepted path into the step's outputs.

    tree: the step's DraftTree; accepted_nodes: [bs, B] node indices (root at column 0, -1 pad);
    accept_len: [bs] accepted draft nodes k; bonus: [bs]; seq_lens: [bs] prefix lengths.
    """
    path_nodes = torch.where(accepted_nodes < 0, torch.zeros_like(accepted_nodes), accepted_nodes)
    # SGLang reads only the first commit_len columns; pad with 0 like DFLASH does
    out = emitted_tokens(tree, accept_len.to(torch.int64), accepted_nodes,
                         bonus.to(torch.int64)).clamp(min=0)
    commit_lens = (accept_len + 1).to(torch.int32)
    return StepCommit(
        out_tokens=out,
        commit_lens=commit_lens,
        new_seq_lens=seq_lens.to(torch.int64) + commit_lens.to(torch.int64),
        path_nodes=path_nodes,
        bonus=bonus.to(torch.int64),
    )


def kv_moves(slots: torch.Tensor, path_nodes: torch.Tensor, accept_len: torch.Tensor):
    """(dst, src) KV slots [bs, B-1] that make the accepted path contiguous after the prefix.

    Path position j (1..k) must end at slot ``slots[b, j]`` (position prefix + j); its KV was
    written at ``slots[b, path_nodes[b, j]]``. Positions past k copy a slot onto itself.
    Because node indices on a path strictly increase, path_nodes[b, j] >= j: applying the
    columns in order j = 1, 2, ... never reads a slot an earlier column overwrote.
    """
    width = path_nodes.shape[1]
    j = torch.arange(1, width, device=slots.device)[None, :]
    dst = slots[:, 1:width]
    src = torch.gather(slots, 1, path_nodes[:, 1:])
    live = j <= accept_len.to(torch.int64)[:, None]
    return dst, torch.where(live, src, dst)


def move_accepted_kv(pool, dst: torch.Tensor, src: torch.Tensor, fused=None) -> None:
    """Apply :func:`kv_moves` to an SGLang KV pool, column by column (see ordering note).

    Each column is one ``move_kv_cache`` call over all layers (within a column the batch's slots
    are disjoint: requests own disjoint slots). With ``fused`` (default: SGLANG_DDTREE_KV_MOVE)
    and a pool whose layout ``kv_move.py`` knows (MHA / MLA token pools), one Triton launch does
    every column of every layer in order instead.
    """
    if fused is None:
        from .config import kv_move_fused

        fused = kv_move_fused()
    if fused and dst.is_cuda:
        from .kv_move import path_kv_mover

        mover = path_kv_mover(pool)
        if mover is not None:
            mover(dst, src)
            return
    # one transpose each, so every column is a contiguous row (not 2 copies per column)
    dst_cols, src_cols = dst.t().contiguous(), src.t().contiguous()
    for j in range(dst_cols.shape[0]):
        pool.move_kv_cache(dst_cols[j], src_cols[j])


def path_hidden(hidden: torch.Tensor, path_nodes: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[bs * B, H] target hidden rows of the accepted path, in path order (root first).

    hidden: [bs * N, H] verify-forward hidden states (aux layers concatenated).
    """
    bs, width = path_nodes.shape
    base = torch.arange(bs, device=hidden.device, dtype=torch.int64)[:, None] * num_tokens
    return hidden.index_select(0, (base + path_nodes).reshape(-1))
