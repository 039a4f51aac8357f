#!/usr/bin/env python
"""Serial phases of the fused tree-build kernel, counted on a CPU (no GPU needed).

The kernel (``cuda_ext/tree_build_kernel.cuh``) runs one thread block per request through a
sequence of block-wide phases (one ``__syncthreads`` each): per depth a candidate count, radix
passes and a compaction, then the output writes. When each phase's work is small, as at the
budgets DDTree uses, the number of phases bounds the kernel's latency: dividing session 5's H200
times (``bench_results/tree_build_h200_s5.json``) by these counts gives 0.3-0.7 us per phase
(peaked inputs take about twice the phases and twice the time of random ones). It counts the
level-wise kernel and its variants (the frontier kernel has no block phases in its pop loop). This script compiles the kernel against the CPU emulation in
``tests/cuda_ext_emu`` (host C++20 compiler), runs it on ``scripts/bench_tree_build.py``'s input
distributions and prints the block barriers per block, so a change to the kernel's structure
can be judged before GPU time is spent on it. The GPU benchmark stays the measure of speed.

    python scripts/tree_build_phases.py [--budgets 16 64 256] [--out phases.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_tree_build import make_topk  # noqa: E402
from sglang_ddtree.tree_backend import KERNEL_ALGOS  # noqa: E402  (ddtree::TreeAlgo)

EMU_DIR = ROOT / "tests" / "cuda_ext_emu"
KERNEL_DIR = ROOT / "cuda_ext"
PHASES_RE = re.compile(r"block barriers per block: ([\d.]+) \(threads (\d+)\), most in one "
                       r"block: (\d+)")
ATOMICS_RE = re.compile(r"shared atomics per block: ([\d.]+), busiest-address depth per block: "
                        r"([\d.]+)")
ALGOS = {k: KERNEL_ALGOS[k] for k in ("levelwise", "merge", "deferred", "deferred_warp")}  # block phases


def build_driver(workdir: str) -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise SystemExit("tree_build_phases needs a C++20 compiler (g++ or clang++)")
    exe = os.path.join(workdir, "emu_driver")
    subprocess.run([cxx, "-std=c++20", "-O2", "-pthread", "-Wno-unknown-pragmas",
                    f"-I{EMU_DIR}", f"-I{KERNEL_DIR}", str(EMU_DIR / "emu_driver.cpp"),
                    "-o", exe], check=True, capture_output=True, text=True)
    return exe


def write_input(path: str, roots, lp, ids, budget: int, threads: int = 0, algo: int = 1,
                fill: int = 0) -> None:
    """The driver input of tests/cuda_ext_emu/emu_driver.cpp (also read by
    scripts/tree_build_clocks.cu): header, log-probs, ids, roots, zero prefix lengths."""
    bs, depth, k = lp.shape
    with open(path, "wb") as f:
        np.array([bs, depth, k, budget, threads, fill, algo], np.int64).tofile(f)
        lp.cpu().numpy().astype(np.float32).tofile(f)
        ids.cpu().numpy().astype(np.int64).tofile(f)
        roots.cpu().numpy().astype(np.int64).tofile(f)
        np.zeros(bs, np.int64).tofile(f)


def phases(exe: str, workdir: str, roots, lp, ids, budget: int, threads: int = 0, algo: int = 1):
    """(mean block barriers per block, threads per block) of one emulated launch; threads 0:
    the launcher's choice for the budget; algo (ALGOS) 1 the level-wise kernel, 3 its merge
    variant, 4 its deferred variant."""
    fin, fout = os.path.join(workdir, "in.bin"), os.path.join(workdir, "out.bin")
    write_input(fin, roots, lp, ids, budget, threads, algo=algo)
    r = subprocess.run([exe, fin, fout], check=True, capture_output=True, text=True, timeout=600)
    m, a = PHASES_RE.search(r.stderr), ATOMICS_RE.search(r.stderr)
    return (float(m.group(1)), int(m.group(2)), float(a.group(1)), float(a.group(2)),
            int(m.group(3)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--dists", nargs="+", default=["peaked", "random"])
    ap.add_argument("--bs", type=int, default=4,
                    help="requests per launch (phases averaged; the most in one block too)")
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--threads", type=int, default=0, help="0: the launcher's choice")
    ap.add_argument("--algo", default="levelwise", choices=tuple(ALGOS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        exe = build_driver(work)
        for dist in args.dists:
            for budget in args.budgets:
                roots, lp, ids = make_topk(args.bs, args.depth, budget, args.vocab, dist,
                                           seed=args.bs * 7919 + budget, device="cpu")
                count, t, atomics, depth, most = phases(exe, work, roots, lp, ids, budget,
                                                        args.threads, ALGOS[args.algo])
                rows.append(dict(dist=dist, budget=budget, threads=t, bs=args.bs, algo=args.algo,
                                 phases_per_block=count, phases_max_block=most,
                                 atomics_per_block=atomics, atomic_depth_per_block=depth))
                print(f"{dist:7s} budget {budget:4d} threads {t:4d}: {count:.1f} block barriers "
                      f"(most {most}), {atomics:.0f} shared atomics, busiest-address depth "
                      f"{depth:.0f} per block", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(command=" ".join(["python", "scripts/tree_build_phases.py"]
                                            + (argv or sys.argv[1:])), rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
