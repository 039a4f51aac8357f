"""Read-only ceilings for the fused MoE's weight traffic: how fast the GPU reads the packed
gate-up (or down) weights of the experts one call touches, with no dequantization and no MMA.

Three Triton read kernels over the same bytes (the touched experts' ``w13 [E, H / 8, 2 I]``, or
with ``--matrix down`` ``w2 [E, I / 8, H]``, int32 of Kimi's TP8-rank shapes, random distinct
experts per call, several weight sets so that nothing stays in L2), each XOR-folding what it
loads into one word per program:

* ``contiguous``: each program streams one contiguous chunk of an expert's matrix;
* ``row_slices``: each program reads ``cols`` columns (``4 * cols`` bytes) of every packed row
  in its K range, as a GEMM tile of ``cols`` columns does (128 B runs at 32 columns);
* ``copy``: ``torch.Tensor.copy_`` of a contiguous buffer of the same size (read + write), the
  denominator the MoE benchmark uses.

Bandwidth = bytes read / time (copy: 2 x bytes). Medians of CUDA-graph replays. Writes JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch
import triton
import triton.language as tl
from bench_tree_build import time_graph  # CUDA-graph replays, median us per call

from sglang_ddtree.provenance import checkout_digest


@triton.jit
def _read_contiguous(w_ptr, ids_ptr, out_ptr, EXPERT_WORDS: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCK: tl.constexpr):
    e = tl.load(ids_ptr + tl.program_id(0)).to(tl.int64)
    c = tl.program_id(1)
    base = w_ptr + e * EXPERT_WORDS + c * CHUNK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, CHUNK, BLOCK):
        acc ^= tl.load(base + i + tl.arange(0, BLOCK))
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + c, tl.xor_sum(acc, 0))


@triton.jit
def _read_row_slices(w_ptr, ids_ptr, out_ptr, ROWS: tl.constexpr, N: tl.constexpr,
                     COLS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program (expert, column tile, K part): COLS columns of ROWS / SPLIT packed rows."""
    e = tl.load(ids_ptr + tl.program_id(0)).to(tl.int64)
    tile = tl.program_id(1)
    n_tiles: tl.constexpr = N // COLS
    col0 = (tile % n_tiles) * COLS
    r0 = (tile // n_tiles) * (ROWS // SPLIT)
    offs_c = col0 + tl.arange(0, COLS)
    acc = tl.zeros([BLOCK_R, COLS], dtype=tl.int32)
    base = w_ptr + e * (ROWS * N)
    for i in range(0, ROWS // SPLIT, BLOCK_R):
        rows = r0 + i + tl.arange(0, BLOCK_R)
        acc ^= tl.load(base + rows[:, None] * N + offs_c[None, :])
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tile, tl.xor_sum(tl.xor_sum(acc, 1), 0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts-touched", type=int, nargs="+", default=[8, 29, 61, 112, 187])
    ap.add_argument("--layers", type=int, default=4, help="weight sets per graph (L2 flush)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=256)
    ap.add_argument("--num-experts", type=int, default=384)
    ap.add_argument("--matrix", choices=("gate_up", "down"), default="gate_up",
                    help="gate_up: w13 [E, H / 8, 2 I]; down: w2 [E, I / 8, H]")
    ap.add_argument("--out", default="bench_results/moe_read_ceiling_h200.json")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    if args.matrix == "gate_up":
        rows, n = args.hidden // 8, 2 * args.inter
        # (columns, K parts, rows a step, warps); rows a step divide each part's rows
        slices = ((32, 4, 32, 2), (32, 8, 16, 2), (64, 4, 32, 4), (128, 4, 32, 4),
                  (512, 16, 8, 4))
    else:
        rows, n = args.inter // 8, args.hidden
        # the down tiles: a column range of every one of the few packed rows
        slices = ((32, 1, 32, 2), (64, 1, 32, 4), (128, 1, 32, 4), (256, 1, 16, 4))
    words = rows * n
    ws = [torch.randint(-2**31, 2**31 - 1, (args.num_experts, rows, n), dtype=torch.int32,
                        device=dev) for _ in range(args.layers)]
    result = {"command": " ".join([sys.executable] + sys.argv),
              "gpu": torch.cuda.get_device_name(dev),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "versions": {"torch": torch.__version__, "triton": triton.__version__},
              "source_digest": checkout_digest(__file__),
              "matrix": args.matrix, "expert_bytes": words * 4, "rows": []}
    for touched in args.experts_touched:
        g = torch.Generator(device="cpu").manual_seed(touched)
        ids = [torch.randperm(args.num_experts, generator=g)[:touched].sort().values
               .to(torch.int32).to(dev) for _ in range(args.layers)]
        nbytes = touched * words * 4
        # one folded word per program
        out = torch.empty(touched * max([(n // c) * sp for c, sp, _, _ in slices] + [32]),
                          dtype=torch.int32, device=dev)
        row = {"experts": touched, "bytes_per_call": nbytes, "us": {}, "gbs": {}}
        variants = {}
        for chunks in (8, 16, 32):
            chunk = words // chunks

            def f(chunks=chunks, chunk=chunk):
                for w, i in zip(ws, ids):
                    _read_contiguous[(touched, chunks)](w, i, out, EXPERT_WORDS=words,
                                                        CHUNK=chunk,
                                                        BLOCK=min(2048, chunk & -chunk),
                                                        num_warps=4)
            variants[f"contiguous_{chunks}"] = f
        for cols, split, br, nw in slices:
            def f(cols=cols, split=split, br=br, nw=nw):
                for w, i in zip(ws, ids):
                    _read_row_slices[(touched, (n // cols) * split)](
                        w, i, out, ROWS=rows, N=n, COLS=cols, SPLIT=split, BLOCK_R=br,
                        num_warps=nw)
            variants[f"row_slices_{cols}c_k{split}"] = f
        src = torch.empty(nbytes // 4, dtype=torch.int32, device=dev)
        dst = torch.empty_like(src)
        variants["copy"] = lambda: dst.copy_(src)
        for name, fn in variants.items():
            us = time_graph(fn, 1, args.iters) / (1 if name == "copy" else args.layers)
            row["us"][name] = us
            row["gbs"][name] = (2 if name == "copy" else 1) * nbytes / us / 1e3
        result["rows"].append(row)
        print(touched, {k: round(v) for k, v in row["gbs"].items()}, flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
