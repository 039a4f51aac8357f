"""SGLANG_DDTREE_CHECK_SYNCS: the per-step host-sync log (bookkeeping on CPU; tests/gpu for CUDA)."""

import logging
import traceback

from sglang_ddtree import config as cfg
from sglang_ddtree.sync_check import SyncCheck, _site


def test_the_switch_is_off_unless_set():
    assert not cfg.sync_check_enabled({})
    assert not cfg.sync_check_enabled({cfg.ENV_SYNC_CHECK: "0"})
    assert cfg.sync_check_enabled({cfg.ENV_SYNC_CHECK: "1"})


def test_off_the_step_runs_untouched():
    check = SyncCheck(enabled=False)
    with check.step():
        x = 1 + 1
    assert x == 2 and check.steps == 0 and check.syncs == 0


def test_each_call_site_is_logged_once_and_counted_every_time(caplog):
    check = SyncCheck(enabled=False, every=2, max_sites=1)
    a, b = ("worker.py:10", "x.py:3"), ("worker.py:20",)
    with caplog.at_level(logging.INFO, logger="sglang_ddtree.sync_check"):
        check.record([("called a synchronizing CUDA operation", a)] * 2)
        check.record([("called a synchronizing CUDA operation", b)])
    assert check.steps == 2 and check.syncs == 3 and check.sites == {a: 2, b: 1}
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "worker.py:10 <- x.py:3" in warned[0].getMessage()  # max_sites
    assert any("3 host syncs in 2 decode steps (2 call sites)" in r.getMessage()
               for r in caplog.records)


def test_site_is_the_synchronizing_line_then_its_callers_outside_torch():
    stack = traceback.StackSummary.from_list([
        ("/srv/sglang/scheduler.py", 5, "run", ""), ("/srv/sglang_ddtree/worker.py", 40, "f", ""),
        ("/srv/sglang_ddtree/verify.py", 7, "g", ""),
        ("/venv/torch/_tensor.py", 99, "item", ""),
        ("/srv/sglang_ddtree/sync_check.py", 30, "hook", "")])
    # torch reports the innermost Python frame outside C++: here a torch file
    assert _site("/venv/torch/_tensor.py", 99, stack) == (
        "torch/_tensor.py:99", "sglang_ddtree/verify.py:7", "sglang_ddtree/worker.py:40",
        "sglang/scheduler.py:5")
    # the synchronizing line itself is not repeated among its callers
    assert _site("/srv/sglang_ddtree/verify.py", 7, stack[:3]) == (
        "sglang_ddtree/verify.py:7", "sglang_ddtree/worker.py:40", "sglang/scheduler.py:5")


def test_other_warnings_pass_through_and_keep_their_filters(monkeypatch):
    """Under the check only the sync warnings are caught; a step's other warnings reach the
    previous handler."""
    import warnings

    import torch

    import sglang_ddtree.sync_check as sc

    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    check = sc.SyncCheck(enabled=False)
    check.enabled = True  # as on a GPU, with torch's sync mode stubbed
    shown = []
    with warnings.catch_warnings():
        warnings.simplefilter("once")  # the caller's filter: a repeated warning shows once
        warnings.showwarning = lambda m, c, f, n, file=None, line=None: shown.append(str(m))
        for _ in range(2):
            with check.step():
                warnings.warn("called a synchronizing CUDA operation")  # caught every time
                warnings.warn("something else")  # passed on, under the caller's filter
                # torch's notice on entering the mode: no sync, though it holds the word
                warnings.warn("Synchronization debug mode is a prototype feature and does not "
                              "yet detect all synchronizing operations")
    # (each step's warnings.catch_warnings resets Python's once-per-location registry, so a
    # repeated warning may show again under the check: debug mode only)
    assert set(shown) == {"something else", "Synchronization debug mode is a prototype "
                          "feature and does not yet detect all synchronizing operations"}
    assert check.syncs == 2 and check.steps == 2
