#!/usr/bin/env python3
"""Summarise an Nsight Compute ``--csv --page details`` log (gpu_session.sh tvncu) as JSON.

Per kernel (launches grouped by name, grid and block), the median over its profiled launches of
the metrics that say where the time goes: duration, DRAM / L2 / L1 / SM throughput, issue slots,
IPC, warp cycles per issued instruction, occupancy and its limits, and the rules' highest-used
pipeline lines. Raw ncu logs are half a megabyte each; the summary is what bench_results keeps.

    python scripts/ncu_details_summary.py ncu_tree_verify_mha_h200.csv --out summary.json
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import statistics
import subprocess
import sys

METRICS = (
    "Duration", "DRAM Throughput", "Memory Throughput", "L2 Cache Throughput",
    "L1/TEX Cache Throughput", "Compute (SM) Throughput", "Issue Slots Busy",
    "Executed Ipc Active", "Warp Cycles Per Issued Instruction", "L2 Hit Rate",
    "L1/TEX Hit Rate", "Theoretical Occupancy", "Achieved Occupancy",
    "Achieved Active Warps Per SM", "Block Limit Registers", "Block Limit Shared Mem",
    "SM Frequency", "DRAM Frequency", "Grid Size", "Block Size", "Registers Per Thread",
    "Waves Per SM", "No Eligible", "Block Limit Warps",
)
RULES = ("HighPipeUtilization", "TheoreticalOccupancy", "SOLBottleneck")


def _number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarise(lines) -> list:
    """Kernels of a details-page CSV log (non-CSV lines skipped), in first-launch order."""
    rows = list(csv.reader(line for line in lines if line.startswith('"')))
    if not rows:
        return []
    col = {name: i for i, name in enumerate(rows[0])}
    launches = {}  # launch id -> (key, {metric: value}, {rule: text})
    for r in rows[1:]:
        if len(r) <= col["Metric Value"]:
            continue
        key = (r[col["Kernel Name"]], r[col["Grid Size"]], r[col["Block Size"]])
        _, metrics, rules = launches.setdefault(r[col["ID"]], (key, {}, {}))
        name = r[col["Metric Name"]]
        if name in METRICS:
            metrics[name] = (_number(r[col["Metric Value"]]), r[col["Metric Unit"]])
        rule = r[col["Rule Name"]] if len(r) > col["Rule Name"] else ""
        if rule in RULES and len(r) > col["Rule Description"]:
            rules.setdefault(rule, r[col["Rule Description"]])
    kernels = {}
    for key, metrics, rules in launches.values():
        k = kernels.setdefault(key, {"launches": 0, "values": {}, "units": {}, "rules": {}})
        k["launches"] += 1
        for name, (value, unit) in metrics.items():
            if value is not None:
                k["values"].setdefault(name, []).append(value)
                k["units"][name] = unit
        for rule, text in rules.items():
            k["rules"].setdefault(rule, text)
    out = []
    for (name, grid, block), k in kernels.items():
        out.append({
            "kernel": name, "grid": grid, "block": block, "launches": k["launches"],
            "median": {m: statistics.median(v) for m, v in k["values"].items()},
            "units": k["units"], "rules": k["rules"]})
    return out


def _gpu_name() -> str:
    """nvidia-smi's name of GPU 0, or "" where there is none (the summary runs where ncu ran)."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return r.stdout.splitlines()[0].strip() if r.returncode == 0 and r.stdout.strip() else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", help="ncu --csv --page details logs")
    ap.add_argument("--out", default=None)
    ap.add_argument("--note", default="", help="what was profiled (recorded in the JSON)")
    ap.add_argument("--gpu", default=None,
                    help="the profiled GPU's name (default: nvidia-smi's first GPU, if any)")
    args = ap.parse_args(argv)
    words = sys.argv[1:] if argv is None else list(argv)
    result = {"note": args.note, "command": " ".join([sys.executable, sys.argv[0]] + words),
              "gpu": args.gpu if args.gpu is not None else _gpu_name(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "files": {}}
    for path in args.logs:
        with open(path) as f:
            result["files"][path.rsplit("/", 1)[-1]] = summarise(f)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
