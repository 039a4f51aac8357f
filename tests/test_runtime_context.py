"""``compat._common.ensure_runtime_context``: SGLang kernels called outside a server (the MoE
benchmark's Triton baseline, its GPU comparison test) need SGLang's published config. Run in a
subprocess: publishing is process-wide."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests" / "gpu" / "models" / "mla-moe-target"

SCRIPT = f"""
from sglang.srt import runtime_context as rc
from sglang_ddtree.compat._common import ensure_runtime_context
try:
    rc.get_exec()
    raise SystemExit("published before the call")
except ValueError as e:
    assert "not published" in str(e), e
assert ensure_runtime_context({str(MODEL)!r}, device='cpu') is True
rc.get_exec().moe  # the namespace SGLang's Triton MoE reads
assert ensure_runtime_context({str(MODEL)!r}, device='cpu') is False  # already published: left alone
print("ok")
"""


def test_publishes_once_so_standalone_sglang_kernels_can_read_config():
    pytest.importorskip("sglang.srt.runtime_context")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
