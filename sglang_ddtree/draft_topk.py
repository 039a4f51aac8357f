"""The drafter's head for DDTree: per-depth top-K log-probs over the target's lm_head.

DFLASH folds a greedy argmax into the drafter's CUDA graph; DDTree needs the top-K tokens and
their log-probabilities (logit - logsumexp, fp32) at each of the B-1 drafted depths. This object
is called inside the drafter's graph (SGLang's capture-tail hook) and writes into static buffers
that the worker reads after replay, or eagerly when the graph did not run.

Tensor parallel: each rank holds a contiguous vocab shard of lm_head; per-shard top-K + logsumexp
are all-gathered and merged deterministically (value desc, token id asc), so every rank builds
the identical tree.
"""

from __future__ import annotations

import torch

from .draft_head import merge_vocab_parallel, shard_topk, topk_logprobs


class DraftTopKHead:
    def __init__(self, *, weight, block_size, topk, num_org, org_vocab_start, max_bs,
                 tp_group=None):
        self.weight = weight  # [V_shard(+pad), H] lm_head weight
        self.block_size = int(block_size)
        self.depths = self.block_size - 1
        self.topk = int(topk)
        self.num_org = int(num_org)
        self.org_vocab_start = int(org_vocab_start)
        self.tp_group = tp_group
        self.tp_size = int(tp_group.world_size) if tp_group is not None else 1
        max_rows = int(max_bs) * self.depths
        dev = weight.device
        self.logp = torch.empty((max_rows, self.topk), dtype=torch.float32, device=dev)
        self.ids = torch.empty((max_rows, self.topk), dtype=torch.int64, device=dev)
        if self.tp_size > 1:
            k_local = min(self.topk, self.num_org)
            self._k_local = k_local
            self._vals = torch.empty((self.tp_size * max_rows, k_local), dtype=torch.float32,
                                     device=dev)
            self._gids = torch.empty((self.tp_size * max_rows, k_local), dtype=torch.int64,
                                     device=dev)
            self._lse = torch.empty((self.tp_size * max_rows,), dtype=torch.float32, device=dev)

    def __call__(self, hidden_states, input_ids=None):
        """hidden_states: [bs * block, H] drafter outputs; position 0 of each block is the root."""
        bs = hidden_states.shape[0] // self.block_size
        hs = hidden_states.view(bs, self.block_size, -1)[:, 1:, :].reshape(-1, hidden_states.shape[-1])
        if hs.dtype != self.weight.dtype:
            hs = hs.to(self.weight.dtype)
        rows = hs.shape[0]
        logits = torch.matmul(hs, self.weight[: self.num_org].T)  # [rows, V_shard]
        if self.tp_size == 1:
            logp, ids = topk_logprobs(logits, self.topk)
            if self.org_vocab_start:
                ids = ids + self.org_vocab_start
        else:
            vals, gids, lse = shard_topk(logits, self._k_local, self.org_vocab_start)
            g_vals = self._vals[: self.tp_size * rows]
            g_ids = self._gids[: self.tp_size * rows]
            g_lse = self._lse[: self.tp_size * rows]
            self.tp_group.all_gather_into_tensor(g_vals, vals.contiguous())
            self.tp_group.all_gather_into_tensor(g_ids, gids.contiguous())
            self.tp_group.all_gather_into_tensor(g_lse, lse.contiguous())
            logp, ids = merge_vocab_parallel(
                g_vals.view(self.tp_size, rows, -1),
                g_ids.view(self.tp_size, rows, -1),
                g_lse.view(self.tp_size, rows),
                self.topk,
            )
        self.logp[:rows].copy_(logp)
        self.ids[:rows].copy_(ids)

    def read(self, bs: int):
        """([bs, B-1, K] fp32 log-probs, [bs, B-1, K] int64 ids) written by the last call."""
        rows = bs * self.depths
        return (self.logp[:rows].view(bs, self.depths, self.topk),
                self.ids[:rows].view(bs, self.depths, self.topk))
