"""The bench_e2e report: markdown table and README block replacement from a results JSON."""

import importlib.util
import json
import os

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
    from sglang_ddtree.worker import StepTimers

    t = StepTimers(mode="cpu")
    with caplog.at_level(logging.INFO, logger="sglang_ddtree.worker"):
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
