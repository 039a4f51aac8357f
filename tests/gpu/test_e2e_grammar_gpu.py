"""GPU, real SGLang servers: grammar-constrained requests through ``scripts/e2e_grammar.py`` as
a pytest.

The tiny pair with its tokenizer and xgrammar; regex, JSON-schema, EBNF and unconstrained
prompts mixed in every batch; DDTREE (budgets 8 / 32) and DFLASH against the target's plain
greedy output token for token (a divergence passes only at a near tie of the target's own
log-probs of the two emitted tokens, printed with its gap), every constrained output checked
with xgrammar. Reduced: no speed phase, batch sizes 1 and 4. ``SGLANG_DDTREE_GRAMMAR_ARGS``
replaces the default arguments.
"""
from __future__ import annotations

import json
import os
import shlex
import sys

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_ARGS = "--budgets 8,32 --batch-sizes 1,4 --prompts 16 --speed-batch-sizes="


def test_grammar_requests_lossless(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import e2e_grammar

    out = tmp_path / "e2e_grammar.json"
    args = shlex.split(os.environ.get("SGLANG_DDTREE_GRAMMAR_ARGS", DEFAULT_ARGS))
    monkeypatch.setattr(sys, "argv", ["e2e_grammar.py", "--out", str(out),
                                      "--workdir", str(tmp_path / "work"), *args])
    with pytest.raises(SystemExit) as done:
        e2e_grammar.main()
    res = json.loads(out.read_text())
    print(json.dumps({"summary": res.get("summary"), "errors": res["errors"]}, indent=1))
    assert not res["errors"], res["errors"]
    assert res["summary"]["ddtree_runs"] == 4 and res["summary"]["ddtree_mismatches"] == 0
    assert res["summary"]["constrained_outputs_rejected_by_grammar"] == 0
    assert done.value.code == 0
