"""scripts/bench_moe_read_ceiling.py's read kernels under Triton's interpreter (a subprocess, so
that this process's triton mode is left alone): each program's XOR fold equals the fold of the
bytes it is meant to read (one contiguous chunk; a column slice of a K range of packed rows)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHECK = r"""
import sys
sys.path.insert(0, "scripts")
import torch
import bench_moe_read_ceiling as m

def fold(t):
    r = 0
    for v in t.reshape(-1).tolist():
        r ^= v
    return r

rows, n = 16, 64
w = torch.randint(-2**31, 2**31 - 1, (5, rows, n), dtype=torch.int32)
ids = torch.tensor([1, 3], dtype=torch.int32)
out = torch.zeros(64, dtype=torch.int32)
m._read_contiguous[(2, 4)](w, ids, out, EXPERT_WORDS=rows * n, CHUNK=rows * n // 4, BLOCK=64)
want = [fold(w[e].reshape(-1)[c * 256:(c + 1) * 256]) for e in (1, 3) for c in range(4)]
assert out[:8].tolist() == want, "contiguous"
out.zero_()
# 2 column tiles of 32 x 2 K parts of 8 rows: tile t = (K part t // 2, columns (t % 2) * 32)
m._read_row_slices[(2, 4)](w, ids, out, ROWS=rows, N=n, COLS=32, SPLIT=2, BLOCK_R=4)
want = [fold(w[e, (t // 2) * 8:(t // 2) * 8 + 8, (t % 2) * 32:(t % 2) * 32 + 32])
        for e in (1, 3) for t in range(4)]
assert out[:8].tolist() == want, "row_slices"
print("ok")
"""


def test_read_kernels_fold_the_bytes_they_name():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
