#!/usr/bin/env python3
"""Static SASS of the fused MoE gate-up's K step in other dequantization layouts (sm_90,
compiled ahead of time on a CPU: no GPU, nothing timed).

Why: at M = 8 the gate-up issues about 680 instructions a warp per K step of a 32-column tile
(2,048 packed words, gate and up), 16 a word of them dequantization (``sass_loop_mix.py``;
``bench_results/README.md`` "Session 37"). The shipped step (``planes``) dequantizes nibble
planes: one bf16x2 holds nibble j of two words (a ``prmt`` pairs them), and each pair is
offset (``fma`` -136) and scaled (``fma`` by the scale) before the MMA. The variants here pair
nibbles j and j + 4 of one word in one bf16x2 (one ``lop3`` after a shift, no ``prmt``), run
one group of 32 input rows per two m16n8k16 dots, and scale each group's fp32 dot after the
MMA (``acc += dot * s``), so the per-word ``HMUL2`` goes; the activations would be copied in
the matching order (within each 32-row group, position ``16 d + 4 r + 2 p + h`` holds input
row ``8 r + 2 d + p + 4 h``). Variants:

* ``groups_per_load``: each group's words, scales and activations loaded on their own;
* ``groups``: the K tile's words and scales loaded once as ``[BN, 4, 2, 2, 2]`` / ``[BN, 2, 2,
  2]`` and split into groups in registers;
* ``groups_f32_scales``: the same with fp32 scales stored ``[N, K / 32]`` (a load-time repack
  that would double the scale bytes: a bound, not a plan);
* ``groups_no_offset``: no -136 ``fma`` (the offset subtracted after the MMA from per-group row
  sums of the activations), fp32 scales.

Each variant computes one expert tile over K = 7,168 at the M = 8 band's tile (32 x 256, 2 warps,
3 stages, 8-row blocks) unless told otherwise; the loop's instruction mix (``sass_loop_mix``),
registers and shared memory go to JSON. Only ``planes`` is the served code (``_mma8``).

    python scripts/probe_moe_dequant_sass.py --out bench_results/moe_dequant_sass_probe_s49.json
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

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from scripts.sass_loop_mix import cubin_sass, function_instructions, loops  # noqa: E402
from sglang_ddtree.triton_kernels.moe_tiles import _mma8  # noqa: E402
from tests.triton_kernels._sm90 import compile_sm90  # noqa: E402


def _pair_ptx(j: int, offset: bool) -> str:
    """Nibbles j and j + 4 of a word -> bf16x2 (128 + n_j, 128 + n_j+4), minus 136 if
    ``offset`` (then exactly (q_j, q_j+4)); returned as two bf16 halves."""
    lines = [".reg .b32 t, one, bias;", "mov.b32 one, 0x3F803F80;", "mov.b32 bias, 0xC308C308;",
             f"shr.u32 t, $2, {4 * j};" if j else "mov.b32 t, $2;",
             "lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;"]
    if offset:
        lines.append("fma.rn.bf16x2 t, t, one, bias;")
    lines.append("mov.b32 {$0, $1}, t;")
    return "{\n" + "\n".join(lines) + "\n}"


_P = [tl.constexpr(_pair_ptx(j, True)) for j in range(4)]
P0, P1, P2, P3 = _P
_R = [tl.constexpr(_pair_ptx(j, False)) for j in range(4)]
R0, R1, R2, R3 = _R


@triton.jit
def _pairs(w, PTX: tl.constexpr):
    return tl.inline_asm_elementwise(PTX, "=h,=h,r", [w], dtype=(tl.bfloat16, tl.bfloat16),
                                     is_pure=True, pack=1)


@triton.jit
def _operand(w, PA: tl.constexpr, PB: tl.constexpr, BN: tl.constexpr):
    """[BN, 4] words -> the [BN, 16] A operand of one dot: word r, pair p, half h at 4 r + 2 p + h."""
    lo0, hi0 = _pairs(w, PA)
    lo1, hi1 = _pairs(w, PB)
    return tl.reshape(tl.join(tl.join(lo0, lo1), tl.join(hi0, hi1)), [BN, 16])


@triton.jit
def _split8(t):
    """[..., 2, 2, 2] -> its 8 slices in order 4 a + 2 b + c."""
    t0, t1 = tl.split(t)
    t00, t01 = tl.split(t0)
    t10, t11 = tl.split(t1)
    a0, a4 = tl.split(t00)
    a2, a6 = tl.split(t01)
    a1, a5 = tl.split(t10)
    a3, a7 = tl.split(t11)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _group(acc_g, acc_u, wg, wu, sg, su, xs, xb, BN: tl.constexpr, OFFSET: tl.constexpr):
    """One 32-row group of gate and up: two dots each, scaled (and offset) after the MMA."""
    a0 = tl.load(xb)
    a1 = tl.load(xb + 16)
    if OFFSET:
        pg = tl.dot(_operand(wg, P0, P1, BN), a0)
        pg = tl.dot(_operand(wg, P2, P3, BN), a1, pg)
        pu = tl.dot(_operand(wu, P0, P1, BN), a0)
        pu = tl.dot(_operand(wu, P2, P3, BN), a1, pu)
    else:
        pg = tl.dot(_operand(wg, R0, R1, BN), a0)
        pg = tl.dot(_operand(wg, R2, R3, BN), a1, pg)
        pu = tl.dot(_operand(wu, R0, R1, BN), a0)
        pu = tl.dot(_operand(wu, R2, R3, BN), a1, pu)
        pg += xs[None, :] * -136.0
        pu += xs[None, :] * -136.0
    acc_g += pg * sg.to(tl.float32)[:, None]
    acc_u += pu * su.to(tl.float32)[:, None]
    return acc_g, acc_u


@triton.jit
def probe_planes(w_ptr, s_ptr, x_ptr, xs_ptr, out_ptr, K: tl.constexpr, N2: tl.constexpr,
                 BN: tl.constexpr, BM: tl.constexpr, BLOCK_K: tl.constexpr):
    KP: tl.constexpr = BLOCK_K // 8
    offs_n = tl.arange(0, BN)
    offs_r = tl.arange(0, KP)
    m = tl.arange(0, BM)
    w_ptrs = w_ptr + offs_r[None, :] * N2 + offs_n[:, None]
    s_ptrs = s_ptr + (offs_r[None, :] // 4) * N2 + offs_n[:, None]
    x_ptrs = x_ptr + m[None, :] * K + offs_r[:, None]
    x_mask = m[None, :] < BM
    acc_g = tl.zeros([BN, BM], dtype=tl.float32)
    acc_u = tl.zeros([BN, BM], dtype=tl.float32)
    for _ in range(0, K // BLOCK_K):
        acc_g, acc_u, _, _ = _mma8(acc_g, acc_u, acc_g, acc_u, tl.load(w_ptrs), tl.load(s_ptrs),
                                   tl.load(w_ptrs + N2 // 2), tl.load(s_ptrs + N2 // 2), x_ptrs,
                                   x_mask, KP, True, False, True)
        x_ptrs += BLOCK_K
        w_ptrs += KP * N2
        s_ptrs += (BLOCK_K // 32) * N2
    o = out_ptr + offs_n[:, None] * BM + m[None, :]
    tl.store(o, acc_g)
    tl.store(o + BN * BM, acc_u)


@triton.jit
def probe_groups_per_load(w_ptr, s_ptr, x_ptr, xs_ptr, out_ptr, K: tl.constexpr,
                          N2: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    offs_n = tl.arange(0, BN)
    r4 = tl.arange(0, 4)
    k16 = tl.arange(0, 16)
    m = tl.arange(0, BM)
    acc_g = tl.zeros([BN, BM], dtype=tl.float32)
    acc_u = tl.zeros([BN, BM], dtype=tl.float32)
    G: tl.constexpr = BLOCK_K // 32
    for ks in range(0, K // BLOCK_K):
        for g in tl.static_range(G):
            wp = w_ptr + (ks * (BLOCK_K // 8) + g * 4 + r4[None, :]) * N2 + offs_n[:, None]
            sp = s_ptr + (ks * G + g) * N2 + offs_n
            xb = x_ptr + m[None, :] * K + ks * BLOCK_K + g * 32 + k16[:, None]
            acc_g, acc_u = _group(acc_g, acc_u, tl.load(wp), tl.load(wp + N2 // 2), tl.load(sp),
                                  tl.load(sp + N2 // 2), 0.0, xb, BN, True)
    o = out_ptr + offs_n[:, None] * BM + m[None, :]
    tl.store(o, acc_g)
    tl.store(o + BN * BM, acc_u)


@triton.jit
def probe_groups(w_ptr, s_ptr, x_ptr, xs_ptr, out_ptr, K: tl.constexpr, N2: tl.constexpr,
                 BN: tl.constexpr, BM: tl.constexpr, BLOCK_K: tl.constexpr,
                 F32_SCALES: tl.constexpr = False, OFFSET: tl.constexpr = True):
    offs_n = tl.arange(0, BN)
    m = tl.arange(0, BM)
    k16 = tl.arange(0, 16)
    r = tl.arange(0, 4)[None, :, None, None, None]
    grp5 = (tl.arange(0, 2)[None, None, :, None, None] * 4
            + tl.arange(0, 2)[None, None, None, :, None] * 2
            + tl.arange(0, 2)[None, None, None, None, :])
    grp4 = grp5.reshape(1, 2, 2, 2)
    w_ptrs = w_ptr + (grp5 * 4 + r) * N2 + offs_n[:, None, None, None, None]
    if F32_SCALES:
        s_ptrs = s_ptr + offs_n[:, None, None, None] * (K // 32) + grp4
        S_STEP: tl.constexpr = BLOCK_K // 32
        S_UP: tl.constexpr = (N2 // 2) * (K // 32)
    else:
        s_ptrs = s_ptr + grp4 * N2 + offs_n[:, None, None, None]
        S_STEP: tl.constexpr = (BLOCK_K // 32) * N2
        S_UP: tl.constexpr = N2 // 2
    xs_ptrs = xs_ptr + m[:, None, None, None] * (K // 32) + grp4
    xb = x_ptr + m[None, :] * K + k16[:, None]
    acc_g = tl.zeros([BN, BM], dtype=tl.float32)
    acc_u = tl.zeros([BN, BM], dtype=tl.float32)
    for _ in range(0, K // BLOCK_K):
        w0, w1, w2, w3, w4, w5, w6, w7 = _split8(tl.load(w_ptrs))
        u0, u1, u2, u3, u4, u5, u6, u7 = _split8(tl.load(w_ptrs + N2 // 2))
        s0, s1, s2, s3, s4, s5, s6, s7 = _split8(tl.load(s_ptrs))
        v0, v1, v2, v3, v4, v5, v6, v7 = _split8(tl.load(s_ptrs + S_UP))
        if OFFSET:
            x0, x1, x2, x3, x4, x5, x6, x7 = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
        else:
            x0, x1, x2, x3, x4, x5, x6, x7 = _split8(tl.load(xs_ptrs))
        acc_g, acc_u = _group(acc_g, acc_u, w0, u0, s0, v0, x0, xb + 0 * 32, BN, OFFSET)
        acc_g, acc_u = _group(acc_g, acc_u, w1, u1, s1, v1, x1, xb + 1 * 32, BN, OFFSET)
        acc_g, acc_u = _group(acc_g, acc_u, w2, u2, s2, v2, x2, xb + 2 * 32, BN, OFFSET)
        acc_g, acc_u = _group(acc_g, acc_u, w3, u3, s3, v3, x3, xb + 3 * 32, BN, OFFSET)
        acc_g, acc_u = _group(acc_g, acc_u, w4, u4, s4, v4, x4, xb + 4 * 32, BN, OFFSET)
        acc_g, acc_u = _group(acc_g, acc_u, w5, u5, s5, v5, x5, xb + 5 * 32, BN, OFFSET)
        acc_g, acc_u = _group(acc_g, acc_u, w6, u6, s6, v6, x6, xb + 6 * 32, BN, OFFSET)
        acc_g, acc_u = _group(acc_g, acc_u, w7, u7, s7, v7, x7, xb + 7 * 32, BN, OFFSET)
        w_ptrs += (BLOCK_K // 8) * N2
        s_ptrs += S_STEP
        xs_ptrs += BLOCK_K // 32
        xb += BLOCK_K
    o = out_ptr + offs_n[:, None] * BM + m[None, :]
    tl.store(o, acc_g)
    tl.store(o + BN * BM, acc_u)


# name -> (kernel, constexprs beyond the tile's, scale dtype)
VARIANTS = {
    "planes": (probe_planes, {}, "*bf16"),
    "groups_per_load": (probe_groups_per_load, {}, "*bf16"),
    "groups": (probe_groups, {}, "*bf16"),
    "groups_f32_scales": (probe_groups, {"F32_SCALES": True}, "*fp32"),
    "groups_no_offset": (probe_groups, {"F32_SCALES": True, "OFFSET": False}, "*fp32"),
}


def probe(name: str, bn: int, bm: int, bk: int, warps: int, stages: int) -> dict:
    fn, extra, s_type = VARIANTS[name]
    sig = {"w_ptr": "*i32", "s_ptr": s_type, "x_ptr": "*bf16", "xs_ptr": "*fp32",
           "out_ptr": "*fp32"}
    kern = compile_sm90(fn, sig, dict(K=7168, N2=512, BN=bn, BM=bm, BLOCK_K=bk, **extra),
                        warps, stages)
    sass, usage = cubin_sass(kern.asm["cubin"])
    (loop,) = loops(function_instructions(sass, fn.__name__))
    regs = re.search(r"REG:(\d+)", usage)
    return {"variant": name, "loop_instructions": loop["instructions"],
            "opcodes": loop["opcodes"], "registers": int(regs.group(1)) if regs else None,
            "spills": "STACK:0" not in usage, "shared_bytes": kern.metadata.shared}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tile", nargs=5, type=int, default=[32, 256, 2, 3, 8],
                    metavar=("BLOCK_N", "BLOCK_K", "WARPS", "STAGES", "BLOCK_M"))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    bn, bk, warps, stages, bm = args.tile
    rows = [probe(v, bn, bm, bk, warps, stages) for v in args.variants]
    for row in rows:
        print(f"{row['variant']:<20} {row['loop_instructions']:>4} instructions a K step, "
              f"{row['registers']} registers, {row['shared_bytes']} B shared")
    result = {"command": " ".join([sys.executable] + sys.argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "versions": {"triton": triton.__version__}, "target": "sm_90 (AOT, no GPU)",
              "tile": dict(zip(("block_n", "block_k", "warps", "stages", "block_m"), args.tile)),
              "k_step_words_per_warp": bn * bk // 8 * 2 // warps,
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
