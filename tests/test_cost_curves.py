"""scripts/bench_cost_curves.py: per-batch-size verify cost, projection arithmetic, accept input."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
import bench_cost_curves as cc  # noqa: E402


def test_plan_runs_times_ddtree_without_syncs_and_splits_stages_on_extra_servers():
    runs = cc.plan_runs([8, 32], [32], ["--spec"])
    names = [r[0] for r in runs]
    assert names == ["ar", "dflash", "ddtree_b8", "ddtree_b32", "ddtree_b32-timers"]
    env = {name: e for name, _, e in runs}
    assert env["ar"] == {} and env["dflash"] == {}
    assert env["ddtree_b8"]["SGLANG_DDTREE_TIMERS"] == "cpu"  # no synchronization: real TPOT
    assert env["ddtree_b32-timers"]["SGLANG_DDTREE_TIMERS"] == "gpu"  # CUDA events
    sync = {name: e for name, _, e in cc.plan_runs([8], [8], [], timer_mode="sync")}
    assert sync["ddtree_b8-timers"]["SGLANG_DDTREE_TIMERS"] == "1"
    only = cc.plan_runs([], [32], [], baselines=["ar"])
    assert [r[0] for r in only] == ["ar", "ddtree_b32-timers"]
    tv = cc.plan_runs([], [32], ["--spec"], baselines=[],
                      ddtree_extra=["--speculative-ddtree-verify-backend", "triton"])
    assert tv == [("ddtree_b32-timers", ["--speculative-algorithm", "DDTREE",
                                         "--speculative-ddtree-budget", "32",
                                         "--speculative-ddtree-verify-backend", "triton",
                                         "--spec"], tv[0][2])]
    args = {name: a for name, a, _ in runs}
    assert args["ddtree_b32"] == args["ddtree_b32-timers"] == [
        "--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "32", "--spec"]


def test_plan_runs_adds_one_timers_server_per_pad():
    import pytest

    runs = cc.plan_runs([], [15, 31], ["--spec"], baselines=["ar"], timer_pads=[0, 3000])
    assert [r[0] for r in runs] == ["ar", "ddtree_b15-timers", "ddtree_b15-pad3000-timers",
                                    "ddtree_b31-timers", "ddtree_b31-pad3000-timers"]
    env = {name: e for name, _, e in runs}
    assert "SGLANG_DDTREE_TIMERS_PAD_US" not in env["ddtree_b15-timers"]
    assert env["ddtree_b15-pad3000-timers"]["SGLANG_DDTREE_TIMERS_PAD_US"] == "3000"
    assert env["ddtree_b15-pad3000-timers"]["SGLANG_DDTREE_TIMERS"] == "gpu"
    args = {name: a for name, a, _ in runs}
    assert args["ddtree_b31-timers"] == args["ddtree_b31-pad3000-timers"]
    with pytest.raises(SystemExit, match="gpu"):
        cc.plan_runs([], [15], [], timer_mode="sync", timer_pads=[3000])
    # derive: the padded server's verify is its own method, over the same AR decode
    res = cc.derive({"tpot_ms": {"ar": {"1": 2.0}}, "accept_length": {},
                     "verify_ms": {"ddtree_b15": {"1": 3.0}, "ddtree_b15-pad3000": {"1": 2.5}}})
    assert res["verify_over_decode"] == {"ddtree_b15": {"1": 1.5},
                                         "ddtree_b15-pad3000": {"1": 1.25}}


def test_derive_steps_from_tpot_times_accept_and_verify_over_ar_decode():
    res = {"tpot_ms": {"ar": {"1": 2.0, "8": 4.0}, "dflash": {"1": 3.0},
                       "ddtree_b32": {"1": 2.5, "8": None}},
           "accept_length": {"ar": {"1": None}, "dflash": {"1": 1.5},
                             "ddtree_b32": {"1": None}},
           "verify_ms": {"ddtree_b32": {"1": 3.0, "8": 6.0, "32": 9.0}}}
    cc.derive(res)
    assert res["step_ms"] == {"ar": {"1": 2.0, "8": 4.0}, "dflash": {"1": 4.5},
                              "ddtree_b32": {"1": 2.5}}  # no accept length: one token a step
    assert res["verify_over_decode"] == {"ddtree_b32": {"1": 1.5, "8": 1.5}}  # no AR at 32


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


def test_measure_model_times_ddtree_unsynced_and_takes_verify_from_the_timers_server(tmp_path):
    """measure_model with fake servers: DDTREE's step is TPOT x accept from its plain server,
    the verify stage comes from its -timers server, and the result is saved after each
    method."""
    import types

    logs = {}

    class FakeServer:
        def __init__(self, args, log, port, env=None):
            self.port, self.startup_s, self.log = port, 1.0, log
            self.env = env or {}
            logs[log] = self.env
            mode = self.env.get("SGLANG_DDTREE_TIMERS", "cpu")
            row = {"steps": 50, "draft": 1.0, "tree": 0.1,
                   "verify": 0.7 if mode == "cpu" else 3.0,
                   "accept": 0.1, "commit": 0.2, "draft_kv": 0.5}
            open(log, "w").write(
                "DDTREE stage ms/step by batch size (%s): %s\n"
                % (mode, json.dumps({"1": row, "8": row})))

        def stop(self):
            pass

    def run_pass(port, prompts, max_new, conc, sampling):
        return {"tpot_ms": 2.0, "accept_length": 1.5}

    from e2e_lossless import stage_times_by_bs

    args = types.SimpleNamespace(prompt_len=16, max_new_tokens=8, attention_backend="triton",
                                 mem_fraction=0.8, repeats=2, port=40000,
                                 workdir=str(tmp_path))
    saved = []
    res = cc.measure_model("qwen3-8b", args, [1, 8], [8, 32], FakeServer, run_pass,
                           stage_times_by_bs, dump=lambda: saved.append(1), timer_budgets=[32])
    assert len(saved) == 5  # ar, dflash, b8, b32, b32-timers
    assert res["step_ms"]["ddtree_b32"] == {"1": 3.0, "8": 3.0}  # TPOT 2.0 x accept 1.5
    assert res["verify_ms"] == {"ddtree_b32": {"1": 3.0, "8": 3.0}}  # the -timers server's
    assert res["verify_over_decode"]["ddtree_b32"] == {"1": 1.5, "8": 1.5}  # / AR's 2.0
    assert res["host_stage_ms"]["ddtree_b8"]["1"]["verify"] == 0.7
    assert "ddtree_b32-timers" not in res["tpot_ms"]  # its TPOT is never used
    timers = [env for log, env in logs.items() if log.endswith("ddtree_b32-timers.log")]
    assert timers and timers[0]["SGLANG_DDTREE_TIMERS"] == "gpu"
    # --server-env reaches every server, AR and DFLASH too, under the per-method settings
    logs.clear()
    res = cc.measure_model("qwen3-8b", args, [1], [8], FakeServer, run_pass, stage_times_by_bs,
                           timer_budgets=[8], server_env={"SGLANG_DDTREE_FUSED_MOE": "1",
                                                          "SGLANG_DDTREE_TIMERS": "x"})
    assert len(logs) == 4 and all(e["SGLANG_DDTREE_FUSED_MOE"] == "1" for e in logs.values())
    assert [e["SGLANG_DDTREE_TIMERS"] for log, e in logs.items() if log.endswith("-timers.log")] \
        == ["gpu"]
    assert res["server_env"] == {"SGLANG_DDTREE_FUSED_MOE": "1", "SGLANG_DDTREE_TIMERS": "x"}


def test_measure_model_keeps_moe_expert_counts_and_can_capture_only_measured_sizes(tmp_path):
    """A DDTREE server run with SGLANG_DDTREE_MOE_STATS=1 logs distinct experts per MoE call by
    token count: measure_model keeps the last line per method. --graph-bs-concurrency captures
    CUDA graphs at the measured concurrencies only."""
    import types

    seen = []

    class FakeServer:
        def __init__(self, args, log, port, env=None):
            self.port, self.startup_s = port, 1.0
            seen.append(args)
            with open(log, "w") as f:
                if "DDTREE" in args:
                    row = {"steps": 9, "draft": 1.0, "tree": 0.1, "verify": 3.0, "accept": 0.1,
                           "commit": 0.2, "draft_kv": 0.5}
                    f.write("DDTREE stage ms/step by batch size (gpu): %s\n"
                            % json.dumps({"1": row}))
                    for mean in (10.0, 41.5):  # the last line wins
                        f.write("DDTREE MoE distinct experts per call by tokens M (mean, "
                                "calls): %s\n" % json.dumps({"33": [mean, 600], "512": [230.0, 60]}))

        def stop(self):
            pass

    args = types.SimpleNamespace(prompt_len=16, max_new_tokens=8, attention_backend="triton",
                                 mem_fraction=0.8, repeats=1, port=40000, workdir=str(tmp_path),
                                 graph_bs_concurrency=True)
    from e2e_lossless import stage_times_by_bs

    res = cc.measure_model("qwen3-8b", args, [8, 1], [], FakeServer,
                           lambda *a: {"tpot_ms": 2.0, "accept_length": 1.0}, stage_times_by_bs,
                           timer_budgets=[32], baselines=["ar"])
    assert res["moe_distinct_experts"] == {"ddtree_b32-timers": {"33": [41.5, 600],
                                                                 "512": [230.0, 60]}}
    ar_args = seen[0]
    i = ar_args.index("--cuda-graph-bs")
    assert ar_args[i + 1: i + 3] == ["1", "8"] and "--cuda-graph-max-bs" not in ar_args
    args.graph_bs_concurrency = False
    seen.clear()
    cc.measure_model("qwen3-8b", args, [8, 1], [], FakeServer,
                     lambda *a: {"tpot_ms": 2.0, "accept_length": 1.0}, stage_times_by_bs,
                     timer_budgets=[], baselines=["ar"])
    assert seen[0][seen[0].index("--cuda-graph-max-bs") + 1] == "8"
    assert "--page-size" not in seen[0]
    # --page-size reaches every server (flashmla's 64-token pages), AR included
    args.page_size = 64
    seen.clear()
    cc.measure_model("qwen3-8b", args, [1], [], FakeServer,
                     lambda *a: {"tpot_ms": 2.0, "accept_length": 1.0}, stage_times_by_bs,
                     timer_budgets=[8], baselines=["ar"])
    assert len(seen) == 2 and all(a[a.index("--page-size") + 1] == "64" for a in seen)


def test_default_mem_fraction_follows_the_card():
    """0.95 on an 80 GB H100 (the 61-layer int4 Kimi rank fits it only so), 0.85 on the H200."""
    mib = 2 ** 20
    assert cc.default_mem_fraction(81_559 * mib) == 0.95  # H100 80GB HBM3
    assert cc.default_mem_fraction(143_771 * mib) == 0.85  # H200
