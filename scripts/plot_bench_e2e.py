#!/usr/bin/env python3
"""Plots and a README table from a scripts/bench_e2e.py JSON (runs anywhere, no GPU).

    python scripts/plot_bench_e2e.py bench_results/bench_e2e_tiny_h200.json [--png-dir DIR]
        [--readme README.md]

Writes ``<stem>_tps.png`` (output tokens/s vs concurrency, one line per method) and
``<stem>_budget.png`` (DDTREE accept length and tokens/s at concurrency 1 vs budget, DFLASH as a
reference line) when matplotlib is installed, and prints the markdown table; with ``--readme``
the table replaces the block between ``<!-- bench-e2e:begin -->`` and ``<!-- bench-e2e:end -->``.
"""

from __future__ import annotations

import argparse
import json
import os
import re

BEGIN, END = "<!-- bench-e2e:begin -->", "<!-- bench-e2e:end -->"


def table(data: dict, mode: str = "greedy") -> str:
    methods = list(data["results"])
    concs = sorted({int(c) for m in methods for c in data["results"][m].get(mode, {})})
    head = "| method | " + " | ".join(f"c={c} tok/s (accept)" for c in concs) + " |"
    rows = [head, "| --- |" + " --- |" * len(concs)]
    for m in methods:
        cells = []
        for c in concs:
            r = data["results"][m].get(mode, {}).get(str(c))
            if r is None:
                cells.append("-")
                continue
            acc = r.get("accept_length")
            cells.append(f"{r['tokens_per_s']:.0f}" + (f" ({acc:.2f})" if acc else ""))
        rows.append(f"| {m} | " + " | ".join(cells) + " |")
    src = f"{data['gpu']}, SGLang {data['sglang_version']}, {data['date'][:10]}, `{data['command']}`"
    return f"Output tokens/s, {mode}, median of {data['repeats']} ({src}):\n\n" + "\n".join(rows)


OWN_STAGES = ("tree", "accept", "commit")  # what DDTREE adds to a chain step (StepTimers)


MODE_WORDS = {
    "sync": "GPU-synchronized stage timers (`SGLANG_DDTREE_TIMERS=1`: each stage also pays a "
            "host-GPU round trip)",
    "gpu": "CUDA-event stage timers (`SGLANG_DDTREE_TIMERS=gpu`: each stage's time on the GPU's "
           "stream, no per-step sync)",
    "cpu": "host stage timers of the speed servers (`SGLANG_DDTREE_TIMERS=cpu`: the host time "
           "each stage takes to issue its work)",
}


def overhead_table(data: dict) -> str:
    """DDTree's own share of the step (tree + accept + commit over the sum of all stages) per
    batch size (powers of two): from the ``-timers`` servers (``stage_ms_by_batch_size``,
    CUDA-event or synchronized timers) and, where the JSON has them, the speed servers' host timers
    (``cpu_stage_ms_by_batch_size``); '' when it has neither. Runs from before the
    ``draft_kv`` stage counted DFlash's drafter KV append inside commit: their share is an upper
    bound and says so."""
    blocks = []
    for key in ("stage_ms_by_batch_size", "cpu_stage_ms_by_batch_size"):
        by_mode = {}
        for method, rec in sorted((data.get(key) or {}).items()):
            rec = rec or {}
            for bs, st in sorted((rec.get("bs") or {}).items(), key=lambda x: int(x[0])):
                if int(bs) & (int(bs) - 1):  # batch sizes 1, 2, 4, 8, ...: a readable table
                    continue
                total = sum(v for k, v in st.items() if k != "steps")
                if not total:
                    continue
                own = sum(st.get(k, 0.0) for k in OWN_STAGES)
                bound = "" if "draft_kv" in st else " (upper bound: commit includes draft_kv)"
                by_mode.setdefault(rec.get("mode") or "sync", []).append(
                    f"| {method} | {bs} | {st['steps']} | {total:.3f} | {own:.3f} | "
                    f"{100 * own / total:.1f} %{bound} |")
        for mode, rows in by_mode.items():
            head = ["| method | batch size | steps | step ms | tree + accept + commit ms | share |",
                    "| --- | --- | --- | --- | --- | --- |"]
            blocks.append(f"DDTree's own per-step overhead, {MODE_WORDS.get(mode, mode)} (goal: at "
                          "most 3 % at budget 32, batch 1..32):\n\n" + "\n".join(head + rows))
    return "\n\n".join(blocks)


def plots(data: dict, stem: str) -> list:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = []
    # greedy when the run has it, else T = 1 (a run of one mode)
    mode = "greedy" if any("greedy" in r for r in data["results"].values()) else "t1"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, res in data["results"].items():
        pts = sorted((int(c), r["tokens_per_s"]) for c, r in res.get(mode, {}).items())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel(f"output tokens/s ({mode})")
    ax.legend(fontsize=8)
    ax.set_title(f"{data['gpu']} / SGLang {data['sglang_version']}")
    fig.tight_layout()
    out.append(f"{stem}_tps.png")
    fig.savefig(out[-1], dpi=120)
    plt.close(fig)

    # fixed budgets only (ddtree_bauto and ddtree_tv_b* are in the tokens/s plot and the table)
    budgets = sorted((int(m[len("ddtree_b"):]), m) for m in data["results"]
                     if m.startswith("ddtree_b") and m[len("ddtree_b"):].isdigit())
    if budgets:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        c1 = lambda m, k: data["results"][m].get(mode, {}).get("1", {}).get(k)  # noqa: E731
        ax.plot([b for b, _ in budgets], [c1(m, "accept_length") for _, m in budgets],
                marker="o", label="DDTREE accept length")
        if "dflash" in data["results"]:
            ax.axhline(c1("dflash", "accept_length") or 0, ls="--", label="DFLASH accept length")
        ax2 = ax.twinx()
        ax2.plot([b for b, _ in budgets], [c1(m, "tokens_per_s") for _, m in budgets],
                 marker="s", color="tab:red", label="DDTREE tokens/s (c=1)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget")
        ax.set_ylabel("accept length")
        ax2.set_ylabel("tokens/s at concurrency 1")
        fig.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        out.append(f"{stem}_budget.png")
        fig.savefig(out[-1], dpi=120)
        plt.close(fig)
    return out


def update_readme(path: str, block: str) -> None:
    text = open(path).read()
    new = f"{BEGIN}\n{block}\n{END}"
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: new, text, flags=re.S)
    else:
        text += "\n" + new + "\n"
    open(path, "w").write(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--png-dir", default=None)
    ap.add_argument("--readme", default=None)
    args = ap.parse_args()
    data = json.load(open(args.json))
    stem = os.path.join(args.png_dir or os.path.dirname(args.json),
                        os.path.splitext(os.path.basename(args.json))[0])
    parts = [table(data, m) for m in ("greedy", "t1")
             if any(m in r for r in data["results"].values())]
    parts += [t for t in (overhead_table(data),) if t]
    block = "\n\n".join(parts)
    print(block)
    for p in plots(data, stem):
        print("wrote", p)
    if args.readme:
        update_readme(args.readme, block)


if __name__ == "__main__":
    main()
