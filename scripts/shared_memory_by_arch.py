#!/usr/bin/env python
"""Shared memory (and, where ptxas reports it, registers) of the served Triton kernels, compiled
on any machine for the GPU archs named (no GPU needed): the MLA verify tiles (32 and 16 rows,
through scripts/tree_verify_static.py), the skinny GEMM's default tiles at 16 / 32 / 64 rows
(its launch stages and 4), and the fused MoE's shipped config table. It is the record behind
the planners' shared-memory rules (tree_attention_plan._MLA_TILE_SMEM, skinny_gemm.launch_stages).

    python scripts/shared_memory_by_arch.py --archs 80,86,89,90,100,103,120 \\
        --out bench_results/shared_memory_by_arch_s31.json
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
os.environ["TRITON_INTERPRET"] = "0"


def _compiler(arch: int):
    """The compile tests' harness (tests/triton_kernels/_sm90.py) for another arch."""
    from tests.triton_kernels._sm90 import compile_sm90

    return functools.partial(compile_sm90, arch=arch)


def mla_rows(arch: int) -> list:
    import tree_verify_static as tvs

    return [tvs.analyse("mla", cfg, arch, tvs.bundled_ptxas(arch), budget=32, min_split_keys=128)
            for cfg in ([32, 64, 4, 2], [16, 64, 4, 2])]


def skinny_rows(arch: int) -> list:
    import tests.triton_kernels.test_skinny_gemm_compile as skc
    from tests.triton_kernels import load_copy

    sg = load_copy("skinny", ("skinny_gemm",), interpret=False)["skinny_gemm"]
    skc.compile_sm90 = _compiler(arch)  # _compile passes the strides as div16
    rows = []
    for n, k in skc.CASES:
        cfg = sg.default_config(n, k, sms=132)
        for block_m in (16, 32, 64):
            for stages in sorted({sg.launch_stages(cfg, block_m), 4}):
                kern = skc._compile(sg, n, k, block_m, cfg, stages=stages)
                rows.append({"n": n, "k": k, "block_m": block_m, "num_stages": stages,
                             "launch_stages": stages == sg.launch_stages(cfg, block_m),
                             "shared_bytes": kern.metadata.shared})
    return rows


def moe_rows(arch: int) -> list:
    import tests.triton_kernels.test_moe_w4a16_compile as aot
    from tests.triton_kernels._moe_kernels import load_moe

    moe = load_moe(interpret=False).moe
    aot._compile = _compiler(arch)
    return [{"kind": kind, "block_m": bm, "tiles": list(tiles), "half_m": bool(half_m),
             **({"wide_halves": True} if wide else {}),
             "shared_bytes": aot._gemm(moe, kind, bm, tiles, half_m, wide).metadata.shared}
            for kind, bm, tiles, half_m, wide in aot._shipped()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default="80,86,89,90,100,103,120")
    ap.add_argument("--skinny-archs", default="90", help="the skinny GEMM's wgmma path is sm_90's")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import triton

    archs = [int(a) for a in args.archs.split(",")]
    result = {"command": " ".join([sys.executable] + (sys.argv if argv is None else
                                                      [__file__] + list(argv))),
              "triton": triton.__version__, "gpu": "none (ahead-of-time compiles)",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "mla": {}, "moe": {}, "skinny": {}}
    for arch in archs:
        result["mla"][arch] = mla_rows(arch)
        result["moe"][arch] = moe_rows(arch)
        print(f"sm_{arch}: MLA " + ", ".join(f"{r['config']} {r['shared_bytes']} B"
                                             for r in result["mla"][arch])
              + f"; MoE table at most {max(r['shared_bytes'] for r in result['moe'][arch])} B",
              flush=True)
    for arch in (int(a) for a in args.skinny_archs.split(",") if a):
        result["skinny"][arch] = skinny_rows(arch)
        for r in result["skinny"][arch]:
            print(f"sm_{arch} skinny {r['n']}x{r['k']} rows {r['block_m']} stages "
                  f"{r['num_stages']}: {r['shared_bytes']} B", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
