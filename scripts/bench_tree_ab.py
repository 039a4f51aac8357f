#!/usr/bin/env python
"""Interleaved A/B timing of tree-kernel variants: one checkout per variant, one process per round.

A single run of ``scripts/bench_tree_build.py`` moves by about 2 % between runs on the H200 (the
same code read 20.2 and 20.9 us at batch 64 / budget 64), as much as the changes tried on the
kernel. Here every variant (a directory holding ``cuda_ext/`` and ``sglang_ddtree/``: a git
worktree, or ``git archive`` of a commit) builds its extension once (in parallel, each into its own
cache), then ``--rounds`` rounds run one short process per variant, in turn, timing the same
points with the same inputs; the summary gives each point's median and range over the rounds.
Comparing medians of interleaved rounds cancels the machine's drift between runs.

    git worktree add /tmp/ab_base HEAD
    python scripts/bench_tree_ab.py --variant base=/tmp/ab_base --variant new=. \\
        --out bench_results/tree_build_ab_h200.json

The timing is ``bench_tree_build.time_graph`` (median CUDA-event time of one graph replay of
``--reps`` calls, over ``--iters`` replays, divided by ``--reps``) on ``bench_tree_build.make_topk``
inputs (same seeds), for the kernels named by ``--kernels`` (default: the served ``deferred_warp``
and, as an in-process control, ``deferred``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_POINTS = "peaked:64:64,random:64:64,peaked:64:32,peaked:64:128,peaked:8:64"


def parse_points(text):
    pts = []
    for item in text.split(","):
        dist, bs, budget = item.split(":")
        pts.append((dist, int(bs), int(budget)))
    return pts


def worker(args):
    """Runs inside one variant's checkout (PYTHONPATH = it): times every point once."""
    import torch

    sys.path.insert(0, HERE)
    from bench_tree_build import make_topk, time_graph  # this checkout's timing code

    from sglang_ddtree import tree_backend
    from sglang_ddtree.provenance import source_digest
    from sglang_ddtree.tree import DraftTree

    tree_backend._loader().load_tree_build_ext(required=True)
    row = {"variant": args.worker, "source_digest": source_digest(os.getcwd()), "us": {}}
    for dist, bs, budget in parse_points(args.points):
        roots, lp, ids = make_topk(bs, args.depth, budget, args.vocab, dist, seed=bs * 7919 + budget)
        for name in args.kernels.split(","):
            algo = tree_backend.KERNEL_ALGOS[name]
            out = DraftTree.empty(bs, budget, "cuda")

            def call(out=out, algo=algo):
                tree_backend.build_tree_cuda(roots, lp, ids, budget, out, algo=algo)

            row["us"][f"{dist}/bs{bs}/b{budget}/{name}"] = round(
                time_graph(call, args.reps, args.iters), 3)
    torch.cuda.synchronize()
    print("ROW " + json.dumps(row), flush=True)


def variant_env(path, tag):
    env = dict(os.environ)
    env["PYTHONPATH"] = path
    env["SGLANG_DDTREE_CACHE_DIR"] = os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                  f"ddtree_ab_cache_{tag}")
    return env


def summarize(rows):
    by = {}
    for r in rows:
        by.setdefault(r["variant"], []).append(r["us"])
    out = {}
    for tag, runs in by.items():
        out[tag] = {k: dict(median=round(statistics.median(x[k] for x in runs), 3),
                            min=min(x[k] for x in runs), max=max(x[k] for x in runs),
                            rounds=len(runs))
                    for k in runs[0]}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", action="append", default=[], metavar="TAG=DIR",
                    help="a checkout to time (repeat; the first is the baseline)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--points", default=DEFAULT_POINTS, help="dist:bs:budget,...")
    ap.add_argument("--kernels", default="deferred_warp,deferred")
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per build or round process")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if not args.variant:
        ap.error("give at least one --variant TAG=DIR")
    variants = []
    for v in args.variant:
        tag, _, path = v.partition("=")
        if not path or not os.path.isdir(os.path.join(path, "cuda_ext")):
            ap.error(f"--variant {v}: DIR must hold cuda_ext/ and sglang_ddtree/")
        variants.append((tag, os.path.abspath(path)))

    build = ("from sglang_ddtree import tree_backend; "
             "tree_backend._loader().load_tree_build_ext(required=True)")
    procs = [(tag, subprocess.Popen([sys.executable, "-c", build], cwd=path,
                                    env=variant_env(path, tag)))
             for tag, path in variants]
    for tag, p in procs:
        if p.wait(timeout=args.timeout) != 0:
            sys.exit(f"variant {tag}: the extension did not build")
    rows = []
    passthrough = ["--points", args.points, "--kernels", args.kernels, "--depth", str(args.depth),
                   "--vocab", str(args.vocab), "--reps", str(args.reps), "--iters", str(args.iters)]
    for rnd in range(args.rounds):
        for tag, path in variants:
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", tag,
                                  *passthrough], cwd=path, env=variant_env(path, tag),
                                 capture_output=True, text=True, timeout=args.timeout)
            line = [x for x in res.stdout.splitlines() if x.startswith("ROW ")]
            if res.returncode != 0 or not line:
                sys.exit(f"variant {tag}, round {rnd}: failed\n{res.stderr[-2000:]}")
            row = json.loads(line[0][4:])
            row["round"] = rnd
            rows.append(row)
            print(f"round {rnd} {tag}: " + " ".join(f"{v:.2f}" for v in row["us"].values()),
                  flush=True)
    summary = summarize(rows)
    tags = [t for t, _ in variants]
    print("point".ljust(36) + "".join(t.rjust(24) for t in tags))
    for k in summary[tags[0]]:
        cells = [summary[t][k] for t in tags]
        print(k.ljust(36) + "".join(
            f"{c['median']:.2f} ({c['min']:.2f}-{c['max']:.2f})".rjust(24) for c in cells))
    if args.out:
        import torch

        meta = dict(
            command=" ".join([sys.executable] + sys.argv),
            torch=torch.__version__, cuda=torch.version.cuda,
            gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
            settings=dict(points=args.points, kernels=args.kernels, depth=args.depth,
                          vocab=args.vocab, reps=args.reps, iters=args.iters, rounds=args.rounds,
                          timing="per round: median CUDA-event time of one graph replay / reps; "
                                 "summary: median, min, max over rounds"),
            variants={t: p for t, p in variants}, rows=rows, summary=summary)
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(meta, f, indent=1)


if __name__ == "__main__":
    main()
