"""GPU test of StepTimers' ``gpu`` mode (SGLANG_DDTREE_TIMERS=gpu): CUDA events at the stage
boundaries measure the time each stage holds the stream, with no synchronization per step.

Run: python -m pytest -q tests/gpu/test_step_timers_gpu.py
"""
from __future__ import annotations

import pytest
import torch

from sglang_ddtree.worker import StepTimers

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
