"""scripts/tree_verify_static.py: the verify kernel compiled for sm_90 without a GPU (skipped
where the CUDA toolkit's ptxas or Triton's CUDA backend is missing, e.g. in CI). Runs the script
in its own process: this test session may have Triton's interpreter switched on."""

import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PTXAS = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"


def test_static_report_of_one_mha_config():
    pytest.importorskip("triton")
    if not os.path.exists(PTXAS):
        pytest.skip("no ptxas (CUDA toolkit)")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, os.path.join(HERE, "..", "scripts", "tree_verify_static.py"),
                        "--kind", "mha", "--configs", "64,64,4,2,2,64", "--ptxas", PTXAS],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    if "error" in row and ("backend" in row["error"].lower() or "cuda" in row["error"].lower()):
        pytest.skip(f"Triton cannot target CUDA here: {row['error']}")
    assert row.get("ptxas_error") is None, row
    assert row["registers"] and row["registers"] <= 255
    assert row["wgmma"] > 0 and row["mma_sync"] == 0  # Hopper tensor-core instructions
