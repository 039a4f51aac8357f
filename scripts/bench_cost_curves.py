#!/usr/bin/env python3
"""Step costs on real model shapes (config-only models, ``--load-format dummy``).

For each model pair in ``bench_assets/model-configs`` (``scripts/make_model_configs.py``): start
SGLang with identical flags as AR, DFLASH and DDTREE (one server per budget), drive each with
``--concurrency`` streams of random prompts, and record

- AR decode step (ms): the median time per output token (TPOT) at that concurrency;
- DFLASH step (ms): TPOT x accept length (dummy drafters accept ~nothing, so ~TPOT);
- DDTREE per budget: the step (TPOT x accept length) from a server like the others (host-only
  stage timers, ``SGLANG_DDTREE_TIMERS=cpu``: no synchronization); for ``--timer-budgets``, a
  second server with GPU-synchronized stage timers (``SGLANG_DDTREE_TIMERS=1``) gives the verify
  forward at batch size = concurrency, and verify(budget+1) / decode(1), the ratio that decides
  whether a wider tree pays. (Until session 5 the TPOT came from the synchronized server,
  which defeats overlap scheduling and inflated DDTREE's step.)

Then a clearly labelled *projection*: tokens/s = concurrency x accept / step, with accept
lengths from a measured run of our tiny pair (``--accept-json``, a scripts/bench_e2e.py JSON) and,
optionally, from a file of published values (``--published-accept``: {"source": ..., "dflash":
a, "ddtree_b<budget>": a, ...}); nothing is filled in when a value is missing.

    python scripts/bench_cost_curves.py --models qwen3-8b,kimi-k2.6-tp8rank-l8 \\
        --out bench_results/cost_curves_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys

from sglang_ddtree.provenance import checkout_digest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(HERE, "..", "bench_assets", "model-configs")


def random_prompts(n, length, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


def project(step_ms: dict, accept: dict, concs) -> dict:
    """{method: {c: tokens/s}} = c * accept / step; methods without both numbers are left out.

    step_ms: {method: {str(c): ms}}; accept: {method: accept length}.
    """
    out = {}
    for method, per_c in step_ms.items():
        a = accept.get(method)
        if a is None:
            continue
        row = {}
        for c in concs:
            ms = per_c.get(str(c))
            if ms:
                row[str(c)] = round(1e3 * c * a / ms, 1)
        if row:
            out[method] = row
    return out


def accept_from_bench(path: str, concurrency: str = "1", mode: str = "greedy") -> dict:
    """{method: accept length} from a scripts/bench_e2e.py JSON (DFLASH and DDTREE rows)."""
    data = json.load(open(path))
    out = {}
    for method, modes in data.get("results", {}).items():
        row = modes.get(mode, {}).get(concurrency)
        if row and row.get("accept_length"):
            out[method] = row["accept_length"]
    return out


def plan_runs(budgets, timer_budgets, spec, timer_mode="gpu", baselines=("ar", "dflash"),
              ddtree_extra=(), timer_pads=(0,)):
    """[(method, extra server args, env)]: AR, DFLASH, DDTREE per budget with host-only stage
    timers (no synchronization, so overlap scheduling and TPOT are those of a plain server),
    and ``-timers`` servers with stage timers on the GPU's stream (``timer_mode`` gpu: CUDA
    events; sync: a synchronization per stage, which defeats overlap scheduling) for the
    verify-forward split; their TPOT is not used. ``timer_pads``: one ``-timers`` server per
    budget and pad; a pad > 0 (gpu mode only) is SGLANG_DDTREE_TIMERS_PAD_US, its server named
    ``ddtree_b<budget>-pad<us>-timers``: a verify stage without the stream's idle wait for the
    host (sglang_ddtree/step_timers.py)."""
    from bench_e2e import ddtree_args

    def ddtree(b):
        return ddtree_args(b, list(ddtree_extra) + spec)

    every = {"SGLANG_DDTREE_TIMERS_EVERY": "10"}
    runs = [r for r in (("ar", [], {}), ("dflash", ["--speculative-algorithm", "DFLASH"] + spec,
                                           {})) if r[0] in baselines]
    runs += [(f"ddtree_b{b}", ddtree(b), {"SGLANG_DDTREE_TIMERS": "cpu", **every})
             for b in budgets]
    # each batch size's first 16 steps are left out: one-time costs are not the step's
    timed = {"SGLANG_DDTREE_TIMERS": "1" if timer_mode == "sync" else timer_mode,
             "SGLANG_DDTREE_TIMERS_SKIP": "16", **every}
    if any(timer_pads) and timer_mode != "gpu":
        raise SystemExit("--timer-pad-us needs --timer-mode gpu")
    runs += [(f"ddtree_b{b}" + (f"-pad{pad}" if pad else "") + "-timers", ddtree(b),
              {**timed, "SGLANG_DDTREE_TIMERS_PAD_US": str(pad)} if pad else timed)
             for b in timer_budgets for pad in timer_pads]
    return runs


def derive(res: dict) -> dict:
    """Fill ``step_ms`` (AR: TPOT; DFLASH and DDTREE: TPOT x accept length, the time of one
    step, all from servers without synchronizing timers) and ``verify_over_decode`` (the
    synchronized verify stage at batch size c over AR's decode step at c) from the measured
    ``tpot_ms``, ``accept_length`` and ``verify_ms``; returns ``res``."""
    res["step_ms"], res["verify_over_decode"] = {}, {}
    for method, per_c in res["tpot_ms"].items():
        acc = res["accept_length"].get(method, {})
        res["step_ms"][method] = {c: round(t * (1.0 if method == "ar" else (acc.get(c) or 1.0)), 4)
                                  for c, t in per_c.items() if t is not None}
    decode = res["step_ms"].get("ar", {})
    for method, per_c in res["verify_ms"].items():
        res["verify_over_decode"][method] = {c: round(v / decode[c], 3)
                                             for c, v in per_c.items() if decode.get(c)}
    return res


def default_mem_fraction(total_bytes: int) -> float:
    """The servers' ``--mem-fraction-static`` on a card of ``total_bytes``: 0.85, or 0.95 on a
    card under 100,000 MiB. An 80 GB H100 holds the 61-layer int4 Kimi rank (about 72 GiB of
    weights with its drafter's) only at 0.95 (session 62); the 141 GB H200 runs kept 0.85."""
    return 0.95 if total_bytes < 100_000 * 2 ** 20 else 0.85


def measure_model(name, args, concs, budgets, Server, run_pass, stage_times_by_bs,
                  res=None, dump=lambda: None, timer_budgets=(), timer_mode="gpu",
                  baselines=("ar", "dflash"), ddtree_extra=(), server_env=None,
                  timer_pads=(0,)):
    """Fills ``res`` (a dict, e.g. already in the result JSON) method by method, calling
    ``dump`` after each: a run cut short by its time limit keeps the methods it measured.
    ``server_env`` goes to every server, AR and DFLASH included (e.g. the fused MoE switch)."""
    from e2e_lossless import moe_distinct_experts  # the servers' log reader

    pairs = json.load(open(os.path.join(CONFIGS, "pairs.json")))
    target = os.path.join(CONFIGS, name)
    draft = os.path.join(CONFIGS, pairs[name])
    vocab = json.load(open(os.path.join(target, "config.json")))["vocab_size"]
    block = json.load(open(os.path.join(draft, "config.json")))["block_size"]
    prompts = random_prompts(max(concs) * 2, args.prompt_len, vocab)
    graph_bs = (["--cuda-graph-bs"] + [str(c) for c in sorted(set(concs))]
                if getattr(args, "graph_bs_concurrency", False) else
                ["--cuda-graph-max-bs", str(max(concs))])
    common = ["--model-path", target, "--load-format", "dummy", "--skip-tokenizer-init",
              "--attention-backend", args.attention_backend] + graph_bs + [
              "--max-running-requests", str(max(concs)),
              "--mem-fraction-static", str(args.mem_fraction), "--sampling-backend", "pytorch",
              "--grammar-backend", "none", "--disable-prefill-cuda-graph",
              "--context-length", str(args.prompt_len + args.max_new_tokens + 1024)]
    if getattr(args, "page_size", 1) > 1:  # every server, AR too (e.g. flashmla's 64)
        common += ["--page-size", str(args.page_size)]
    spec = ["--speculative-draft-model-path", draft, "--speculative-draft-load-format", "dummy"]
    res = {} if res is None else res
    res.update({"target": name, "draft": pairs[name], "drafter_block": block,
                "server_env": dict(server_env or {}), "tpot_ms": {},
                "accept_length": {}, "step_ms": {}, "verify_ms": {}, "verify_over_decode": {},
                "stage_ms": {}, "host_stage_ms": {}, "moe_distinct_experts": {},
                "startup_s": {}, "errors": {}})
    greedy = {"temperature": 0.0}
    for i, (method, extra, env) in enumerate(plan_runs(budgets, timer_budgets, spec,
                                                           timer_mode, baselines,
                                                           ddtree_extra, timer_pads)):
        log = os.path.join(args.workdir, f"{name}-{method}.log")
        try:
            srv = Server(common + extra, log, args.port + i, env={**(server_env or {}), **env})
        except Exception as e:  # e.g. out of memory for this shape: keep the other methods
            res["errors"][method] = repr(e)[:1500]
            continue
        res["startup_s"][method] = round(srv.startup_s, 1)
        try:
            run_pass(srv.port, prompts[: max(concs)], 16, max(concs), greedy)  # warm-up
            if method.endswith("-timers"):  # the stage split only: one pass per batch size
                for c in concs:
                    run_pass(srv.port, prompts[:c], args.max_new_tokens, c, greedy)
            else:
                tpot, acc = {}, {}
                for c in concs:
                    reps = [run_pass(srv.port, prompts[:c], args.max_new_tokens, c, greedy)
                            for _ in range(args.repeats)]
                    tpot[str(c)] = statistics.median(r["tpot_ms"] for r in reps)
                    acc[str(c)] = reps[-1]["accept_length"]
                res["tpot_ms"][method], res["accept_length"][method] = tpot, acc
        except Exception as e:
            res["errors"][method] = repr(e)[:1500]
        finally:
            srv.stop()
        if method.startswith("ddtree"):
            counts = moe_distinct_experts(log) if os.path.exists(log) else None
            if counts:  # SGLANG_DDTREE_MOE_STATS=1
                res["moe_distinct_experts"][method] = counts
            by_bs = stage_times_by_bs(log)
            rows = {str(c): (by_bs or {}).get("bs", {}).get(str(c)) for c in concs}
            rows = {c: r for c, r in rows.items() if r}
            if method.endswith("-timers"):
                base = method[: -len("-timers")]
                res["stage_ms"][base] = rows
                res["verify_ms"][base] = {c: r["verify"] for c, r in rows.items()}
            else:
                res["host_stage_ms"][method] = rows
        derive(res)
        dump()
    return res


def main():
    from bench_e2e import run_pass
    from e2e_lossless import Server, parse_server_env, stage_times_by_bs, stop_on_sigterm

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_results/cost_curves_h200.json")
    ap.add_argument("--models", default="qwen3-8b,qwen3-30b-a3b,kimi-k2.6-tp8rank-l8")
    ap.add_argument("--budgets", default="8,16,32,64",
                    help="DDTREE budgets (the tiny pair's, so its accept lengths project)")
    ap.add_argument("--timer-budgets", default=None,
                    help="budgets that also get a GPU-synchronized timers server (default: all)")
    ap.add_argument("--timer-mode", default="gpu", choices=("gpu", "sync"),
                    help="stage timers of the -timers servers: gpu (CUDA events, no per-step "
                    "sync) or sync (a synchronization at every stage boundary)")
    ap.add_argument("--timer-pad-us", default="0",
                    help="comma list of pads (us) for the -timers servers, one server per budget "
                    "and pad; 0 = none. A pad (a GPU busy-wait after the tree stage, its own "
                    "stage) lets the host issue the verify before the stream reaches it, so the "
                    "verify stage is the forward alone: e.g. 0,3000 measures the idle wait")
    ap.add_argument("--baselines", default="ar,dflash",
                    help="which of ar / dflash get a server (verify/decode needs ar)")
    ap.add_argument("--ddtree-args", default="",
                    help="extra flags of every DDTREE server, e.g. "
                    "'--speculative-ddtree-verify-backend triton'")
    ap.add_argument("--ddtree-arg", action="append", default=[], metavar="=ARG",
                    help="one more word of --ddtree-args (repeatable, written --ddtree-arg=ARG "
                         "when ARG starts with --): survives the word splitting of an argument "
                         "list passed through a variable (gpu_session.sh's COSTS_ARGS), which "
                         "a quoted --ddtree-args does not")
    ap.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment for every server of the run, AR and DFLASH included "
                         "(repeatable), e.g. SGLANG_DDTREE_FUSED_MOE=1 for the int4 Kimi rank "
                         "on our fused MoE kernel instead of SGLang's Marlin (whose first call "
                         "builds with nvcc for minutes: gpu_session.sh jitbg)")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--graph-bs-concurrency", action="store_true",
                    help="capture CUDA graphs only at the measured concurrencies "
                         "(--cuda-graph-bs) instead of every size up to the largest: shorter "
                         "server starts for deep models (the 61-layer Kimi rank: ~2-3 min each)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--page-size", type=int, default=1,
                    help="KV page size of every server (flashmla needs 64)")
    ap.add_argument("--mem-fraction", type=float, default=None,
                    help="--mem-fraction-static of every server; default: default_mem_fraction "
                         "of the card (0.85, or 0.95 on a card under 100,000 MiB)")
    ap.add_argument("--accept-json", default=os.path.join(
        HERE, "..", "bench_results", "bench_e2e_tiny_h200_sweep_s7.json"),
        help="a scripts/bench_e2e.py JSON whose greedy c=1 accept lengths feed the projection")
    ap.add_argument("--published-accept", default=None,
                    help="JSON {source, dflash, ddtree_b<budget>...} of published accept lengths")
    ap.add_argument("--port", type=int, default=30700)
    ap.add_argument("--workdir", default="/tmp/ddtree_cost_curves")
    args = ap.parse_args()

    import sglang
    import torch

    os.makedirs(args.workdir, exist_ok=True)
    if args.mem_fraction is None:
        args.mem_fraction = default_mem_fraction(torch.cuda.get_device_properties(0).total_memory)
    concs = [int(c) for c in args.concurrency.split(",")]
    budgets = [int(b) for b in args.budgets.split(",") if b]
    timer_budgets = budgets if args.timer_budgets is None else \
        [int(b) for b in args.timer_budgets.split(",") if b]
    result = {"sglang_version": sglang.__version__, "torch_version": torch.__version__,
              "source_digest": checkout_digest(__file__),
              "gpu": torch.cuda.get_device_name(0),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": " ".join(["python", "scripts/bench_cost_curves.py"] + sys.argv[1:]),
              "timer_mode": args.timer_mode, "mem_fraction": args.mem_fraction,
              "notes": "dummy weights; ms are medians; ddtree stage ms come from the -timers "
                       "servers (timer_mode: gpu = CUDA events, sync = a synchronization per "
                       "stage) at batch size = concurrency; 'projection' multiplies these "
                       "measured step costs by accept lengths measured elsewhere (named)",
              "models": {}, "projection": {}}

    def dump():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        json.dump(result, open(args.out, "w"), indent=1)

    stop_on_sigterm(dump)
    sources = {}
    if args.accept_json and os.path.exists(args.accept_json):
        sources["tiny_pair_measured:" + os.path.basename(args.accept_json)] = \
            accept_from_bench(args.accept_json)
    if args.published_accept:
        pub = json.load(open(args.published_accept))
        sources["published:" + str(pub.pop("source", args.published_accept))] = pub
    for acc in sources.values():
        acc.setdefault("ar", 1.0)  # one token per decode step
    for name in args.models.split(","):
        result["models"][name] = {}
        measure_model(name, args, concs, budgets, Server, run_pass, stage_times_by_bs,
                      res=result["models"][name], dump=dump, timer_budgets=timer_budgets,
                      timer_mode=args.timer_mode,
                      timer_pads=[int(p) for p in args.timer_pad_us.split(",") if p],
                      baselines=[b for b in args.baselines.split(",") if b],
                      ddtree_extra=args.ddtree_args.split() + args.ddtree_arg,
                      server_env=parse_server_env(args.server_env))
        result["projection"][name] = {src: project(result["models"][name]["step_ms"], acc, concs)
                                      for src, acc in sources.items()}
        dump()
        print(name, json.dumps(result["models"][name]["verify_over_decode"]), flush=True)
    dump()
    print("->", args.out)


if __name__ == "__main__":
    main()
