"""scripts/profile_step.py: the trace summary (per-step host time, launches, GPU time)."""

import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
spec = importlib.util.spec_from_file_location(
    "profile_step", os.path.join(HERE, "..", "scripts", "profile_step.py"))
prof = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prof)


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


STEP = "/x/sglang_ddtree/worker.py(200): forward_batch_generation"


def _steps(n, inner):
    """n decode steps 10 ms apart, each a 4 ms worker step holding inner(t0)'s events."""
    ev = []
    for step in range(n):
        t0 = step * 10_000
        ev += [_x("python_function", STEP, t0, 4000)] + inner(t0)
    return ev


def test_summary_counts_outermost_worker_calls_as_steps():
    ev = _steps(4, lambda t0: [
            # the target worker's call nests inside: not a step of its own
            _x("python_function", "/x/sglang/srt/managers/tp_worker.py(90): forward_batch_generation",
               t0 + 1000, 1500),
            _x("python_function", "/x/sglang_ddtree/step_graph.py(70): __call__", t0 + 3000, 500),
            _x("cuda_runtime", "cudaGraphLaunch", t0 + 3100, 20),
            _x("cuda_runtime", "cudaLaunchKernel", t0 + 3200, 5),
            _x("cuda_runtime", "cudaLaunchKernel", t0 + 3300, 5),
            _x("cpu_op", "aten::argmax", t0 + 2900, 30),
            _x("kernel", "some_kernel", t0 + 3500, 700),
        ])
    ev.append({"ph": "M", "name": "process_name"})  # metadata events are ignored
    s = prof.summarize_trace({"traceEvents": ev})
    assert s["steps"] == 4
    assert s["step_host_ms"] == 4.0
    assert s["launch_calls_per_step"] == 3.0
    assert s["kernel_ms_per_step"] == 0.7 and s["kernels_per_step"] == 1.0
    py = {r["name"]: r for r in s["python_inclusive"]}
    assert py["worker.py:forward_batch_generation"]["ms_per_step"] == 4.0
    assert py["tp_worker.py:forward_batch_generation"]["ms_per_step"] == 1.5
    assert py["step_graph.py:__call__"]["calls_per_step"] == 1.0
    assert s["cpu_ops"][0]["name"] == "aten::argmax"
    assert s["gpu_kernels"] == [{"name": "some_kernel", "ms_per_step": 0.7,
                                 "calls_per_step": 1.0}]


def test_step_tree_nests_frames_and_attributes_launches():
    ev = _steps(2, lambda t0: [
            _x("python_function", "/x/sglang_ddtree/worker.py(400): _draft", t0 + 100, 1000),
            _x("python_function", "/x/compat/v0_5_17.py(10): run_draft_block", t0 + 200, 600),
            _x("cuda_runtime", "cudaGraphLaunch", t0 + 300, 10),
            _x("cuda_runtime", "cudaLaunchKernel", t0 + 900, 5),  # in _draft, after the block
            _x("python_function", "/x/sglang_ddtree/step_graph.py(70): __call__", t0 + 2000, 500),
            _x("cuda_runtime", "cudaLaunchKernel", t0 + 2100, 5),
            # outside every step: not in the tree
            _x("python_function", "/x/sglang/srt/managers/scheduler.py(1): recv", t0 + 5000, 300),
        ])
    for e in ev:
        e["tid"] = 1
    tree = prof.summarize_trace({"traceEvents": ev})["step_tree"]
    rows = {r["path"]: r for r in tree}
    step = "worker.py:forward_batch_generation"
    assert [r["path"] for r in tree] == [
        step, f"{step} > worker.py:_draft",
        f"{step} > worker.py:_draft > v0_5_17.py:run_draft_block",
        f"{step} > step_graph.py:__call__"]
    assert rows[step]["ms_per_step"] == 4.0
    assert rows[f"{step} > worker.py:_draft"]["ms_per_step"] == 1.0
    assert rows[f"{step} > worker.py:_draft"]["launches_per_step"] == 1.0
    assert rows[f"{step} > worker.py:_draft > v0_5_17.py:run_draft_block"][
        "launches_per_step"] == 1.0
    assert rows[f"{step} > step_graph.py:__call__"]["calls_per_step"] == 1.0


def test_host_time_diff_ranks_what_ddtree_adds_over_dflash():
    a = {"python_inclusive": [{"name": "scheduler.py:run_batch", "ms_per_step": 6.0},
                              {"name": "dflash_worker_v2.py:forward_batch_generation",
                               "ms_per_step": 5.0},
                              {"name": "utils.py:same", "ms_per_step": 0.5}]}
    b = {"python_inclusive": [{"name": "scheduler.py:run_batch", "ms_per_step": 7.1},
                              {"name": "worker.py:forward_batch_generation", "ms_per_step": 6.0},
                              {"name": "utils.py:same", "ms_per_step": 0.51}]}
    rows = prof.host_time_diff(a, b)
    assert [r["name"] for r in rows] == ["worker.py:forward_batch_generation",
                                         "dflash_worker_v2.py:forward_batch_generation",
                                         "scheduler.py:run_batch"]  # 0.01 ms: below min_ms
    assert rows[0]["diff_ms"] == 6.0 and rows[1]["diff_ms"] == -5.0
    assert rows[2] == {"name": "scheduler.py:run_batch", "a_ms": 6.0, "b_ms": 7.1,
                       "diff_ms": 1.1}


def test_kernels_by_frame_follow_their_launch_calls():
    """Kernels join their launch call by correlation id (all of a graph's kernels share the
    graph launch's), and the call the frame it ran in, cut to two levels below the step."""
    def corr(e, c):
        e["args"] = {"correlation": c}
        return e

    def inner(t0):
        c = t0 // 10_000 * 10  # correlation ids unique per step
        return [
            _x("python_function", "/x/sglang_ddtree/worker.py(400): _decode_step", t0 + 50, 3900),
            _x("python_function", "/x/sglang_ddtree/worker.py(410): _draft", t0 + 100, 900),
            corr(_x("cuda_runtime", "cudaGraphLaunch", t0 + 300, 10), c + 1),
            _x("python_function", "/x/sglang_ddtree/worker.py(420): _verify", t0 + 1100, 2000),
            _x("python_function", "/x/sglang/srt/model_executor/model_runner.py(9): forward",
               t0 + 1200, 1500),  # a third level: folds into _verify
            corr(_x("cuda_runtime", "cudaGraphLaunch", t0 + 1300, 10), c + 2),
            corr(_x("kernel", "draft_gemm", t0 + 400, 300), c + 1),
            corr(_x("kernel", "tree_attn", t0 + 1400, 500), c + 2),
            corr(_x("kernel", "moe_gate_up", t0 + 1900, 700), c + 2),
            corr(_x("kernel", "tree_attn", t0 + 2600, 100), c + 2),
            corr(_x("kernel", "stray", t0 + 5000, 50), c + 9),  # no launch call in a step
        ]
    ev = _steps(2, inner)
    for e in ev:
        e["tid"] = 1
    frames = prof.summarize_trace({"traceEvents": ev})["gpu_kernels_by_frame"]
    step = "worker.py:forward_batch_generation > worker.py:_decode_step"
    by = {f["frame"]: f for f in frames}
    assert [f["frame"] for f in frames] == [f"{step} > worker.py:_verify",
                                            f"{step} > worker.py:_draft", prof.OUTSIDE]
    verify = by[f"{step} > worker.py:_verify"]
    assert verify["ms_per_step"] == 1.3 and verify["kernels_per_step"] == 3.0
    assert verify["kernels"] == [
        {"name": "moe_gate_up", "ms_per_step": 0.7, "calls_per_step": 1.0,
         "concurrent_ms_per_step": 0.0},
        {"name": "tree_attn", "ms_per_step": 0.6, "calls_per_step": 2.0,
         "concurrent_ms_per_step": 0.0}]
    assert verify["busy_ms_per_step"] == 1.3  # one stream: the kernels' spans do not overlap
    assert by[f"{step} > worker.py:_draft"]["kernels"][0]["name"] == "draft_gemm"
    assert by[prof.OUTSIDE]["ms_per_step"] == 0.05


def test_target_forward_kernels_and_their_difference():
    ar = {"gpu_kernels_by_frame": [
        {"frame": "tp_worker.py:forward_batch_generation > model_runner.py:forward",
         "kernels": [{"name": "gemm", "ms_per_step": 0.5, "calls_per_step": 10},
                     {"name": "attn_decode", "ms_per_step": 0.2, "calls_per_step": 8}]},
        {"frame": prof.OUTSIDE, "kernels": [{"name": "prefill", "ms_per_step": 9.0,
                                            "calls_per_step": 1}]}]}
    dd = {"gpu_kernels_by_frame": [
        {"frame": "worker.py:forward_batch_generation > worker.py:_decode_step > "
                  "tp_worker.py:forward_batch_generation",
         "kernels": [{"name": "gemm", "ms_per_step": 0.7, "calls_per_step": 10},
                     {"name": "tree_attn", "ms_per_step": 0.3, "calls_per_step": 8}]},
        {"frame": "worker.py:forward_batch_generation > worker.py:_decode_step > "
                  "worker.py:_draft",  # the drafter's kernels are not the target's
         "kernels": [{"name": "gemm", "ms_per_step": 0.4, "calls_per_step": 3}]}]}
    assert prof.target_forward_kernels(ar) == [
        {"name": "gemm", "ms_per_step": 0.5, "calls_per_step": 10},
        {"name": "attn_decode", "ms_per_step": 0.2, "calls_per_step": 8}]
    diff = prof.kernel_time_diff(prof.target_forward_kernels(ar), prof.target_forward_kernels(dd))
    assert [(r["name"], r["diff_ms"]) for r in diff] == [
        ("tree_attn", 0.3), ("attn_decode", -0.2), ("gemm", 0.2)]
    assert diff[1]["b_calls"] == 0.0 and diff[0]["a_ms"] == 0.0


def test_method_flags_one_ddtree_server_per_budget():
    spec = ["--speculative-draft-model-path", "d"]
    one = prof.method_flags(["ar", "ddtree"], ["32"], spec)
    assert list(one) == ["ar", "ddtree"] and one["ar"] == []
    assert one["ddtree"][:4] == ["--speculative-algorithm", "DDTREE",
                                 "--speculative-ddtree-budget", "32"]
    two = prof.method_flags(["ddtree", "dflash"], ["8", "16"], spec)
    assert list(two) == ["ddtree_b8", "ddtree_b16", "dflash"]
    assert two["ddtree_b16"][3] == "16" and two["dflash"][-1] == "d"


def test_kernel_families_of_a_kimi_verify_forward():
    """Names as the H200 traces of sessions 26 and 30 spelled them."""
    fam = {n: prof.kernel_family(n) for n in (
        "_gate_up_kernel", "_down_loop_kernel", "_prologue_kernel", "_combine_kernel",
        "void device::marlin_moe::Marlin<__nv_bfloat16, 1125899907892224l>(int4 const*)",
        "void count_and_sort_expert_tokens_kernel<int>(int const*, int*, int*)",
        "_router_triton_kernel",
        "void moe_sum_reduce_kernel<c10::BFloat16, 8>(c10::BFloat16 const*)",
        "_tree_attn_fwd_kernel", "_tree_attn_reduce_kernel", "_fwd_kernel_stage2",
        "_fwd_grouped_kernel_stage1",
        "void (anonymous namespace)::router_gemm_kernel<__nv_bfloat16, float, 128, 8, 8>",
        "nvjet_sm90_tst_64x40_64x16_4x1_v_bz_splitK_TNT",
        "void (anonymous namespace)::fused_a_gemm_kernel<1, 2112, 7168, 16, 8, 256, 16>",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float>",
        "void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*)",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::OpaqueType<2u>>",
        "void (anonymous namespace)::fused_rope_kernel<false, 64l, true>")}
    assert [n for n, f in fam.items() if f == "moe"] == list(fam)[:8]
    assert [n for n, f in fam.items() if f == "attention"] == list(fam)[8:12]
    assert [n for n, f in fam.items() if f == "gemm"] == list(fam)[12:16]
    assert [n for n, f in fam.items() if f == "norm"] == list(fam)[16:17]
    assert [n for n, f in fam.items() if f == "other"] == list(fam)[17:]
    tot = prof.family_totals([{"name": "_gate_up_kernel", "ms_per_step": 0.25},
                              {"name": "nvjet_x", "ms_per_step": 0.5},
                              {"name": "elementwise", "ms_per_step": 0.125}])
    assert tot == {"moe": 0.25, "attention": 0.0, "gemm": 0.5, "norm": 0.0, "other": 0.125,
                   "total": 0.875}


def test_server_env_parsing_and_the_fused_moe_record(monkeypatch):
    from e2e_lossless import parse_server_env  # shared with bench_cost_curves.py

    assert parse_server_env(["SGLANG_DDTREE_FUSED_MOE=1", "A=b=c"]) == {
        "SGLANG_DDTREE_FUSED_MOE": "1", "A": "b=c"}
    for bad in (["NOVALUE"], ["=1"]):
        try:
            parse_server_env(bad)
        except SystemExit as e:
            assert "KEY=VALUE" in str(e)
        else:
            raise AssertionError(bad)
    monkeypatch.setenv("SGLANG_DDTREE_FUSED_MOE", "1")
    assert prof.effective_env({}, "SGLANG_DDTREE_FUSED_MOE") == "1"  # inherited by the servers
    assert prof.effective_env({"SGLANG_DDTREE_FUSED_MOE": "0"}, "SGLANG_DDTREE_FUSED_MOE") == "0"
    monkeypatch.delenv("SGLANG_DDTREE_FUSED_MOE")
    assert prof.effective_env({}, "SGLANG_DDTREE_FUSED_MOE", "0") == "0"


def test_partial_results_are_written_with_their_comparisons(tmp_path):
    """A run cut after some methods leaves a JSON of those (complete: false), compared with AR
    where AR is among them; written whole each time (no half-written file)."""
    frame = "worker.py:_decode_step > tp_worker.py:forward_batch_generation"
    ar = {"gpu_kernels_by_frame": [{"frame": "tp_worker.py:forward_batch_generation", "kernels": [
        {"name": "_gate_up_kernel", "ms_per_step": 0.5, "calls_per_step": 7},
        {"name": "_fwd_kernel_stage2", "ms_per_step": 0.25, "calls_per_step": 8}]}]}
    dd = {"gpu_kernels_by_frame": [{"frame": frame, "kernels": [
        {"name": "_gate_up_kernel", "ms_per_step": 0.75, "calls_per_step": 7},
        {"name": "_tree_attn_fwd_kernel", "ms_per_step": 0.5, "calls_per_step": 8}]}]}
    out = tmp_path / "sub" / "p.json"
    result = {"complete": False, "methods": {"ar": ar}}
    prof.write_result(result, str(out))
    first = json.loads(out.read_text())
    assert first["complete"] is False and "target_forward_minus_ar" in first
    assert first["target_forward_minus_ar"] == {}
    result["methods"]["ddtree_b32"] = dd
    prof.write_result(result, str(out))
    got = json.loads(out.read_text())
    assert got["target_forward_families_minus_ar"]["ddtree_b32"] == {
        "moe": 0.25, "attention": 0.25, "gemm": 0.0, "norm": 0.0, "other": 0.0, "total": 0.5}
    assert {r["name"] for r in got["target_forward_minus_ar"]["ddtree_b32"]} == {
        "_gate_up_kernel", "_tree_attn_fwd_kernel", "_fwd_kernel_stage2"}
    assert not list(out.parent.glob("*.tmp"))


def test_compare_profiles_of_two_runs():
    def run(**methods):
        return {"methods": {n: {"gpu_kernels_by_frame": [{
            "frame": "tp_worker.py:forward_batch_generation",
            "kernels": [{"name": k, "ms_per_step": v, "calls_per_step": 8} for k, v in ks]}]}
            for n, ks in methods.items()}}
    one = run(ar=[("nvjet_a", 0.5), ("_gate_up_kernel", 0.25)],
              ddtree_b15=[("fused_a_gemm_kernel<16>", 0.5), ("_gate_up_kernel", 0.5)])
    two = run(ddtree_b16=[("nvjet_b", 0.75), ("_gate_up_kernel", 0.5)])
    res = prof.compare_profiles([one, two], pairs=(("ddtree_b15", "ddtree_b16"),))
    assert res["sources"] == {"ar": 0, "ddtree_b15": 0, "ddtree_b16": 1}
    assert res["families_minus_ar"]["ddtree_b16"]["gemm"] == 0.25
    assert res["families_minus_ar"]["ddtree_b16"]["moe"] == 0.25
    pair = res["pairs"]["ddtree_b16-ddtree_b15"]
    assert pair["families"]["gemm"] == 0.25 and pair["families"]["total"] == 0.25
    assert {(r["name"], r["family"], r["diff_ms"]) for r in pair["kernels"]} == {
        ("nvjet_b", "gemm", 0.75), ("fused_a_gemm_kernel<16>", "gemm", -0.5)}
    for bad, pairs in (([one, one], ()), ([one], (("ar", "ddtree_b16"),))):
        try:
            prof.compare_profiles(bad, pairs=pairs)
        except SystemExit as e:
            assert "ddtree_b16" in str(e) or "two of the files" in str(e)
        else:
            raise AssertionError(pairs)


def test_kernels_of_two_streams_at_once():
    """The shared expert on SGLang's second stream beside the routed MoE: both kernels' times
    hold the shared span, the frame's busy time does not."""
    def inner(t0):
        c = t0 // 10_000 * 10
        ev = [_x("python_function", "/x/sglang/srt/managers/tp_worker.py(9): "
                 "forward_batch_generation", t0 + 50, 3900),
              _x("cuda_runtime", "cudaGraphLaunch", t0 + 100, 10)]
        ev[1]["args"] = {"correlation": c + 1}
        for name, ts, dur, stream in (("_gate_up_kernel", 1000, 400, 7),
                                      ("nvjet_shared", 1100, 200, 9),
                                      ("nvjet_shared_down", 1350, 100, 9),
                                      ("_down_loop_kernel", 1400, 100, 7)):
            k = _x("kernel", name, t0 + ts, dur)
            k["args"] = {"correlation": c + 1, "stream": stream}
            ev.append(k)
        return ev
    frames = prof.summarize_trace({"traceEvents": _steps(2, inner)})["gpu_kernels_by_frame"]
    (f,) = frames
    k = {r["name"]: r for r in f["kernels"]}
    assert f["ms_per_step"] == 0.8 and f["busy_ms_per_step"] == 0.5
    assert k["_gate_up_kernel"]["concurrent_ms_per_step"] == 0.25  # 1100-1300 and 1350-1400
    assert k["nvjet_shared"]["concurrent_ms_per_step"] == 0.2
    assert k["nvjet_shared_down"]["concurrent_ms_per_step"] == 0.1  # gate-up, then down
    assert k["_down_loop_kernel"]["concurrent_ms_per_step"] == 0.05
    summ = {"gpu_kernels_by_frame": frames}
    assert prof.target_forward_busy_ms(summ) == 0.5
    assert prof.target_forward_kernels(summ)[0] == {
        "name": "_gate_up_kernel", "ms_per_step": 0.4, "calls_per_step": 1.0,
        "concurrent_ms_per_step": 0.25}
    assert prof.target_forward_busy_ms({"gpu_kernels_by_frame": [
        {"frame": "tp_worker.py:forward_batch_generation", "ms_per_step": 1.0,
         "kernels": []}]}) is None  # a summary from before session 30


def _fake_servers(monkeypatch, tmp_path, total_bytes):
    """profile_step.main with its servers, requests and the card faked: returns the event log
    ("start NAME", "ready NAME", "stop NAME") and each server's flags."""
    import torch
    import bench_e2e
    import e2e_lossless

    events, flags = [], {}

    class FakeServer:
        def __init__(self, args, log, port, env=None, wait=True):
            self.name = os.path.basename(log)[:-4]
            self.port, self.trace_dir = port, env["SGLANG_TORCH_PROFILER_DIR"]
            flags[self.name] = args
            events.append(f"start {self.name}")
            self.stopped = False

        def wait_ready(self):
            events.append(f"ready {self.name}")
            return self

        def stop(self):
            if not self.stopped:
                events.append(f"stop {self.name}")
            self.stopped = True

    by_port = {}
    real_init = FakeServer.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        by_port[self.port] = self

    FakeServer.__init__ = init

    def post(port, path, payload):  # /start_profile: the "server" writes its trace
        with open(os.path.join(by_port[port].trace_dir, "t.trace.json"), "w") as f:
            json.dump({"traceEvents": _steps(2, lambda t0: [])}, f)

    monkeypatch.setattr(e2e_lossless, "Server", FakeServer)
    monkeypatch.setattr(e2e_lossless, "stop_on_sigterm", lambda: None)
    monkeypatch.setattr(bench_e2e, "run_pass", lambda *a, **k: None)
    monkeypatch.setattr(prof, "_post", post)
    monkeypatch.setattr(prof.time, "sleep", lambda s: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Card")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i=0: type("P", (), {"total_memory": total_bytes})())
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [1, 2, 3]}) + "\n" for _ in range(8)))
    return events, flags, ["--prompts-file", str(prompts), "--workdir", str(tmp_path / "w"),
                           "--out", str(tmp_path / "o.json"), "--methods", "ar,ddtree",
                           "--budget", "31", "--steps", "2"]


def _mem_fraction(args):
    return float(args[args.index("--mem-fraction-static") + 1])


def test_serial_starts_each_server_after_the_last_stopped(monkeypatch, tmp_path):
    """--serial (the 61-layer Kimi rank on an 80 GB H100): one server alive at a time, at the
    card's default memory fraction (0.95 under 100,000 MiB); without it every server starts
    before the first is used, at 0.85; --mem-fraction overrides both."""
    events, flags, argv = _fake_servers(monkeypatch, tmp_path, 80 * 2 ** 30)
    monkeypatch.setattr(sys, "argv", ["profile_step.py", *argv, "--serial"])
    prof.main()
    assert events == ["start ar", "ready ar", "stop ar",
                      "start ddtree", "ready ddtree", "stop ddtree"]
    assert {n: _mem_fraction(a) for n, a in flags.items()} == {"ar": 0.95, "ddtree": 0.95}
    out = json.loads((tmp_path / "o.json").read_text())
    assert out["serial"] is True and out["mem_fraction"] == 0.95 and out["complete"]

    events.clear()
    monkeypatch.setattr(sys, "argv", ["profile_step.py", *argv])
    prof.main()
    assert events[:2] == ["start ar", "start ddtree"]
    assert {n: _mem_fraction(a) for n, a in flags.items()} == {"ar": 0.85, "ddtree": 0.85}

    monkeypatch.setattr(sys, "argv", ["profile_step.py", *argv, "--serial",
                                      "--mem-fraction", "0.9"])
    prof.main()
    assert {n: _mem_fraction(a) for n, a in flags.items()} == {"ar": 0.9, "ddtree": 0.9}
