"""What a CUDA-graph IF node costs on this GPU (a probe for the fused MoE's small-call path).

Captures graphs of ``--reps`` repetitions of one pattern and times their replays with CUDA
events (per repetition, median of ``--rounds`` replays):

* ``kernel``: one tiny kernel (``x.add_(1)`` on one element), the unit to compare with;
* ``if_true`` / ``if_false``: the same kernel inside an IF node whose predicate is true / false
  (torch's ``CUDAGraph.begin_capture_to_if_node``: a kernel that sets the node's handle from a
  bool tensor on the GPU, then the conditional node);
* ``if_pair``: two IF nodes on complementary predicates, each holding the kernel (an if / else
  as torch builds it before CUDA 12.8);
* ``empty``: nothing (what a replay costs by itself, divided by ``--reps``).

It also checks that the IF nodes ran what their predicates say (the counter's final value).

    python scripts/probe_graph_conditional.py --out bench_results/graph_conditional_h200.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics

import torch


def _if_body(graph_cls, pred: torch.Tensor):
    g = graph_cls.get_currently_capturing_graph()
    g.begin_capture_to_if_node(pred)
    return g


def capture(pattern: str, reps: int, x: torch.Tensor, p: torch.Tensor, q: torch.Tensor):
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(reps):
            if pattern == "kernel":
                x.add_(1)
            elif pattern in ("if_true", "if_false"):
                g = _if_body(torch.cuda.CUDAGraph, p if pattern == "if_true" else q)
                x.add_(1)
                g.end_capture_to_conditional_node()
            elif pattern == "if_pair":
                for pred in (p, q):
                    g = _if_body(torch.cuda.CUDAGraph, pred)
                    x.add_(1)
                    g.end_capture_to_conditional_node()
            elif pattern != "empty":
                raise ValueError(pattern)
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    has_api = all(hasattr(torch.cuda.CUDAGraph, a) for a in (
        "get_currently_capturing_graph", "begin_capture_to_if_node",
        "end_capture_to_conditional_node"))
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "has_if_node_api": has_api,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "reps": args.reps, "rounds": args.rounds, "us_per_rep": {}, "checks": {},
    }
    print(json.dumps({k: result[k] for k in ("gpu", "torch", "cuda", "has_if_node_api")}))
    patterns = ["empty", "kernel"] + (["if_true", "if_false", "if_pair"] if has_api else [])
    x = torch.zeros(1, device="cuda", dtype=torch.float32)
    p = torch.tensor(True, device="cuda")
    q = torch.tensor(False, device="cuda")
    for pattern in patterns:
        x.zero_()
        graph = capture(pattern, args.reps, x, p, q)
        x.zero_()
        graph.replay()
        torch.cuda.synchronize()
        expect = {"empty": 0, "kernel": 1, "if_true": 1, "if_false": 0, "if_pair": 1}[pattern]
        got = x.item()
        result["checks"][pattern] = {"expected": expect * args.reps, "got": got,
                                     "ok": got == expect * args.reps}
        times = []
        for _ in range(args.rounds):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1000.0 / args.reps)
        result["us_per_rep"][pattern] = round(statistics.median(times), 3)
        print(pattern, result["us_per_rep"][pattern], "us per repetition",
              result["checks"][pattern])
        del graph
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
