"""scripts/bench_grammar_walk.py on the smallest setting: the trees hold the reference path, the
walk admits it, and the JSON rows come out (the benchmark itself is CPU timing, never asserted)."""

import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))

pytest.importorskip("xgrammar")
pytest.importorskip("transformers")
pytest.importorskip("sglang")
import bench_grammar_walk as bgw  # noqa: E402


def test_trees_hold_the_reference_path_and_the_walk_admits_it():
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from e2e_grammar import compile_constraint

    tok = AutoTokenizer.from_pretrained(os.path.join(bgw.HERE, "..", "bench_assets",
                                                     "tiny-code", "target"))
    info = bgw.padded_info(tok, 4096)
    compiled = compile_constraint(xgr.GrammarCompiler(info), "json")
    tree, chains, roots = bgw.make_trees(compiled, info.vocab_size, bs=2, block=8, topk=4,
                                         budget=12, valid_share=0.5, seed=3)
    for b in range(2):  # rank 0 at every depth is the reference token: the best path
        node = 0
        for d, want in enumerate(chains[b, 1:].tolist(), start=1):
            kids = [i for i in range(tree.tokens.shape[1])
                    if tree.valid[b, i] and int(tree.parents[b, i]) == node
                    and int(tree.tokens[b, i]) == want]
            if not kids:
                break
            node = kids[0]
        assert node != 0  # at least the first reference token is in the tree
    nxt, sib = bgw.chain_links(chains)
    ms, admitted, per_node = bgw.walk_ms(compiled, info.vocab_size, roots, nxt, sib, chains, 1)
    assert admitted == chains.numel()  # every chain node is grammar-valid: each one filled
    ms, admitted, _ = bgw.walk_ms(compiled, info.vocab_size, roots, tree.retrive_next_token,
                                  tree.retrive_next_sibling, tree.tokens, 1)
    assert 2 <= admitted <= tree.valid.sum()


def test_script_writes_its_rows(tmp_path, monkeypatch):
    out = tmp_path / "g.json"
    monkeypatch.setattr(sys, "argv", ["bench_grammar_walk.py", "--out", str(out), "--budgets",
                                      "8", "--vocab-sizes", "4096", "--constraints", "regex",
                                      "--repeats", "1", "--batch", "2", "--block", "8"])
    bgw.main()
    res = json.loads(out.read_text())
    row = res["rows"][0]
    assert row["vocab"] == 4096 and row["constraint"] == "regex"
    assert row["dflash_chain"]["admitted"] == 2 * 8 and row["ddtree_b8"]["admitted"] >= 2
