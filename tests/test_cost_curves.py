"""scripts/bench_cost_curves.py: per-batch-size verify cost, projection arithmetic, accept input."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
import bench_cost_curves as cc  # noqa: E402


def test_verify_cost_reads_the_batch_size_row():
    rec = {"mode": "sync", "bs": {"8": {"steps": 40, "draft": 1.0, "tree": 0.1, "verify": 5.0,
                                        "accept": 0.2, "commit": 0.7}}}
    assert cc.verify_cost(rec, 8) == (5.0, 7.0)
    assert cc.verify_cost(rec, 4) == (None, None)
    assert cc.verify_cost(None, 8) == (None, None)


def test_projection_is_concurrency_times_accept_over_step():
    step = {"ar": {"1": 10.0, "8": 20.0}, "dflash": {"1": 12.0}, "ddtree_b32": {"1": 15.0},
            "ddtree_b64": {"1": 18.0}}
    acc = {"ar": 1.0, "dflash": 1.5, "ddtree_b32": 2.4}
    got = cc.project(step, acc, [1, 8])
    assert got["ar"] == {"1": 100.0, "8": 400.0}
    assert got["dflash"] == {"1": 125.0}
    assert got["ddtree_b32"] == {"1": 160.0}
    assert "ddtree_b64" not in got  # no accept length for it: nothing made up


def test_accept_lengths_come_from_a_bench_json(tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"results": {
        "ar": {"greedy": {"1": {"tokens_per_s": 5.0, "accept_length": None}}},
        "dflash": {"greedy": {"1": {"accept_length": 1.53}}},
        "ddtree_b32": {"greedy": {"1": {"accept_length": 2.09}}, "t1": {"1": {"accept_length": 1.6}}},
    }}))
    assert cc.accept_from_bench(str(path)) == {"dflash": 1.53, "ddtree_b32": 2.09}
    assert cc.accept_from_bench(str(path), mode="t1") == {"ddtree_b32": 1.6}


def test_random_prompts_shape_and_range():
    ps = cc.random_prompts(3, 7, 100, seed=1)
    assert len(ps) == 3 and all(len(p) == 7 and all(10 <= t < 90 for t in p) for p in ps)
    assert ps == cc.random_prompts(3, 7, 100, seed=1)
