"""Accept length every smaller budget would have had, measured from this server's own trees.

A DDTree of budget b' < b is the first b' nodes of the budget-b tree: nodes are selected best
first in one total order (score, then depth, then rank path), node i of the tree is the i-th
selected, and with the default top-K (= budget) a node outside the top b' has b' better
siblings. The step's accepted path is therefore also the path a budget-b' tree would have
accepted, cut at its first node of index > b' (node indices strictly increase along a path).
At T > 0 the per-node samples do not depend on the tree either, so the cut path has the
distribution of a real budget-b' step.

Counting that on the GPU every step (inside the accept/commit graph) gives the accept-length
curve over budgets 1, 2, 4, ..., b from a single server, and the gain side of a per-batch-size
budget choice (docs/auto_budget.md). Reading it never synchronizes: ``report`` returns the
values copied (non-blocking) at the previous call.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch


def candidate_budgets(budget: int) -> List[int]:
    """1, 2, 4, ... below ``budget``, and ``budget`` itself."""
    out, b = [], 1
    while b < budget:
        out.append(b)
        b *= 2
    return out + [budget]


def accepted_within_budgets(path_nodes: torch.Tensor, accept_len: torch.Tensor,
                            budgets: torch.Tensor) -> torch.Tensor:
    """[C] int64: over the batch, the accepted path nodes (positions 1..accept_len) whose index
    is at most each budget (path_nodes: [bs, B] int64, root first; accept_len: [bs]; budgets:
    [C] int64). Static shapes: graph-capturable."""
    width = path_nodes.shape[1]
    j = torch.arange(1, width, device=path_nodes.device)
    live = j[None, :] <= accept_len.to(torch.int64)[:, None]  # [bs, B-1]
    within = (path_nodes[None, :, 1:] <= budgets[:, None, None]) & live[None]
    return within.sum(dim=(1, 2))


class BudgetAcceptStats:
    def __init__(self, budget: int, device):
        device = torch.device(device)
        self.candidates = candidate_budgets(budget)
        self.budgets = torch.tensor(self.candidates, dtype=torch.int64, device=device)
        # [C] accepted draft tokens summed over request-steps, then the request-step count
        # (int64: exact, and what the fused walk's atomic adds take)
        self.totals = torch.zeros(len(self.candidates) + 1, dtype=torch.int64, device=device)
        self._cuda = device.type == "cuda"
        self._host = torch.zeros(len(self.candidates) + 1, dtype=torch.int64,
                                 pin_memory=self._cuda)
        self._copied = None  # event recorded after the last non-blocking copy

    def update(self, path_nodes: torch.Tensor, accept_len: torch.Tensor) -> None:
        """path_nodes: [bs, B] int64 accepted node per path position (root first, 0-padded);
        accept_len: [bs] accepted draft tokens. Static shapes, in place: graph-capturable."""
        self.totals[:-1] += accepted_within_budgets(path_nodes, accept_len, self.budgets)
        self.totals[-1:] += path_nodes.shape[0]

    def report(self) -> Optional[Dict[int, float]]:
        """{budget: tokens per step (accepted drafts + 1)} as of the previous call (no sync),
        None before any step was seen; then starts the next copy."""
        if self._copied is not None and not self._copied.query():
            return None  # the previous copy has not landed yet: never wait for it
        prev = self._host.clone()
        self._host.copy_(self.totals, non_blocking=True)
        if self._cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        steps = float(prev[-1])
        if steps <= 0:
            return None
        return {b: round(1.0 + float(v) / steps, 4)
                for b, v in zip(self.candidates, prev[:-1].tolist())}
