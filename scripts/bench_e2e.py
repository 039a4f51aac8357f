#!/usr/bin/env python3
"""AR vs DFLASH vs DDTREE (several budgets) on one model pair, same server settings, one run.

For each method: one SGLang server (identical flags apart from the speculative ones; by default
all servers start at once with fixed KV pools and ``--sleep-on-idle``), warm up, then for each
sampling mode and concurrency send the held-out prompts with streaming and record, over
``--repeats`` passes (median reported): output tokens/s (all completion tokens / wall), TTFT
(request start to first streamed chunk), TPOT ((e2e - TTFT) / (tokens - 1)), accept length
(completion tokens / verify steps, from SGLang's meta_info), the pass's wall time, p90 and
slowest request. By default (``--interleave 1``) the methods take turns pass by pass at every
point, so that host noise falls on all of them alike; ``--interleave 0`` measures one method's
whole sweep after another. DDTREE speed servers log host-only stage times
(``SGLANG_DDTREE_TIMERS=cpu``: no synchronization); stage times on the GPU's stream (CUDA events,
``--timer-mode gpu``, or per-stage synchronization, ``sync``) come from separate ``-timers``
servers (``--timer-budgets``, any budget) afterwards, whose speed is not used.

Default pair: bench_assets/tiny-code (scripts/train_tiny_pair.py), prompts from its
eval_prompts.jsonl. Writes JSON (``--out``) with command, versions, GPU and date; plots come
from scripts/plot_bench_e2e.py.

    python scripts/bench_e2e.py --out bench_results/bench_e2e_tiny_h200.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import os
import statistics
import sys
import time
import urllib.request

from sglang_ddtree.provenance import checkout_digest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_lossless import (  # noqa: E402  (server handling and its log readers)
    Server, accept_by_budget, stage_times, stage_times_by_bs, stop_on_sigterm,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ASSETS = os.path.join(HERE, "..", "bench_assets", "tiny-code")


def stream_generate(port, input_ids, max_new, sampling):
    """(output token count, ttft s, e2e s, meta_info) of one streamed request."""
    params = {"max_new_tokens": max_new, "ignore_eos": True, **sampling}
    body = json.dumps({"input_ids": input_ids, "sampling_params": params, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.time()
    ttft, last = None, None
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.time() - t0
            last = json.loads(line[5:])
    e2e = time.time() - t0
    meta = last["meta_info"]
    return meta["completion_tokens"], ttft, e2e, meta


def run_pass(port, prompts, max_new, conc, sampling):
    t0 = time.time()
    with cf.ThreadPoolExecutor(conc) as ex:
        res = list(ex.map(lambda p: stream_generate(port, p, max_new, sampling), prompts))
    wall = time.time() - t0
    toks = sum(r[0] for r in res)
    steps = sum(r[3].get("spec_verify_ct", 0) for r in res)
    tpot = [(r[2] - r[1]) / (r[0] - 1) for r in res if r[0] > 1]
    e2e = sorted(r[2] for r in res)
    return {"tokens_per_s": toks / wall, "ttft_ms": 1e3 * statistics.median(r[1] for r in res),
            "tpot_ms": 1e3 * statistics.median(tpot) if tpot else None,
            "accept_length": toks / steps if steps else None,
            # stragglers: a pass's tokens/s falls with its slowest requests, which the median
            # TPOT does not show (session 5: c = 8 had the better TPOT and the lower tokens/s)
            "wall_s": wall, "e2e_p90_ms": 1e3 * e2e[min(len(e2e) - 1, int(0.9 * len(e2e)))],
            "e2e_max_ms": 1e3 * e2e[-1]}


MODES = (("greedy", {"temperature": 0.0}), ("t1", {"temperature": 1.0, "top_p": 1.0}))


def batch_cap(concurrency: str, timer_concurrency: str) -> int:
    """Every server's --max-running-requests and --cuda-graph-max-bs: the largest concurrency
    any pass uses, the -timers servers' included (session 16 capped it at the speed points'
    largest, so a timers pass at 32 ran at batch sizes up to 8)."""
    return max(int(c) for c in f"{concurrency},{timer_concurrency}".split(",") if c)


def pass_prompts(prompts, c, args):
    """The requests of one pass at concurrency c: max(prompts-per-pass, waves * c) of the
    held-out prompts, cycled when that is more than there are (a repeated prompt then hits
    SGLang's prefix cache, the same for every method)."""
    n = max(args.prompts_per_pass, args.waves * c)
    return (prompts * -(-n // len(prompts)))[:n]


def median_row(reps):
    """Per-field median of a point's passes (None where the passes have none)."""
    return {k: statistics.median(r[k] for r in reps) if reps[0][k] is not None else None
            for k in reps[0]}


def measure(port, prompts, args, concs):
    out = {}
    for mode, sampling in MODES:
        if mode not in args.modes:
            continue
        run_pass(port, prompts[: max(concs)], args.max_new_tokens, max(concs), sampling)  # warm
        out[mode] = {}
        for c in concs:
            reps = [run_pass(port, pass_prompts(prompts, c, args), args.max_new_tokens,
                             c, sampling) for _ in range(args.repeats)]
            out[mode][str(c)] = median_row(reps)
            print(mode, c, json.dumps(out[mode][str(c)]), flush=True)
    return out


def measure_interleaved(ports, prompts, args, concs, errors, on_point=lambda out: None):
    """{name: {mode: {c: median row}}} for every server in ``ports`` ({name: port}), all up at
    once: at each (mode, concurrency) point the methods take turns pass by pass (A B C A B C
    ...), so a slow stretch of the host lands on every method alike instead of on whichever
    was being measured then (session 5: one server's point moved by up to 35 % between runs).
    A server that fails is recorded in ``errors`` and leaves the rotation."""
    out = {name: {} for name in ports}
    live = dict(ports)

    def one(name, *a):
        try:
            return run_pass(live[name], *a)
        except Exception as e:  # keep the other methods' numbers; report this one
            errors[name] = repr(e)[:2000]
            del live[name]
            return None

    deadline = getattr(args, "deadline", None)
    took = {}  # concurrency -> seconds its last point took (an earlier mode's)
    last = 0.0  # seconds of the point just measured
    for mode, sampling in MODES:
        if mode not in args.modes:
            continue
        for name in list(live):  # warm-up
            one(name, prompts[: max(concs)], args.max_new_tokens, max(concs), sampling)
        for c in concs:
            # no point that would end after the deadline, judged by the same concurrency in an
            # earlier mode, else by 1.5x the point just measured (concurrencies ascend): the
            # rest of the step's time is for the timers servers and the final dump
            if deadline is not None and time.time() + took.get(c, 1.5 * last) > deadline:
                errors.setdefault("skipped_points", []).append(f"{mode} c={c}: --time-budget")
                continue
            t_point = time.time()
            reps = {name: [] for name in live}
            for _ in range(args.repeats):
                for name in list(live):
                    r = one(name, pass_prompts(prompts, c, args), args.max_new_tokens,
                            c, sampling)
                    if r is not None:
                        reps[name].append(r)
            for name, rs in reps.items():
                if rs and name in live:
                    out[name].setdefault(mode, {})[str(c)] = median_row(rs)
                    print(name, mode, c, json.dumps(out[name][mode][str(c)]), flush=True)
            last = took[c] = time.time() - t_point
            on_point(out)
    return out


def add_pair_args(ap, out):
    """--out, and the model pair + prompts (default: the trained tiny pair)."""
    ap.add_argument("--out", default=out)
    ap.add_argument("--target", default=os.path.join(ASSETS, "target"))
    ap.add_argument("--draft", default=os.path.join(ASSETS, "dflash-draft"))
    ap.add_argument("--prompts-file", default=os.path.join(ASSETS, "eval_prompts.jsonl"))


def parse_variants(specs):
    """[(tag, {KEY: VALUE})] from ``--variant TAG:KEY=VALUE[,KEY=VALUE]`` strings."""
    out = []
    for spec in specs:
        tag, sep, kvs = spec.partition(":")
        pairs = [kv.split("=", 1) for kv in kvs.split(",") if kv]
        if not sep or not tag.isidentifier() or not pairs or any(len(p) != 2 for p in pairs):
            raise SystemExit(f"--variant {spec!r}: expected TAG:KEY=VALUE[,KEY=VALUE]")
        out.append((tag, dict(pairs)))
    return out


def ddtree_args(budget, spec):
    """Server flags of DDTREE at ``budget`` (a number, ``auto``, or ``online``: auto with
    SGLANG_DDTREE_AUTO_MODE=online, set by the caller)."""
    return ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget",
            "auto" if budget == "online" else str(budget)] + spec


def main():
    ap = argparse.ArgumentParser()
    add_pair_args(ap, "bench_results/bench_e2e_tiny_h200.json")
    ap.add_argument("--budgets", default="8,16,32,64,128",
                    help="fixed budgets, 'auto' (the table) and 'online' (auto, measured)")
    ap.add_argument("--triton-verify-budgets", default="",
                    help="budgets also measured with --speculative-ddtree-verify-backend triton "
                         "(methods ddtree_tv_b<budget>), e.g. 32")
    ap.add_argument("--concurrency", default="1,4,8,16,32,64")
    ap.add_argument("--modes", default="greedy,t1")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts-per-pass", type=int, default=64)
    ap.add_argument("--waves", type=int, default=1,
                    help="at least this many full batches per pass (more requests at high "
                    "concurrency, where a pass of one or two waves lasts under a second)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds from the start by which the interleaved points must end (a "
                    "point that would end later, judged by the longest one so far, is skipped; "
                    "the -timers servers still run): keeps a time-boxed call from losing them")
    ap.add_argument("--port", type=int, default=30300)
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--workdir", default="/tmp/ddtree_bench_e2e")
    ap.add_argument("--timer-budgets", default="32",
                    help="DDTREE budgets (fixed or auto, measured for speed or not) that get a "
                    "server with the stage timers on, measured after the speed points")
    ap.add_argument("--timer-mode", default="gpu", choices=("gpu", "sync"),
                    help="SGLANG_DDTREE_TIMERS of the -timers servers: gpu (CUDA events, no "
                    "per-step sync) or sync (a synchronization at every stage boundary)")
    ap.add_argument("--timer-concurrency", default="1,8,32",
                    help="concurrencies of the -timers servers' passes (two passes each)")
    ap.add_argument("--concurrent-start", type=int, default=1,
                    help="1: start all servers at once (fixed KV pools, --sleep-on-idle), then "
                    "measure one at a time; 0: one server at a time")
    ap.add_argument("--kv-tokens", type=int, default=131072)
    ap.add_argument("--interleave", type=int, default=1,
                    help="1 (with --concurrent-start 1): the methods take turns pass by pass at "
                    "every point; 0: one method's whole sweep after another")
    ap.add_argument("--variant", action="append", default=[], metavar="TAG:KEY=VALUE[,KEY=VALUE]",
                    help="also run every DDTREE speed budget and -timers budget with this "
                    "environment, as method ddtree_b<budget>_<TAG> (repeatable), e.g. "
                    "fusedcommit:SGLANG_DDTREE_COMMIT=fused: an A/B in the same run")
    args = ap.parse_args()
    args.modes = args.modes.split(",")
    args.deadline = None if args.time_budget is None else time.time() + args.time_budget

    import sglang
    import torch

    os.makedirs(args.workdir, exist_ok=True)
    concs = [int(c) for c in args.concurrency.split(",")]
    cap = batch_cap(args.concurrency, args.timer_concurrency)
    prompts = [json.loads(l)["input_ids"] for l in open(args.prompts_file)]
    common = ["--model-path", args.target, "--attention-backend", args.attention_backend,
              "--cuda-graph-max-bs", str(cap), "--max-running-requests", str(cap),
              "--mem-fraction-static", "0.7", "--sampling-backend", "pytorch",
              "--grammar-backend", "none", "--disable-prefill-cuda-graph", "--sleep-on-idle"]
    if args.concurrent_start:  # fixed pools: SGLang's free-memory sizing races between starts
        common[common.index("0.7")] = "0.85"
        common += ["--max-total-tokens", str(args.kv_tokens)]
    spec = ["--speculative-draft-model-path", args.draft]
    methods = [("ar", [], {}), ("dflash", ["--speculative-algorithm", "DFLASH"] + spec, {})]
    # "online": --speculative-ddtree-budget auto with SGLANG_DDTREE_AUTO_MODE=online
    methods += [(f"ddtree_b{b}", ddtree_args(b, spec),
                 {"SGLANG_DDTREE_AUTO_MODE": "online"} if b == "online" else {})
                for b in args.budgets.split(",")]
    variants = parse_variants(args.variant)
    methods += [(f"{name}_{tag}", extra, {**env, **venv}) for name, extra, env in list(methods)
                if name.startswith("ddtree_b") for tag, venv in variants]
    methods += [(f"ddtree_tv_b{b}", ddtree_args(
                    b, ["--speculative-ddtree-verify-backend", "triton"] + spec), {})
                for b in args.triton_verify_budgets.split(",") if b]
    result = {
        "sglang_version": sglang.__version__, "torch_version": torch.__version__,
        "source_digest": checkout_digest(__file__),
        "gpu": torch.cuda.get_device_name(0),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "command": " ".join(["python", "scripts/bench_e2e.py"] + sys.argv[1:]),
        "target": args.target, "draft": args.draft, "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "prompts_per_pass": args.prompts_per_pass, "waves": args.waves,
        "concurrent_start": args.concurrent_start,
        "interleaved": bool(args.concurrent_start and args.interleave),
        "results": {}, "stage_ms_per_step": {}, "cpu_stage_ms_per_step": {},
        "stage_ms_by_batch_size": {}, "cpu_stage_ms_by_batch_size": {},
        "accept_by_smaller_budget": {}, "startup_s": {}, "errors": {},
    }
    log = lambda tag: os.path.join(args.workdir, f"{tag}.log")  # noqa: E731
    timer_budgets = {b for b in args.timer_budgets.split(",") if b}
    # DDTREE speed servers log host (CPU) time per stage: no synchronization, no slowdown
    jobs = [(name, extra, {**env, **({"SGLANG_DDTREE_TIMERS": "cpu"}
                                     if name.startswith("ddtree") else {})})
            for name, extra, env in methods]
    # a stage line every 10 steps: the few steps of the high-concurrency passes get one too
    timed = {"SGLANG_DDTREE_TIMERS": "1" if args.timer_mode == "sync" else args.timer_mode,
             "SGLANG_DDTREE_TIMERS_EVERY": "10", "SGLANG_DDTREE_TIMERS_SKIP": "16"}
    jobs += [(f"ddtree_b{b}{suffix}-timers", ddtree_args(b, spec), {**venv, **timed})
             for b in sorted(timer_budgets, key=str)
             for suffix, venv in [("", {})] + [(f"_{t}", e) for t, e in variants]]
    servers = {}

    def start(i, job):
        name, extra, env = job
        return Server(common + extra, log(name), args.port + i, env=env,
                      wait=not args.concurrent_start)

    def dump():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        json.dump(result, open(args.out, "w"), indent=1)

    stop_on_sigterm(dump)
    try:
        if args.concurrent_start:  # start every server now; measure one at a time below
            for i, job in enumerate(jobs):
                servers[job[0]] = start(i, job)
        done = set()
        if args.concurrent_start and args.interleave:
            speed = {}
            for name, _, _ in jobs:
                if name.endswith("-timers"):
                    continue
                try:
                    servers[name].wait_ready()
                    speed[name] = servers[name].port
                    result["startup_s"][name] = round(servers[name].startup_s, 1)
                except Exception as e:
                    result["errors"][name] = repr(e)[:2000]
                    done.add(name)

            def on_point(out):
                result["results"] = {k: v for k, v in out.items() if v}
                dump()

            on_point(measure_interleaved(speed, prompts, args, concs, result["errors"],
                                         on_point))
            for name in speed:
                srv = servers[name]
                srv.stop()
                if name.startswith("ddtree"):
                    result["cpu_stage_ms_per_step"][name] = stage_times(srv.log)
                    result["cpu_stage_ms_by_batch_size"][name] = stage_times_by_bs(srv.log)
                done.add(name)
            dump()
        for i, job in enumerate(jobs):
            name = job[0]
            if name in done:
                continue
            srv = servers.get(name) or start(i, job)
            servers[name] = srv
            srv.wait_ready()
            try:
                if name.endswith("-timers"):  # timed servers: stage times, no speed here
                    for c in [int(c) for c in args.timer_concurrency.split(",") if c]:
                        for _ in range(2):
                            run_pass(srv.port, pass_prompts(prompts, c, args),
                                     args.max_new_tokens, c, {"temperature": 0.0})
                    srv.stop()
                    base = name[: -len("-timers")]
                    result["stage_ms_per_step"][base] = stage_times(srv.log)
                    result["stage_ms_by_batch_size"][base] = stage_times_by_bs(srv.log)
                    result["accept_by_smaller_budget"][base] = accept_by_budget(srv.log)
                else:
                    result["results"][name] = measure(srv.port, prompts, args, concs)
                    result["startup_s"][name] = round(srv.startup_s, 1)
                    if name.startswith("ddtree"):
                        srv.stop()
                        result["cpu_stage_ms_per_step"][name] = stage_times(srv.log)
                        result["cpu_stage_ms_by_batch_size"][name] = stage_times_by_bs(srv.log)
            except Exception as e:  # keep the other methods' numbers; report this one
                result["errors"][name] = repr(e)[:2000]
            finally:
                srv.stop()
            dump()
    finally:
        for srv in servers.values():
            srv.stop()
    print("->", args.out)


if __name__ == "__main__":
    main()
