"""scripts/e2e_grammar.py on fake servers whose constrained outputs come from real xgrammar
matchers over the tiny pair's tokenizer: the constraints compile, the checker accepts what a
grammar allows and rejects what it does not, and a DDTREE server that diverges from AR (or emits
a token its grammar bans) fails the run. Catches script bugs before GPU time is spent on them."""

import json
import os
import random
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))

xgr = pytest.importorskip("xgrammar")
pytest.importorskip("transformers")
pytest.importorskip("sglang")
import e2e_grammar  # noqa: E402

TARGET = os.path.join(e2e_grammar.ASSETS, "target")
VOCAB = 4096


@pytest.fixture(scope="module")
def check():
    return e2e_grammar.grammar_checker(TARGET, VOCAB)


@pytest.fixture(scope="module")
def compiled():
    _, comp = e2e_grammar.constraint_compiler(TARGET, VOCAB)
    return {name: e2e_grammar.compile_constraint(comp, name) for name in ("regex", "json", "ebnf")}


def constrained_walk(grammar, n, seed):
    """Up to n tokens a grammar allows (a seeded pick among the allowed ones at each step);
    (tokens, finish reason)."""
    m = xgr.GrammarMatcher(grammar)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        allowed = e2e_grammar.allowed_tokens(m, VOCAB)
        t = allowed[0] if rng.random() < 0.5 else rng.choice(allowed)
        assert m.accept_token(t)
        out.append(t)
        if m.is_terminated():
            return out, {"type": "stop"}
    return out, {"type": "length"}


def test_checker_accepts_allowed_outputs_and_rejects_a_banned_token(check, compiled):
    for name, grammar in compiled.items():
        out, finish = constrained_walk(grammar, 48, seed=len(name))
        c = check(name, out, finish)
        assert c["accepted_prefix"] and c["complete"] == (finish["type"] == "stop"), (name, c)
        # a token the grammar bans right at the start
        allowed = set(e2e_grammar.allowed_tokens(xgr.GrammarMatcher(grammar), VOCAB))
        banned = next(t for t in range(VOCAB) if t not in allowed)
        assert not check(name, [banned] + out[1:], finish)["accepted_prefix"]


def test_constraint_mix_covers_every_kind_and_none():
    names = list(e2e_grammar.CONSTRAINTS)
    kinds = [e2e_grammar.constraint_of(i, names) for i in range(8)]
    assert set(kinds) == set(names) | {None}
    assert e2e_grammar.sampling_of(None) == {"ignore_eos": False}
    assert e2e_grammar.sampling_of("json")["json_schema"].startswith("{")


class FakeServer:
    """AR and DFLASH: each constrained prompt's output is a seeded walk of its grammar (seeded by
    the prompt, so every server agrees), unconstrained ones count up. ``diverge``: the DDTREE
    budget whose server changes one unconstrained output (a mismatch); ``ban``: the budget
    whose server emits a banned token first on the regex prompts."""

    compiled = None
    diverge = ban = fail = swap = None
    pair_gap = 0.1
    started = []

    def __init__(self, args, log, port, env=None, wait=True):
        self.args, self.env = args, env
        self.budget = (args[args.index("--speculative-ddtree-budget") + 1]
                       if "--speculative-ddtree-budget" in args else None)
        self.budget = self.budget if self.budget in (None, "auto") else int(self.budget)
        assert args[args.index("--grammar-backend") + 1] == "xgrammar"
        assert "--skip-tokenizer-init" not in args  # the grammar needs the tokenizer
        FakeServer.started.append(self)
        self.stopped = False

    def wait_ready(self):
        return self

    def generate(self, ids, n, sampling=None, logprob=False, token_ids_logprob=None):
        if self.budget is not None and self.budget == FakeServer.fail:
            raise RuntimeError("request failed")
        if logprob:  # the near-tie query: the AR token far ahead of every other; the pair's
            # gap is FakeServer.pair_gap (AR's token above the other)
            meta = {"output_top_logprobs": [[(-0.1, 1, ""), (-5.0, 2, "")]]}
            if token_ids_logprob:
                a, b = token_ids_logprob
                meta["output_token_ids_logprobs"] = [[(-3.0, a, None),
                                                      (-3.0 - FakeServer.pair_gap, b, None)]]
            return {"meta_info": meta}
        kind = next((k for k, (key, _) in e2e_grammar.CONSTRAINTS.items()
                     if key in (sampling or {})), None)
        assert sampling["ignore_eos"] is False
        if kind is None:
            out, finish = [(ids[-1] + i) % VOCAB for i in range(n)], {"type": "length"}
            if self.budget is not None and self.budget == FakeServer.diverge:
                out[3] = (out[3] + 7) % VOCAB
        else:
            out, finish = constrained_walk(FakeServer.compiled[kind], n, seed=sum(ids))
            if kind == "regex" and self.budget is not None and self.budget == FakeServer.ban:
                out = [2] + out[1:]  # "#" is no indented line's first character
            if kind == "json" and self.budget is not None and self.budget == FakeServer.swap:
                # another allowed token at the second position: where AR's best is banned,
                # only the two emitted tokens' gap says whether this is a near tie
                out, finish = constrained_walk(FakeServer.compiled[kind], n,
                                               seed=sum(ids) + 1)
        meta = {"completion_tokens": len(out), "spec_verify_ct": max(1, len(out) // 3),
                "finish_reason": finish}
        return {"output_ids": out, "meta_info": meta}

    def stop(self):
        self.stopped = True


def _run(monkeypatch, tmp_path, compiled, extra=()):
    import torch

    lossless = e2e_grammar.lossless
    monkeypatch.setattr(lossless, "Server", FakeServer)
    monkeypatch.setattr(lossless, "stop_on_sigterm", lambda on_exit=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "FakeGPU")
    FakeServer.compiled, FakeServer.started = compiled, []
    out = tmp_path / "g.json"
    monkeypatch.setattr(sys, "argv", [
        "e2e_grammar.py", "--out", str(out), "--workdir", str(tmp_path / "w"), "--prompts", "8",
        "--max-new-tokens", "24", "--batch-sizes", "1,2", "--budgets", "8,32", *extra])
    with pytest.raises(SystemExit) as exit_:
        e2e_grammar.main()
    return exit_.value.code, json.loads(out.read_text())


def test_dry_run_passes_when_every_server_matches(monkeypatch, tmp_path, compiled):
    FakeServer.diverge = FakeServer.ban = FakeServer.fail = None
    rc, res = _run(monkeypatch, tmp_path, compiled)
    assert rc == 0, res["summary"]
    assert set(res["servers"]) == {"ar", "dflash", "ddtree_b8", "ddtree_b32"}
    s = res["summary"]
    assert s["ddtree_runs"] == 4 and s["ddtree_identical"] == 4 * 8 and s["ddtree_mismatches"] == 0
    assert s["constrained_outputs_rejected_by_grammar"] == 0
    run = res["servers"]["ddtree_b8"]["runs"][0]
    assert set(run["grammar"]) == {"regex", "json", "ebnf"}
    assert run["identical_by_constraint"]["none"] == [2, 2]
    assert all(s.stopped for s in FakeServer.started)
    # the speed phase: every server at each speed concurrency, DDTREE over DFLASH in one run
    assert set(res["speed"]) == {"1", "8"}
    row = res["speed"]["1"]
    assert set(row) == {"ar", "dflash", "ddtree_b8", "ddtree_b32"}
    assert len(row["ddtree_b8"]["tokens_per_s_passes"]) == 3
    assert row["ddtree_b8"]["over_dflash"] == pytest.approx(
        row["ddtree_b8"]["tokens_per_s"] / row["dflash"]["tokens_per_s"])


def test_constrained_divergence_is_judged_by_the_two_emitted_tokens(monkeypatch, tmp_path,
                                                                     compiled):
    FakeServer.diverge = FakeServer.ban = FakeServer.fail = None
    FakeServer.swap, FakeServer.pair_gap = 8, 0.1  # within --tie-tol: near ties
    rc, res = _run(monkeypatch, tmp_path, compiled)
    runs = res["servers"]["ddtree_b8"]["runs"]
    assert rc == 0 and all(r["near_ties"] >= 1 and not r["mismatches"] for r in runs)
    assert res["summary"]["ddtree_near_ties"] >= 2
    FakeServer.pair_gap = 2.0  # far apart: mismatches, the run fails
    rc, res = _run(monkeypatch, tmp_path, compiled)
    bad = res["servers"]["ddtree_b8"]["runs"][0]["mismatches"]
    assert rc == 1 and bad and bad[0]["constraint"] == "json" and bad[0]["token_gap"] == 2.0
    FakeServer.swap, FakeServer.pair_gap = None, 0.1


def test_dry_run_fails_on_a_mismatch_or_a_banned_token(monkeypatch, tmp_path, compiled):
    FakeServer.diverge, FakeServer.ban, FakeServer.fail = 32, None, None
    rc, res = _run(monkeypatch, tmp_path, compiled)
    assert rc == 1 and res["summary"]["ddtree_mismatches"] == 2 * 2  # 2 prompts x 2 batch sizes
    FakeServer.diverge, FakeServer.ban = None, 8
    rc, res = _run(monkeypatch, tmp_path, compiled)
    assert rc == 1 and res["summary"]["constrained_outputs_rejected_by_grammar"] == 2 * 2
    # a server whose requests fail: recorded, the other servers' runs still complete
    FakeServer.ban, FakeServer.fail = None, 32
    rc, res = _run(monkeypatch, tmp_path, compiled)
    assert rc == 1 and res["errors"][-1].startswith("ddtree_b32 c1: ")
    assert res["errors"][0].startswith("ddtree_b32 speed c1: ")
    assert "ddtree_b32" not in res["speed"]["1"] and "ddtree_b8" in res["speed"]["1"]
    assert len(res["servers"]["ddtree_b8"]["runs"]) == 2 and res["summary"]["ddtree_runs"] == 2
    assert all(s.stopped for s in FakeServer.started)
    FakeServer.fail = None


def test_mla_target_gets_the_tiny_tokenizer_and_dummy_weights(monkeypatch, tmp_path, compiled):
    """--model mla: the MLA + MoE configs with the tiny pair's tokenizer (vocabulary, EOS and
    the drafter's mask token matched), dummy weights on every server, budget auto passed on."""
    FakeServer.diverge = FakeServer.ban = FakeServer.fail = FakeServer.swap = None
    rc, res = _run(monkeypatch, tmp_path, compiled,
                   ["--model", "mla", "--budgets", "8,auto", "--no-dflash",
                    "--speed-batch-sizes", ""])
    assert rc == 0, res["summary"]
    assert set(res["servers"]) == {"ar", "ddtree_b8", "ddtree_bauto"} and res["model"] == "mla"
    for srv in FakeServer.started:
        a = srv.args
        assert a[a.index("--model-path") + 1] == res["target"]
        assert a[a.index("--load-format") + 1] == "dummy"
        if "--speculative-algorithm" in a:
            assert a[a.index("--speculative-draft-model-path") + 1] == res["draft"]
            assert a[a.index("--speculative-draft-load-format") + 1] == "dummy"
    assert FakeServer.started[-1].budget == "auto"
    tcfg = json.load(open(os.path.join(res["target"], "config.json")))
    dcfg = json.load(open(os.path.join(res["draft"], "config.json")))
    assert tcfg["model_type"] == "deepseek_v2" and tcfg["kv_lora_rank"] == 512
    assert tcfg["vocab_size"] == dcfg["vocab_size"] == VOCAB
    assert tcfg["eos_token_id"] == 0 and dcfg["dflash_config"]["mask_token_id"] == 1
    # the copied tokenizer compiles the constraints over that vocabulary
    tok, comp = e2e_grammar.constraint_compiler(res["target"], tcfg["vocab_size"])
    assert tok.convert_ids_to_tokens(1) == "<|MASK|>"
    assert e2e_grammar.compile_constraint(comp, "ebnf") is not None
    assert res["summary"]["ddtree_runs"] == 4 and res["summary"]["ddtree_mismatches"] == 0


def test_oracle_plants_ar_outputs_in_the_ddtree_servers(monkeypatch, tmp_path, compiled):
    """--oracle: only the DDTREE servers read the test-only oracle file, written with AR's
    constrained outputs before any DDTREE run; refused beside a speed phase."""
    FakeServer.diverge = FakeServer.ban = FakeServer.fail = FakeServer.swap = None
    rc, res = _run(monkeypatch, tmp_path, compiled,
                   ["--model", "mla", "--budgets", "8", "--no-dflash", "--speed-batch-sizes",
                    "", "--oracle"])
    assert rc == 0 and res["oracle"] is True
    by_budget = {s.budget: s for s in FakeServer.started}
    path = by_budget[8].env["SGLANG_DDTREE_TEST_ORACLE"]
    assert by_budget[None].env is None  # AR: no oracle
    items = json.load(open(path))["items"]
    ar_out = res["servers"]["ar"]["runs"][0]
    assert len(items) == 8 and ar_out["output_tokens"] == sum(len(i["output"]) for i in items)
    monkeypatch.setattr(sys, "argv", ["e2e_grammar.py", "--oracle"])  # the default speed phase
    with pytest.raises(SystemExit) as exit_:
        e2e_grammar.main()
    assert exit_.value.code == 2
