"""scripts/e2e_lossless.py end to end on fake servers: every phase (speed, oracle cases, edge
checks, KV idle, graph vs eager, the deterministic pair, a server that dies) runs and the JSON
and exit status come out right. Catches script bugs before GPU time is spent on them."""

import json
import os
import sys
import types

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
import e2e_lossless  # noqa: E402


class FakeServer:
    """Greedy output = the prompt's last token counting up (the target's 'own' output); a
    seeded request adds its seed. ``dead``: the model name whose servers fail to start."""

    dead = None
    started = []

    def __init__(self, args, log, port, env=None, wait=True):
        self.args, self.log, self.port, self.env = args, log, port, env or {}
        self.spec = "--speculative-algorithm" in args
        self.model = args[args.index("--model-path") + 1]
        open(log, "w").write("fake server log\n")
        FakeServer.started.append(self)
        self.stopped = False

    def wait_ready(self):
        if FakeServer.dead and FakeServer.dead in self.model:
            raise RuntimeError(f"server died: see {self.log}")
        self.startup_s = 1.0
        return self

    def generate(self, ids, n, params=None, logprob=False):
        params = params or {}
        seed = params.get("sampling_seed", 0)
        out = [(ids[-1] + seed + i) % 4000 for i in range(n)]
        stop = params.get("stop_token_ids")
        if stop and not params.get("ignore_eos", True):
            for i, t in enumerate(out):
                if t in stop:
                    out = out[: i + 1]
                    break
        meta = {"completion_tokens": len(out), "spec_verify_ct": max(1, len(out) // 3)}
        if logprob:
            meta["output_top_logprobs"] = [[(-0.1, out[0], ""), (-2.0, 1, "")]]
        return {"output_ids": out, "meta_info": meta}

    def stop(self):
        self.stopped = True


def _run(monkeypatch, tmp_path, *extra):
    monkeypatch.setattr(e2e_lossless, "Server", FakeServer)
    monkeypatch.setattr(e2e_lossless, "stop_on_sigterm", lambda on_exit=None: None)
    monkeypatch.setattr(e2e_lossless, "http",
                        lambda url, *a, **k: {"loads": [{"num_used_tokens": 0}]})
    monkeypatch.setattr(e2e_lossless.urllib.request, "urlopen",
                        lambda url, *a, **k: types.SimpleNamespace(read=lambda: b""))
    monkeypatch.setattr(e2e_lossless.time, "sleep", lambda s: None)
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "FakeGPU")
    FakeServer.started = []
    out = tmp_path / "e2e.json"
    monkeypatch.setattr(sys, "argv", [
        "e2e_lossless.py", "--out", str(out), "--workdir", str(tmp_path / "work"),
        "--prompts", "6", "--max-new-tokens", "16", "--repeats", "1", "--batch-sizes", "1,2",
        *extra])
    rc = e2e_lossless.main()
    return rc, json.loads(out.read_text())


def test_dry_run_all_phases(monkeypatch, tmp_path):
    pytest.importorskip("sglang")
    FakeServer.dead = None
    rc, res = _run(monkeypatch, tmp_path, "--cases", "tiny:8,auto;mla:8;tiny_tv:8;tiny_kvsglang:8",
                   "--eager-check", "tiny:8", "--speed", "tiny:8", "--deterministic", "tiny:8")
    assert res["errors"] == [] and rc == 0, res["failures"]
    assert len(res["cases"]) == 5 * 2 + 2  # 5 graph cases + 1 eager case, x 2 batch sizes
    per_column = [s for s in FakeServer.started if "tiny_kvsglang" in s.log]
    assert per_column and per_column[0].env["SGLANG_DDTREE_KV_MOVE"] == "sglang"
    # tiny_tv differs from tiny only on the DDTREE side: one AR server for both
    ars = [s for s in FakeServer.started if not s.spec and "deterministic" not in str(s.args)]
    assert len(ars) == 2
    tv = [c for c in res["cases"] if c["model"] == "tiny_tv"]
    assert tv and tv[0]["verify_backend"] == "triton"
    assert res["sampled_runs"] and all(r["completed"] == r["requests"] == 6
                                       for r in res["sampled_runs"])
    assert all(c["identical"] == c["prompts"] for c in res["cases"])
    assert {e["budget"] for e in res["edge_checks"]} == {8, "auto"}
    edge = res["edge_checks"][0]
    assert edge["all_equal"] and any(c["stopped_early"] for c in edge["checks"])
    assert res["graph_vs_eager"] and all(g["equal"] == g["prompts"] for g in res["graph_vs_eager"])
    det = res["deterministic"]["tiny"]
    assert det["seeded"]["all_reproducible"] and det["seeded"]["equal_to_ar"] == 6
    assert set(res["speed"]["tiny"]) >= {"ar", "dflash", "ddtree"}
    assert len(res["kv_idle_checks"]) == 6
    assert all(s.stopped for s in FakeServer.started)  # nothing leaks into the next run


def test_server_env_reaches_the_ar_reference_and_ddtree_servers(monkeypatch, tmp_path):
    """kimi_int4 runs our fused int4 MoE on both sides (same seeded experts): an AR reference on
    SGLang's own MoE would compare two different models."""
    pytest.importorskip("sglang")
    FakeServer.dead = None
    rc, res = _run(monkeypatch, tmp_path, "--cases", "kimi_int4:8", "--eager-check=",
                   "--speed", "kimi_int4:8", "--deterministic", "kimi_int4:8")
    assert rc == 0 and res["errors"] == [], res["failures"]
    want = e2e_lossless.MODEL_SETS["kimi_int4"]["server_env"]
    assert want == {"SGLANG_DDTREE_FUSED_MOE": "1", "SGLANG_DDTREE_MOE_DUMMY_INT4_SEED": "1234"}
    kimi = [s for s in FakeServer.started if "kimi-k2.6-tp8rank-l8-int4" in s.model]
    # AR reference (also the speed run's AR), oracle case, speed DFLASH / DDTREE,
    # deterministic AR / DDTREE
    assert len(kimi) == 6 and len([s for s in kimi if not s.spec]) == 2
    for srv in kimi:
        assert {k: srv.env.get(k) for k in want} == want, srv.log
        assert srv.args[srv.args.index("--load-format") + 1] == "dummy"
    assert all(c["identical"] == c["prompts"] for c in res["cases"])


def test_sets_sharing_an_absent_base_share_one_ar(monkeypatch, tmp_path):
    pytest.importorskip("sglang")
    FakeServer.dead = None
    rc, res = _run(monkeypatch, tmp_path, "--cases", "tiny_tv:8;tiny_kvsglang:8", "--eager-check=",
                   "--speed=", "--deterministic=")
    assert rc == 0 and res["errors"] == []
    assert len([s for s in FakeServer.started if not s.spec]) == 1


def test_flashmla_sets_share_an_ar_on_flashmla_pages(monkeypatch, tmp_path):
    """mla_fmla_tv / mla_fmla / mla_fmla_auto: every server on the flashmla backend with
    64-token pages (AR included: one reference for all), the DDTREE servers on our Triton verify
    with the drafter on triton; mla_fmla_tv's prefix on our kernel alone (triton), mla_fmla's
    on FlashMLA, mla_fmla_auto's left to the default (auto)."""
    pytest.importorskip("sglang")
    FakeServer.dead = None
    rc, res = _run(monkeypatch, tmp_path, "--cases", "mla_fmla_tv:8;mla_fmla:8;mla_fmla_auto:8",
                   "--eager-check=", "--speed=", "--deterministic=")
    assert rc == 0 and res["errors"] == [], res["failures"]
    assert len([s for s in FakeServer.started if not s.spec]) == 1
    for srv in FakeServer.started:
        assert srv.args[srv.args.index("--attention-backend") + 1] == "flashmla", srv.log
        assert srv.args[srv.args.index("--page-size") + 1] == "64", srv.log
    ddtree = [s for s in FakeServer.started if s.spec]
    assert ddtree and all("--speculative-draft-attention-backend" in s.args for s in ddtree)
    prefix = {s.log.split("/")[-1].split("-ddtree")[0]: s.env.get("SGLANG_DDTREE_MLA_PREFIX")
              for s in ddtree}
    assert prefix == {"mla_fmla_tv": "triton", "mla_fmla": "flashmla", "mla_fmla_auto": None}
    assert all(c["verify_backend"] == "triton" for c in res["cases"])


def test_draft_attention_sets_reuse_their_targets_ar(monkeypatch, tmp_path):
    """tiny_dtv / mla_dtv (gpu_session.sh draftattn): compared with the plain sets' AR servers
    (one each, nothing extra), their DDTREE servers alone carry the drafter switch."""
    pytest.importorskip("sglang")
    FakeServer.dead = None
    rc, res = _run(monkeypatch, tmp_path, "--cases", "tiny_dtv:8;mla_dtv:8", "--eager-check=",
                   "--speed=", "--deterministic=")
    assert rc == 0 and res["errors"] == [], res["failures"]
    ar = [s for s in FakeServer.started if not s.spec]
    assert len(ar) == 2 and all("SGLANG_DDTREE_DRAFT_ATTENTION" not in s.env for s in ar)
    ddtree = [s for s in FakeServer.started if s.spec]
    assert len(ddtree) == 2
    assert all(s.env.get("SGLANG_DDTREE_DRAFT_ATTENTION") == "triton" for s in ddtree)


def test_native_drafter_set_keeps_sglangs_kernel(monkeypatch, tmp_path):
    """tiny_dnat: the tiny pair's DDTREE server with the drafter kept native (a triton drafter
    is on our kernel by default since session 24), beside tiny's AR server."""
    pytest.importorskip("sglang")
    FakeServer.dead = None
    rc, res = _run(monkeypatch, tmp_path, "--cases", "tiny_dnat:8", "--eager-check=",
                   "--speed=", "--deterministic=")
    assert rc == 0 and res["errors"] == [], res["failures"]
    ddtree = [s for s in FakeServer.started if s.spec]
    assert [s.env.get("SGLANG_DDTREE_DRAFT_ATTENTION") for s in ddtree] == ["native"]


def test_dry_run_survives_a_dead_model(monkeypatch, tmp_path):
    pytest.importorskip("sglang")
    FakeServer.dead = "mla"
    try:
        rc, res = _run(monkeypatch, tmp_path, "--cases", "tiny:8;mla:8", "--eager-check=",
                       "--speed=", "--deterministic=")
    finally:
        FakeServer.dead = None
    assert rc == 1 and res["failures"]["errors"] >= 1
    assert {c["model"] for c in res["cases"]} == {"tiny"}  # the live model's cases still ran
    assert any("mla" in e for e in res["errors"])
    assert all(s.stopped for s in FakeServer.started)


def test_sigterm_stops_live_servers_and_saves(monkeypatch):
    """``timeout`` ends a step with SIGTERM: every live server is stopped (so none answers the
    next step's requests) and the partial results are saved before the script exits."""
    import signal

    saved, stopped = [], []
    fake = types.SimpleNamespace(stop=lambda: stopped.append(1))
    monkeypatch.setattr(e2e_lossless, "LIVE_SERVERS", [fake, fake])
    previous = signal.getsignal(signal.SIGTERM)
    try:
        e2e_lossless.stop_on_sigterm(lambda: saved.append(1))
        with pytest.raises(SystemExit) as exc:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):  # the handler runs at the next bytecode boundary
                pass
        assert exc.value.code == 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped == [1, 1] and saved == [1]


def test_summarize_counts_a_partial_result():
    """A time-limited run's result (a deterministic pair that never answered, no histogram)
    still gets failure counts from what finished; a mismatch and a leak are counted."""
    result = {"cases": [{"accept_length": 3.0, "mismatches": [{"pos": 4}]},
                        {"accept_length": 2.0, "mismatches": []}],
              "edge_checks": [{"all_equal": True}], "deterministic": {"tiny": {}},
              "sampled_runs": [{"requests": 8, "completed": 8}],
              "kv_idle_checks": [{"num_used_tokens_after_flush": 3, "leak_log_lines": []}],
              "graph_vs_eager": [], "errors": []}
    e2e_lossless.summarize(result, {}, {})
    assert result["failures"] == {"mismatches": 1, "edge_checks": 0, "seeded_not_reproducible": 0,
                                  "kv_not_idle": 1, "sampled_incomplete": 0, "errors": 0}
    assert result["mean_accept_length_over_cases"] == 2.5
    assert result["mean_accept_length"] is None


def test_graph_vs_eager_from_the_cases_digests():
    """Read back from a JSON (no outputs in memory), graph vs eager compares the per-prompt
    output digests of the graph-on and graph-off cases of the same model, budget, batch size."""
    d = e2e_lossless.output_digest
    case = lambda graph, outs: {"model": "tiny", "budget": 32, "batch_size": 4,  # noqa: E731
                                "cuda_graph": graph, "accept_length": 2.0, "mismatches": [],
                                "output_digests": [d(o) for o in outs]}
    result = {"cases": [case(True, [[1, 2], [3, 4], [5]]), case(False, [[1, 2], [3, 5], [5]])],
              "edge_checks": [], "deterministic": {}, "sampled_runs": [], "kv_idle_checks": [],
              "graph_vs_eager": [], "errors": []}
    e2e_lossless.summarize(result, {}, {})
    assert result["graph_vs_eager"] == [{"model": "tiny", "budget": 32, "batch_size": 4,
                                         "prompts": 3, "equal": 2, "first_divergences": None}]
    assert d([1, 2]) == d((1, 2)) != d([2, 1])


def test_dry_run_online_auto_case(monkeypatch, tmp_path):
    """A case budget 'online' starts DDTREE with budget auto and SGLANG_DDTREE_AUTO_MODE=online."""
    pytest.importorskip("sglang")
    FakeServer.dead = None
    rc, res = _run(monkeypatch, tmp_path, "--cases", "tiny:online", "--eager-check=", "--speed=",
                   "--deterministic=")
    assert res["errors"] == [] and rc == 0, res["failures"]
    online = [s for s in FakeServer.started if s.spec]
    assert len(online) == 1 and online[0].env["SGLANG_DDTREE_AUTO_MODE"] == "online"
    args = online[0].args
    assert args[args.index("--speculative-ddtree-budget") + 1] == "auto"
    assert {c["budget"] for c in res["cases"]} == {"online"}


def test_skinny_serve_switch_reaches_the_ddtree_servers_only(monkeypatch, tmp_path):
    """gpu_session.sh skinnyserve: the int4 Kimi set with --ddtree-env SGLANG_DDTREE_SKINNY_GEMM
    compares DDTREE on the skinny GEMM with an AR server on SGLang's own GEMMs; both keep the
    set's fused-MoE environment."""
    pytest.importorskip("sglang")
    FakeServer.dead = None
    rc, res = _run(monkeypatch, tmp_path, "--cases", "kimi_int4:16,31", "--eager-check=",
                   "--speed=", "--deterministic=", "--ddtree-env", "SGLANG_DDTREE_SKINNY_GEMM=1")
    assert rc == 0 and res["errors"] == [], res["failures"]
    ar = [s for s in FakeServer.started if not s.spec]
    ddtree = [s for s in FakeServer.started if s.spec]
    assert len(ar) == 1 and len(ddtree) == 2
    assert "SGLANG_DDTREE_SKINNY_GEMM" not in ar[0].env
    assert all(s.env.get("SGLANG_DDTREE_SKINNY_GEMM") == "1" for s in ddtree)
    assert all(s.env.get("SGLANG_DDTREE_FUSED_MOE") == "1" for s in ar + ddtree)


def test_mla_prefix_from_batch_8_set(monkeypatch, tmp_path):
    """mla_fmla8 (gpu_session.sh fmlabatch): its DDTREE servers carry flashmla:8 on the
    FlashMLA-paged target, compared with mla_fmla_tv's AR server."""
    pytest.importorskip("sglang")
    FakeServer.dead = None
    rc, res = _run(monkeypatch, tmp_path, "--cases", "mla_fmla8:16", "--batch-sizes", "1,8",
                   "--eager-check=", "--speed=", "--deterministic=")
    assert rc == 0 and res["errors"] == [], res["failures"]
    ddtree = [s for s in FakeServer.started if s.spec]
    assert ddtree and all(s.env.get("SGLANG_DDTREE_MLA_PREFIX") == "flashmla:8" for s in ddtree)
    ar = [s for s in FakeServer.started if not s.spec]
    assert len(ar) == 1 and "SGLANG_DDTREE_MLA_PREFIX" not in (ar[0].env or {})
    assert all("--page-size" in s.args for s in FakeServer.started)


@pytest.mark.parametrize("case,setting", [("tiny_fa3p", "fa3"), ("tiny_fa3p4", "fa3:4")])
def test_mha_prefix_on_fa3_sets(monkeypatch, tmp_path, case, setting):
    """tiny_fa3p / tiny_fa3p4 (gpu_session.sh fa3prefix): DDTREE servers on the fa3 backend with
    our Triton verify and the prefix on FA3, compared with tiny_fa3's AR server."""
    pytest.importorskip("sglang")
    FakeServer.dead = None
    rc, res = _run(monkeypatch, tmp_path, "--cases", f"{case}:16", "--batch-sizes", "1,4",
                   "--eager-check=", "--speed=", "--deterministic=")
    assert rc == 0 and res["errors"] == [], res["failures"]
    ddtree = [s for s in FakeServer.started if s.spec]
    assert ddtree and all(s.env.get("SGLANG_DDTREE_MHA_PREFIX") == setting for s in ddtree)
    assert all(s.args[s.args.index("--speculative-ddtree-verify-backend") + 1] == "triton"
               for s in ddtree)
    ar = [s for s in FakeServer.started if not s.spec]
    assert len(ar) == 1 and "SGLANG_DDTREE_MHA_PREFIX" not in (ar[0].env or {})
    assert all(s.args[s.args.index("--attention-backend") + 1] == "fa3"
               for s in FakeServer.started)


def test_kimi_serving_variant_sets(monkeypatch, tmp_path):
    """kimi_int4_fp8kv / _fa3 / _fmla: each set's AR reference and DDTREE servers share its
    KV dtype, attention backend and pages (an AR on another cache or backend would compare two
    different numerics), and keep the fused-MoE environment."""
    pytest.importorskip("sglang")
    FakeServer.dead = None
    rc, res = _run(monkeypatch, tmp_path, "--cases",
                   "kimi_int4_fp8kv:8;kimi_int4_fa3:8;kimi_int4_fmla:8", "--eager-check=",
                   "--speed=", "--deterministic=")
    assert rc == 0 and res["errors"] == [], res["failures"]
    ar = [s for s in FakeServer.started if not s.spec]
    assert len(ar) == 3 and len(FakeServer.started) == 6

    def arg(s, flag):
        return s.args[s.args.index(flag) + 1] if flag in s.args else None

    for srv in FakeServer.started:
        assert srv.env.get("SGLANG_DDTREE_FUSED_MOE") == "1"
    kv = sorted((arg(s, "--kv-cache-dtype"), s.spec) for s in FakeServer.started
                if arg(s, "--kv-cache-dtype"))
    assert kv == [("fp8_e4m3", False), ("fp8_e4m3", True)]
    fa3 = [s for s in FakeServer.started if arg(s, "--attention-backend") == "fa3"]
    assert len(fa3) == 2 and all(arg(s, "--speculative-ddtree-verify-backend") == "triton"
                                 for s in fa3 if s.spec)
    fmla = [s for s in FakeServer.started if arg(s, "--attention-backend") == "flashmla"]
    assert len(fmla) == 2 and all(arg(s, "--page-size") == "64" for s in fmla)
