#!/usr/bin/env python3
"""Digests of the sm_90 PTX of every fused-MoE GEMM config (gate-up and down) the shipped
table serves (and of the split-K reduce kernel), compiled ahead of time on a CPU, with debug
line info and labels stripped: two checkouts whose digests match launch the same code, so a
refactor of the kernels can be checked for "no change to what is served" without a GPU.

    python scripts/moe_ptx_digest.py            # in each checkout, then compare the lines
"""
from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.triton_kernels._moe_kernels import load_moe  # noqa: E402
import tests.triton_kernels.test_moe_w4a16_compile as aot  # noqa: E402


def normalized(ptx: str) -> str:
    """PTX without line info, comments, debug sections, labels and kernel names."""
    keep = []
    for line in ptx.splitlines():
        t = line.strip()
        if not t or t.startswith((".loc", ".file", "//", ".section", ".b8", ".b32", ".b64")):
            continue
        if t.startswith("$L__") and t.endswith(":"):
            continue
        keep.append(re.sub(r"_(gate_up|down)_\w*", "K", t))
    return "\n".join(keep)


def main() -> int:
    moe = load_moe(interpret=False).moe
    for kind, bm, tiles, half_m in aot._shipped():
        ptx = aot._gemm(moe, kind, bm, tiles, half_m).asm["ptx"]
        print(kind, bm, tiles, "half_m" if half_m else "",
              hashlib.sha1(normalized(ptx).encode()).hexdigest()[:12])
    sig = {"part_ptr": "*fp32", "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32",
           "h_ptr": "*bf16", "T": "i32", "part_rows": "i32"}
    for split in (2, 4, 8):
        ptx = aot._compile(moe._gate_up_reduce_kernel, sig,
                           dict(I=aot.I, SPLIT_K=split, BLOCK_M=16, BLOCK_C=128, DOWN_BLOCK_K=256,
                                SPLIT_TARGET=0, NUM_N=4, KS=28),
                           4, 1).asm["ptx"]
        print("reduce", split, hashlib.sha1(normalized(ptx).encode()).hexdigest()[:12])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
