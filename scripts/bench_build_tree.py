#!/usr/bin/env python
"""Benchmark the torch tree builder (``sglang_ddtree.tree.build_tree``) and accept walk on one GPU.

Grid: batch x budget with D = 15 (block 16) and K = budget (DESIGN: K = min(budget, vocab)).
Each point captures ``build_tree`` (and, separately, ``accept_walk``) in a CUDA graph, replays it
``--iters`` times on random sorted top-K inputs and reports the median per replay (CUDA events),
plus the eager time and the number of kernels one build launches (torch profiler).
Also checks one replay against the CPU oracle (``build_tree_reference``) when bs x budget <= 8192.

Writes JSON (command, versions, GPU, date, results) to ``--out`` and prints a table.
Run: ``python scripts/bench_build_tree.py``
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

from sglang_ddtree.accept import accept_walk
from sglang_ddtree.tree import DraftTree, build_tree, build_tree_reference


def random_topk(bs, depth, k, vocab, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(bs, depth, vocab, device="cuda", generator=g) * 3
    vals, ids = torch.log_softmax(logits, -1).topk(k, -1)
    roots = torch.randint(0, vocab, (bs,), device="cuda", generator=g)
    return roots, vals.contiguous(), ids.contiguous()


def time_graph(fn, iters):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return graph, statistics.median(times)


def time_eager(fn, iters):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def count_kernels(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def bench_point(bs, budget, depth, vocab, iters):
    k = min(budget, vocab)
    roots, lp, ids = random_topk(bs, depth, k, vocab, seed=bs * 7919 + budget)
    out = DraftTree.empty(bs, budget, "cuda")
    build = lambda: build_tree(roots, lp, ids, budget, out=out)  # noqa: E731
    graph, build_us = time_graph(build, iters)
    pred = out.tokens.clone()
    walk_graph, walk_us = time_graph(lambda: accept_walk(out, pred), iters)
    graph.replay()
    torch.cuda.synchronize()
    checked = None
    if bs * budget <= 8192:
        ref = build_tree_reference(roots.cpu(), lp.cpu(), ids.cpu(), budget)
        checked = all(torch.equal(v, getattr(out, name).cpu()) for name, v in ref.tensors().items())
    return dict(bs=bs, budget=budget, depth=depth, k=k, build_graph_us=round(build_us, 1),
                build_eager_us=round(time_eager(build, max(3, iters // 10)), 1),
                walk_graph_us=round(walk_us, 1), build_kernels=count_kernels(build),
                matches_reference=checked)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=32768, help="skip points with bs*N above")
    ap.add_argument("--out", default="bench_results/build_tree.json")
    args = ap.parse_args()
    results = []
    for bs in args.bs:
        for budget in args.budgets:
            if bs * (budget + 1) > args.max_tokens:
                continue
            results.append(bench_point(bs, budget, args.depth, args.vocab, args.iters))
            print(results[-1], flush=True)
    meta = dict(command=" ".join([sys.executable] + sys.argv), torch=torch.__version__,
                cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(), results=results)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(meta, f, indent=1)
    cols = ["bs", "budget", "k", "build_graph_us", "build_eager_us", "walk_graph_us",
            "build_kernels", "matches_reference"]
    print(" ".join(f"{c:>17}" for c in cols))
    for r in results:
        print(" ".join(f"{str(r[c]):>17}" for c in cols))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
