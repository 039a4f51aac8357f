"""``doctor --graphs``: the JSON names the code it checked when run from a checkout, and its
cases (draft, MHA, MLA) pass against the fp32 reference on CPU (Triton's interpreter)."""
from __future__ import annotations

import json
import os

from sglang_ddtree import doctor
from sglang_ddtree.provenance import source_digest


def test_json_records_settings_and_the_checkouts_source_digest(tmp_path):
    out = tmp_path / "sub" / "doctor.json"
    doctor._write_json(str(out), [], dict(budgets=[4], batch_sizes=[1]))
    data = json.loads(out.read_text())
    assert data["results"] == []
    meta = data["meta"]
    assert meta["command"] == "sglang-ddtree doctor --graphs"
    assert meta["settings"] == dict(budgets=[4], batch_sizes=[1])
    # the checkout the package was imported from (an installed wheel records none)
    root = os.path.dirname(os.path.dirname(os.path.abspath(doctor.__file__)))
    if os.path.isfile(os.path.join(root, "pyproject.toml")):
        assert meta["source_digest"] == source_digest(root)
    else:
        assert "source_digest" not in meta


# --- the cases themselves on CPU (Triton's interpreter; capture / replay as plain calls) ------

import pytest  # noqa: E402


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from tests.triton_kernels import load_kernels

    k = load_kernels(interpret=True)
    # the doctor imports the installed package's kernels: point those names at the
    # interpreter-loaded copies (module table and package attribute: a GPU session may have
    # imported the compiled ones already)
    import importlib
    import sys

    pkg = importlib.import_module("sglang_ddtree.triton_kernels")
    for name in ("reference", "tree_attention", "tree_attention_mla"):
        monkeypatch.setitem(sys.modules, f"sglang_ddtree.triton_kernels.{name}", getattr(k, name))
        monkeypatch.setattr(pkg, name, getattr(k, name), raising=False)
    return k


@pytest.mark.parametrize("kernel,budget", [("draft", 8), ("draft", 5), ("draft", 24), ("mha", 4),
                                           ("mla", 3)])
def test_case_passes_against_the_reference_on_cpu(interpret, monkeypatch, kernel, budget):
    monkeypatch.setitem(doctor.MHA_SHAPE, "num_q_heads", 4)  # small shapes for the interpreter
    monkeypatch.setitem(doctor.MHA_SHAPE, "num_kv_heads", 2)
    monkeypatch.setitem(doctor.MHA_SHAPE, "head_dim", 16)
    monkeypatch.setitem(doctor.DRAFT_SHAPE, "num_q_heads", 4)
    monkeypatch.setitem(doctor.DRAFT_SHAPE, "head_dim", 16)
    monkeypatch.setitem(doctor.MLA_SHAPE, "num_heads", 2)
    monkeypatch.setitem(doctor.MLA_SHAPE, "kv_lora_rank", 32)
    monkeypatch.setitem(doctor.MLA_SHAPE, "rope_dim", 16)
    r = doctor._check_case(kernel, budget, 2, max_context=40, page_size=4, trials=2, seed=3,
                           device="cpu")
    assert r.status == "pass", r
    assert r.trials == 2 and r.graph_vs_eager_equal and r.rel_err_vs_reference < 2e-2
    assert r.extra["tile"] == "16x16/1w"  # the tile the kernel ran (the CPU's), in its row
    assert "tile 16x16/1w" in doctor._row(r)


def test_draft_case_uses_the_block_mask(interpret, monkeypatch):
    """A draft row's N is its block size and its mask all ones: with the tree masks of a verify
    instead (random trees), the drafter's reference would not match."""
    monkeypatch.setitem(doctor.DRAFT_SHAPE, "num_q_heads", 4)
    monkeypatch.setitem(doctor.DRAFT_SHAPE, "head_dim", 16)
    seen = []
    real = interpret.reference.tree_attention_reference

    def spy(q, k, v, loc, mask, **kw):
        seen.append((q.shape[0], bool(mask.all())))
        return real(q, k, v, loc, mask, **kw)

    monkeypatch.setattr(interpret.reference, "tree_attention_reference", spy)
    r = doctor._check_case("draft", 6, 2, max_context=20, page_size=4, trials=1, seed=1,
                           device="cpu")
    assert r.status == "pass" and seen == [(2 * 6, True)]
    assert "draft" in doctor.default_kernels()


def test_draft_case_at_the_kimi_drafters_shape_takes_the_split_path(interpret):
    """The real shape (8 q heads on 1 KV head, d 128, block 16) over 2,000 keys: split-K and its
    reduce on the interpreter's small machine, within tolerance of the reference."""
    r = doctor._check_case("draft", 16, 1, max_context=2000, page_size=16, trials=1, seed=16,
                           device="cpu")
    assert r.status == "pass", r
    assert r.num_splits > 1


def test_plan_context_sets_the_split_count_as_a_server_plans_it(interpret, monkeypatch):
    """Planned for a long context (a server's --context-length), a short replay still takes the
    split path a server launches (most splits empty) and passes; planned for max_context only,
    40 keys allow one split."""
    monkeypatch.setitem(doctor.DRAFT_SHAPE, "num_q_heads", 4)
    monkeypatch.setitem(doctor.DRAFT_SHAPE, "head_dim", 16)
    short = doctor._check_case("draft", 6, 2, max_context=40, page_size=4, trials=1, seed=1,
                               device="cpu")
    served = doctor._check_case("draft", 6, 2, max_context=40, page_size=4, trials=1, seed=1,
                                device="cpu", plan_context=doctor.DEFAULT_PLAN_CONTEXT)
    assert short.num_splits == 1 and served.num_splits > 1, (short, served)
    assert short.status == served.status == "pass", (short, served)


@pytest.mark.parametrize("page", [1, 4])
def test_fa3_prefix_case_on_cpu(interpret, monkeypatch, page):
    """mha_fa3 rows: the prefix through FA3's contract (a torch stand-in here), prepared from
    the verify backend's kind of snapshot, the tree keys on our kernel; one split."""
    import sglang_ddtree.mha_prefix as mha_prefix
    from tests._fa3_standin import torch_fa3

    monkeypatch.setattr(mha_prefix, "load_fa3", lambda: torch_fa3)
    monkeypatch.setitem(doctor.MHA_SHAPE, "num_q_heads", 4)
    monkeypatch.setitem(doctor.MHA_SHAPE, "num_kv_heads", 2)
    monkeypatch.setitem(doctor.MHA_SHAPE, "head_dim", 16)
    r = doctor._check_case("mha_fa3", 5, 2, max_context=40, page_size=page, trials=2, seed=7,
                           device="cpu")
    assert r.status == "pass", r
    assert r.num_splits == 1 and r.extra["page_size"] == page
