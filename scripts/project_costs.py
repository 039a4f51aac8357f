#!/usr/bin/env python
"""A labelled *projection* from measured step costs: tokens/s = batch x accept length / step.

Nothing here is measured. The step costs are (from ``scripts/bench_cost_curves.py`` JSONs, dummy
weights on the H200, and on an H100 for session 66's Kimi rank; each source's GPU is in the
output):

- AR and DFLASH: the speed servers' TPOT x their accept length (AR: 1), i.e. the step;
- DDTREE per budget: the speed server's step where one ran, else the sum of the ``-timers``
  server's stage times (CUDA events: draft, tree, verify, accept, commit, publish, drafter KV),
  labelled ``timers``; that sum leaves out the scheduler's time between steps, which the AR
  TPOT includes, so it flatters DDTREE by that much.

The accept lengths come from elsewhere and are named in the output:

- ``tiny_pair``: our trained tiny pair, greedy, concurrency 1 (``--accept-json``, a
  ``scripts/bench_e2e.py`` JSON with DFLASH and DDTREE per budget);
- ``published``: the DDTree paper's values (``--published``; one DFLASH and one DDTREE value at
  the paper's best budget, applied to every measured DDTREE budget, and labelled so).

A method whose step or accept length is missing is left out, never filled in.

    python scripts/project_costs.py --out bench_results/projection_h200_s22.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_cost_curves import accept_from_bench, project as tokens_per_s  # noqa: E402
RESULTS = os.path.join(HERE, "..", "bench_results")
# the committed cost curves this projection reads by default, with what each one's dummy weights
# do to the step (printed with every row of that model)
DEFAULT_COSTS = {
    "cost_curves_h200.json":
        "8 of 61 layers; SGLang's stock dummy fill routes every token to the same 8-10 experts "
        "(session 14), so its verify reads no more expert weights than a decode step",
    "cost_curves_kimi_l61_int4_indep_h200_s14.json":
        "all 61 layers, int4 experts on our fused MoE; dummy routers that route each token "
        "independently (65 / 188 of 384 experts per 9- / 33-token verify): a real router lies "
        "between this and the stock fill",
    "cost_curves_kimi_l61_int4_rankvocab_h200_s22.json":
        "all 61 layers, int4 experts on our fused MoE, one TP8 rank's 20,480-row vocabulary; "
        "SGLang's stock dummy fill (every token to the same experts: the cheapest verify); "
        "AR speed server and DDTREE b8 / b16 / b32 -timers servers, no DFLASH step",
    "cost_curves_kimi_l61_b7_b32_split1_h100_s66.json":
        "all 61 layers on an H100 (session 66), int4 experts on our fused MoE, the rank's "
        "vocabulary, the MLA verify's split query / latent parts (served since session 64); "
        "SGLang's stock dummy fill (every token to the same experts: the cheapest verify); AR "
        "speed server and DDTREE b7 / b8 / b15 / b31 / b32 -timers servers, no DFLASH step",
    "cost_curves_qwen3_8b_dflash_h200_s16.json":
        "dense; dummy weights; AR and DFLASH speed servers (session 16; DFLASH's own accept "
        "length there is 1.02, the random drafter's) and the DDTREE b32 -timers server",
    "cost_curves_kimi_l61_rankvocab_32k_draft_ours_h200_s24.json":
        "the rank-vocabulary rank at 32,768 prompt tokens on SGLang's flashmla backend, pages "
        "of 64, verify prefix on FlashMLA, the drafter's attention on our kernel (session 24); "
        "AR speed server and DDTREE b8 / b16 -timers servers, no DFLASH step",
    "cost_curves_kimi_l61_rankvocab_32k_draft_flashinfer_h200_s24.json":
        "as above with the drafter on SGLang's flashinfer backend (session 24)",
    "cost_curves_qwen3_30b_a3b_h200_s15.json":
        "dummy weights; a 33-token verify touches 114 of 128 experts",
}
STAGES = ("draft", "tree", "verify", "accept", "commit", "publish", "draft_kv")


def step_costs(model: dict) -> dict:
    """{method: {batch: {"ms": step ms, "from": "speed" | "timers"}}} of one model's entry."""
    out = {}
    for method, per_c in (model.get("step_ms") or {}).items():
        for c, ms in per_c.items():
            if ms:
                out.setdefault(method, {})[str(c)] = {"ms": float(ms), "from": "speed"}
    for method, per_c in (model.get("stage_ms") or {}).items():
        for c, stages in per_c.items():
            if str(c) in out.get(method, {}) or not stages:
                continue
            if not all(s in stages for s in STAGES):
                continue
            ms = sum(float(stages[s]) for s in STAGES)
            out.setdefault(method, {})[str(c)] = {"ms": round(ms, 4), "from": "timers"}
    return out


def step_cap(method: str, block) -> float:
    """The most tokens one step of ``method`` can emit with a drafter of ``block`` positions:
    the block (its drafted positions and the bonus token); for DDTREE also budget + 1 (the
    path is at most the tree's nodes, plus the bonus). Unbounded when the block is unknown."""
    cap = float(block) if block else float("inf")
    if method.startswith("ddtree_b") and method[8:].isdigit():
        cap = min(cap, int(method[8:]) + 1.0)
    return cap


def published_accepts(pub: dict, methods, block=None) -> dict:
    """{method: accept length}: the paper's DFLASH value, and its one DDTREE value for every
    DDTREE budget we measured (labelled in the output: the paper's budget is its best one),
    each capped at what a step of that method can emit with this model's drafter block
    (:func:`step_cap`; the paper's drafter has a block of 16, the Kimi emulation's 8)."""
    out = {"ar": 1.0}
    if pub.get("dflash") is not None:
        out["dflash"] = min(float(pub["dflash"]), step_cap("dflash", block))
    if pub.get("ddtree") is not None:
        for m in methods:
            if m.startswith("ddtree"):
                out[m] = min(float(pub["ddtree"]), step_cap(m, block))
    return out


def project(costs: dict, accepts: dict) -> dict:
    """{method: {batch: {"tokens_per_s", "step_ms", "step_from", "accept", "over_ar",
    "over_dflash"}}}: ``bench_cost_curves.project`` on these steps, with where each came from."""
    concs = sorted({int(c) for per_c in costs.values() for c in per_c})
    tps = tokens_per_s({m: {c: step["ms"] for c, step in per_c.items()}
                        for m, per_c in costs.items()}, accepts, concs)
    out = {m: {c: {"tokens_per_s": v, "step_ms": costs[m][c]["ms"],
                   "step_from": costs[m][c]["from"], "accept": accepts[m]}
               for c, v in row.items()}
           for m, row in tps.items()}
    for method, per_c in out.items():
        for c, row in per_c.items():
            bases = ("ar", "dflash") if method.startswith("ddtree") else \
                ("ar",) if method == "dflash" else ()
            for base in bases:
                ref = out.get(base, {}).get(c)
                if ref:
                    row[f"over_{base}"] = round(row["tokens_per_s"] / ref["tokens_per_s"], 2)
    return out


def markdown(result: dict) -> str:
    lines = [f"- {m}: {src['file']} ({src['note']})" for m, src in result["step_sources"].items()]
    lines += ["", "| model | accept from | method | batch | step ms (from) | accept | projected tokens/s "
             "| / AR | / DFLASH |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for model, by_src in result["projection"].items():
        for src, per_m in by_src.items():
            for method in sorted(per_m, key=lambda m: (m != "ar", m != "dflash", m)):
                for c, r in sorted(per_m[method].items(), key=lambda kv: int(kv[0])):
                    lines.append(
                        f"| {model} | {src} | {method} | {c} | {r['step_ms']:.2f} ({r['step_from']}) "
                        f"| {r['accept']:.2f} | {r['tokens_per_s']:.0f} | {r.get('over_ar', '')} "
                        f"| {r.get('over_dflash', '')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--costs", nargs="*", default=[os.path.join(RESULTS, f) for f in DEFAULT_COSTS],
                    help="scripts/bench_cost_curves.py JSONs (default: the committed ones)")
    ap.add_argument("--accept-json", default=os.path.join(RESULTS, "bench_e2e_tiny_h200_sweep_s7.json"))
    ap.add_argument("--published", default=os.path.join(
        HERE, "..", "bench_assets", "published_accept_ddtree_paper.json"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    pub = json.load(open(args.published)) if args.published else None
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": " ".join(["python", "scripts/project_costs.py"] + (argv or sys.argv[1:])),
              "label": "PROJECTION, not a measurement: measured step costs x accept lengths "
                       "measured elsewhere (named per row)",
              "step_sources": {}, "accept_sources": {}, "projection": {}}
    tiny = dict(accept_from_bench(args.accept_json), ar=1.0) if args.accept_json else None
    if tiny:
        result["accept_sources"]["tiny_pair"] = {
            "file": os.path.basename(args.accept_json), "values": tiny}
    for path in args.costs:
        data = json.load(open(path))
        for name, entry in data.get("models", {}).items():
            costs = step_costs(entry)
            if not costs:
                continue
            # one model measured in several files (contexts, drafter backends): keyed by both
            model = name if name not in result["step_sources"] else \
                f"{name} [{os.path.basename(path)}]"
            result["step_sources"][model] = {
                "file": os.path.basename(path), "date": data.get("date"), "gpu": data.get("gpu"),
                "note": DEFAULT_COSTS.get(os.path.basename(path), "")}
            by_src = {}
            if tiny:
                by_src["tiny_pair"] = project(costs, tiny)
            if pub:
                acc = published_accepts(pub, costs, entry.get("drafter_block"))
                result["accept_sources"]["published"] = {
                    "source": pub.get("source"), "budget": pub.get("budget"),
                    "dflash": pub.get("dflash"), "ddtree": pub.get("ddtree")}
                by_src["published"] = project(costs, acc)
            result["projection"][model] = by_src
    text = markdown(result)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print("->", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
