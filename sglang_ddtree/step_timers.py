"""Per-stage step timers of the DDTREE worker (SGLANG_DDTREE_TIMERS=sync|cpu|gpu; off by default).

The worker marks each stage boundary of a decode step (draft, tree, verify, accept, commit,
publish, draft_kv); the timers log ms per step overall and per batch size every ``every``
steps. scripts/bench_e2e.py and scripts/bench_cost_curves.py read those log lines.
"""

from __future__ import annotations

import json
import logging
import time

import torch

from . import config as cfg

logger = logging.getLogger(__name__)


class StepTimers:
    """Per-stage time of the step, off by default. ``sync`` mode synchronizes the GPU at every
    stage boundary (wall time of each stage, GPU work included, plus one host-GPU round trip
    per stage); ``cpu`` mode does not synchronize and measures the host time each stage takes
    to issue its work -- the cost that bounds a step when the GPU work is small and hidden by
    overlap scheduling; ``gpu`` mode records a CUDA event at every stage boundary and reads
    them once per log line (one synchronization per ``every`` steps): the time each stage holds
    the stream, which is its GPU work when the host runs ahead and the host's issue time when
    the GPU waits for it -- what the stage adds to the step's wall time, without the round
    trips ``sync`` adds.

    draft: drafter block + top-K head; tree: tree build; verify: mask, positions and the
    target's forward; accept: the target's token at every node (argmax, or sampling and the TP
    broadcast); commit: tree walk, emitted tokens, KV relocation (one graph replay); publish:
    SGLang's ``on_publish`` callback with the new lengths (the scheduler's, which every spec
    worker calls; counted in commit before session 8); draft_kv: the drafter's KV from the
    accepted nodes' hidden states (DFlash's own append, which DFLASH pays every step as well).
    DDTree's own overhead over a chain step is tree + accept + commit.

    ``pad_us`` (gpu mode, SGLANG_DDTREE_TIMERS_PAD_US; a diagnostic): :meth:`pad`, called after
    the tree stage, queues a GPU busy-wait of about that many microseconds, timed as the stage
    ``pad`` (its length is what the events measure; the microseconds only set it roughly). The
    host issues the verify meanwhile, so ``verify`` then holds the forward's GPU work alone:
    the verify of a run without the pad minus this one is the time the stream sat idle waiting
    for the host to issue the verify."""

    STAGES = ("draft", "tree", "verify", "accept", "commit", "publish", "draft_kv")
    PAD_STAGE = "pad"
    # GPU clock cycles a microsecond of the pad spins (torch.cuda._sleep counts cycles); about
    # the boost clock of an H100 / H200 (1.98 GHz): slower clocks make a longer pad
    PAD_CYCLES_PER_US = 2000

    def __init__(self, mode: str = "off", every: int = 200, skip: int = 0, pad_us: int = 0):
        if mode == "gpu" and not torch.cuda.is_available():
            raise cfg.DDTreeConfigError("SGLANG_DDTREE_TIMERS=gpu needs a CUDA device; use "
                                        "cpu or 1 (sync)")
        if pad_us and mode != "gpu":
            raise cfg.DDTreeConfigError("SGLANG_DDTREE_TIMERS_PAD_US needs "
                                        "SGLANG_DDTREE_TIMERS=gpu")
        self.pad_us = int(pad_us)
        # the stages this run logs: the pad's only when it is on (older readers see no change)
        self.stages = self.STAGES + ((self.PAD_STAGE,) if self.pad_us else ())
        self.mode = mode
        self.every = every  # steps between log lines
        self.enabled = mode != "off"
        self._sync = mode == "sync"
        self._gpu = mode == "gpu"
        self.totals = {s: 0.0 for s in self.stages}
        self.steps = 0  # steps finished
        self.steps_counted = 0  # of which in the stage times (past each batch size's skip)
        self._step = {s: 0.0 for s in self.stages}
        self.by_bs = {}  # bs -> [steps, {stage: seconds}]
        self.skip = skip  # first steps of each batch size left out (one-time costs)
        self._seen = {}  # bs -> steps finished at that batch size, counted or not
        # gpu mode: this step's (stage, end event) after its start event; finished steps not
        # yet read; events to reuse once read
        self._events = []
        self._pending = []
        self._free = []

    def _record(self):
        ev = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def start(self):
        if self.enabled:
            if self._gpu:
                self._events = [(None, self._record())]
                return
            if self._sync:
                torch.cuda.synchronize()
            self._t = time.perf_counter()

    def mark(self, stage):
        if self.enabled:
            if self._gpu:
                self._events.append((stage, self._record()))
                return
            if self._sync:
                torch.cuda.synchronize()
            now = time.perf_counter()
            self._step[stage] += now - self._t
            self._t = now

    def pad(self):
        """gpu mode with a pad: the busy-wait and its stage mark (see the class); else nothing."""
        if self.pad_us and self._gpu:
            torch.cuda._sleep(self.pad_us * self.PAD_CYCLES_PER_US)
            self.mark(self.PAD_STAGE)

    def _add(self, bs, per_stage):
        self._seen[bs] = self._seen.get(bs, 0) + 1
        if self._seen[bs] <= self.skip:
            return
        self.steps_counted += 1
        entry = self.by_bs.setdefault(bs, [0, {s: 0.0 for s in self.stages}])
        entry[0] += 1
        for stage, v in per_stage.items():
            self.totals[stage] += v
            entry[1][stage] += v

    def _read_events(self):
        """gpu mode: wait for the last finished step's events (once per log line), then add
        every pending step's stage times."""
        if not self._pending:
            return
        self._pending[-1][1][-1][1].synchronize()
        for bs, events in self._pending:
            per_stage = {s: 0.0 for s in self.stages}
            for (_, a), (stage, b) in zip(events, events[1:]):
                per_stage[stage] += a.elapsed_time(b) / 1e3  # ms -> s
            self._add(bs, per_stage)
            self._free.extend(ev for _, ev in events)
        self._pending = []

    def finish(self, bs):
        if not self.enabled:
            return
        self.steps += 1
        if self._gpu:
            self._pending.append((bs, self._events))
            self._events = []
        else:
            self._add(bs, self._step)
            self._step = {s: 0.0 for s in self.stages}
        if self.steps % self.every == 0:
            if self._gpu:
                self._read_events()
            n = max(1, self.steps_counted)
            per = {s: round(1e3 * v / n, 3) for s, v in self.totals.items()}
            logger.info("DDTREE stage ms/step (%s) over %d steps (last bs=%d): %s", self.mode,
                        self.steps_counted, bs, per)
            logger.info("DDTREE stage ms/step by batch size (%s): %s", self.mode,
                        json.dumps(self.per_batch_size()))
            from . import moe_hook

            if moe_hook.stats_enabled():  # SGLANG_DDTREE_MOE_STATS=1 (a host sync; diagnostic)
                logger.info("DDTREE MoE distinct experts per call by tokens M (mean, calls): %s",
                            json.dumps(moe_hook.moe_stats_summary()))

    def per_batch_size(self):
        """{bs: {"steps": n, stage: ms per step}} over every step so far."""
        return {str(bs): {"steps": n, **{s: round(1e3 * v / n, 3) for s, v in t.items()}}
                for bs, (n, t) in sorted(self.by_bs.items())}
