#!/usr/bin/env python3
"""Static SASS of the served fused-MoE gate-up kernel's K loop, SGLang's packing against the
grouped layout (``w13_layout="grouped"``, ``triton_kernels/moe_layout.py``), compiled ahead of
time for sm_90 on a CPU (no GPU, nothing timed): instructions a warp issues per K step, their
opcodes, registers and shared memory, per tile (``--tiles``: block_n, block_k, warps, stages,
split_k, split_target, block_m). With the dynamic count of a call (K steps x warps x live
tiles), the lower bound on its issue time: the H200 issues one instruction a cycle per
scheduler, 4 schedulers an SM, 132 SMs.

    python scripts/moe_gate_up_sass.py --out bench_results/moe_gate_up_sass_s51.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import triton  # noqa: E402

from scripts.sass_loop_mix import function_instructions, loops  # noqa: E402
from tests.triton_kernels._moe_kernels import load_moe  # noqa: E402
from tests.triton_kernels._sm90 import compile_sm90  # noqa: E402

H, I, TOPK = 7168, 256, 8
DEFAULT_TILES = ["32,256,2,3,4,256,8", "64,256,4,3,4,512,8", "64,256,4,3,4,512,16"]


def _tool(name: str) -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def probe(moe, tile, grouped: bool) -> dict:
    bn, bk, warps, stages, split_k, target, bm = tile
    sig = {"xp_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "sorted_ids_ptr": "*i32",
           "block_expert_ptr": "*i32", "h_ptr": "*bf16", "part_ptr": "*fp32",
           "cnt_ptr": "*i32", "T": "i32", "part_rows": "i32"}
    const = dict(K=H, I=I, TOPK=TOPK, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOWN_BLOCK_K=256,
                 PORTABLE=False, SPLIT_DQ=True, SPLIT_K=split_k, HALF_M=False,
                 SERIAL=split_k > 1, SPLIT_TARGET=target, NUM_EXPERTS=384 if target else 0,
                 GROUPED=grouped)
    kern = compile_sm90(moe._gate_up_kernel, sig, const, warps, stages)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kern.asm["cubin"])
        sass = subprocess.run([str(_tool("cuobjdump")), "-sass", str(cubin)], check=True,
                              capture_output=True, text=True).stdout
        usage = subprocess.run([str(_tool("cuobjdump")), "--dump-resource-usage", str(cubin)],
                               check=True, capture_output=True, text=True).stdout
    body = max(loops(function_instructions(sass, "_gate_up_kernel")),
               key=lambda lp: lp["instructions"])  # the K loop (the split-K sum loop is short)
    return {"layout": "grouped" if grouped else "sglang",
            "tile": dict(zip(("block_n", "block_k", "warps", "stages", "split_k",
                              "split_target", "block_m"), tile)),
            "loop_instructions_per_warp": body["instructions"], "opcodes": body["opcodes"],
            "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "spills": "STACK:0" not in usage, "shared_bytes": kern.metadata.shared}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", nargs="+", default=DEFAULT_TILES)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    moe = load_moe(interpret=False).moe
    rows = []
    for spec in args.tiles:
        tile = tuple(int(v) for v in spec.split(","))
        for grouped in (False, True):
            row = probe(moe, tile, grouped)
            rows.append(row)
            print(f"{spec:<22} {row['layout']:<8} {row['loop_instructions_per_warp']:>4} a K "
                  f"step a warp, {row['registers']} registers, {row['shared_bytes']} B shared",
                  flush=True)
    result = {"command": " ".join([sys.executable] + sys.argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "versions": {"triton": triton.__version__}, "target": "sm_90 (AOT, no GPU)",
              "shapes": {"hidden": H, "inter": I, "topk": TOPK}, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
