#!/usr/bin/env python
"""Time the accept/commit stage of a step: the op path against the one-launch walk_commit.

Per point (batch size, budget, KV layers) and path (``ops``: SGLang's ``verify_tree_greedy`` walk
when SGLang imports, else the vectorised ``accept_walk``, plus the PyTorch-op bookkeeping;
``fused``: ``triton_kernels/walk_commit.py``), the accept/commit CUDA graph of
``step_graph.AcceptCommitGraphs`` is captured as the worker captures it, on a tree from the
static buffers of ``tree_graph.TreeBuildGraphs`` (peaked draft log-probs, so paths run deep), with
target tokens that follow the tree's deepest path (draft inputs: ``bench_tree_build.make_topk``
with ``--boost``; ``accepted_mean`` says how deep the paths ran), disjoint KV slots and an MLA-like KV pool of
``--layers`` latent buffers (the fused KV mover serves it, as in serving). Then ``--iters`` calls
run back to back and the script records:

- ``host_us``: host time per call (what a step's commit stage costs the host that issues it),
- ``gpu_us``: CUDA-event time per call over the same loop (the stage's hold on the stream: the GPU
  work, or the host's issue time where the GPU waits for it),

medians over ``--repeats`` loops. Outputs of the two paths are compared (they must be equal). This
isolates what ``SGLANG_DDTREE_COMMIT`` changes; the served share of the step comes from the
servers' stage timers (``bench_e2e.py --variant``).

    python scripts/bench_commit.py --out bench_results/commit_h200.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

sys.path.insert(0, os.path.join(ROOT, "scripts"))
from bench_tree_build import make_topk  # noqa: E402  (the tree benchmark's draft inputs)

from sglang_ddtree.provenance import checkout_digest  # noqa: E402
from sglang_ddtree.step_graph import AcceptCommitGraphs  # noqa: E402
from sglang_ddtree.tree_graph import TreeBuildGraphs  # noqa: E402


class MLATokenToKVPool:
    """Stands in for SGLang's MLA token pool (the class name is what ``kv_move`` recognises):
    one ``[slots, 1, 576]`` latent buffer per layer."""

    def __init__(self, slots: int, layers: int, device, width: int = 576):
        self.kv_buffer = [torch.zeros(slots, 1, width, dtype=torch.bfloat16, device=device)
                          for _ in range(layers)]

    def move_kv_cache(self, tgt, src):  # SGLang's per-column move, when the fused mover is off
        for buf in self.kv_buffer:
            buf[tgt] = buf[src]


def pick_walk(which: str = "auto"):
    """(walk, name) of the op path: SGLang's verify_tree_greedy (``sglang``, what serves), the
    vectorised ``accept_walk`` (``torch``), or ``auto``: SGLang's when it imports on a GPU."""
    from sglang_ddtree.accept import accept_walk

    torch_walk = (lambda tree, pred, width: accept_walk(tree, pred, width - 1)), "accept_walk"
    if which == "torch" or (which == "auto" and not torch.cuda.is_available()):
        return torch_walk
    try:
        from sglang_ddtree import compat

        return compat.load().tree_greedy_walk, "sglang verify_tree_greedy"
    except Exception as e:  # noqa: BLE001 -- no SGLang here: the vectorised walk stands in
        if which == "sglang":
            raise
        return torch_walk[0], f"accept_walk (SGLang not importable: {type(e).__name__})"


def deepest_path_tokens(tree):
    """[bs, N] int64 target tokens that walk each request's deepest path, then stop (set-up
    only: reads the tree on the host)."""
    tokens, parents, depths = tree.tokens.cpu(), tree.parents.cpu(), tree.depths.cpu()
    bs, n = tokens.shape
    pred = torch.full((bs, n), 1 << 40, dtype=torch.int64)  # no tree token: the walk stops
    for b in range(bs):
        node = int(torch.argmax(depths[b]))
        while node > 0:
            par = int(parents[b, node])
            pred[b, par] = tokens[b, node]
            node = par
    return pred.to(tree.tokens.device)


def measure(graphs, args_fn, iters, repeats, device):
    """(host us, gpu us) per call, medians over repeats of iters back-to-back calls."""
    host, gpu = [], []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(repeats):
        sync()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(iters):
            graphs(*args_fn())
        t1 = time.perf_counter()
        if device.type == "cuda":
            end.record()
            end.synchronize()
            gpu.append(1e3 * start.elapsed_time(end) / iters)
        host.append(1e6 * (t1 - t0) / iters)
    return statistics.median(host), (statistics.median(gpu) if gpu else None)


def run_point(bs, budget, layers, depth, iters, repeats, device, walk, vocab=32000,
              boost=(12.0, 10.0)):
    """{path: {host_us, gpu_us}} at one point, plus whether the paths' outputs agree."""
    block = depth + 1
    k = min(budget, 64)
    trees = TreeBuildGraphs(budget, depth, k, device, use_graphs=device.type == "cuda")
    tree = trees(*make_topk(bs, depth, k, vocab, "peaked", seed=bs * 1000 + budget,
                            device=device, boost=boost))
    pred = deepest_path_tokens(tree)
    n = budget + 1
    width = max(n, block)
    g = torch.Generator().manual_seed(budget)
    slots = (torch.randperm(bs * width * 2, generator=g)[: bs * width] + 1).view(bs, width)
    slots = slots.to(device)
    prefix = torch.randint(16, 4096, (bs,), generator=g).to(device)
    row = {}
    outs = {}
    for path in ("ops", "fused"):
        pool = MLATokenToKVPool(bs * width * 2 + 1, layers, device)
        graphs = AcceptCommitGraphs(block, walk, use_graphs=device.type == "cuda", device=device,
                                    fused=path == "fused")
        first = graphs(tree, pred, slots, prefix, pool)  # captures (or runs eagerly off GPU)
        outs[path] = [t.clone() for t in (first.step.out_tokens, first.step.commit_lens,
                                          first.step.new_seq_lens, first.step.bonus,
                                          first.hidden_rows)]
        host, gpu = measure(graphs, lambda: (tree, pred, slots, prefix, pool), iters, repeats,
                            device)
        row[path] = {"host_us": round(host, 2), "gpu_us": None if gpu is None else round(gpu, 2),
                     "captured": bool(graphs._entries), "failed": dict(graphs.failed)}
    row["equal"] = all(torch.equal(a, b) for a, b in zip(outs["ops"], outs["fused"]))
    row["accepted_mean"] = round(float(outs["ops"][1].float().mean()) - 1.0, 2)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "commit_h200.json"))
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--budgets", default="32,64")
    ap.add_argument("--layers", default="4,61", help="KV layers of the pool (tiny pair: 4; "
                    "Kimi K2.6: 61)")
    ap.add_argument("--depth", type=int, default=15, help="drafter block - 1")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--walk", default="auto", choices=("auto", "sglang", "torch"),
                    help="the op path's walk (auto: SGLang's kernel when it imports on a GPU)")
    ap.add_argument("--boost", default="12,10", help="LO,SPAN: the draft's top token per depth "
                    "gets LO + SPAN * U(0, 1) added to its logit (deeper trees and longer "
                    "accepted paths as LO grows; 25,10: every path runs the full depth)")
    args = ap.parse_args(argv)
    boost = tuple(float(x) for x in args.boost.split(","))
    device = torch.device(args.device if torch.cuda.is_available() else "cpu")
    walk, walk_name = pick_walk(args.walk)
    result = {"command": " ".join(["python", "scripts/bench_commit.py"] + (argv or sys.argv[1:])),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (dry run)",
              "torch_version": torch.__version__, "source_digest": checkout_digest(__file__),
              "ops_walk": walk_name, "boost": list(boost),
              "notes": "host_us: host time per accept/commit call; gpu_us: CUDA-event time per "
                       "call over the same back-to-back loop; medians over repeats",
              "results": []}
    for layers in [int(x) for x in args.layers.split(",")]:
        for budget in [int(x) for x in args.budgets.split(",")]:
            for bs in [int(x) for x in args.batch_sizes.split(",")]:
                row = run_point(bs, budget, layers, args.depth, args.iters, args.repeats, device,
                                walk, boost=boost)
                row.update(bs=bs, budget=budget, layers=layers)
                result["results"].append(row)
                print(json.dumps(row), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("->", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
