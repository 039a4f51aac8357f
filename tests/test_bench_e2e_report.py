"""The bench_e2e report: markdown table and README block replacement from a results JSON."""

import importlib.util
import json
import os
import types

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location(
    "plot_bench_e2e", os.path.join(HERE, "..", "scripts", "plot_bench_e2e.py"))
plot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot)

DATA = {
    "gpu": "GPU X", "sglang_version": "0.5.17", "date": "2026-11-30T00:00:00Z",
    "command": "python scripts/bench_e2e.py", "repeats": 3,
    "results": {
        "ar": {"greedy": {"1": {"tokens_per_s": 500.0, "accept_length": None}}},
        "ddtree_b32": {"greedy": {"1": {"tokens_per_s": 900.4, "accept_length": 3.456}},
                       "t1": {"1": {"tokens_per_s": 700.0, "accept_length": 2.5}}},
    },
}


def test_table_lists_methods_and_numbers():
    t = plot.table(DATA, "greedy")
    assert "| ar | 500 |" in t
    assert "| ddtree_b32 | 900 (3.46) |" in t
    assert "GPU X" in t and "median of 3" in t


def test_readme_block_is_replaced_not_appended(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("intro\n")
    plot.update_readme(str(readme), "first")
    plot.update_readme(str(readme), "second")
    text = readme.read_text()
    assert text.count(plot.BEGIN) == 1 and "second" in text and "first" not in text


def test_main_prints_both_modes(tmp_path, capsys, monkeypatch):
    p = tmp_path / "r.json"
    p.write_text(json.dumps(DATA))
    monkeypatch.setattr("sys.argv", ["plot", str(p), "--png-dir", str(tmp_path)])
    plot.main()
    out = capsys.readouterr().out
    assert "greedy" in out and "t1" in out


def test_stage_times_reads_both_timer_modes(tmp_path):
    import sys

    sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
    import bench_e2e

    log = tmp_path / "srv.log"
    log.write_text(
        "[x] DDTREE stage ms/step over 200 steps (last bs=1): {'draft': 1.0, 'tree': 2.0}\n"
        "[x] DDTREE stage ms/step (cpu) over 400 steps (last bs=4): {'draft': 0.5, 'tree': 0.1}\n")
    assert bench_e2e.stage_times(str(log)) == {"mode": "cpu", "steps": 400, "draft": 0.5,
                                               "tree": 0.1}
    log.write_text("DDTREE stage ms/step (sync) over 200 steps (last bs=1): {'commit': 1.5}\n")
    assert bench_e2e.stage_times(str(log))["mode"] == "sync"


def test_step_timers_by_batch_size_round_trip(tmp_path, caplog):
    import logging

    import bench_e2e
    from sglang_ddtree.step_timers import StepTimers

    t = StepTimers(mode="cpu")
    with caplog.at_level(logging.INFO, logger="sglang_ddtree.step_timers"):
        for i in range(400):
            t.start()
            for stage in StepTimers.STAGES:
                t.mark(stage)
            t.finish(1 if i % 4 else 8)
    per = t.per_batch_size()
    assert per["1"]["steps"] == 300 and per["8"]["steps"] == 100
    assert set(per["8"]) == {"steps", *StepTimers.STAGES}
    log = tmp_path / "srv.log"
    log.write_text("\n".join(r.getMessage() for r in caplog.records) + "\n")
    got = bench_e2e.stage_times_by_bs(str(log))
    assert got["mode"] == "cpu" and got["bs"]["1"]["steps"] == 300
    assert bench_e2e.stage_times(str(log))["steps"] == 400


def test_moe_expert_counts_ride_the_stage_timer_lines(tmp_path, caplog, monkeypatch):
    """SGLANG_DDTREE_MOE_STATS: the timers' log point also prints the distinct-expert counts,
    and the scripts' parser reads them back (keys are token counts, as strings after JSON)."""
    import logging

    import torch

    from e2e_lossless import moe_distinct_experts
    from sglang_ddtree import moe_hook
    from sglang_ddtree.step_timers import StepTimers

    monkeypatch.setitem(moe_hook._stats, "buf", None)
    monkeypatch.setitem(moe_hook._stats, "on", True)
    moe_hook.record_distinct_experts(torch.tensor([[0, 1], [2, 1], [0, 3]]), 8)
    t = StepTimers(mode="cpu", every=2)
    with caplog.at_level(logging.INFO, logger="sglang_ddtree.step_timers"):
        for _ in range(2):
            t.start()
            t.finish(1)
    log = tmp_path / "srv.log"
    log.write_text("\n".join(r.getMessage() for r in caplog.records) + "\n")
    assert moe_distinct_experts(str(log)) == {"3": [4.0, 1]}
    monkeypatch.setitem(moe_hook._stats, "on", False)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sglang_ddtree.step_timers"):
        for _ in range(2):
            t.start()
            t.finish(1)
    assert not any("distinct experts" in r.getMessage() for r in caplog.records)


def test_accept_by_budget_line_is_parsed(tmp_path):
    import bench_e2e

    log = tmp_path / "srv.log"
    log.write_text("x DDTREE accept length by budget (this server's trees): "
                   '{"1": 1.4, "2": 1.6, "32": 2.1}\n')
    assert bench_e2e.accept_by_budget(str(log)) == {"1": 1.4, "2": 1.6, "32": 2.1}


def test_plots_take_auto_and_triton_verify_methods(tmp_path):
    pytest = __import__("pytest")
    pytest.importorskip("matplotlib")
    data = json.loads(json.dumps(DATA))
    g = {"greedy": {"1": {"tokens_per_s": 800.0, "accept_length": 3.0}}}
    data["results"].update(ddtree_bauto=g, ddtree_tv_b32=g, ddtree_b8=g)
    files = plot.plots(data, str(tmp_path / "x"))
    assert any(f.endswith("_budget.png") for f in files)


def test_overhead_table_shares_and_marks_old_runs():
    data = {"stage_ms_by_batch_size": {
        "ddtree_b32": {"mode": "sync", "bs": {
            "8": {"steps": 100, "draft": 2.0, "tree": 0.05, "verify": 5.0, "accept": 0.05,
                  "commit": 0.1, "draft_kv": 0.8},
            "1": {"steps": 300, "draft": 1.0, "tree": 0.1, "verify": 2.0, "accept": 0.1,
                  "commit": 0.8}}}}}
    t = plot.overhead_table(data)
    lines = t.splitlines()
    bs1 = next(x for x in lines if x.startswith("| ddtree_b32 | 1 |"))
    bs8 = next(x for x in lines if x.startswith("| ddtree_b32 | 8 |"))
    assert lines.index(bs1) < lines.index(bs8)  # batch sizes in numeric order
    assert "25.0 % (upper bound" in bs1  # 1.0 of 4.0 ms, commit still holds the KV append
    assert "| 8.000 | 0.200 | 2.5 % |" in bs8
    assert plot.overhead_table({"results": {}}) == ""


def test_bench_e2e_dry_run_on_fake_servers(tmp_path, monkeypatch):
    """scripts/bench_e2e.py end to end with fake servers and passes: every method (auto and
    triton-verify budgets included) gets results, the timer server its stage records, and the
    JSON is written; catches script bugs before GPU time is spent on them."""
    import sys

    import pytest

    pytest.importorskip("sglang")
    import bench_e2e
    import torch

    started = []

    class FakeServer:
        def __init__(self, args, log, port, env=None, wait=True):
            self.args, self.log, self.port, self.env = args, log, port, env or {}
            self.startup_s = 1.0
            open(log, "w").write(
                "DDTREE stage ms/step (sync) over 200 steps (last bs=1): {'draft': 1.0, "
                "'tree': 0.1, 'verify': 2.0, 'accept': 0.1, 'commit': 0.2, 'draft_kv': 0.6}\n"
                'DDTREE stage ms/step by batch size (sync): {"1": {"steps": 200, "draft": 1.0, '
                '"tree": 0.1, "verify": 2.0, "accept": 0.1, "commit": 0.2, "draft_kv": 0.6}}\n')
            started.append(self)

        def wait_ready(self):
            return self

        def stop(self):
            pass

    def fake_pass(port, prompts, max_new, conc, sampling):
        return {"tokens_per_s": 100.0 * conc, "ttft_ms": 5.0, "tpot_ms": 2.0,
                "accept_length": 2.0}

    monkeypatch.setattr(bench_e2e, "Server", FakeServer)
    monkeypatch.setattr(bench_e2e, "run_pass", fake_pass)
    monkeypatch.setattr(bench_e2e, "stop_on_sigterm", lambda on_exit=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "FakeGPU")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": [1, 2, 3]}) for _ in range(8)) + "\n")
    out = tmp_path / "b.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_e2e.py", "--out", str(out), "--prompts-file", str(prompts), "--budgets",
        "8,auto,online",
        "--triton-verify-budgets", "32", "--concurrency", "1,4", "--modes", "greedy",
        "--repeats", "1", "--timer-budgets", "8,32", "--workdir", str(tmp_path / "w")])
    bench_e2e.main()
    res = json.loads(out.read_text())
    assert set(res["results"]) == {"ar", "dflash", "ddtree_b8", "ddtree_bauto", "ddtree_bonline",
                                   "ddtree_tv_b32"}
    online = next(s for s in started if s.env.get("SGLANG_DDTREE_AUTO_MODE") == "online")
    assert online.args[online.args.index("--speculative-ddtree-budget") + 1] == "auto"
    assert online.env["SGLANG_DDTREE_TIMERS"] == "cpu"
    assert sum(s.env.get("SGLANG_DDTREE_AUTO_MODE") == "online" for s in started) == 1
    assert res["results"]["ddtree_b8"]["greedy"]["4"]["tokens_per_s"] == 400.0
    assert res["stage_ms_by_batch_size"]["ddtree_b8"]["bs"]["1"]["draft_kv"] == 0.6
    # a timer-only budget (32 is not among the speed budgets) still gets its -timers server,
    # with CUDA-event timers by default
    timed = {s.log.rsplit("/", 1)[-1]: s for s in started if s.log.endswith("-timers.log")}
    assert set(timed) == {"ddtree_b8-timers.log", "ddtree_b32-timers.log"}
    assert timed["ddtree_b32-timers.log"].env["SGLANG_DDTREE_TIMERS"] == "gpu"
    assert "ddtree_b32" in res["stage_ms_by_batch_size"] and "ddtree_b32" not in res["results"]
    assert not res["errors"]
    tv = next(s for s in started if "--speculative-ddtree-verify-backend" in s.args)
    assert tv.args[tv.args.index("--speculative-ddtree-budget") + 1] == "32"
    assert "| 4.000 | 0.400 | 10.0 % |" in plot.overhead_table(res)  # tree+accept+commit / step

    # --variant: every DDTREE budget (speed and -timers) again with the variant's environment
    started.clear()
    out2 = tmp_path / "v.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_e2e.py", "--out", str(out2), "--prompts-file", str(prompts), "--budgets", "8",
        "--concurrency", "1", "--modes", "greedy", "--repeats", "1", "--timer-budgets", "32",
        "--variant", "fc:SGLANG_DDTREE_COMMIT=fused", "--workdir", str(tmp_path / "w2")])
    bench_e2e.main()
    res = json.loads(out2.read_text())
    assert set(res["results"]) == {"ar", "dflash", "ddtree_b8", "ddtree_b8_fc"}
    envs = {s.log.rsplit("/", 1)[-1]: s.env for s in started}
    assert envs["ddtree_b8_fc.log"]["SGLANG_DDTREE_COMMIT"] == "fused"
    assert envs["ddtree_b8_fc.log"]["SGLANG_DDTREE_TIMERS"] == "cpu"
    assert "SGLANG_DDTREE_COMMIT" not in envs["ddtree_b8.log"]
    assert envs["ddtree_b32_fc-timers.log"]["SGLANG_DDTREE_COMMIT"] == "fused"
    assert envs["ddtree_b32_fc-timers.log"]["SGLANG_DDTREE_TIMERS"] == "gpu"
    assert set(res["stage_ms_by_batch_size"]) == {"ddtree_b32", "ddtree_b32_fc"}
    with pytest.raises(SystemExit, match="expected TAG:KEY=VALUE"):
        bench_e2e.parse_variants(["fc=SGLANG_DDTREE_COMMIT"])


def test_run_pass_reports_stragglers_beside_the_medians(monkeypatch):
    """tokens/s over the pass's wall time, median TTFT/TPOT, and the p90 / slowest request."""
    import sys

    sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
    import bench_e2e

    # (completion tokens, ttft s, e2e s, meta): nine quick requests and one straggler
    answers = iter([(11, 0.01, 0.11, {"spec_verify_ct": 5})] * 9
                   + [(11, 0.01, 1.01, {"spec_verify_ct": 5})])
    monkeypatch.setattr(bench_e2e, "stream_generate", lambda *a: next(answers))
    r = bench_e2e.run_pass(0, [[1]] * 10, 11, 1, {})
    assert r["accept_length"] == 110 / 50
    assert abs(r["tpot_ms"] - 10.0) < 1e-6  # (0.11 - 0.01) / 10 tokens: the straggler hides
    assert abs(r["e2e_max_ms"] - 1010.0) < 1e-6 and abs(r["e2e_p90_ms"] - 1010.0) < 1e-6
    assert r["wall_s"] > 0 and r["tokens_per_s"] == 110 / r["wall_s"]


def test_interleaved_points_take_turns_and_drop_a_failing_server(monkeypatch):
    """At every point the methods alternate pass by pass; a server that fails mid-run is
    reported and leaves the rotation while the others finish."""
    import sys

    sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
    import bench_e2e

    order = []

    def fake_pass(port, prompts, max_new, conc, sampling):
        order.append((port, conc))
        if port == 3 and len([o for o in order if o[0] == 3]) == 3:
            raise RuntimeError("server died")
        return {"tokens_per_s": 10.0 * port, "ttft_ms": 1.0, "tpot_ms": 2.0,
                "accept_length": None}

    monkeypatch.setattr(bench_e2e, "run_pass", fake_pass)
    args = types.SimpleNamespace(modes=["greedy"], max_new_tokens=8, prompts_per_pass=4,
                                 repeats=2, waves=1)
    errors, points = {}, []
    out = bench_e2e.measure_interleaved({"a": 1, "b": 2, "c": 3}, [[1]] * 8, args, [1, 4],
                                        errors, on_point=lambda o: points.append(1))
    # warm-up at the largest concurrency, then per point: a b c a b c
    assert order[:3] == [(1, 4), (2, 4), (3, 4)]
    assert order[3:9] == [(1, 1), (2, 1), (3, 1)] * 2  # c's third call fails
    assert order[9:] == [(1, 4), (2, 4)] * 2  # the next point without c
    assert "server died" in errors["c"] and out["c"] == {}  # no half-measured point
    assert out["a"]["greedy"]["4"]["tokens_per_s"] == 10.0
    assert out["b"]["greedy"]["1"]["tokens_per_s"] == 20.0
    assert len(points) == 2  # saved after each point


def test_pass_prompts_waves_cycle_the_prompts():
    import sys

    sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
    import bench_e2e

    args = types.SimpleNamespace(prompts_per_pass=3, waves=1)
    prompts = [[1], [2], [3], [4], [5]]
    assert bench_e2e.pass_prompts(prompts, 1, args) == [[1], [2], [3]]
    assert bench_e2e.pass_prompts(prompts, 4, args) == [[1], [2], [3], [4]]
    args.waves = 3
    assert bench_e2e.pass_prompts(prompts, 1, args) == [[1], [2], [3]]
    assert bench_e2e.pass_prompts(prompts, 4, args) == prompts * 2 + [[1], [2]]


def test_interleaved_points_stop_at_the_deadline(monkeypatch):
    """--time-budget: a point that would end after the deadline (judged by 1.5x the point
    before it) does not start, and the skipped points are named in the errors (the timers servers
    and the dump still get their time)."""
    import sys

    sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
    import bench_e2e

    # time.time() per point: the check, the point's start and end (the points take 10 s, 10 s)
    clock = iter([0.0, 0.0, 10.0, 15.0, 15.0, 25.0, 45.0])
    monkeypatch.setattr(bench_e2e.time, "time", lambda: next(clock))
    monkeypatch.setattr(bench_e2e, "run_pass", lambda *a: {
        "tokens_per_s": 1.0, "ttft_ms": 1.0, "tpot_ms": 1.0, "accept_length": None})
    args = types.SimpleNamespace(modes=["greedy"], max_new_tokens=8, prompts_per_pass=2,
                                 repeats=1, waves=1, deadline=50.0)
    errors = {}
    out = bench_e2e.measure_interleaved({"a": 1}, [[1]] * 4, args, [1, 4, 8], errors)
    # c=1 at 0 (ends 10), c=4 at 15 (15 + 15 <= 50, ends 25), c=8 at 45: 45 + 15 > 50
    assert list(out["a"]["greedy"]) == ["1", "4"]
    assert errors["skipped_points"] == ["greedy c=8: --time-budget"]


def test_deadline_judges_a_point_by_the_same_concurrency_of_the_earlier_mode(monkeypatch):
    """The second mode's c=1 point is as long as the first mode's c=1 (20 s), not 1.5x the
    short c=4 point just before it: it is skipped at 45 s of a 60 s budget; c=4 still runs."""
    monkeypatch.syspath_prepend(os.path.join(HERE, "..", "scripts"))
    import bench_e2e

    clock = iter([0.0, 0.0, 20.0, 20.0, 20.0, 22.0, 45.0, 46.0, 46.0, 48.0])
    monkeypatch.setattr(bench_e2e.time, "time", lambda: next(clock))
    monkeypatch.setattr(bench_e2e, "run_pass", lambda *a: {
        "tokens_per_s": 1.0, "ttft_ms": 1.0, "tpot_ms": 1.0, "accept_length": None})
    args = types.SimpleNamespace(modes=["greedy", "t1"], max_new_tokens=8, prompts_per_pass=2,
                                 repeats=1, waves=1, deadline=60.0)
    errors = {}
    out = bench_e2e.measure_interleaved({"a": 1}, [[1]] * 4, args, [1, 4], errors)
    assert list(out["a"]["greedy"]) == ["1", "4"] and list(out["a"]["t1"]) == ["4"]
    assert errors["skipped_points"] == ["t1 c=1: --time-budget"]


class _FakeEvent:
    """torch.cuda.Event stand-in: ``record`` reads a fake clock (ms), counts syncs."""
    clock = 0.0
    syncs = 0
    made = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        _FakeEvent.made += 1
        self.t = None

    def record(self):
        self.t = _FakeEvent.clock

    def synchronize(self):
        _FakeEvent.syncs += 1

    def elapsed_time(self, end):
        return end.t - self.t


def test_step_timers_gpu_mode_reads_events_once_per_log_line(monkeypatch, tmp_path, caplog):
    import logging

    import torch

    monkeypatch.syspath_prepend(os.path.join(HERE, "..", "scripts"))
    import bench_e2e
    from sglang_ddtree.step_timers import StepTimers

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    _FakeEvent.clock, _FakeEvent.syncs, _FakeEvent.made = 0.0, 0, 0
    # stage i of a step lasts (i + 1) ms on the fake stream, at batch size 2 in every 4th step
    t = StepTimers(mode="gpu", every=10)
    with caplog.at_level(logging.INFO, logger="sglang_ddtree.step_timers"):
        for step in range(20):
            t.start()
            for i, stage in enumerate(StepTimers.STAGES):
                _FakeEvent.clock += i + 1
                t.mark(stage)
            t.finish(2 if step % 4 == 0 else 1)
            if step == 8:  # nothing is read before the first log line
                assert _FakeEvent.syncs == 0 and t.totals["draft"] == 0.0
    assert _FakeEvent.syncs == 2  # one per log line, not one per stage or step
    assert _FakeEvent.made == 80  # one window of 10 steps x 8; the second reuses them
    per = t.per_batch_size()
    assert per["1"]["steps"] == 15 and per["2"]["steps"] == 5
    assert [per["1"][s] for s in StepTimers.STAGES] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    log = tmp_path / "srv.log"
    log.write_text("\n".join(r.getMessage() for r in caplog.records) + "\n")
    got = bench_e2e.stage_times(str(log))
    assert got["mode"] == "gpu" and got["steps"] == 20 and got["commit"] == 5.0


def test_step_timers_skip_each_batch_sizes_first_steps():
    from sglang_ddtree.step_timers import StepTimers

    t = StepTimers(mode="cpu", skip=3)
    for i in range(10):
        t.start()
        t.mark("draft")
        t.finish(1 if i < 5 else 4)
    per = t.per_batch_size()
    assert per["1"]["steps"] == 2 and per["4"]["steps"] == 2 and t.steps_counted == 4
    assert t.steps == 10


def test_timers_mode_names(monkeypatch):
    from sglang_ddtree import config as cfg

    for raw, mode in (("", "off"), ("0", "off"), ("cpu", "cpu"), ("GPU", "gpu"), ("1", "sync"),
                      ("sync", "sync")):
        assert cfg.timers_mode({cfg.ENV_TIMERS: raw}) == mode


def test_timers_pad_needs_gpu_timers_and_a_whole_number(monkeypatch):
    """SGLANG_DDTREE_TIMERS_PAD_US: off by default and at 0; with gpu timers the microseconds;
    with any other timers mode, or a bad value, an error at start-up naming the fix."""
    import pytest

    from sglang_ddtree import config as cfg

    pad = cfg.ENV_TIMERS + "_PAD_US"
    assert cfg.timers_pad_us({}) == 0
    assert cfg.timers_pad_us({pad: "0", cfg.ENV_TIMERS: "cpu"}) == 0
    assert cfg.timers_pad_us({pad: "3000", cfg.ENV_TIMERS: "gpu"}) == 3000
    for env, words in (({pad: "3000", cfg.ENV_TIMERS: "cpu"}, "SGLANG_DDTREE_TIMERS=gpu"),
                       ({pad: "3000"}, "SGLANG_DDTREE_TIMERS=gpu"),
                       ({pad: "-5", cfg.ENV_TIMERS: "gpu"}, ">= 0"),
                       ({pad: "3ms", cfg.ENV_TIMERS: "gpu"}, "not an integer")):
        with pytest.raises(cfg.DDTreeConfigError, match=words):
            cfg.timers_pad_us(env)


def test_step_timers_log_a_pad_stage_only_when_the_pad_is_on():
    import pytest

    from sglang_ddtree import config as cfg
    from sglang_ddtree.step_timers import StepTimers

    t = StepTimers(mode="cpu")
    assert t.stages == StepTimers.STAGES
    t.start()
    t.pad()  # no pad: nothing marked, nothing queued
    t.mark("draft")
    t.finish(1)
    assert set(t.per_batch_size()["1"]) == {"steps", *StepTimers.STAGES}
    with pytest.raises(cfg.DDTreeConfigError, match="SGLANG_DDTREE_TIMERS=gpu"):
        StepTimers(mode="cpu", pad_us=100)


def test_servers_admit_the_timers_passes_concurrency():
    """The -timers servers' passes (--timer-concurrency) must not be capped by the speed points'
    largest concurrency: every server is started for the largest of both."""
    spec_b = importlib.util.spec_from_file_location(
        "bench_e2e", os.path.join(HERE, "..", "scripts", "bench_e2e.py"))
    bench = importlib.util.module_from_spec(spec_b)
    spec_b.loader.exec_module(bench)
    assert bench.batch_cap("1,8", "1,2,4,8,32") == 32
    assert bench.batch_cap("1,4,64", "1,8,32") == 64
    assert bench.batch_cap("16", "") == 16
