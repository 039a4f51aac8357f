"""GPU, real SGLang servers: the lossless suite of ``scripts/e2e_lossless.py`` as a pytest.

DDTREE greedy output equals the target's plain greedy output token for token (a divergence
passes only at a near tie of the target's own logits, printed with its gap), at batch sizes 1, 4
and 16, with stop-token / max_new_tokens edge checks, T > 0 runs, the KV pool back to idle, CUDA
graph on and off, and a deterministic AR + DDTREE pair for seeded T > 0. The script is the one
``scripts/gpu_session.sh e2e`` runs; this test runs it with a reduced default case set (about
eight minutes on an H200) and fails on any counted failure. ``SGLANG_DDTREE_E2E_ARGS`` replaces
the default arguments (e.g. the script's own defaults: ``SGLANG_DDTREE_E2E_ARGS=""``).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_ARGS = ("--cases tiny:8,32;mla:8,32 --eager-check tiny:32 --speed= "
                "--deterministic tiny:32 --repeats 1")


def test_lossless_suite(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "_ddtree_e2e_lossless_suite", os.path.join(ROOT, "scripts", "e2e_lossless.py"))
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    out = tmp_path / "e2e_lossless.json"
    args = shlex.split(os.environ.get("SGLANG_DDTREE_E2E_ARGS", DEFAULT_ARGS))
    monkeypatch.setattr(sys, "argv", ["e2e_lossless.py", "--out", str(out),
                                      "--workdir", str(tmp_path / "work"), *args])
    rc = e2e.main()
    res = json.loads(out.read_text())
    print(json.dumps({"failures": res["failures"], "cases": len(res["cases"]),
                      "mean_accept_length": res["mean_accept_length"],
                      "errors": res.get("errors")}, indent=1))
    assert res["cases"], "no case ran"
    assert not any(res["failures"].values()), res["failures"]
    assert rc == 0
