"""scripts/e2e_fused_moe.py on CPU: the log-prob comparison and a dry run with fake servers."""

import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
import e2e_fused_moe as em  # noqa: E402


def test_logprob_agreement_over_the_tokens_both_list():
    a = [(-0.1, 5, ""), (-2.0, 7, ""), (-3.0, 9, "")]
    b = [(-0.12, 5, ""), (-2.5, 7, ""), (-2.9, 11, "")]
    diff, same = em.logprob_agreement(a, b)
    assert diff == pytest.approx(0.5) and same
    assert em.logprob_agreement(a, [(-0.1, 11, "")]) == (None, False)  # nothing in common


def test_the_target_is_an_int4_kimi_rank(tmp_path):
    cfg = json.load(open(os.path.join(em.write_target(str(tmp_path), 3, 20480), "config.json")))
    assert cfg["num_hidden_layers"] == 3 and cfg["vocab_size"] == 20480
    q = cfg["quantization_config"]
    assert q["quant_method"] == "compressed-tensors"
    assert json.dumps(q).count('"num_bits": 4') >= 1 and '"group_size": 32' in json.dumps(q)


def test_dry_run_with_fake_servers(tmp_path, monkeypatch):
    """Stock and ours agree except one near tie: the JSON says so and the run passes; the
    seed env is on both servers and the switch only on ours."""
    pytest.importorskip("sglang")
    import e2e_lossless

    started = []

    class FakeServer:
        def __init__(self, args, log, port, wait=True, env=None):
            self.env, self.port, self.startup_s = env or {}, port, 1.0
            self.ours = self.env.get("SGLANG_DDTREE_FUSED_MOE") == "1"
            started.append(self)

        def wait_ready(self):
            return self

        def generate(self, input_ids, max_new_tokens, sampling=None, logprob=False, timeout=180):
            # the stock path's view: token 1 best, token 2 close behind (prefill and decode)
            top = [(-0.5, 1, ""), (-0.6, 2, ""), (-3.0, 3, "")]
            if self.ours:
                top = [(-0.52, 1, ""), (-0.61, 2, ""), (-3.0, 3, "")]
            out, tops = [1] * max_new_tokens, [top] * max_new_tokens
            if self.ours and len(input_ids) % 2 and max_new_tokens > 3:
                # ours decodes the runner-up at position 3 of odd prompts: its decode forward
                # there ranks token 2 first, its prefill of the same prefix does not
                out = [1, 1, 1, 2] + [1] * (max_new_tokens - 4)
                tops = tops[:3] + [[(-0.55, 2, ""), (-0.56, 1, ""), (-3.0, 3, "")]] + tops[4:]
            meta = {"completion_tokens": max_new_tokens}
            if logprob:
                meta["output_top_logprobs"] = tops
            return {"output_ids": out, "meta_info": meta}

        def stop(self):
            pass

    monkeypatch.setattr(e2e_lossless, "Server", FakeServer)
    monkeypatch.setattr(e2e_lossless, "stop_on_sigterm", lambda on_exit=None: None)
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "FakeGPU")
    out = tmp_path / "r.json"
    rc = em.main(["--out", str(out), "--workdir", str(tmp_path / "w"), "--prompts", "6",
                  "--max-new-tokens", "8", "--concurrency", "2", "--greedy-concurrency", "1,2"])
    res = json.loads(out.read_text())
    assert rc == 0 and res["status"] == "complete" and not res["errors"]
    assert res["next_token"]["top1_equal"] == 6
    assert res["next_token"]["max_abs_logprob_diff"] == pytest.approx(0.02)
    assert sorted(res["greedy"]) == ["c1", "c2"]  # one comparison per greedy concurrency
    for g in res["greedy"].values():
        assert g["identical"] + g["near_ties"] == 6 and g["near_ties"] > 0 and not g["mismatches"]
        # each divergence seen from both sides: the fake ours decodes token 2 where its own
        # prefill's best is token 1
        assert [d["position"] for d in g["divergences"]] == [3] * g["near_ties"]
        assert all(d["stock_decode_token"] == 1 and d["ours_decode_token"] == 2
                   and d["stock_decode_is_prefill_top1"] and not d["ours_decode_is_prefill_top1"]
                   and d["prefill_top1_equal"] for d in g["divergences"])
        # the diverging decode step itself: ours' token 2 is 0.1 nats behind the stock path's
        # best there, a near tie; both decode lists agree within 0.06
        assert g["decode_near_ties"] == g["near_ties"] and g["not_decode_near_ties"] == 0
        for d in g["divergences"]:
            assert d["ours_token_gap_in_stock_decode"] == pytest.approx(0.1)
            assert d["decode_max_abs_logprob_diff"] == pytest.approx(0.06)
            assert d["ours_decode_top4"][0] == [2, -0.55]
    stock, ours = started
    assert "SGLANG_DDTREE_FUSED_MOE" not in stock.env
    assert stock.env["SGLANG_DDTREE_MOE_DUMMY_INT4_SEED"] == ours.env[
        "SGLANG_DDTREE_MOE_DUMMY_INT4_SEED"]
    # both servers get the same non-degenerate dummy weights (default range 0.05)
    assert stock.env["SGLANG_DDTREE_DUMMY_INIT_RANGE"] == ours.env[
        "SGLANG_DDTREE_DUMMY_INIT_RANGE"] == "0.05"
    assert res["dummy_init_range"] == 0.05
    # a tighter tie tolerance than ours' 0.1-nat gap: the same divergences now fail the run
    started.clear()
    rc = em.main(["--out", str(out), "--workdir", str(tmp_path / "w"), "--prompts", "6",
                  "--max-new-tokens", "8", "--concurrency", "2", "--greedy-concurrency", "1",
                  "--tie-tol", "0.05"])
    g = json.loads(out.read_text())["greedy"]["c1"]
    assert rc == 1 and g["decode_near_ties"] == 0
    assert g["not_decode_near_ties"] == len(g["mismatches"]) > 0
