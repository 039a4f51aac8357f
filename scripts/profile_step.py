#!/usr/bin/env python3
"""Where a decode step's time goes: AR / DFLASH / DDTREE under SGLang's own profiler.

Starts one server per method (same flags; by default the trained tiny pair), warms it up, then
asks SGLang for a torch-profiler trace of ``--steps`` decode steps (``/start_profile`` with
CPU + GPU activities and Python stacks) while a concurrency-``--concurrency`` load runs, and
summarises each trace: per decode step, the host time inside every Python function (inclusive),
the count and time of CUDA runtime calls (kernel / graph launches), and the GPU kernel time,
in total, by kernel name, and by the step frame that launched it (a DDTREE step's verify
forward apart from its drafter and tree kernels; needs the trace's correlation ids).
``--dummy`` profiles a config-only pair (e.g. the Kimi rank emulation under
bench_assets/model-configs) with dummy weights.
The profiler slows the host side down, so compare the two methods with each other, not with
the benchmark's tokens/s. Each target forward's kernels are also summed by family (MoE,
attention, GEMM, norm, other) and compared with AR's. Kernel durations add up to GPU time
only where kernels do not overlap: SGLang's DeepseekV2 layers run the shared expert on a
second stream inside CUDA graphs, so each frame also records its busy time (the union of its
kernels' spans) and each kernel its time beside another stream's kernel.

    python scripts/profile_step.py --out bench_results/profile_step_h200.json
    python scripts/profile_step.py --compare A.json B.json --pairs ddtree_b15:ddtree_b16

``summarize_trace`` is importable and tested on CPU (tests/test_profile_step.py).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import datetime
import glob
import gzip
import json
import os
import sys
import time
import urllib.request

from sglang_ddtree.provenance import checkout_digest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STEP_FUNCTION = "forward_batch_generation"  # one call per scheduler step in the spec worker


def load_trace(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _pyname(name: str) -> str:
    """'path/to/sglang_ddtree/worker.py(211): forward_batch_generation' -> 'worker.py:forward_batch_generation'."""
    if "): " in name and "(" in name:
        where, func = name.split("): ", 1)
        return f"{os.path.basename(where.split('(')[0])}:{func}"
    return name


def summarize_trace(trace: dict, top: int = 40, tree_depth: int = 4,
                    frame_depth: int = 2) -> dict:
    """Per-step host and GPU costs from a chrome trace (torch profiler ``export_chrome_trace``).

    Steps are the calls of the spec worker's ``forward_batch_generation`` (the outermost ones);
    every number is divided by their count. Durations are in microseconds in the trace and ms
    here.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    py = collections.defaultdict(lambda: [0.0, 0])
    rt = collections.defaultdict(lambda: [0.0, 0])
    ops = collections.defaultdict(lambda: [0.0, 0])
    kern = collections.defaultdict(lambda: [0.0, 0])
    kernel_us, kernels = 0.0, 0
    step_spans = []
    for e in events:
        cat, name, dur = e.get("cat", ""), e.get("name", ""), float(e["dur"])
        if cat == "python_function":
            key = _pyname(name)
            py[key][0] += dur
            py[key][1] += 1
            if key.endswith(":" + STEP_FUNCTION) and "worker" in key:
                step_spans.append((float(e["ts"]), float(e["ts"]) + dur, key))
        elif cat == "cuda_runtime":
            rt[name][0] += dur
            rt[name][1] += 1
        elif cat == "cpu_op":
            ops[name][0] += dur
            ops[name][1] += 1
        elif cat == "kernel":
            kernel_us += dur
            kernels += 1
            kern[name[:160]][0] += dur
            kern[name[:160]][1] += 1
    # outermost worker calls only (a subclass calling super() nests one inside the other)
    step_spans.sort()
    outer, end = [], -1.0
    for s, t, key in step_spans:
        if s >= end:
            outer.append((s, t, key))
            end = t
    steps = max(len(outer), 1)

    def table(d):
        rows = sorted(d.items(), key=lambda kv: -kv[1][0])[:top]
        return [{"name": k, "ms_per_step": round(v[0] / 1e3 / steps, 4),
                 "calls_per_step": round(v[1] / steps, 2)} for k, v in rows]

    launches = sum(v[1] for k, v in rt.items() if "LaunchKernel" in k or "GraphLaunch" in k)
    launch_paths = {}
    tree = step_tree(events, outer, steps, max_depth=tree_depth, launch_paths=launch_paths)
    return {
        "step_tree": tree,
        "steps": len(outer),
        "step_host_ms": round(sum(t - s for s, t, _ in outer) / 1e3 / steps, 4),
        "kernel_ms_per_step": round(kernel_us / 1e3 / steps, 4),
        "kernels_per_step": round(kernels / steps, 1),
        "launch_calls_per_step": round(launches / steps, 1),
        "python_inclusive": table(py),
        "cuda_runtime": table(rt),
        "cpu_ops": table(ops),
        "gpu_kernels": table(kern),  # GPU time by kernel name (graph-replayed ones included)
        "gpu_kernels_by_frame": kernels_by_frame(events, launch_paths, steps, frame_depth),
    }


OUTSIDE = "(launched outside a step)"


def _stream(e: dict):
    """A kernel event's stream (the trace's ``args.stream``, else its ``tid``)."""
    return (e.get("args") or {}).get("stream", e.get("tid"))


def _union_us(spans: list) -> float:
    """Length of the union of ``(start, end)`` spans."""
    total, end = 0.0, None
    for s, t in sorted(spans):
        if end is None or s > end:
            total += t - s
            end = t
        elif t > end:
            total += t - end
            end = t
    return total


def _concurrent_us(kernels: list) -> list:
    """For each ``(start, end, stream)`` kernel, the part of it during which a kernel of
    another stream ran (SGLang's DeepseekV2 layers run the shared expert on a second stream
    inside CUDA graphs, beside the routed MoE: both kernels' durations then hold the shared
    time, and their sum exceeds the GPU time). A stream runs its kernels one after another,
    so per stream the spans sorted by start are sorted by end too."""
    by_stream = collections.defaultdict(list)
    for s, t, st in kernels:
        by_stream[st].append((s, t))
    for spans in by_stream.values():
        spans.sort()
    ends = {st: [t for _, t in spans] for st, spans in by_stream.items()}
    out = []
    for s, t, st in kernels:
        hits = []
        for other, spans in by_stream.items():
            if other == st:
                continue
            j = bisect.bisect_right(ends[other], s)  # first span ending after s
            while j < len(spans) and spans[j][0] < t:
                hits.append((max(s, spans[j][0]), min(t, spans[j][1])))
                j += 1
        out.append(_union_us(hits))
    return out


def kernels_by_frame(events, launch_paths: dict, steps: int, depth: int = 2,
                     top: int = 80) -> list:
    """GPU kernel time per step by the step frame that launched it: each kernel joins its
    launch call (``cudaLaunchKernel`` / ``cudaGraphLaunch``, which a graph's kernels all
    share) by the trace's ``correlation`` id, and the launch call the innermost Python frame
    around it (``launch_paths``, filled by :func:`step_tree`), cut to ``depth`` levels below
    the step (e.g. ``worker.py:forward_batch_generation > worker.py:_decode_step >
    worker.py:_verify``). So a DDTREE step's verify forward is told from its drafter and tree
    kernels. A trace without correlation ids puts every kernel under ``OUTSIDE``.
    Kernel times are summed; where kernels of two streams overlap the sum exceeds the GPU
    time, so each frame also has ``busy_ms_per_step`` (the union of its kernels' spans) and
    each kernel ``concurrent_ms_per_step`` (its time beside another stream's kernel).
    [{"frame", "ms_per_step", "busy_ms_per_step", "kernels_per_step", "kernels": [{"name",
    "ms_per_step", "calls_per_step", "concurrent_ms_per_step"}]}], most time first."""
    kernels = [e for e in events if e.get("cat") == "kernel"]
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), _stream(e)) for e in kernels]
    concurrent = _concurrent_us(spans)
    frames = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0, 0.0]))
    frame_spans = collections.defaultdict(list)
    for e, span, conc in zip(kernels, spans, concurrent):
        path = launch_paths.get((e.get("args") or {}).get("correlation"))
        frame = OUTSIDE if path is None else " > ".join(path.split(" > ")[:depth + 1])
        k = frames[frame][e.get("name", "")[:160]]
        k[0] += float(e["dur"])
        k[1] += 1
        k[2] += conc
        frame_spans[frame].append(span[:2])
    out = []
    for frame, kern in frames.items():
        rows = sorted(kern.items(), key=lambda kv: -kv[1][0])
        out.append({"frame": frame,
                    "ms_per_step": round(sum(v[0] for v in kern.values()) / 1e3 / steps, 4),
                    "busy_ms_per_step": round(_union_us(frame_spans[frame]) / 1e3 / steps, 4),
                    "kernels_per_step": round(sum(v[1] for v in kern.values()) / steps, 1),
                    "kernels": [{"name": n, "ms_per_step": round(v[0] / 1e3 / steps, 4),
                                 "calls_per_step": round(v[1] / steps, 2),
                                 "concurrent_ms_per_step": round(v[2] / 1e3 / steps, 4)}
                                for n, v in rows[:top]]})
    out.sort(key=lambda f: -f["ms_per_step"])
    return out


def _is_launch(name: str) -> bool:
    return "LaunchKernel" in name or "GraphLaunch" in name


def step_tree(events, outer, steps, max_depth=4, min_ms=0.005, launch_paths=None):
    """The step's host time as a call tree: one row per call path below the step function
    (``a > b > c``, at most ``max_depth`` levels), with inclusive ms, calls and CUDA launches
    per step, in call order. Nesting is by time containment of Python events on one thread;
    CUDA runtime calls count towards the innermost Python frame around them. A dict passed as
    ``launch_paths`` receives each launch call's ``correlation`` id -> that frame's path."""
    spans = {(s, t) for s, t, _ in outer}
    py = sorted((e for e in events if e.get("cat") in ("python_function", "cuda_runtime")),
                key=lambda e: (e.get("tid", 0), float(e["ts"]), -float(e["dur"])))
    rows = {}  # path -> [us, calls, launches, first ts]
    stack = []  # (end, path) of open Python frames on this thread
    tid = None
    for e in py:
        ts, dur = float(e["ts"]), float(e["dur"])
        if e.get("tid", 0) != tid:
            tid, stack = e.get("tid", 0), []
        while stack and stack[-1][0] <= ts:
            stack.pop()
        if e.get("cat") == "cuda_runtime":
            if stack and stack[-1][1] is not None and _is_launch(e.get("name", "")):
                rows[stack[-1][1]][2] += 1
                corr = (e.get("args") or {}).get("correlation")
                if launch_paths is not None and corr is not None:
                    launch_paths[corr] = stack[-1][1]
            continue
        name = _pyname(e.get("name", ""))
        parent = stack[-1][1] if stack else None
        if parent is None:  # only a step's own frame opens a path
            path = name if (ts, ts + dur) in spans else None
        else:
            path = parent + " > " + name
            if path.count(" > ") > max_depth:
                path = parent  # deeper frames fold into their ancestor at max depth
        if path is not None and path != parent:
            r = rows.setdefault(path, [0.0, 0, 0, ts])
            r[0] += dur
            r[1] += 1
        stack.append((ts + dur, path))
    out = [{"path": p, "depth": p.count(" > "), "ms_per_step": round(r[0] / 1e3 / steps, 4),
            "calls_per_step": round(r[1] / steps, 2), "launches_per_step": round(r[2] / steps, 2)}
           for p, r in sorted(rows.items(), key=lambda kv: kv[1][3])]
    # call order of first appearance, children under their parent
    order = {}
    for row in out:
        order[row["path"]] = len(order)
    out.sort(key=lambda row: [order[" > ".join(row["path"].split(" > ")[:i + 1])]
                              for i in range(row["depth"] + 1)])
    return [row for row in out if row["ms_per_step"] >= min_ms]


def host_time_diff(a: dict, b: dict, top: int = 25, min_ms: float = 0.02) -> list:
    """Where ``b``'s host time per step exceeds ``a``'s (two summaries of ``summarize_trace``):
    [{"name", "a_ms", "b_ms", "diff_ms"}] over every Python function either summary lists,
    largest absolute difference first. A function missing from one side counts 0 there, so a
    function only one method calls shows with its whole time. Inclusive times: a parent's
    difference contains its children's."""
    ta = {r["name"]: r["ms_per_step"] for r in a.get("python_inclusive", [])}
    tb = {r["name"]: r["ms_per_step"] for r in b.get("python_inclusive", [])}
    rows = [{"name": n, "a_ms": ta.get(n, 0.0), "b_ms": tb.get(n, 0.0),
             "diff_ms": round(tb.get(n, 0.0) - ta.get(n, 0.0), 4)} for n in set(ta) | set(tb)]
    rows = [r for r in rows if abs(r["diff_ms"]) >= min_ms]
    rows.sort(key=lambda r: (-abs(r["diff_ms"]), r["name"]))
    return rows[:top]


def method_flags(names: list, budgets: list, spec: list) -> dict:
    """Server flags per profiled method, in the order asked. ``ddtree`` with several budgets
    becomes one method per budget (``ddtree_b8``, ``ddtree_b16``, ...)."""
    out = {}
    for name in names:
        if name == "ar":
            out[name] = []
        elif name == "dflash":
            out[name] = ["--speculative-algorithm", "DFLASH"] + spec
        elif name == "ddtree":
            for b in budgets:
                key = "ddtree" if len(budgets) == 1 else f"ddtree_b{b}"
                out[key] = ["--speculative-algorithm", "DDTREE",
                            "--speculative-ddtree-budget", b] + spec
        else:
            raise SystemExit(f"--methods: unknown method {name!r} (ar, dflash, ddtree)")
    return out


TARGET_FORWARD = "tp_worker.py:forward_batch_generation"  # the target model's forward


def target_forward_kernels(summary: dict) -> list:
    """GPU kernels per step of the target model's forward: an AR step is one, a speculative
    step's verify forward the frames ending in the target worker's forward (graph replays
    included). [{"name", "ms_per_step", "calls_per_step"}], summed over those frames."""
    acc = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for f in summary.get("gpu_kernels_by_frame", []):
        if TARGET_FORWARD in f["frame"].split(" > "):
            for k in f["kernels"]:
                acc[k["name"]][0] += k["ms_per_step"]
                acc[k["name"]][1] += k["calls_per_step"]
                acc[k["name"]][2] += k.get("concurrent_ms_per_step", 0.0)
    return [{"name": n, "ms_per_step": round(v[0], 4), "calls_per_step": round(v[1], 2),
             **({"concurrent_ms_per_step": round(v[2], 4)} if v[2] else {})}
            for n, v in sorted(acc.items(), key=lambda kv: -kv[1][0])]


def target_forward_busy_ms(summary: dict):
    """GPU busy time per step of the target forward's frames (the union of their kernels'
    spans, summed over the frames), or None for a summary from before session 30 (no
    ``busy_ms_per_step``)."""
    frames = [f for f in summary.get("gpu_kernels_by_frame", [])
              if TARGET_FORWARD in f["frame"].split(" > ")]
    if not frames or any("busy_ms_per_step" not in f for f in frames):
        return None
    return round(sum(f["busy_ms_per_step"] for f in frames), 4)


def kernel_time_diff(a: list, b: list, top: int = 30, min_ms: float = 0.002) -> list:
    """Where kernel list ``b`` (ms per step by name) exceeds ``a``: [{"name", "a_ms", "b_ms",
    "diff_ms", "a_calls", "b_calls"}], largest absolute difference first; a kernel missing
    from one side counts 0 there."""
    ka = {r["name"]: r for r in a}
    kb = {r["name"]: r for r in b}
    rows = []
    for n in set(ka) | set(kb):
        ra, rb = ka.get(n, {}), kb.get(n, {})
        diff = rb.get("ms_per_step", 0.0) - ra.get("ms_per_step", 0.0)
        if abs(diff) >= min_ms:
            rows.append({"name": n, "a_ms": ra.get("ms_per_step", 0.0),
                         "b_ms": rb.get("ms_per_step", 0.0), "diff_ms": round(diff, 4),
                         "a_calls": ra.get("calls_per_step", 0.0),
                         "b_calls": rb.get("calls_per_step", 0.0)})
    rows.sort(key=lambda r: (-abs(r["diff_ms"]), r["name"]))
    return rows[:top]


# kernel families of a target forward, first match wins (names as the profiler writes them).
# The router's GEMM counts as a GEMM: SGLang's dsv3 router_gemm_kernel serves up to 16 tokens,
# cuBLAS (an nvjet kernel, not told apart from the others) above; its top-k (SGLang's
# _router_triton_kernel) is the MoE's.
KERNEL_FAMILIES = (
    ("moe", ("marlin", "_gate_up", "_down_", "_down_kernel", "_prologue_kernel",
             "_combine_kernel", "moe_", "align_", "expert", "topk", "_router_triton")),
    ("attention", ("attn", "_fwd_kernel_stage", "_fwd_grouped_kernel", "flashmla", "mla_",
                   "_tree_attn")),
    ("gemm", ("nvjet", "gemm", "splitKreduce", "cutlass", "sm90_xmma", "bmm")),
    ("norm", ("norm",)),
)


def kernel_family(name: str) -> str:
    """The family of a GPU kernel name (:data:`KERNEL_FAMILIES`; ``other`` if none)."""
    low = name.lower()
    for family, keys in KERNEL_FAMILIES:
        if any(k.lower() in low for k in keys):
            return family
    return "other"


def family_totals(kernels: list) -> dict:
    """ms per step by kernel family of a kernel list ({"name", "ms_per_step"} rows), plus
    ``total``."""
    out = {f: 0.0 for f, _ in KERNEL_FAMILIES}
    out["other"] = 0.0
    for k in kernels:
        out[kernel_family(k["name"])] += k["ms_per_step"]
    out["total"] = sum(out.values())
    return {f: round(v, 4) for f, v in out.items()}


def effective_env(server_env: dict, key: str, default: str = "") -> str:
    """A server's value of ``key``: ``--server-env`` over this process's environment."""
    return server_env.get(key, os.environ.get(key, default))


def families_minus(fams: dict, base: str) -> dict:
    """{method: {family: ms over ``base``'s}} for every method of ``fams`` ({method: family
    totals}) but ``base``."""
    return {n: {f: round(v - fams[base][f], 4) for f, v in fam.items()}
            for n, fam in fams.items() if n != base}


def analyse(result: dict) -> None:
    """Fill the comparisons in ``result`` from the methods profiled so far: DDTREE's host
    time over DFLASH's, each method's target-forward kernels and their families, and each
    speculative method's target-forward kernels over AR's."""
    m = result["methods"]
    if "python_inclusive" in m.get("dflash", {}) and "python_inclusive" in m.get("ddtree", {}):
        # the question this profile exists for: which functions make DDTREE's step longer
        result["ddtree_minus_dflash"] = host_time_diff(m["dflash"], m["ddtree"])
    # the question for the Kimi ratio: which kernels make a verify forward dearer than a
    # decode step
    for summ in m.values():
        if "gpu_kernels_by_frame" in summ:
            summ["target_forward_kernels"] = target_forward_kernels(summ)
            summ["target_forward_families"] = family_totals(summ["target_forward_kernels"])
            busy = target_forward_busy_ms(summ)
            if busy is not None:  # kernel sum minus busy: time two streams ran at once
                summ["target_forward_busy_ms"] = busy
    if "target_forward_kernels" in m.get("ar", {}):
        result["target_forward_minus_ar"] = {
            name: kernel_time_diff(m["ar"]["target_forward_kernels"],
                                   summ["target_forward_kernels"])
            for name, summ in m.items() if name != "ar" and "target_forward_kernels" in summ}
        result["target_forward_families_minus_ar"] = families_minus(
            {name: summ["target_forward_families"] for name, summ in m.items()
             if "target_forward_families" in summ}, "ar")


def compare_profiles(results: list, base: str = "ar", pairs: tuple = ()) -> dict:
    """Several profile JSONs (from one or several runs) side by side: each method's
    target-forward kernel families, their difference from ``base``'s, and, per ``(a, b)`` of
    ``pairs``, the kernels where ``b``'s target forward differs from ``a``'s (the 17th and
    the 33rd token: ``("ddtree_b15", "ddtree_b16")``). A method found in two files is an
    error (name them apart by profiling them in one run). Each method records the file it
    came from."""
    methods, sources = {}, {}
    for i, res in enumerate(results):
        for name, summ in res.get("methods", {}).items():
            if name in methods:
                raise SystemExit(f"--compare: method {name!r} is in two of the files")
            if "target_forward_kernels" not in summ and "gpu_kernels_by_frame" in summ:
                summ = dict(summ, target_forward_kernels=target_forward_kernels(summ))
            if "target_forward_kernels" in summ:
                methods[name], sources[name] = summ, i
    fams = {n: family_totals(s["target_forward_kernels"]) for n, s in methods.items()}
    out = {"sources": sources, "families": fams}
    busy = {n: target_forward_busy_ms(s) for n, s in methods.items()}
    if any(v is not None for v in busy.values()):  # runs from session 30's second change on
        out["target_forward_busy_ms"] = busy
    if base in fams:
        out["families_minus_" + base] = families_minus(fams, base)
    for a, b in pairs:
        for n in (a, b):
            if n not in methods:
                raise SystemExit(f"--pairs: no method {n!r} in the files ({sorted(methods)})")
        rows = kernel_time_diff(methods[a]["target_forward_kernels"],
                                methods[b]["target_forward_kernels"], top=40)
        for r in rows:
            r["family"] = kernel_family(r["name"])
        out.setdefault("pairs", {})[f"{b}-{a}"] = {
            "families": {f: round(v - fams[a][f], 4) for f, v in fams[b].items()},
            "kernels": rows}
    return out


def write_result(result: dict, out: str) -> None:
    analyse(result)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, out)


def _post(port, path, payload):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return r.read().decode()


def compare_main(argv: list) -> None:
    """``profile_step.py --compare A.json B.json ... [--base ar] [--pairs a:b,c:d] [--out F]``:
    :func:`compare_profiles` of finished runs (no GPU)."""
    ap = argparse.ArgumentParser(prog="profile_step.py --compare")
    ap.add_argument("--compare", nargs="+", required=True, metavar="JSON")
    ap.add_argument("--base", default="ar")
    ap.add_argument("--pairs", default="", help="comma list of a:b method pairs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    pairs = tuple(tuple(p.split(":", 1)) for p in args.pairs.split(",") if p)
    if any(len(p) != 2 for p in pairs):
        raise SystemExit(f"--pairs {args.pairs!r}: expected a:b[,c:d]")
    res = compare_profiles([load_trace(f) for f in args.compare], args.base, pairs)
    res = {"command": " ".join(["python", "scripts/profile_step.py"] + argv),
           "files": args.compare, **res}
    fams = res["families"]
    cols = list(next(iter(fams.values()))) if fams else []
    print(f"{'ms/step':14s}" + "".join(f"{c:>10s}" for c in cols))
    for n, fam in fams.items():
        print(f"{n:14s}" + "".join(f"{fam[c]:10.4f}" for c in cols))
    for n, b in res.get("target_forward_busy_ms", {}).items():
        if b is not None:
            print(f"{n:14s} busy {b:.4f} ms/step (kernel sum {fams[n]['total']:.4f}: the rest "
                  "ran beside another stream's kernels)")
    for n, fam in res.get("families_minus_" + args.base, {}).items():
        print(f"{n + ' - ' + args.base:14s}" + "".join(f"{fam[c]:+10.4f}" for c in cols))
    for key, pair in res.get("pairs", {}).items():
        print(f"== {key}: " + ", ".join(f"{f} {v:+.4f}" for f, v in pair["families"].items()))
        for r in pair["kernels"][:15]:
            print(f"  {r['diff_ms']:+8.4f}  {r['family']:9s} ({r['a_ms']:.4f} x{r['a_calls']} -> "
                  f"{r['b_ms']:.4f} x{r['b_calls']})  {r['name'][:80]}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        json.dump(res, open(args.out, "w"), indent=1)
        print("->", args.out)


def main():
    if "--compare" in sys.argv[1:]:
        return compare_main(sys.argv[1:])
    from bench_e2e import add_pair_args, run_pass
    from e2e_lossless import Server, parse_server_env, stop_on_sigterm

    ap = argparse.ArgumentParser()
    add_pair_args(ap, "bench_results/profile_step_h200.json")
    ap.add_argument("--budget", default="32",
                    help="DDTREE budget; a comma list (8,16) profiles one DDTREE server per "
                    "budget, named ddtree_b8, ddtree_b16")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=30500)
    ap.add_argument("--workdir", default="/tmp/ddtree_profile")
    ap.add_argument("--methods", default="dflash,ddtree", help="of ar, dflash, ddtree")
    ap.add_argument("--dummy", action="store_true",
                    help="config-only target and drafter (bench_assets/model-configs): "
                    "--load-format dummy for both, no tokenizer")
    ap.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment of every server (repeatable), recorded in the JSON: e.g. "
                    "SGLANG_DDTREE_FUSED_MOE=1 for the int4 Kimi rank on our fused MoE (without "
                    "it SGLang's Marlin MoE serves it)")
    ap.add_argument("--mem-fraction", type=float, default=None,
                    help="the servers' --mem-fraction-static (default 0.85; with --serial "
                    "bench_cost_curves' default_mem_fraction for the card: 0.95 under "
                    "100,000 MiB)")
    ap.add_argument("--serial", action="store_true",
                    help="start each server when the one before has stopped (default: all at "
                    "once): the 61-layer int4 Kimi rank fills an 80 GB H100 alone")
    args = ap.parse_args()
    server_env = parse_server_env(args.server_env)

    import sglang
    import torch
    from bench_cost_curves import default_mem_fraction

    mem_fraction = args.mem_fraction or (default_mem_fraction(
        torch.cuda.get_device_properties(0).total_memory) if args.serial else 0.85)

    os.makedirs(args.workdir, exist_ok=True)
    prompts = [json.loads(l)["input_ids"] for l in open(args.prompts_file)]
    common = ["--model-path", args.target, "--attention-backend", "triton",
              "--cuda-graph-max-bs", "16", "--max-running-requests", "16",
              "--mem-fraction-static", str(mem_fraction), "--max-total-tokens", "65536",
              "--sampling-backend", "pytorch", "--grammar-backend", "none",
              "--disable-prefill-cuda-graph", "--sleep-on-idle"]
    spec = ["--speculative-draft-model-path", args.draft]
    if args.dummy:
        common += ["--load-format", "dummy", "--skip-tokenizer-init"]
        spec += ["--speculative-draft-load-format", "dummy"]
    methods = method_flags(args.methods.split(","), args.budget.split(","), spec)
    result = {"sglang_version": sglang.__version__, "torch_version": torch.__version__,
              "source_digest": checkout_digest(__file__),
              "gpu": torch.cuda.get_device_name(0),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": " ".join(["python", "scripts/profile_step.py"] + sys.argv[1:]),
              "concurrency": args.concurrency, "profiled_steps": args.steps,
              "server_env": server_env, "fused_moe": effective_env(
                  server_env, "SGLANG_DDTREE_FUSED_MOE", "0") not in ("", "0"),
              "complete": False, "methods": {}}
    result["mem_fraction"], result["serial"] = mem_fraction, args.serial
    servers = {}
    stop_on_sigterm()

    def start(i, name, extra):
        trace_dir = os.path.join(args.workdir, name)
        os.makedirs(trace_dir, exist_ok=True)
        servers[name] = Server(common + extra, os.path.join(args.workdir, f"{name}.log"),
                               args.port + i, wait=False,
                               env={**server_env, "SGLANG_TORCH_PROFILER_DIR": trace_dir})
        return servers[name]

    try:
        if not args.serial:
            for i, (name, extra) in enumerate(methods.items()):
                start(i, name, extra)
        for i, (name, extra) in enumerate(methods.items()):
            srv = servers[name] if name in servers else start(i, name, extra)
            srv.wait_ready()
            trace_dir = os.path.join(args.workdir, name)
            batch = prompts[: max(args.concurrency, 8)]
            run_pass(srv.port, batch, args.max_new_tokens, args.concurrency,
                     {"temperature": 0.0})  # warm-up: graphs captured, kernels compiled
            _post(srv.port, "/start_profile",
                  {"output_dir": trace_dir, "num_steps": args.steps, "activities": ["CPU", "GPU"],
                   "with_stack": True, "profile_id": name})
            run_pass(srv.port, batch, args.max_new_tokens, args.concurrency, {"temperature": 0.0})
            deadline = time.time() + 120
            files = []
            while time.time() < deadline and not files:
                files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json*"), recursive=True)
                time.sleep(2)
            srv.stop()
            if not files:
                result["methods"][name] = {"error": f"no trace written under {trace_dir}"}
                continue
            time.sleep(3)  # the exporter may still be writing
            # a long table: the DDTREE - DFLASH difference needs each function on both sides
            summary = summarize_trace(load_trace(sorted(files)[-1]), top=200)
            summary["trace_file"] = os.path.basename(sorted(files)[-1])
            result["methods"][name] = summary
            print(name, json.dumps({k: v for k, v in summary.items()
                                    if not isinstance(v, list)}), flush=True)
            # every finished method on disk at once: a call cut by its time limit keeps them
            # (session 30 lost three methods' kernel tables that way)
            write_result(result, args.out)
    finally:
        for srv in servers.values():
            srv.stop()
    result["complete"] = True
    write_result(result, args.out)
    m = result["methods"]
    if result.get("ddtree_minus_dflash"):
        print("== host ms/step, DDTREE minus DFLASH (inclusive; largest first)")
        for r in result["ddtree_minus_dflash"]:
            print(f"  {r['diff_ms']:+8.3f}  ({r['a_ms']:.3f} -> {r['b_ms']:.3f})  {r['name']}")
    for name, fam in result.get("target_forward_families_minus_ar", {}).items():
        print(f"== {name}: target forward's GPU kernels minus AR's by family (ms/step): "
              + ", ".join(f"{f} {v:+.4f}" for f, v in fam.items()))
    for name, rows in result.get("target_forward_minus_ar", {}).items():
        a = sum(r["ms_per_step"] for r in m["ar"]["target_forward_kernels"])
        b = sum(r["ms_per_step"] for r in m[name]["target_forward_kernels"])
        print(f"== {name}: target forward's GPU kernels minus AR's ({a:.3f} -> {b:.3f} ms/step)")
        for r in rows:
            print(f"  {r['diff_ms']:+8.4f}  ({r['a_ms']:.4f} x{r['a_calls']} -> {r['b_ms']:.4f} "
                  f"x{r['b_calls']})  {r['name'][:90]}")
    for name, s in result["methods"].items():
        print(f"== {name}: GPU kernel time by the step frame that launched it (ms/step)")
        for f in s.get("gpu_kernels_by_frame", []):
            if f["ms_per_step"] >= 0.05:
                print(f"  {f['ms_per_step']:8.3f} ms  {f['kernels_per_step']:7.1f} kernels  "
                      f"{f['frame']}")
                for k in f["kernels"][:8]:
                    print(f"      {k['ms_per_step']:8.4f}  x{k['calls_per_step']:<6} "
                          f"{k['name'][:90]}")
    for name, s in result["methods"].items():
        print(f"== {name}: the step's host time as a call tree (ms/step, calls, launches)")
        for row in s.get("step_tree", []):
            if row["depth"] <= 2 and row["ms_per_step"] >= 0.05:
                leaf = row["path"].split(" > ")[-1]
                print(f"  {row['ms_per_step']:8.3f} ms  x{row['calls_per_step']:<5} "
                      f"L{row['launches_per_step']:<6} {'  ' * row['depth']}{leaf}")
    print("->", args.out)


if __name__ == "__main__":
    main()
