#!/usr/bin/env python3
"""Derive a ``SGLANG_DDTREE_AUTO_TABLE`` from a measured scripts/bench_e2e.py run.

For every measured concurrency, the fixed DDTREE budget with the most output tokens/s wins;
batch sizes between two measured concurrencies take the nearer one's winner (the boundary is
their geometric mean, rounded down); runs of equal winners merge. The result is what
``--speculative-ddtree-budget auto`` reads:

    python scripts/make_auto_table.py bench_results/bench_e2e_tiny_h200_partial.json
    # -> SGLANG_DDTREE_AUTO_TABLE=2:32,inf:8

It also says where DFLASH beat the best DDTREE budget: there the table cannot help.

With ``--bands 8`` (batch-size upper bounds) the table has one budget per band instead: the
budget with the highest geometric mean of its DDTREE / DFLASH ratio over the band's measured
concurrencies, so that one noisy point does not add a switch (the default table came from
``bench_e2e_tiny_h200_sweep_s7.json`` this way):

    python scripts/make_auto_table.py bench_results/bench_e2e_tiny_h200_sweep_s7.json --bands 8
    # -> SGLANG_DDTREE_AUTO_TABLE=8:128,inf:64
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys

BUDGET_RE = re.compile(r"^ddtree_b(\d+)$")


def budget_points(data: dict, mode: str = "greedy"):
    """(concurrency, budget, DDTREE tokens/s, DFLASH tokens/s or None) of every fixed-budget
    point measured in ``mode``."""
    results = data.get("results", {})
    dflash = results.get("dflash", {}).get(mode, {})
    for method, modes in results.items():
        m = BUDGET_RE.match(method)
        if not m:
            continue
        for c, row in modes.get(mode, {}).items():
            if row.get("tokens_per_s") is not None:
                yield (int(c), int(m.group(1)), row["tokens_per_s"],
                       dflash.get(c, {}).get("tokens_per_s"))


def winners(data: dict, mode: str = "greedy") -> dict:
    """{concurrency: (best budget, its tokens/s, dflash tokens/s or None)} over fixed budgets."""
    out = {}
    for c, budget, tps, ref in budget_points(data, mode):
        if c not in out or tps > out[c][1]:
            out[c] = (budget, tps, ref)
    return dict(sorted(out.items()))


def table_from(win: dict) -> str:
    """'max_bs:budget,...,inf:budget' from {concurrency: (budget, ...)}."""
    if not win:
        raise ValueError("no DDTREE fixed-budget results in this run")
    concs = sorted(win)
    rows = []
    for i, c in enumerate(concs):
        bound = "inf" if i + 1 == len(concs) else str(int(math.sqrt(c * concs[i + 1])))
        budget = win[c][0]
        if rows and rows[-1][1] == budget:
            rows[-1] = (bound, budget)  # extend the previous range
        else:
            rows.append((bound, budget))
    return ",".join(f"{b}:{budget}" for b, budget in rows)


def ratios(data: dict, mode: str = "greedy") -> dict:
    """{concurrency: {budget: DDTREE / DFLASH tokens/s}} where both were measured."""
    out: dict = {}
    for c, budget, tps, ref in budget_points(data, mode):
        if ref:
            out.setdefault(c, {})[budget] = tps / ref
    return dict(sorted(out.items()))


def table_from_bands(rat: dict, bands: list) -> str:
    """One budget per batch-size band (upper bounds ``bands``, then inf): the best geometric
    mean ratio over the band's concurrencies, among budgets measured at all of them."""
    rows = []
    lo = 0
    for hi in list(bands) + [math.inf]:
        concs = [c for c in rat if lo < c <= hi]
        lo = hi
        if not concs:
            continue
        common = set.intersection(*(set(rat[c]) for c in concs))
        if not common:
            raise ValueError(f"no budget measured at every concurrency of {concs}")
        score = {b: math.exp(sum(math.log(rat[c][b]) for c in concs) / len(concs)) for b in common}
        best = max(sorted(common), key=lambda b: score[b])
        bound = "inf" if hi == math.inf else str(hi)
        if rows and rows[-1][1] == best:
            rows[-1] = (bound, best)
        else:
            rows.append((bound, best))
    return ",".join(f"{b}:{budget}" for b, budget in rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_json")
    ap.add_argument("--mode", default="greedy", choices=("greedy", "t1"))
    ap.add_argument("--bands", type=int, nargs="*", default=None,
                    help="batch-size band upper bounds: one budget per band (see above)")
    args = ap.parse_args(argv)
    data = json.load(open(args.bench_json))
    if args.bands is not None:
        rat = ratios(data, args.mode)
        for c, row in rat.items():
            print(f"# concurrency {c}: " + ", ".join(f"b{b} {r:.2f}x" for b, r in sorted(row.items())),
                  file=sys.stderr)
        print(f"SGLANG_DDTREE_AUTO_TABLE={table_from_bands(rat, args.bands)}")
        return
    win = winners(data, args.mode)
    for c, (budget, tps, ref) in win.items():
        note = "" if ref is None else f"  (DFLASH {ref:.0f}: {tps / ref:.2f}x)"
        print(f"# concurrency {c}: budget {budget}, {tps:.0f} tok/s{note}", file=sys.stderr)
    print(f"SGLANG_DDTREE_AUTO_TABLE={table_from(win)}")


if __name__ == "__main__":
    main()
