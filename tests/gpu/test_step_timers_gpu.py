"""GPU test of StepTimers' ``gpu`` mode (SGLANG_DDTREE_TIMERS=gpu): CUDA events at the stage
boundaries measure the time each stage holds the stream, with no synchronization per step.

Run: python -m pytest -q tests/gpu/test_step_timers_gpu.py
"""
from __future__ import annotations

import pytest
import torch

from sglang_ddtree.step_timers import StepTimers

pytestmark = pytest.mark.gpu


def test_gpu_mode_sees_gpu_work_the_host_does_not_wait_for():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    t = StepTimers(mode="gpu", every=20)
    torch.cuda.synchronize()
    for _ in range(20):
        t.start()
        for stage in StepTimers.STAGES:
            if stage == "verify":  # ~2 ms of GPU work issued in microseconds
                torch.cuda._sleep(2_000_000)
            t.mark(stage)
        t.finish(1)
        # the host has not waited: the 20 sleeps are queued ahead of it until the log line
    per = t.per_batch_size()["1"]
    assert per["steps"] == 20
    assert per["verify"] > 0.3, per  # ms: the GPU work, whatever the clock rate
    assert all(per[s] < 0.1 * per["verify"] for s in StepTimers.STAGES if s != "verify"), per


def test_pad_takes_the_idle_wait_out_of_the_next_stage():
    """SGLANG_DDTREE_TIMERS_PAD_US: the host issues the next stage's work late (after a 3 ms
    host wait); without a pad the stage holds that wait, with a pad (a busy-wait longer than
    it) the stage holds its own GPU work only, and the pad is a stage of its own."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import time

    def run(pad_us):
        t = StepTimers(mode="gpu", every=10, pad_us=pad_us)
        torch.cuda.synchronize()
        for _ in range(10):
            t.start()
            t.mark("draft")
            t.mark("tree")
            t.pad()
            time.sleep(0.003)  # the host prepares the verify; the stream is empty
            torch.cuda._sleep(200_000)  # the verify's GPU work: ~0.1 ms
            t.mark("verify")
            t.finish(1)
            torch.cuda.synchronize()  # the next step starts on an empty stream, as here
        return t.per_batch_size()["1"]

    plain, padded = run(0), run(8000)
    assert "pad" not in plain and padded["pad"] > 2.5, (plain, padded)
    assert plain["verify"] > 2.5, plain  # ms: the host's wait, charged to the verify
    assert padded["verify"] < 1.0, padded  # the GPU work alone


def test_moe_distinct_expert_counts_accumulate_inside_a_cuda_graph(monkeypatch):
    """SGLANG_DDTREE_MOE_STATS: the counts are fixed-shape GPU ops, so a captured MoE call adds
    to them at every replay (the buffer is made by the first, eager, call)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from sglang_ddtree import moe_hook

    monkeypatch.setitem(moe_hook._stats, "buf", None)
    ids = torch.tensor([[0, 5], [5, 7], [9, 0]], device="cuda", dtype=torch.int32)
    moe_hook.record_distinct_experts(ids, 16)  # eager: makes the buffer, 4 distinct
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe_hook.record_distinct_experts(ids, 16)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        moe_hook.record_distinct_experts(ids, 16)
    for _ in range(3):
        g.replay()
    ids.copy_(torch.tensor([[1, 1], [1, 1], [1, 1]], device="cuda"))  # 1 distinct from now on
    g.replay()
    torch.cuda.synchronize()
    assert moe_hook.moe_stats_summary() == {3: [round((4 * 5 + 1) / 6, 2), 6]}
