#!/usr/bin/env python
"""Benchmark the fused CUDA tree builder against the torch-op ``build_tree``, inside CUDA graphs.

Grid: batch {1, 8, 64} x budget {16, 64, 256}, D = 15 (block 16), K = budget (DESIGN: K =
min(budget, vocab); ``--k-cap`` caps it), two input distributions over a 151936-token vocab:
- ``random``: log_softmax(3 * randn) top-K. Flat top-K, so the
  trees are wide and shallow: the fused kernel stops after 1-3 depths.
- ``peaked``: the same plus a boost of U(10, 20) on one token per (request, depth), i.e. a
  top-1 probability of roughly 0.3-0.99 like a trained drafter: deep trees, all 15 depths busy.
Each builder is captured ``--reps`` times back to back in one CUDA graph; a replay is timed with
CUDA events and the median over ``--iters`` replays divided by ``--reps`` is the time per step
(launch gaps included, as in a real step). The fused output is compared with the torch output
field by field, and the number of kernels one call launches is counted with the profiler.
A threads-per-block sweep runs at batch 64 for each budget of ``--sweep-budgets`` (default 64).
Every kernel of the extension is timed at every point it can take (``levelwise_us``,
``merge_us``: the level-wise kernel's merge variant, budgets up to 128; ``deferred_us``: its
deferred variant, budgets up to 256 (``deferred_warp_us``: with warp runs over narrow levels);
``frontier_us``: the best-first kernel serves budgets up to
287) and checked equal; ``fused_us`` is the one that
``SGLANG_DDTREE_TREE_KERNEL=auto`` serves there.

Writes JSON (command, versions, GPU, date, settings, results) to ``--out`` and prints a table.
Run: ``python scripts/bench_tree_build.py``
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

from sglang_ddtree import tree_backend
from sglang_ddtree.provenance import checkout_digest
from sglang_ddtree.tree import DraftTree, build_tree


def make_topk(bs, depth, k, vocab, dist, seed, device="cuda", boost=(10.0, 10.0)):
    """(roots, top-k log-probs, ids) of random draft logits; ``peaked`` adds lo + span * U(0, 1)
    (``boost``) to one token per depth: the larger, the deeper the tree's main path."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(bs, depth, vocab, device=device, generator=g) * 3
    if dist == "peaked":
        tok = torch.randint(0, vocab, (bs, depth, 1), device=device, generator=g)
        add = boost[0] + boost[1] * torch.rand(bs, depth, 1, device=device, generator=g)
        logits.scatter_add_(-1, tok, add)
    vals, ids = torch.log_softmax(logits, -1).topk(k, -1)
    roots = torch.randint(0, vocab, (bs,), device=device, generator=g)
    del logits
    return roots, vals.contiguous(), ids.contiguous()


def time_graph(fn, reps, iters):
    """Median microseconds per fn() call, fn captured reps times in one graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def count_kernels(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def same(a: DraftTree, b: DraftTree) -> bool:
    return all(torch.equal(v, getattr(b, k)) for k, v in a.tensors().items())


def bench_point(bs, budget, depth, k, vocab, dist, reps, iters, threads=0, with_torch=True):
    roots, lp, ids = make_topk(bs, depth, k, vocab, dist, seed=bs * 7919 + budget)
    ext = tree_backend._loader().load_tree_build_ext(required=True)
    served = ext.kernel_name(budget, k, depth, 0)
    row = dict(dist=dist, bs=bs, budget=budget, depth=depth, k=k, threads=threads or "auto",
               kernel=served)
    outs = {}
    for name in ("levelwise", "frontier", "merge", "deferred", "deferred_warp"):
        algo = tree_backend.KERNEL_ALGOS[name]
        if ext.kernel_name(budget, k, depth, algo) != name:
            continue  # the frontier kernel / the merge or deferred variant cannot take this point
        out = DraftTree.empty(bs, budget, "cuda")
        call = lambda out=out, algo=algo: tree_backend.build_tree_cuda(  # noqa: E731
            roots, lp, ids, budget, out, threads=threads, algo=algo)
        row[f"{name}_us"] = round(time_graph(call, reps, iters), 2)
        call()
        outs[name] = (out, call)
    fused_out, fused = outs[served]
    row["fused_us"] = row[f"{served}_us"]
    if len(outs) >= 2:
        row["kernels_equal"] = all(same(outs["levelwise"][0], o[0]) for o in outs.values())
    row["mean_tree_depth"] = round(fused_out.depths.max(1).values.float().mean().item(), 2)
    if with_torch:
        torch_out = DraftTree.empty(bs, budget, "cuda")
        op = lambda: build_tree(roots, lp, ids, budget, torch_out)  # noqa: E731
        row["torch_us"] = round(time_graph(op, max(1, reps // 4), max(5, iters // 2)), 2)
        op()
        torch.cuda.synchronize()
        row["speedup"] = round(row["torch_us"] / row["fused_us"], 1)
        row["fused_kernels"] = count_kernels(fused)
        row["torch_kernels"] = count_kernels(op)
        row["fused_equals_torch"] = same(fused_out, torch_out)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--dists", nargs="+", default=["peaked", "random"])
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k-cap", type=int, default=None, help="K = min(budget, k_cap)")
    ap.add_argument("--reps", type=int, default=20, help="calls captured per graph")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--sweep-threads", type=int, nargs="*", default=[64, 128, 256])
    ap.add_argument("--sweep-budgets", type=int, nargs="*", default=[64])
    ap.add_argument("--out", default="bench_results/tree_build_h200.json")
    args = ap.parse_args()

    tree_backend._loader().load_tree_build_ext(required=True)
    results = []
    for dist in args.dists:
        for bs in args.bs:
            for budget in args.budgets:
                k = min(budget, args.vocab, args.k_cap or budget)
                results.append(bench_point(bs, budget, args.depth, k, args.vocab, dist,
                                           args.reps, args.iters))
                print(results[-1], flush=True)
    sweep = []
    for dist in args.dists:
        for sb in args.sweep_budgets:
            for t in args.sweep_threads:
                sweep.append(bench_point(64, sb, args.depth, min(sb, args.k_cap or sb), args.vocab,
                                         dist, args.reps, args.iters, threads=t, with_torch=False))
                print(sweep[-1], flush=True)

    goal = {}
    for r in results:
        if r["bs"] == 64 and r["budget"] == 64:
            goal[r["dist"]] = dict(fused_us=r["fused_us"], under_20us=r["fused_us"] <= 20.0,
                                   speedup=r["speedup"], at_least_10x=r["speedup"] >= 10.0)
    meta = dict(
        command=" ".join([sys.executable] + sys.argv), source_digest=checkout_digest(__file__),
        torch=torch.__version__,
        cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        settings=dict(depth=args.depth, vocab=args.vocab, k="min(budget, k_cap)" if args.k_cap
                      else "budget", k_cap=args.k_cap, reps=args.reps, iters=args.iters,
                      timing="median CUDA-event time of one graph replay / reps"),
        results=results, threads_sweep=sweep, goal_bs64_budget64=goal)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(meta, f, indent=1)

    cols = ["dist", "bs", "budget", "k", "mean_tree_depth", "levelwise_us", "frontier_us", "merge_us",
            "deferred_us", "deferred_warp_us",
            "kernel", "fused_us", "torch_us", "speedup", "fused_kernels", "fused_equals_torch",
            "kernels_equal"]
    print(" ".join(f"{c:>14}" for c in cols))
    for r in results:
        print(" ".join(f"{str(r.get(c)):>14}" for c in cols))
    print("threads sweep (bs 64):", ", ".join(
        f"{r['dist']}/b{r['budget']}/{r['threads']}: {r['fused_us']} us" for r in sweep))
    print("goal (bs 64, budget 64: <= 20 us and >= 10x):", goal)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
