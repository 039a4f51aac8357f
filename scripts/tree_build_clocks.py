#!/usr/bin/env python
"""Where a fused tree-build kernel spends its time on the GPU: clock64() marks per phase.

Compiles ``scripts/tree_build_clocks.cu`` (nvcc, the running GPU's arch) with the kernel header's
``DDTREE_PHASE_CLOCKS`` marks switched on (the extension never defines it, so the served kernel
has no marks), runs it on ``scripts/bench_tree_build.py``'s input distributions and prints, per
mark, the mean cycles since the previous mark over blocks, and the slowest block's whole
sequence. Mark ids: 0 start; level-wise 100 d + (0 level start, 1 candidate counts, 2 select,
3 compaction scan, 4 level end; with ``merge`` and ``deferred_warp`` also 5 a run starts at
this depth, 6 it ended at this depth; inside a ``deferred_warp`` run, per depth, 7 walked, 8
counted and scanned, 9 appended, and 10000 + 100 d + 1 / + 2 counted (before the scan) /
appended (before the histogram adds)); frontier 100 staged, 1000 + i after pop i; both 9000
build done, 9003 node outputs written, 9005 / 9006 the layout's rows and per-position outputs /
the barrier after them, 9009 end (9001 / 9002: the level-wise kernel's final order / outputs).
Each mark is a clock read and three global stores by thread 0, so the marks slow a block down;
the per-launch time printed beside them is measured without a CUDA graph. A diagnostic:
``scripts/bench_tree_build.py`` stays the measure of speed.

    python scripts/tree_build_clocks.py --budgets 64 --bs 64 [--algo levelwise frontier] [--out f.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_tree_build import make_topk  # noqa: E402
from tree_build_phases import write_input  # noqa: E402

from sglang_ddtree.tree_backend import KERNEL_ALGOS as ALGOS  # noqa: E402  (ddtree::TreeAlgo)
MAX_BLOCKS = 64
PAIRS = 192  # kClockPairs in tree_build_kernel.cuh


def build(workdir: str, arch: str) -> str:
    """nvcc of the toolkit the extension builds with (tree_backend's loader finds it)."""
    from torch.utils import cpp_extension

    from sglang_ddtree import tree_backend

    includes, ldflags = tree_backend._loader()._toolkit_flags()
    exe = os.path.join(workdir, "tree_build_clocks")
    subprocess.run([os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"), "-O3", f"-arch={arch}",
                    "-std=c++17", f"-DDDTREE_PHASE_CLOCKS={MAX_BLOCKS}", f"-I{ROOT / 'cuda_ext'}",
                    *[f"-I{i}" for i in includes], *ldflags,
                    str(ROOT / "scripts" / "tree_build_clocks.cu"), "-o", exe], check=True)
    return exe


def parse(raw: bytes, bs: int):
    per = 2 * PAIRS + 1
    arr = np.frombuffer(raw[: 8 * MAX_BLOCKS * per], np.int64).reshape(MAX_BLOCKS, per)
    us = float(np.frombuffer(raw[8 * MAX_BLOCKS * per:], np.float32)[0])
    blocks = []
    for b in range(min(bs, MAX_BLOCKS)):
        n = int(arr[b, 0])
        marks = [(int(arr[b, 1 + 2 * i]), int(arr[b, 2 + 2 * i])) for i in range(n)]
        blocks.append([(m, c - marks[i - 1][1] if i else 0) for i, (m, c) in enumerate(marks)])
    return blocks, us


def summarize(blocks):
    by_mark: dict[int, list[int]] = {}
    for marks in blocks:
        for m, dc in marks[1:]:
            by_mark.setdefault(m, []).append(dc)
    totals = [sum(dc for _, dc in marks) for marks in blocks]
    slow = int(np.argmax(totals))
    return dict(
        mean_cycles_per_mark={str(m): round(statistics.mean(v), 1) for m, v in sorted(by_mark.items())},
        blocks_per_mark={str(m): len(v) for m, v in sorted(by_mark.items())},
        total_cycles_mean=round(statistics.mean(totals), 1), total_cycles_max=max(totals),
        slowest_block=slow, slowest_block_marks=blocks[slow])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[64])
    ap.add_argument("--bs", type=int, nargs="+", default=[64])
    ap.add_argument("--dists", nargs="+", default=["peaked", "random"])
    ap.add_argument("--algo", nargs="+", default=["levelwise", "frontier", "deferred"],
                    choices=list(ALGOS))
    ap.add_argument("--threads", type=int, nargs="+", default=[0], help="0: the launcher's choice")
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--arch", default="native")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        exe = build(work, args.arch)
        fin, fout = os.path.join(work, "in.bin"), os.path.join(work, "out.bin")
        for dist in args.dists:
            for bs in args.bs:
                for budget in args.budgets:
                    # the benchmark's inputs for this point (same seed rule)
                    roots, lp, ids = make_topk(bs, args.depth, budget, args.vocab, dist,
                                               seed=bs * 7919 + budget, device="cpu")
                    for algo in args.algo:
                        for threads in args.threads:
                            write_input(fin, roots, lp, ids, budget, threads, ALGOS[algo])
                            r = subprocess.run([exe, fin, fout], capture_output=True, text=True)
                            if r.returncode != 0:
                                print(f"{dist} bs {bs} b {budget} {algo}: {r.stderr.strip()}")
                                continue
                            blocks, us = parse(Path(fout).read_bytes(), bs)
                            row = dict(dist=dist, bs=bs, budget=budget, algo=algo,
                                       threads=threads or "auto", us_per_launch=round(us, 2),
                                       kernel=r.stderr.strip(), **summarize(blocks))
                            rows.append(row)
                            print(f"== {dist} bs {bs} budget {budget} {algo} threads "
                                  f"{threads or 'auto'}: {r.stderr.strip()}")
                            print(f"   cycles per block: mean {row['total_cycles_mean']}, max "
                                  f"{row['total_cycles_max']}; mean per mark: "
                                  f"{row['mean_cycles_per_mark']}")
                            print(f"   slowest block {row['slowest_block']}: "
                                  f"{row['slowest_block_marks']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(command=" ".join(["python", "scripts/tree_build_clocks.py"]
                                            + (argv if argv is not None else sys.argv[1:])),
                           rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
