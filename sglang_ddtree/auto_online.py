"""``--speculative-ddtree-budget auto`` with ``SGLANG_DDTREE_AUTO_MODE=online``: the budget per
batch size chosen from this server's own measured throughput instead of a stored table.

Why: the best budget depends on the model and the host. On the trained tiny pair (host-bound
steps) budget 32 beat budget 8 at every concurrency on the H200, so a wide tree cost nothing.
On the Kimi K2.6 TP8-rank emulation (GPU-bound) a 33-token verify cost 1.9x a 9-token one at
batch 32 (``bench_results/``). A stored table cannot be right for both.

What it measures, on the host only (no GPU value is read, nothing synchronizes):

- the interval between the starts of consecutive decode steps. In overlap scheduling that is
  the step's real cost, whichever of host or GPU bounds it. An extend or idle forward in
  between breaks the pair, and that interval is dropped;
- the tokens the scheduler has emitted to the batch's requests since the previous step
  (``len(req.output_ids)`` deltas). Those tokens belong to a step ``lag`` steps back (overlap
  scheduling processes a step's results while later steps run). They are credited to that
  step's budget.

Per batch-size bucket (1, 2, 3-4, 5-8, ... requests) and budget it keeps the tokens per
request-step (the accept length) and the mean interval. It scores each budget by accept length
/ interval, which is tokens per request per ms. A bucket first tries every budget for
``window`` steps (largest first), then uses the best one for ``exploit`` steps, then measures
every budget afresh (the incumbent first) so that the choice follows the load.

Every rank must use the same budget, and timings differ between ranks. At TP > 1 every rank
runs the same schedule (it depends only on step counts and batch sizes, which TP ranks share)
and takes rank 0's choice at the end of each measuring round: one small CPU broadcast per
round. With DP attention the ranks' batches differ, so that setup is refused at start-up.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Iterable, Optional, Tuple


def bucket_of(bs: int) -> int:
    """The batch-size bucket: the smallest power of two >= bs."""
    return 1 << max(0, (int(bs) - 1).bit_length())


@dataclass
class _Stats:
    ms: float = 0.0  # summed step intervals
    intervals: int = 0
    tokens: float = 0.0  # emitted tokens credited to this budget
    req_steps: float = 0.0  # requests x steps those tokens came from

    def score(self, min_samples: int) -> Optional[float]:
        """Tokens per request per ms, or None with too few samples."""
        if self.intervals < min_samples or self.req_steps < min_samples or self.ms <= 0:
            return None
        return (self.tokens / self.req_steps) / (self.ms / self.intervals)


@dataclass
class _Bucket:
    stats: Dict[int, _Stats]
    queue: Deque[int] = field(default_factory=collections.deque)  # budgets left to try
    current: Optional[int] = None
    left: int = 0  # steps left for ``current``
    best: Optional[int] = None


class OnlineBudgetController:
    def __init__(self, budgets: Iterable[int], window: int = 32, exploit: int = 512,
                 lag: int = 2, agree: Optional[Callable[[int], int]] = None):
        self.budgets = tuple(sorted(set(budgets), reverse=True))
        if not self.budgets:
            raise ValueError("OnlineBudgetController needs at least one budget")
        self.window, self.exploit, self.lag = window, exploit, lag
        # TP > 1: every rank reaches each choice at the same decode step (the schedule depends
        # only on step counts and batch sizes, which TP ranks share); ``agree`` turns the local
        # choice into rank 0's, so that all ranks verify the same width
        self.agree = agree
        self.min_samples = max(1, window // 2)
        self._buckets: Dict[int, _Bucket] = {}
        self._prev: Optional[Tuple[float, int, int, int]] = None  # (t, bucket, budget, bs)
        if lag < 1:
            raise ValueError("lag must be >= 1: a step's tokens are emitted after it ran")
        # (bucket, budget, bs) of the last ``lag`` decode steps, oldest first
        self._recent: Deque[Tuple[int, int, int]] = collections.deque(maxlen=lag)
        self._emitted: Dict[str, int] = {}
        self.steps = 0  # decode steps seen

    # --- bookkeeping -----------------------------------------------------------------------
    def other_forward(self) -> None:
        """An extend / idle forward ran: the next interval is not a decode step's."""
        self._prev = None

    def _credit_interval(self, now: float) -> None:
        if self._prev is None:
            return
        t, bucket, budget, _ = self._prev
        s = self._buckets[bucket].stats[budget]
        s.ms += 1e3 * (now - t)
        s.intervals += 1

    def _credit_tokens(self, emitted: int) -> None:
        """Tokens emitted since the previous step belong to the step ``lag`` steps back."""
        if emitted <= 0 or len(self._recent) < self.lag:
            return
        bucket, budget, bs = self._recent[0]
        s = self._buckets[bucket].stats[budget]
        s.tokens += emitted
        s.req_steps += bs

    def emitted_since_last(self, reqs) -> int:
        """Output tokens the scheduler added to ``reqs`` since the previous call (requests new
        to this controller count from their current length)."""
        total, seen = 0, {}
        for r in reqs:
            n = len(r.output_ids)
            rid = r.rid
            total += max(0, n - self._emitted.get(rid, n))
            seen[rid] = n
        self._emitted = seen
        return total

    # --- the choice ------------------------------------------------------------------------
    def _bucket(self, b: int) -> _Bucket:
        st = self._buckets.get(b)
        if st is None:
            st = self._buckets[b] = _Bucket(stats={x: _Stats() for x in self.budgets})
            st.queue.extend(self.budgets)
        return st

    def _next_budget(self, st: _Bucket) -> int:
        if st.current is not None and st.left > 0:
            return st.current
        if len(self.budgets) == 1:
            st.current = st.best = self.budgets[0]
            st.left = self.exploit
            return st.current
        if st.queue:  # exploring: the next budget for a window
            st.current, st.left = st.queue.popleft(), self.window
            return st.current
        if st.best is not None and st.current == st.best:
            # an exploit period ended: measure every budget afresh, the incumbent first (no
            # switch if it is still the best)
            for x in st.stats:
                st.stats[x] = _Stats()
            st.queue.extend([st.best] + [x for x in self.budgets if x != st.best])
            st.current, st.left = st.queue.popleft(), self.window
            return st.current
        # exploration over: the best score (ties: the wider tree), for an exploit period
        scores = {b: s.score(self.min_samples) for b, s in st.stats.items()}
        known = {b: v for b, v in scores.items() if v is not None}
        best = max(known, key=lambda b: (known[b], b)) if known else self.budgets[0]
        st.best = best if self.agree is None else int(self.agree(best))
        st.current, st.left = st.best, self.exploit
        return st.current

    def step(self, bs: int, emitted: int, now: float) -> int:
        """Called at the start of a decode step of ``bs`` requests: credits the interval since
        the previous decode step and the newly emitted tokens, and returns this step's
        budget."""
        self.steps += 1
        self._credit_interval(now)
        self._credit_tokens(emitted)
        b = bucket_of(bs)
        st = self._bucket(b)
        budget = self._next_budget(st)
        st.left -= 1
        self._prev = (now, b, budget, bs)
        self._recent.append((b, budget, bs))
        return budget

    def report(self) -> Dict[str, Dict[str, object]]:
        """{bucket: {"best": budget, budget: {"accept": a, "step_ms": ms}}} for the log."""
        out = {}
        for b, st in sorted(self._buckets.items()):
            row: Dict[str, object] = {"best": st.best}
            for budget, s in st.stats.items():
                if s.intervals and s.req_steps:
                    row[str(budget)] = {"accept": round(s.tokens / s.req_steps, 3),
                                        "step_ms": round(s.ms / s.intervals, 3)}
            out[str(b)] = row
        return out
