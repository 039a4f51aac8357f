#!/usr/bin/env python
"""Where a kernel's warps wait, per SASS opcode and per loop, from Nsight Compute's
per-instruction warp-state samples (no source-line mapping: works for Triton kernels).

Input: the CSV that ``ncu --section WarpStateStats --section SourceCounters --page source
--csv --print-source sass`` writes to stdout for one kernel launch (ncu's log lines before the
table are skipped; a file holding several launches, each after its ``"Kernel Name"`` line, is
split). For each launch it reports:

* every ``stall_*`` reason's share of the samples (``stall_selected`` is a warp issuing, so its
  share is the fraction of sampled warp-cycles spent issuing);
* per opcode (``HMMA.16816.F32.BF16`` -> ``HMMA``): samples, share, its two largest reasons;
* per loop (each backward branch, as ``sass_loop_mix.loops``): its body's static instruction
  count, share of the samples and largest reasons (printed from 1 % of the samples; all in
  the JSON);
* the ``--top`` instructions by samples.

    ncu --clock-control none -k regex:_gate_up_kernel --launch-skip 2 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters --page source --csv \\
        --print-source sass python3 scripts/bench_fused_moe.py --no-sglang --profile-ms 8 \\
        --layers 1 > gate_up.csv
    python scripts/ncu_sass_stalls.py gate_up.csv --out stalls.json
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_stall_lines import read_profile, samples  # noqa: E402
from sass_loop_mix import loops, opcode  # noqa: E402


def split_launches(text: str) -> list[tuple[str, str]]:
    """(kernel name, its part of the file) per ``"Kernel Name"`` line; the whole text under
    the name ``?`` if there is none."""
    lines = text.splitlines()
    starts = [i for i, x in enumerate(lines) if x.startswith('"Kernel Name"')]
    if not starts:
        return [("?", text)]
    parts = []
    for a, b in zip(starts, starts[1:] + [len(lines)]):
        cells = lines[a].split('","')
        name = cells[1].rstrip('",') if len(cells) > 1 else "?"
        parts.append((name, "\n".join(lines[a + 1:b])))
    return parts


def _top(counter: collections.Counter, total: int, n: int) -> list:
    return [[k, round(v / total, 4) if total else 0.0] for k, v in counter.most_common(n) if v]


def summarize(rows: list, top: int = 20) -> dict:
    """The report of one launch's per-instruction rows (``read_profile``)."""
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    by_reason = collections.Counter()
    by_op = collections.defaultdict(collections.Counter)
    op_samples = collections.Counter()
    per_insn = []
    insns = []
    for r in rows:
        addr = int(r["Address"], 16)
        text = r["Source"].strip()
        insns.append((addr, text))
        c = collections.Counter({k: samples(r, k) for k in reasons})
        n = sum(c.values())  # = ncu's "Warp Stall Sampling (All Samples)" of the row
        by_reason.update(c)
        op = opcode(text)
        by_op[op].update(c)
        op_samples[op] += n
        per_insn.append((addr, text, n, c))
    total = sum(by_reason.values())
    base = insns[0][0] if insns else 0
    ops = [{"opcode": op, "samples": n, "share": round(n / total, 4) if total else 0.0,
            "reasons": _top(by_op[op], n, 2)} for op, n in op_samples.most_common()]
    loop_rows = []
    for lp in loops(insns):
        lo, hi = int(lp["from"], 16), int(lp["to"], 16)
        c = collections.Counter()
        n = 0
        for addr, _, k, cc in per_insn:
            if lo <= addr <= hi:
                n += k
                c.update(cc)
        loop_rows.append({"from": hex(lo - base), "to": hex(hi - base),
                          "instructions": lp["instructions"], "samples": n,
                          "share": round(n / total, 4) if total else 0.0,
                          "reasons": _top(c, n, 4)})
    hot = sorted(per_insn, key=lambda x: -x[2])[:top]
    return {
        "samples": total,
        "instructions": len(rows),
        "issuing_share": round(by_reason["stall_selected"] / total, 4) if total else 0.0,
        "reasons": _top(by_reason, total, len(reasons)),
        "opcodes": ops,
        "loops": loop_rows,
        "top_instructions": [{"offset": hex(a - base), "sass": t, "samples": n,
                              "reasons": _top(c, n, 3)} for a, t, n, c in hot],
    }


def read(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return f.read()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="+", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=20, help="instructions listed by samples")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    launches = []
    for path in args.csv:
        for name, text in split_launches(read(path)):
            rep = summarize(read_profile(text), args.top)
            launches.append(dict(file=os.path.basename(path), kernel=name, **rep))
            print(f"{os.path.basename(path)}: {name[:70]}")
            print(f"  {rep['samples']} samples, issuing {rep['issuing_share']:.1%}; reasons: "
                  + ", ".join(f"{k[6:]} {v:.1%}" for k, v in rep["reasons"][:6]))
            for lp in rep["loops"]:
                if lp["share"] < 0.01:
                    continue
                print(f"  loop {lp['from']}-{lp['to']} ({lp['instructions']} instructions): "
                      f"{lp['share']:.1%} of samples; "
                      + ", ".join(f"{k[6:]} {v:.1%}" for k, v in lp["reasons"]))
            for o in rep["opcodes"][:8]:
                print(f"  {o['opcode']:<8} {o['share']:6.1%}  "
                      + ", ".join(f"{k[6:]} {v:.0%}" for k, v in o["reasons"]))
    result = {"command": " ".join([sys.executable] + sys.argv), "launches": launches}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
