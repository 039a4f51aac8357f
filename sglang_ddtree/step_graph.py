"""Accept walk + commit bookkeeping + KV relocation, replayed from one CUDA graph per batch size.

After the target's verify forward a step needs only static-shape work: SGLang's
``verify_tree_greedy`` walk, the emitted tokens and new lengths, the KV relocation of the
accepted path (one ``move_kv_cache`` per path column) and the row index of the accepted nodes'
hidden states. As eager launches that is about fifty small kernels, whose launch cost lands on
the critical path of every decode step. Here it is captured once per batch size and replayed
(inputs copied in -- the target's tokens written in place where the caller asks for the
buffer, ``predicted_buffer`` -- outputs cloned out, three of them as one packed clone). The
worker captures every batch size up to the largest CUDA-graph batch size at start-up
(``prewarm``); a batch size beyond it is captured on first use. By default
(``SGLANG_DDTREE_COMMIT=fused``) the walk and all of the bookkeeping are one Triton launch
(``triton_kernels/walk_commit.py``) plus the KV move; where that kernel cannot run, the op path
above serves, after one logged error.

The tree is not copied in: the tree builder hands out the same per-batch-size buffers every step
(``TreeBuildGraphs``), so the graph reads them where they are. A call with other tree buffers (or
on CPU, or with graphs off) runs the same function eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from .config import ENV_COMMIT
from .commit import StepCommit, commit_from_path, kv_moves, move_accepted_kv
from .graph_capture import capture, warm_up
from .tree import DraftTree

logger = logging.getLogger(__name__)


@dataclass
class AcceptCommit:
    step: StepCommit
    hidden_rows: torch.Tensor  # [bs * B] int64 rows of the verify hidden states, path order


def accept_and_commit(tree: DraftTree, predicted: torch.Tensor, slots: torch.Tensor,
                      prefix: torch.Tensor, path_width: int, walk: Callable,
                      pool, stats=None, fused: bool = False) -> AcceptCommit:
    """Walk ``tree`` against the target's ``predicted`` tokens and commit the accepted path.

    tree: [bs, N] DraftTree; predicted: [bs, N] int64 target token at every node; slots:
    [bs, W >= N] int64 KV slots of positions prefix..prefix+W-1; prefix: [bs] lengths;
    path_width: the drafter block B; walk: ``compat.tree_greedy_walk``; pool: SGLang KV pool
    (None: skip the KV relocation); stats: optional ``BudgetAcceptStats`` updated in place.
    fused: walk and bookkeeping in one Triton launch (``triton_kernels/walk_commit.py``, the
    same integers; ``walk`` unused) instead of SGLang's walk and PyTorch ops.
    """
    if fused:
        return _finish_fused(_walk_commit(tree, predicted, slots, prefix, path_width, stats),
                             pool)
    accept_len, accepted_nodes, bonus = walk(tree, predicted, path_width)
    step = commit_from_path(tree, accepted_nodes, accept_len, bonus, prefix)
    if stats is not None:
        stats.update(step.path_nodes, accept_len)
    if pool is not None:
        dst, src = kv_moves(slots, step.path_nodes, accept_len)
        move_accepted_kv(pool, dst, src)
    bs, n = tree.tokens.shape
    base = torch.arange(bs, device=tree.tokens.device, dtype=torch.int64)[:, None] * n
    return AcceptCommit(step=step, hidden_rows=(base + step.path_nodes).reshape(-1))


def _walk_commit(tree, predicted, slots, prefix, path_width, stats):
    """The fused path's one launch (``triton_kernels/walk_commit.py``): walk, bookkeeping and
    budget statistics. It checks its inputs and compiles before it launches, so when it raises
    it has written nothing."""
    from .triton_kernels.walk_commit import walk_commit

    return walk_commit(tree, predicted.to(torch.int64), slots.to(torch.int64), prefix,
                       path_width,
                       None if stats is None else stats.budgets,
                       None if stats is None else stats.totals)


def _finish_fused(wc, pool) -> AcceptCommit:
    """The KV move of the fused path's result, and its outputs as ``AcceptCommit``."""
    if pool is not None:
        move_accepted_kv(pool, wc.kv_dst, wc.kv_src)
    return AcceptCommit(step=StepCommit(out_tokens=wc.out_tokens, commit_lens=wc.commit_lens,
                                        new_seq_lens=wc.new_seq_lens,
                                        path_nodes=wc.path_nodes, bonus=wc.bonus),
                        hidden_rows=wc.hidden_rows)


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    tree_ptr: int  # data_ptr of the tree tokens the graph reads
    predicted: torch.Tensor
    slots: torch.Tensor
    prefix: torch.Tensor
    out: AcceptCommit
    # bytes written by the graph: out_tokens, new_seq_lens, bonus as int64, then commit_lens as
    # int32 (one clone hands all four out instead of four; _unpack reads them back)
    packed: torch.Tensor


def _pack(out: AcceptCommit) -> torch.Tensor:
    s = out.step
    parts = (s.out_tokens.reshape(-1), s.new_seq_lens.to(torch.int64), s.bonus.to(torch.int64),
             s.commit_lens.to(torch.int32))
    return torch.cat([t.contiguous().view(torch.uint8) for t in parts])


def _unpack(packed: torch.Tensor, bs: int, width: int):
    """(out_tokens [bs, width] int64, new_seq_lens [bs] int64, bonus [bs] int64, commit_lens
    [bs] int32): views of one ``_pack`` byte buffer (the int64 parts first, so every view is
    aligned)."""
    n64 = bs * width + 2 * bs
    w = packed[: 8 * n64].view(torch.int64)
    return (w[: bs * width].view(bs, width), w[bs * width: bs * width + bs], w[bs * width + bs:],
            packed[8 * n64:].view(torch.int32))


class AcceptCommitGraphs:
    """``accept_and_commit`` per batch size from a CUDA graph (captured on first use)."""

    def __init__(self, path_width: int, walk: Callable, use_graphs: bool, device, stats=None,
                 fused: bool = False):
        self.path_width, self.walk, self.stats, self.fused = path_width, walk, stats, fused
        self.fused_error: Optional[str] = None  # why the fused path was given up, if it was
        self.device = torch.device(device)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self._entries: Dict[Tuple, _Entry] = {}
        self.failed: Dict[Tuple, str] = {}  # capture errors: that key runs eagerly

    def __call__(self, tree: DraftTree, predicted: torch.Tensor, slots: torch.Tensor,
                 prefix: torch.Tensor, pool) -> AcceptCommit:
        key = self._key(tree, slots, prefix, pool)
        if not self.use_graphs or key in self.failed:
            return self._eager(tree, predicted, slots, prefix, pool)
        e = self._entries.get(key)
        if e is None:
            try:
                e = self._entries[key] = self._capture(tree, predicted, slots, prefix, pool)
            except Exception as err:  # noqa: BLE001 -- reported, then served eagerly
                self.failed[key] = f"{type(err).__name__}: {err}"
                logger.error(
                    "DDTREE: accept/commit graph capture failed for %s (%s); running it eagerly",
                    key, self.failed[key])
                return self._eager(tree, predicted, slots, prefix, pool)
        if e.tree_ptr != tree.tokens.data_ptr():  # not the builder's static buffers
            return self._eager(tree, predicted, slots, prefix, pool)
        # inputs the graph does not already read in place: the worker writes the target's tokens
        # into predicted_buffer, and the step-prep buffers handed to prewarm are the graph's own
        # slots and prefix
        for given, static in ((predicted, e.predicted), (slots, e.slots), (prefix, e.prefix)):
            if given.data_ptr() != static.data_ptr():
                static.copy_(given)
        e.graph.replay()
        s = e.out.step
        # outputs that outlive the step (next step's lengths/bonus, SGLang's result) are cloned:
        # the next replay at this batch size overwrites the static buffers
        bs, width = s.out_tokens.shape
        out_tokens, new_seq_lens, bonus, commit_lens = _unpack(e.packed.clone(), bs, width)
        return AcceptCommit(
            step=StepCommit(out_tokens=out_tokens, commit_lens=commit_lens,
                            new_seq_lens=new_seq_lens, path_nodes=s.path_nodes, bonus=bonus),
            hidden_rows=e.out.hidden_rows)

    def predicted_buffer(self, tree: DraftTree, slots: torch.Tensor, prefix: torch.Tensor,
                         pool):
        """The [bs, N] int64 buffer the graph of this step's shapes reads the target's tokens
        from, for the caller to write them in place (one copy fewer per step), or None (no
        graph yet, graphs off, or not the builder's tree buffers: pass a tensor as usual)."""
        if not self.use_graphs:
            return None
        e = self._entries.get(self._key(tree, slots, prefix, pool))
        if e is None or e.tree_ptr != tree.tokens.data_ptr():
            return None
        return e.predicted

    @staticmethod
    def _key(tree, slots, prefix, pool) -> Tuple:
        return (tree.tokens.shape[0], tree.tokens.shape[1], slots.shape[1], prefix.dtype,
                slots.dtype, id(pool))

    def prewarm(self, tree: DraftTree, width: int, pool, prefix_dtype=torch.int64,
                slots_dtype=torch.int64, slots: Optional[torch.Tensor] = None,
                prefix: Optional[torch.Tensor] = None) -> bool:
        """Capture the graph a step with ``tree`` (the tree builder's static buffers of one
        batch size) will replay, before serving: a first capture mid-serving stalls that step
        (tens to hundreds of ms, measured on the H200) and, on a new shape, compiles kernels.
        ``tree`` is overwritten with a valid root-only tree (the capture's warm-up walks it).
        ``slots`` [bs, width] / ``prefix`` [bs]: buffers every step at this batch size passes
        (the step-prep kernel's), which the graph then reads in place instead of copying them
        in; they are zeroed here (before serving: nothing reads them yet). Returns whether a
        graph was captured now."""
        bs, n = tree.tokens.shape
        dev = tree.tokens.device
        if slots is None:
            slots = torch.zeros(bs, width, dtype=slots_dtype, device=dev)
        if prefix is None:
            prefix = torch.zeros(bs, dtype=prefix_dtype, device=dev)
        if tuple(slots.shape) != (bs, width) or tuple(prefix.shape) != (bs,):
            raise ValueError(f"prewarm: slots {tuple(slots.shape)} / prefix "
                             f"{tuple(prefix.shape)} are not [{bs}, {width}] / [{bs}]")
        key = self._key(tree, slots, prefix, pool)
        if not self.use_graphs or key in self._entries or key in self.failed:
            return False
        tree.copy_(DraftTree.make_dummy(bs, n - 1, dev, max_depth=tree.max_depth or 1))
        predicted = torch.zeros(bs, n, dtype=torch.int64, device=dev)
        try:
            self._entries[key] = self._capture(tree, predicted, slots, prefix, pool,
                                               in_place=True)
        except Exception as err:  # noqa: BLE001 -- reported; that key then runs eagerly
            self.failed[key] = f"{type(err).__name__}: {err}"
            logger.error("DDTREE: accept/commit graph capture failed for %s (%s); it will run "
                         "eagerly", key, self.failed[key])
            return False
        return True

    def _eager(self, tree, predicted, slots, prefix, pool, count=True):
        stats = self.stats if count else None
        if self.fused:
            try:
                wc = _walk_commit(tree, predicted, slots, prefix, self.path_width, stats)
            except Exception as err:  # noqa: BLE001 -- reported, then the op path serves
                # nothing was written (the launch never happened): the op path does the step
                self.fused = False
                self.fused_error = f"{type(err).__name__}: {err}"
                logger.error(
                    "DDTREE: the one-launch accept/commit kernel (%s=fused) failed (%s); the "
                    "op path serves instead (set %s=ops to skip this attempt)", ENV_COMMIT,
                    self.fused_error, ENV_COMMIT)
            else:
                return _finish_fused(wc, pool)
        return accept_and_commit(tree, predicted, slots, prefix, self.path_width, self.walk, pool,
                                 stats=stats, fused=False)

    def _capture(self, tree, predicted, slots, prefix, pool, in_place=False) -> _Entry:
        """in_place: the graph reads ``slots`` and ``prefix`` themselves (prewarm's buffers,
        zeroed), not placeholders of their shapes."""
        dev = self.device
        # placeholders for the warm-up run: slot 0 is SGLang's padding slot, so the warm-up's
        # KV "moves" copy slot 0 onto itself
        st_pred = torch.zeros_like(predicted)
        if in_place:
            st_slots, st_prefix = slots, prefix
            st_slots.zero_()
            st_prefix.zero_()
        else:
            st_slots = torch.zeros_like(slots)
            st_prefix = torch.zeros_like(prefix)
        # the warm-up runs on placeholders: it must not count towards the budget statistics
        warm_up(lambda: _pack(self._eager(tree, st_pred, st_slots, st_prefix, pool,
                                          count=False)), dev)

        def step():
            out = self._eager(tree, st_pred, st_slots, st_prefix, pool)
            return out, _pack(out)

        graph, (out, packed) = capture(step, dev)
        return _Entry(graph, tree.tokens.data_ptr(), st_pred, st_slots, st_prefix, out, packed)
