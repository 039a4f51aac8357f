#!/usr/bin/env python
"""Launch one fused tree-build kernel eagerly, for a profiler (Nsight Compute) to look at.

Same inputs as ``scripts/bench_tree_build.py`` (``make_topk``, same seeds); ``--warmup`` launches
first (the extension's build and first-launch costs), then ``--launches`` more. Profile the last:

    ncu --clock-control none --kernel-name regex:tree_build_kernel --launch-skip 3 \\
        --launch-count 1 --section WarpStateStats --section SourceCounters \\
        python scripts/profile_tree_kernel.py --algo deferred_warp --bs 64 --budget 64
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_tree_build import make_topk  # noqa: E402

from sglang_ddtree import tree_backend  # noqa: E402
from sglang_ddtree.tree import DraftTree  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algo", default="deferred_warp", choices=tuple(tree_backend.KERNEL_ALGOS))
    ap.add_argument("--dist", default="peaked", choices=("peaked", "random"))
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--launches", type=int, default=1)
    args = ap.parse_args()
    tree_backend._loader().load_tree_build_ext(required=True)
    roots, lp, ids = make_topk(args.bs, args.depth, args.budget, args.vocab, args.dist,
                               seed=args.bs * 7919 + args.budget)
    out = DraftTree.empty(args.bs, args.budget, "cuda")
    algo = tree_backend.KERNEL_ALGOS[args.algo]
    for _ in range(args.warmup + args.launches):
        tree_backend.build_tree_cuda(roots, lp, ids, args.budget, out, algo=algo)
    torch.cuda.synchronize()
    print(f"{args.algo}: {args.warmup + args.launches} launches, batch {args.bs}, budget "
          f"{args.budget}, {args.dist}; mean tree depth "
          f"{out.depths.max(1).values.float().mean().item():.2f}")


if __name__ == "__main__":
    main()
