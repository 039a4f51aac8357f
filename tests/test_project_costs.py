"""scripts/project_costs.py: the labelled projection from measured step costs."""

import importlib.util
import json
import os

import pytest

_spec = importlib.util.spec_from_file_location(
    "project_costs", os.path.join(os.path.dirname(__file__), "..", "scripts", "project_costs.py"))
project_costs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(project_costs)


def _cost_file(tmp_path):
    stages = {"draft": 1.0, "tree": 0.1, "verify": 6.0, "accept": 0.1, "commit": 0.1,
              "publish": 0.05, "draft_kv": 0.15}
    data = {"date": "2026-12-01", "gpu": "NVIDIA H200", "models": {"m": {
        "step_ms": {"ar": {"1": 5.0, "8": 6.0}, "dflash": {"1": 8.0}},
        # budget 32: timers only at batch 1 (sum 7.5 ms); budget 8: a speed server, whose
        # step wins over its timers
        "stage_ms": {"ddtree_b32": {"1": dict(stages, steps=50),
                                    "8": {"verify": 9.0}},  # incomplete: left out
                     "ddtree_b8": {"1": dict(stages, steps=50)}},
    }}}
    data["models"]["m"]["step_ms"]["ddtree_b8"] = {"1": 7.0}
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(data))
    return path


def test_steps_come_from_speed_servers_first_then_from_complete_stage_timers(tmp_path):
    model = json.loads(_cost_file(tmp_path).read_text())["models"]["m"]
    costs = project_costs.step_costs(model)
    assert costs["ddtree_b32"] == {"1": {"ms": 7.5, "from": "timers"}}
    assert costs["ddtree_b8"]["1"] == {"ms": 7.0, "from": "speed"}
    assert costs["ar"]["8"] == {"ms": 6.0, "from": "speed"}


def test_projection_is_batch_times_accept_over_step_and_leaves_missing_values_out(tmp_path):
    model = json.loads(_cost_file(tmp_path).read_text())["models"]["m"]
    got = project_costs.project(project_costs.step_costs(model),
                                {"ar": 1.0, "dflash": 2.0, "ddtree_b32": 3.0})
    assert got["ar"]["8"]["tokens_per_s"] == pytest.approx(8e3 / 6.0, abs=0.05)
    row = got["ddtree_b32"]["1"]
    assert row["tokens_per_s"] == pytest.approx(3e3 / 7.5, abs=0.05)
    assert row["over_ar"] == round((3 / 7.5) / (1 / 5.0), 2)
    assert row["over_dflash"] == round((3 / 7.5) / (2 / 8.0), 2)
    assert "ddtree_b8" not in got  # no accept length for it: not filled in
    assert "over_dflash" not in got["ar"]["1"]


def test_published_values_apply_to_every_measured_budget_and_the_cli_labels_them(tmp_path):
    pub = tmp_path / "pub.json"
    pub.write_text(json.dumps({"source": "a paper", "budget": "its best", "dflash": 8.0,
                               "ddtree": 10.0}))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"results": {
        "dflash": {"greedy": {"1": {"accept_length": 1.5}}},
        "ddtree_b32": {"greedy": {"1": {"accept_length": 2.0}, "8": {"accept_length": 9.0}}}}}))
    out = tmp_path / "proj.json"
    assert project_costs.main(["--costs", str(_cost_file(tmp_path)), "--accept-json", str(bench),
                               "--published", str(pub), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert "PROJECTION" in res["label"]
    assert res["accept_sources"]["published"]["source"] == "a paper"
    pub_rows = res["projection"]["m"]["published"]
    assert pub_rows["ddtree_b32"]["1"]["accept"] == 10.0
    assert pub_rows["ddtree_b8"]["1"]["accept"] == 9.0  # capped at budget + 1
    tiny = res["projection"]["m"]["tiny_pair"]
    assert tiny["ddtree_b32"]["1"]["accept"] == 2.0  # concurrency 1's value, not 8's
    assert "ddtree_b8" not in tiny


def test_published_values_are_capped_at_what_a_step_can_emit():
    """A drafter block of 8 emits at most 8 tokens a step, a budget-4 tree at most 5: the
    paper's 10.7 (block 16) does not carry over."""
    pub = {"dflash": 8.0, "ddtree": 10.7}
    acc = project_costs.published_accepts(pub, ["ddtree_b4", "ddtree_b8", "ddtree_b32", "ar"],
                                          block=8)
    assert acc == {"ar": 1.0, "dflash": 8.0, "ddtree_b4": 5.0, "ddtree_b8": 8.0,
                   "ddtree_b32": 8.0}
    acc = project_costs.published_accepts(pub, ["ddtree_b32"], block=None)
    assert acc["ddtree_b32"] == 10.7 and acc["dflash"] == 8.0
