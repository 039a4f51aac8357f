"""``scripts/moe_table_variant.py``: the variant tables the device steps time against the
served one."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import moe_table_variant as mtv  # noqa: E402

from sglang_ddtree.triton_kernels import moe_config as mc  # noqa: E402

H100 = "NVIDIA H100 80GB HBM3"


def _band(table, max_m):
    return next(b for b in table["bands"] if b["max_m"] == max_m)


def test_spec_parses_bands_and_fields():
    assert mtv.parse_spec("32,48:block_m=32,gate_up.par_acc=0,down.n_per_cta=128") == (
        [32, 48], [(None, "block_m", 32), ("gate_up", "par_acc", 0), ("down", "n_per_cta", 128)])


@pytest.mark.parametrize("spec,words", [
    ("32", "BANDS:FIELD"), ("x:block_m=32", "max_m integers"), ("32:block_m", "FIELD=VALUE"),
    ("32:block_m=big", "not an integer"), ("32:gate_up.blok_n=32", "not a GemmConfig field"),
    ("32:block_n=32", "not a band field"), ("32:up.block_n=32", "only gate_up.F and down.F")])
def test_bad_specs_are_refused_with_the_reason(spec, words):
    with pytest.raises(ValueError, match=words):
        mtv.parse_spec(spec)


def test_only_the_named_fields_of_the_named_bands_change():
    base = mc.table_json(None, None)
    t = mtv.apply_specs(base, ["32,48:block_m=32,half_m=1,gate_up.num_stages=2",
                               "8:down.n_per_cta=512"])
    for b, old in zip(t["bands"], base["bands"]):
        want = json.loads(json.dumps(old))
        if b["max_m"] in (32, 48):
            want.update(block_m=32, half_m=1)
            want["gate_up"]["num_stages"] = 2
        if b["max_m"] == 8:
            want["down"]["n_per_cta"] = 512
        assert b == want
    assert base == mc.table_json(None, None)  # the base itself is left alone
    with pytest.raises(ValueError, match="no band max_m=33"):
        mtv.apply_specs(base, ["33:block_m=32"])


def _run(tmp_path, *args):
    out = tmp_path / "t.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "moe_table_variant.py"),
                        str(out), *args], capture_output=True, text=True, timeout=120)
    return r, out


def test_the_device_overrides_are_merged_first(tmp_path):
    # the H100 override gives the M = 8 band's down 128 columns; a variant of another field
    # keeps it, and the written table has no devices section left to re-apply
    r, out = _run(tmp_path, "8:gate_up.num_stages=4", "--device", H100)
    assert r.returncode == 0, r.stderr
    t = json.loads(out.read_text())
    assert "devices" not in t
    assert _band(t, 8)["down"] == _band(mc.table_json(None, H100), 8)["down"]
    assert _band(t, 8)["gate_up"]["num_stages"] == 4
    assert mc.select_config(8, str(out), None).gate_up.num_stages == 4


def test_a_table_the_loader_refuses_is_not_written(tmp_path):
    r, out = _run(tmp_path, "8:gate_up.split_k=4", "--base", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "missing" in r.stderr and not out.exists()
    # a removed tile option that is set: the loader refuses it, so nothing is written
    base = tmp_path / "base.json"
    raw = mc.table_json(None, None)
    _band(raw, 8)["gate_up"]["prefetch_ahead"] = 1
    base.write_text(json.dumps(raw))
    r, out = _run(tmp_path, "8:gate_up.num_stages=4", "--base", str(base), "--device", "")
    assert r.returncode == 2 and "prefetch_ahead" in r.stderr and not out.exists()


def test_no_spec_writes_the_table_a_card_is_served(tmp_path):
    """Without SPECs the table is written as ``--device``'s card is served it (the H100: with
    its split M 17-27 band), or as written for ``--device ''``: what gpu_session.sh moem28
    times against each other."""
    for device in (H100, ""):
        out = tmp_path / f"t{bool(device)}.json"
        assert mtv.main([str(out), "--device", device]) == 0
        table = json.loads(out.read_text())
        assert table["bands"] == mc.table_json(None, device or None)["bands"]
        for m in (8, 16, 27, 28, 32, 33):
            assert mc.select_config(m, str(out), None) == mc.select_config(m, None, device or None)
    assert [b["max_m"] for b in json.loads((tmp_path / "tTrue.json").read_text())["bands"]] != \
        [b["max_m"] for b in json.loads((tmp_path / "tFalse.json").read_text())["bands"]]
