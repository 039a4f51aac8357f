"""scripts/merge_bench_e2e.py: one table from bench_e2e runs split over device calls."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import merge_bench_e2e as mb  # noqa: E402


def run(concs, mode="greedy", digest="d1", date="2026-11-30T10:00"):
    res = {m: {mode: {str(c): {"tokens_per_s": 100.0 * c, "accept_length": 2.0}
                      for c in concs}} for m in ("dflash", "ddtree_b32")}
    return {"gpu": "H200", "sglang_version": "0.5.17", "target": "t", "draft": "d",
            "max_new_tokens": 128, "repeats": 3, "date": date, "command": f"bench {concs}",
            "source_digest": digest, "results": res, "errors": {},
            "startup_s": {"dflash": 70.0}, "cpu_stage_ms_per_step": {"ddtree_b32": {"tree": .1}}}


def test_merges_concurrencies_and_modes(tmp_path):
    a, b, c = run([1, 4]), run([16, 64], date="2026-11-30T09:00"), run([1, 4], mode="t1")
    files = []
    for i, r in enumerate((a, b, c)):
        p = tmp_path / f"{i}.json"
        p.write_text(json.dumps(r))
        files.append(str(p))
    out = tmp_path / "m.json"
    assert mb.main(files + ["-o", str(out)]) == 0
    m = json.loads(out.read_text())
    assert sorted(m["results"]["ddtree_b32"]["greedy"], key=int) == ["1", "4", "16", "64"]
    assert sorted(m["results"]["dflash"]["t1"], key=int) == ["1", "4"]
    assert m["date"] == "2026-11-30T09:00" and len(m["merged_from"]) == 3
    assert m["source_digest"] == "d1"
    assert "dflash" in m["startup_s"] and "ddtree_b32" in m["cpu_stage_ms_per_step"]


def test_refuses_overlaps_and_different_setups():
    with pytest.raises(ValueError, match="c=4 is in two inputs"):
        mb.merge([run([1, 4]), run([4, 8])], ["a", "b"])
    other = run([8])
    other["max_new_tokens"] = 96
    with pytest.raises(ValueError, match="max_new_tokens"):
        mb.merge([run([1]), other], ["a", "b"])
    assert mb.merge([run([1]), run([2], digest="d2")], ["a", "b"])["source_digest"] == \
        "differs between inputs"
