"""The tree build, replayed from one CUDA graph per batch size.

``build_tree`` in torch ops is a few dozen small kernels per depth: fine inside a graph, slow as
eager launches (about a thousand per step at D = 15). This wrapper captures it once per batch
size (at start-up through ``static_tree``, else on first use; static input/output buffers, the
builder's ``out=`` path) and afterwards only
copies the step's inputs in and replays (``graph_capture.capture``: no device-wide sync or
allocator flush at capture; replays never synchronize). A builder marked ``single_launch``
(the fused CUDA kernel) is called directly instead, writing into per-batch-size buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

from .graph_capture import capture, warm_up
from .tree import DraftTree, build_tree


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    root: torch.Tensor  # [bs] int64
    logp: torch.Tensor  # [bs, D, K] float32
    ids: torch.Tensor  # [bs, D, K] int64
    out: DraftTree


class TreeBuildGraphs:
    def __init__(self, budget: int, depth: int, topk: int, device, builder: Callable = build_tree,
                 use_graphs: bool = True):
        self.budget, self.depth, self.topk = budget, depth, topk
        self.device = torch.device(device)
        self.builder = builder
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self._entries: Dict[int, _Entry] = {}
        # a builder that is one kernel launch gains nothing from a graph; it writes into
        # per-batch-size buffers (static, so the accept/commit graph can read them in place)
        self.single_launch = bool(getattr(builder, "single_launch", False)) and \
            self.device.type == "cuda"
        self._outs: Dict[int, DraftTree] = {}
        self._positions: Dict[int, torch.Tensor] = {}

    def __call__(self, root_ids: torch.Tensor, topk_logp: torch.Tensor,
                 topk_ids: torch.Tensor) -> DraftTree:
        bs = root_ids.shape[0]
        if self.single_launch:  # the fused kernel: one launch into this batch size's buffers
            return self.builder(root_ids, topk_logp, topk_ids, self.budget,
                                out=self._static_out(bs))
        if not self.use_graphs:
            return self.builder(root_ids, topk_logp, topk_ids, self.budget)
        e = self._entries.get(bs)
        if e is None:
            e = self._entries[bs] = self._capture(bs)
        e.root.copy_(root_ids)
        e.logp.copy_(topk_logp)
        e.ids.copy_(topk_ids)
        e.graph.replay()
        return e.out

    def build_with_layout(self, root_ids: torch.Tensor, topk_logp: torch.Tensor,
                          topk_ids: torch.Tensor, seq_lens: torch.Tensor,
                          full_mask: Optional[torch.Tensor] = None):
        """(tree, positions [bs, N] int64): the tree plus its verify layout, the positions
        ``seq_lens + depths`` and, when ``full_mask`` (1-D bool, long enough) is given, the
        FULL_MASK the target's attention backend reads. The fused kernel writes all of it in
        its one launch (into this batch size's buffers); any other builder gets the same
        layout from ``verify.write_verify_layout``."""
        from .verify import write_verify_layout

        bs = root_ids.shape[0]
        if self.single_launch and getattr(self.builder, "writes_layout", False):
            out, pos = self._static_out(bs), self._static_positions(bs)
            seq64 = seq_lens if seq_lens.dtype == torch.int64 else seq_lens.to(torch.int64)
            tree = self.builder(root_ids, topk_logp, topk_ids, self.budget, out=out,
                                seq_lens=seq64, positions=pos, full_mask=full_mask)
            return tree, pos
        tree = self(root_ids, topk_logp, topk_ids)
        return tree, write_verify_layout(tree, seq_lens, full_mask)

    def static_tree(self, bs: int) -> Optional[DraftTree]:
        """The buffers every tree of batch size ``bs`` is built into, created (and, for a
        captured builder, its graph captured) now: what a start-up prewarm hands to the
        accept/commit graph, which reads them in place. None when trees are built eagerly into
        fresh tensors (graphs off)."""
        if self.single_launch:
            if getattr(self.builder, "writes_layout", False):
                self._static_positions(bs)
            return self._static_out(bs)
        if not self.use_graphs:
            return None
        e = self._entries.get(bs)
        if e is None:
            e = self._entries[bs] = self._capture(bs)
        return e.out

    def _static_out(self, bs: int) -> DraftTree:
        out = self._outs.get(bs)
        if out is None:
            out = self._outs[bs] = DraftTree.empty(bs, self.budget, self.device,
                                                   max_depth=self.depth)
        return out

    def _static_positions(self, bs: int) -> torch.Tensor:
        pos = self._positions.get(bs)
        if pos is None:
            pos = self._positions[bs] = torch.empty(bs, self.budget + 1, dtype=torch.int64,
                                                    device=self.device)
        return pos

    def _capture(self, bs: int) -> _Entry:
        dev = self.device
        root = torch.zeros(bs, dtype=torch.int64, device=dev)
        # valid placeholder input: sorted log-probs, distinct ids per row
        logp = (-torch.arange(self.topk, device=dev, dtype=torch.float32)).expand(
            bs, self.depth, self.topk).contiguous()
        ids = torch.arange(self.topk, device=dev, dtype=torch.int64).expand(
            bs, self.depth, self.topk).contiguous()
        out = DraftTree.empty(bs, self.budget, dev, max_depth=self.depth)
        build = lambda: self.builder(root, logp, ids, self.budget, out=out)  # noqa: E731
        warm_up(build, dev)  # caches index tables, so the capture allocates nothing new
        graph, _ = capture(build, dev)
        return _Entry(graph, root, logp, ids, out)
