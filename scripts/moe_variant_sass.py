#!/usr/bin/env python3
"""Static sm_90 SASS of the fused MoE's gate-up and looped down with the opt-in kernel
variants (``GemmConfig.par_acc``, ``scale_once``), compiled ahead of time on a CPU: no GPU,
nothing timed.

Per tile and variant: the main loop's instructions per iteration and opcode mix
(``sass_loop_mix``), the longest chain of dependent ``HMMA`` in one iteration (an MMA whose
accumulator input is an earlier MMA's output), registers, spills and shared memory. What it
says about speed is only what those numbers imply; ``gpu_session.sh moepar`` times them.

    python scripts/moe_variant_sass.py --out bench_results/moe_variant_sass_s52.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from sass_loop_mix import cubin_sass, function_instructions, loops  # noqa: E402

_HMMA = re.compile(r"(?:@!?P\w+\s+)?HMMA\.\S+\s+R(\d+),\s*R\d+,\s*R\d+,\s*R(\d+)")
_DEST = re.compile(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s+R(\d+)\b")
# opcodes whose first register operand is not written (stores, branches, barriers, copies to
# shared memory, waits)
_NO_DEST = ("ST", "RED", "ATOM", "BRA", "BAR", "LDGSTS", "DEPBAR", "LDGDEPBAR", "EXIT", "NOP",
            "WARPSYNC", "ISETP", "FSETP", "PLOP3", "UISETP")


def hmma_chain(body: list[tuple[int, str]]) -> int:
    """The longest run of HMMAs in ``body`` (address, text), in program order, each taking the
    previous one's output register as its accumulator input (C operand) with no other write to
    it in between. (Register pairs and quads are tracked by their first register, as SASS
    names them.)"""
    depth: dict[int, int] = {}
    longest = 0
    for _, text in body:
        m = _HMMA.match(text.strip())
        if m:
            d, c = int(m.group(1)), int(m.group(2))
            depth[d] = depth.get(c, 0) + 1
            longest = max(longest, depth[d])
            continue
        m = _DEST.match(text.strip())
        if m and not m.group(1).split(".")[0].startswith(_NO_DEST):
            depth.pop(int(m.group(2)), None)
    return longest


def compile_variant(kind: str, bm: int, tiles: tuple, par_acc: int, scale_once: int,
                    half_m: bool = False, wide: bool = False) -> dict:
    from tests.triton_kernels._moe_kernels import load_moe
    import tests.triton_kernels.test_moe_w4a16_compile as aot

    moe = load_moe(interpret=False).moe
    tiles = tuple(tiles) + (0, 0, 1, 0)[len(tiles) - 4:] if len(tiles) < 8 else tuple(tiles)
    kern = aot._gemm(moe, kind, bm, tiles[:8] + (par_acc, scale_once) + tuple(tiles[10:11]),
                     half_m, wide)
    name = ("_gate_up_kernel" if kind == "gate_up" else
            "_down_loop_kernel" if tiles[4] else "_down_kernel")
    sass, usage = cubin_sass(kern.asm["cubin"])
    insns = function_instructions(sass, name)
    loop = max(loops(insns), key=lambda lp: lp["instructions"])
    lo, hi = int(loop["from"], 16), int(loop["to"], 16)
    regs = re.search(r"REG:(\d+)", usage)
    warps = tiles[2]
    return {"kind": kind, "block_m": bm, "tile": list(tiles[:8]), "half_m": half_m,
            "wide_halves": wide, **({"max_regs": tiles[10]} if tiles[10:11] else {}),
            "par_acc": par_acc, "scale_once": scale_once,
            "loop_instructions": loop["instructions"], "opcodes": loop["opcodes"],
            "hmma_chain": hmma_chain([(a, t) for a, t in insns if lo <= a <= hi]),
            "registers": int(regs.group(1)) if regs else None,
            "spills": "STACK:0" not in usage, "shared_bytes": kern.metadata.shared,
            "programs_per_sm": programs_per_sm(int(regs.group(1)) if regs else 255,
                                               kern.metadata.shared, warps)}


def programs_per_sm(regs: int, shared: int, warps: int) -> dict:
    """Programs of one kernel an H100 / H200 SM holds (sm_90): 65,536 registers with a thread's
    count rounded up to 8, 228 KB of shared memory with 1 KB reserved a program, 64 warps, 32
    programs; each bound and the least."""
    from tests.triton_kernels._sm90 import programs_by_registers

    by = {"registers": programs_by_registers(regs, warps),
          "shared_memory": 228 * 1024 // (shared + 1024), "warps": 64 // warps}
    return {**by, "programs": min(min(by.values()), 32)}


# the shipped table's small-M tiles (M = 8, 9-16 on 8-row blocks; 17-48 on 16-row half_m
# blocks; their looped down tiles), and two M = 8 gate-up candidates
DEFAULT_CASES = [
    ("gate_up", 8, (32, 256, 2, 3, 0, 1, 4, 256), False),
    # the same tile with the dequant in one piece (split_dq 0), and with 128-row K steps
    ("gate_up", 8, (32, 256, 2, 3, 0, 0, 4, 256), False),
    ("gate_up", 8, (32, 128, 2, 4, 0, 1, 4, 256), False),
    ("gate_up", 8, (64, 256, 4, 3, 0, 1, 4, 512), False),
    ("gate_up", 16, (64, 256, 4, 3, 0, 1, 4, 512), True),
    ("down", 8, (64, 256, 4, 3, 256, 0, 1, 0), False),
    ("down", 8, (64, 256, 4, 3, 512, 0, 1, 896), False),
]


# Two-width (half_m) kernels' resources (session 53): the M 9-48 bands' gate-up tile on 8-row
# blocks (the M 9-16 band as shipped), on 16-row half_m blocks (the M 17-48 bands as shipped),
# and on 16- / 32-row half_m blocks with MoeConfig.wide_halves; the M 17-48 bands' looped down
# on 8-row blocks, on 16-row half_m blocks, and there with scale_once (tiles' 10th field; the
# 11th: GemmConfig.max_regs)
WIDE_CASES = [
    ("gate_up", 8, (64, 256, 4, 3, 0, 1, 4, 512), False, False),
    ("gate_up", 16, (64, 256, 4, 3, 0, 1, 4, 512), True, False),
    ("gate_up", 16, (64, 256, 4, 3, 0, 1, 4, 512), True, True),
    ("gate_up", 16, (64, 256, 4, 3, 0, 1, 4, 512, 0, 0, 128), True, True),
    ("gate_up", 16, (64, 256, 4, 3, 0, 1, 2, 512), True, True),
    ("gate_up", 32, (64, 256, 4, 3, 0, 1, 4, 512), True, False),
    ("gate_up", 32, (64, 256, 4, 3, 0, 1, 4, 512), True, True),
    ("down", 8, (64, 256, 4, 3, 512, 0, 1, 0), False, False),
    ("down", 16, (64, 256, 4, 3, 512, 0, 1, 0), True, False),
    ("down", 16, (64, 256, 4, 3, 512, 0, 1, 0, 0, 1), True, False),
    ("down", 16, (64, 256, 4, 3, 512, 0, 1, 0), False, False),
    # register limits (GemmConfig.max_regs): the M = 8 band's looped down with 512-column
    # ranges (~854 programs at M = 8 on random routing: one wave at 7-8 programs an SM, 1.08 at
    # 6) and the M 9-16 band's gate-up
    ("down", 8, (64, 256, 4, 3, 512, 0, 1, 0, 0, 0, 72), False, False),
    ("down", 8, (64, 256, 4, 3, 512, 0, 1, 0, 0, 1, 64), False, False),
    ("gate_up", 8, (64, 256, 4, 3, 0, 1, 4, 512, 0, 1, 96), False, False),
]


def _par_once(mode: str, kind: str, tiles: tuple) -> list:
    """(par_acc, scale_once) pairs to compile a case with: every pair (the variant cases); the
    case's own 9th / 10th fields (the two-width cases); as served, then with scale_once where
    the kernel has it (the table; the per-tile down has not)."""
    if mode == "variants":
        return [(0, 0), (1, 0), (0, 1), (1, 1)]
    if mode == "wide":
        return [tuple(tiles[8:10]) or (0, 0)]
    return [(0, 0)] + ([(0, 1)] if kind == "gate_up" or tiles[4] else [])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", action="store_true",
                    help="every config the shipped table serves (each band's gate-up and down), "
                         "as served and with scale_once, instead of the variant cases")
    ap.add_argument("--wide", action="store_true",
                    help="the two-width kernels' cases (WIDE_CASES: wide_halves, and the half_m "
                         "down with scale_once) instead of par_acc / scale_once's")
    args = ap.parse_args(argv)
    rows = []
    mode = "table" if args.table else "wide" if args.wide else "variants"
    if args.table:
        import tests.triton_kernels.test_moe_w4a16_compile as aot

        cases = [(kind, bm, tuple(tiles[:8]), half, wide)
                 for kind, bm, tiles, half, wide in aot._shipped()]
    else:
        cases = WIDE_CASES if args.wide else [c + (False,) for c in DEFAULT_CASES]
    for kind, bm, tiles, half, wide in cases:
        for par, once in _par_once(mode, kind, tiles):
            r = compile_variant(kind, bm, tiles, par, once, half, wide)
            rows.append(r)
            print(f"{kind:<8} bm {bm:>2} {','.join(map(str, tiles)):<24} "
                  f"{'half_m ' if half else ''}{'wide_halves ' if wide else ''}par_acc {par} "
                  f"scale_once {once}: {r['loop_instructions']} instructions a loop, HMMA "
                  f"chain {r['hmma_chain']}, {r['registers']} registers, "
                  f"{r['shared_bytes']} B shared{', SPILLS' if r['spills'] else ''}, "
                  f"{r['programs_per_sm']['programs']} programs an SM")
    import triton

    result = {"command": " ".join([sys.executable] + sys.argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "versions": {"triton": triton.__version__}, "target": "sm_90 (AOT, no GPU)",
              "shapes": {"hidden": 7168, "inter": 256, "topk": 8}, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
