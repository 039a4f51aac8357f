#!/usr/bin/env python3
"""Merge scripts/bench_e2e.py JSONs of one setup measured over several device calls.

    python scripts/merge_bench_e2e.py A.json B.json [...] -o bench_results/bench_e2e_tiny_h200.json

A device call is limited to 10 minutes, so the full grid (concurrency 1..64, greedy and T = 1)
runs as several calls with the same servers' settings. Results are keyed method -> mode ->
concurrency; a key measured in two files is an error (say which one to keep by leaving the
other file out). Stage timers and per-batch-size tables are merged by method; ``merged_from``
records every input's file name, date, command and source digest, and the merge refuses inputs
whose GPU, SGLang version, model pair, repeats or new-token count differ.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

SAME = ("gpu", "sglang_version", "target", "draft", "max_new_tokens", "repeats")
BY_METHOD = ("stage_ms_per_step", "cpu_stage_ms_per_step", "stage_ms_by_batch_size",
             "cpu_stage_ms_by_batch_size", "accept_by_smaller_budget", "startup_s")


def merge(runs: list, names: list) -> dict:
    if not runs:
        raise ValueError("nothing to merge")
    base = runs[0]
    for name, r in zip(names[1:], runs[1:]):
        for k in SAME:
            if r.get(k) != base.get(k):
                raise ValueError(f"{name}: {k} = {r.get(k)!r}, but {names[0]} has {base.get(k)!r}")
    out = {k: v for k, v in base.items() if k not in ("results", "errors", "status") + BY_METHOD}
    out["results"] = {}
    out["errors"] = {}
    for k in BY_METHOD:
        out[k] = {}
    for name, r in zip(names, runs):
        for method, modes in r.get("results", {}).items():
            for mode, by_c in modes.items():
                dst = out["results"].setdefault(method, {}).setdefault(mode, {})
                for c, row in by_c.items():
                    if c in dst:
                        raise ValueError(f"{name}: {method} {mode} c={c} is in two inputs")
                    dst[c] = row
        for k in BY_METHOD:
            for method, v in r.get(k, {}).items():  # a second input's table keeps its file name
                out[k][method if method not in out[k] else f"{method}@{name}"] = v
        for k, v in r.get("errors", {}).items():
            out["errors"][f"{k}@{name}"] = v
    out["date"] = min(r["date"] for r in runs)
    out["command"] = " ; ".join(r["command"] for r in runs)
    out["merged_from"] = [{"file": os.path.basename(n), "date": r.get("date"),
                           "command": r.get("command"), "source_digest": r.get("source_digest"),
                           "status": r.get("status")} for n, r in zip(names, runs)]
    digests = {r.get("source_digest") for r in runs}
    out["source_digest"] = digests.pop() if len(digests) == 1 else "differs between inputs"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args(argv)
    runs = [json.load(open(p)) for p in args.inputs]
    try:
        merged = merge(runs, args.inputs)
    except ValueError as e:
        print(f"merge_bench_e2e: {e}", file=sys.stderr)
        return 2
    with open(args.out, "w") as f:
        json.dump(merged, f, indent=1)
    print(f"merged {len(runs)} runs -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
