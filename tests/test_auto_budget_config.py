"""--speculative-ddtree-budget auto: the table, the widths, the CLI and the startup export."""

import argparse

import pytest

from sglang_ddtree import config as cfg
from sglang_ddtree import hooks


def test_table_parsing_and_lookup():
    env = {cfg.ENV_BUDGET: "auto", cfg.ENV_AUTO_TABLE: "1:64, 8:32, inf:8"}
    tc = cfg.resolve(16, 5000, env)
    assert tc.auto_table == ((1, 64), (8, 32), (cfg.INF_BS, 8))
    assert tc.budget == 64 and tc.topk == 64 and tc.num_draft_tokens == 65  # widest tree
    assert [tc.budget_for(b) for b in (1, 2, 8, 9, 512)] == [64, 32, 32, 8, 8]
    assert tc.budgets == (64, 32, 8)
    assert cfg.read_budget(env) == 64
    fixed = cfg.resolve(16, 5000, {cfg.ENV_BUDGET: "24"})
    assert fixed.auto_table is None and fixed.budget_for(100) == 24 and fixed.budgets == (24,)


def test_default_table_comes_from_the_measured_run():
    tc = cfg.resolve(16, 5000, {cfg.ENV_BUDGET: "auto"})
    assert tc.auto_table == cfg.parse_auto_table(cfg.DEFAULT_AUTO_TABLE)


@pytest.mark.parametrize("raw,msg", [
    ("1:32", "last entry must be 'inf"),
    ("4:32,2:16,inf:8", "strictly increasing"),
    ("0:32,inf:8", "strictly increasing"),
    ("1:32;inf:8", "is not an integer"),
    ("32,inf:8", "expected 'max_bs:budget"),
    ("1:2000,inf:8", "speculative-ddtree-budget must be in"),
    ("x:8,inf:8", "is not an integer"),
])
def test_bad_tables_are_refused_with_the_fix(raw, msg):
    with pytest.raises(cfg.DDTreeConfigError, match=msg):
        cfg.parse_auto_table(raw)


def test_cli_accepts_auto_and_exports_it():
    parser = argparse.ArgumentParser()
    hooks.add_ddtree_cli_args(parser)
    assert parser.parse_args(["--speculative-ddtree-budget", "AUTO"]).speculative_ddtree_budget \
        == "auto"
    assert parser.parse_args(["--speculative-ddtree-budget", "12"]).speculative_ddtree_budget == 12
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-ddtree-budget", "big"])
    env = {}
    hooks.export_cli_args(argparse.Namespace(speculative_ddtree_budget="auto"), environ=env)
    assert env[cfg.ENV_BUDGET] == "auto"
    with pytest.raises(cfg.DDTreeConfigError, match="inf"):  # a bad table fails at startup
        hooks.export_cli_args(argparse.Namespace(speculative_ddtree_budget="auto"),
                              environ={cfg.ENV_AUTO_TABLE: "1:32"})


def test_verify_widths_of_the_smaller_budgets(monkeypatch):
    from sglang_ddtree.spec_algo import verify_widths

    monkeypatch.setenv(cfg.ENV_BUDGET, "auto")
    monkeypatch.setenv(cfg.ENV_AUTO_TABLE, "1:32,4:16,inf:8")
    monkeypatch.setenv(cfg.ENV_BLOCK_SIZE, "16")
    assert verify_widths(33) == (33, 16)  # the server's own width: the largest tree
    assert verify_widths(17) == (17, 16)  # runner built for budget 16
    assert verify_widths(9) == (9, 16)  # runner built for budget 8
    with pytest.raises(RuntimeError, match="budget changed"):
        verify_widths(12)


def test_default_table_is_the_one_derived_from_the_committed_run():
    import json
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "scripts"))
    import make_auto_table

    data = json.load(open(os.path.join(here, "..", "bench_results",
                                       "bench_e2e_tiny_h200_sweep_s7.json")))
    rat = make_auto_table.ratios(data)
    assert sorted(rat) == [1, 4, 8, 16, 32, 64] and all(len(r) == 5 for r in rat.values())
    assert make_auto_table.table_from_bands(rat, [8]) == cfg.DEFAULT_AUTO_TABLE


def test_band_table_takes_the_best_geometric_mean_per_band():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
    import make_auto_table

    rat = {1: {32: 1.2, 64: 1.3}, 4: {32: 1.2, 64: 1.1}, 16: {32: 0.9, 64: 2.0},
           64: {32: 1.5, 64: 1.0, 8: 3.0}}
    # band <= 4: gm(1.2, 1.2) = 1.2 > gm(1.3, 1.1) = 1.196; band > 4: gm(0.9, 1.5) < gm(2, 1);
    # budget 8 was not measured at 16, so it cannot win the band
    assert make_auto_table.table_from_bands(rat, [4]) == "4:32,inf:64"
    assert make_auto_table.table_from_bands(rat, []) == "inf:64"  # 1.94 < 2.86 over all four
    assert make_auto_table.table_from_bands({1: {32: 1.0}, 2: {32: 1.1}}, [1]) == "inf:32"


def test_table_derivation_boundaries_and_merging():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
    import make_auto_table

    win = {1: (64, 0, None), 8: (32, 0, None), 16: (32, 0, None), 64: (8, 0, None)}
    assert make_auto_table.table_from(win) == "2:64,32:32,inf:8"
    cfg.parse_auto_table(make_auto_table.table_from(win))  # valid for the server


def test_verify_memory_estimate_matches_the_design_note():
    """DESIGN: Kimi (vocab 163840), width 65, batch 48 -> about 2 GB of fp32 verify logits."""
    est = cfg.verify_memory_bytes(48, 65, 163840, 8192)
    assert est["verify_logits"] == 48 * 65 * 163840 * 4
    assert 1.9e9 < est["verify_logits"] < 2.1e9
    assert est["full_mask_bound"] == 48 * 65 * (8192 + 65)


def test_deepep_low_latency_verify_overflow_is_refused():
    """DeepEP low-latency dispatch caps tokens per rank (SGLang's default 128); a verify of
    batch x (budget + 1) tokens above it is refused with the fix, not left to fail in DeepEP."""
    err = cfg.deepep_verify_tokens_error("deepep", "auto", 8, 33, environ={})
    assert err and "264" in err and "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK=264" in err
    assert cfg.deepep_verify_tokens_error("deepep", "low_latency", 3, 33, environ={}) is None
    assert cfg.deepep_verify_tokens_error("deepep", "normal", 64, 65, environ={}) is None
    assert cfg.deepep_verify_tokens_error("none", "auto", 64, 65, environ={}) is None
    env = {cfg.ENV_DEEPEP_LL_TOKENS: "512"}
    assert cfg.deepep_verify_tokens_error("deepep", "auto", 8, 33, environ=env) is None
    # beyond DeepEP's 1024 the env var cannot help: the message says what can
    big = cfg.deepep_verify_tokens_error("deepep", "auto", 64, 65, environ={})
    assert "up to 1024" not in big and "--max-running-requests to 1" in big


def test_auto_mode_defaults_to_the_table_and_online_needs_auto_and_tp1():
    assert cfg.read_auto_mode({}) == "table"
    assert cfg.read_auto_mode({cfg.ENV_AUTO_MODE: "Online", cfg.ENV_BUDGET: "auto"}) == "online"
    with pytest.raises(cfg.DDTreeConfigError, match="expected one of table, online"):
        cfg.read_auto_mode({cfg.ENV_AUTO_MODE: "adaptive", cfg.ENV_BUDGET: "auto"})
    with pytest.raises(cfg.DDTreeConfigError, match="Set --speculative-ddtree-budget auto"):
        cfg.read_auto_mode({cfg.ENV_AUTO_MODE: "online", cfg.ENV_BUDGET: "32"})
    assert cfg.online_auto_parallel_error(False) is None
    assert "--enable-dp-attention does not" in cfg.online_auto_parallel_error(True)
    assert "pipeline parallel size 2" in cfg.online_auto_parallel_error(False, pp_size=2)
    # the CLI export checks it before any model loads
    env = {cfg.ENV_AUTO_MODE: "online"}
    with pytest.raises(cfg.DDTreeConfigError, match="budget is fixed"):
        hooks.export_cli_args(argparse.Namespace(speculative_ddtree_budget=32), environ=env)
    hooks.export_cli_args(argparse.Namespace(speculative_ddtree_budget="auto"), environ=env)
    assert env[cfg.ENV_BUDGET] == "auto"
