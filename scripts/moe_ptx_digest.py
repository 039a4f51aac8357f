#!/usr/bin/env python3
"""Digests of the sm_90 PTX of every fused-MoE GEMM config (gate-up and down) the shipped
table serves (and of the split-K reduce kernel and the grouping launches), compiled ahead of
time on a CPU, with debug line info and labels stripped: two checkouts whose digests match
launch the same code, so a refactor of the kernels can be checked for "no change to what is
served" without a GPU.

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
    for kind, bm, tiles, half_m, *wide in aot._shipped():
        wide = bool(wide and wide[0])  # (older checkouts' _shipped() has no wide field)
        ptx = aot._gemm(moe, kind, bm, tiles, half_m, *([wide] if wide else [])).asm["ptx"]
        print(kind, bm, tiles, "half_m" if half_m else "", *(["wide_halves"] if wide else []),
              hashlib.sha1(normalized(ptx).encode()).hexdigest()[:12])
    sig = {"part_ptr": "*fp32", "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32",
           "h_ptr": "*bf16", "T": "i32", "part_rows": "i32"}
    for split in (2, 4, 8):
        ptx = aot._compile(moe._gate_up_reduce_kernel, sig,
                           dict(I=aot.I, SPLIT_K=split, BLOCK_M=16, BLOCK_C=128, DOWN_BLOCK_K=256,
                                SPLIT_TARGET=0, NUM_N=4, KS=28),
                           4, 1).asm["ptx"]
        print("reduce", split, hashlib.sha1(normalized(ptx).encode()).hexdigest()[:12])
    for name, sig, const, warps in _grouping_kernels():
        ptx = aot._compile(getattr(moe, name), sig, const, warps, 1).asm["ptx"]
        print(name, sorted(const.items()), hashlib.sha1(normalized(ptx).encode()).hexdigest()[:12])
    return 0


def _grouping_kernels():
    """(kernel name, signature, constexprs, warps) of the grouping launches at Kimi's 384
    experts as the wrapper sizes them for M = 1, 8 and 300 (one launch) and 2,048 (two)."""
    prologue = {"topk_ids_ptr": "*i32", "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32",
                "x_ptr": "*bf16", "xp_ptr": "*bf16", "T": "i32", "max_blocks": "i32",
                "stride_xm": "i32"}
    base = dict(NUM_EXPERTS=384, E_PAD=512, K=aot.H, COPY_FIRST=False, COPY_PROGS=1)
    for bm, block_t, n_t, block_b, block_k in ((16, 16, 1, 16, 128), (8, 64, 1, 16, 256),
                                               (16, 1024, 3, 16, 256), (32, 1024, 3, 16, 128)):
        yield "_prologue_kernel", prologue, dict(base, BLOCK_M=bm, BLOCK_T=block_t,
                                                 NUM_T_BLOCKS=n_t, BLOCK_B=block_b,
                                                 BLOCK_K=block_k), 4
    count = {"topk_ids_ptr": "*i32", "counts_ptr": "*i32", "x_ptr": "*bf16", "xp_ptr": "*bf16",
             "T": "i32", "stride_xm": "i32"}
    yield "_align_count_kernel", count, dict(NUM_EXPERTS=384, E_PAD=512, CH=1024, NUM_CH=16,
                                             K=aot.H, BLOCK_K=128, COPY_PROGS=7), 4
    place = {"topk_ids_ptr": "*i32", "counts_ptr": "*i32", "base_ptr": "*i32",
             "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "T": "i32",
             "max_blocks": "i32"}
    yield "_align_place_kernel", place, dict(NUM_EXPERTS=384, E_PAD=512, BLOCK_M=64, CH=1024,
                                             NUM_CH=16, BLOCK_B=64), 4


if __name__ == "__main__":
    raise SystemExit(main())
