"""``doctor --graphs --out``: the JSON names the code it checked when run from a checkout."""
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
