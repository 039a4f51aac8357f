#!/usr/bin/env python3
"""Lossless end-to-end suite on a GPU: DDTREE greedy output == the target's plain greedy output.

Starts real SGLang servers (one per configuration, identical settings), sends the same prompts at
several concurrencies, and compares token for token. A divergence counts as a *near tie* only
when, at the first differing position, the target's own log-prob of the token DDTREE emitted is
within ``--tie-tol`` of its best token's (queried from the AR server); anything else is a
mismatch. Long accepted paths come from the test-only oracle draft mode
(SGLANG_DDTREE_TEST_ORACLE), which plants the AR output in the drafter's top-K at random depths
and ranks. Models: ``tiny`` (the trained pair in bench_assets/tiny-code, held-out code prompts)
and ``mla`` (MLA + MoE, dummy weights).

Writes JSON (``--out``) with sglang version, GPU, date, command and one entry per case.

    python scripts/e2e_lossless.py --out bench_results/e2e_lossless_h200.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from sglang_ddtree.provenance import checkout_digest

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "..", "tests", "gpu", "models")

ASSETS = os.path.join(HERE, "..", "bench_assets", "tiny-code")

MODEL_SETS = {
    # the project's trained tiny pair (dense Qwen3 + DFlash drafter): confident, context-dependent
    # predictions, held-out code prompts
    "tiny": {"target": os.path.join(ASSETS, "target"), "draft": os.path.join(ASSETS, "dflash-draft"),
             "random_target": False, "real_weights": True, "backend": "triton",
             "prompts_file": os.path.join(ASSETS, "eval_prompts.jsonl")},
    # target made with random normal weights at run time. Measured on the H200: its next-token
    # distribution is so flat that the top-2 log-prob gap is <= 0.125 nats at most positions, so
    # bf16 noise between the verify and decode kernels flips tokens; kept for debugging only
    "dense": {"target": "qwen3-rand-target", "draft": "qwen3-rand-dflash", "random_target": True,
              "backend": "triton"},
    # MLA + MoE, SGLang's dummy init (config only)
    "mla": {"target": "mla-moe-target", "draft": "mla-moe-dflash-draft", "random_target": False,
            "backend": "triton"},
}
# the tiny pair with 16-token KV pages (AR reference and DDTREE both paged): KV relocation and
# slot reservation with page_size > 1
MODEL_SETS["tiny_page16"] = dict(MODEL_SETS["tiny"], extra_args=["--page-size", "16"])
# the other target attention backends that verify a tree:
# fa3 for MHA and MLA (Hopper), flashinfer for MHA
# flashinfer for MHA through its own FULL_MASK verify; fa3 (MHA and MLA, Hopper) and triton
# through our Triton tree-verify kernels (--speculative-ddtree-verify-backend triton), prefill and
# decode staying on the target's backend
TRITON_VERIFY = ["--speculative-ddtree-verify-backend", "triton"]
MODEL_SETS["tiny_flashinfer"] = dict(MODEL_SETS["tiny"], backend="flashinfer")
# (tiny_fa3: the defaults, so on Hopper the verify's prefix on FA3 since session 34's auto;
# tiny_fa3_tv: our kernel alone, SGLANG_DDTREE_MHA_PREFIX=triton)
MODEL_SETS["tiny_fa3"] = dict(MODEL_SETS["tiny"], backend="fa3", ddtree_args=TRITON_VERIFY)
MODEL_SETS["tiny_fa3_tv"] = dict(MODEL_SETS["tiny_fa3"], ar_of="tiny_fa3",
                                 ddtree_env={"SGLANG_DDTREE_MHA_PREFIX": "triton"})
MODEL_SETS["mla_fa3"] = dict(MODEL_SETS["mla"], backend="fa3", ddtree_args=TRITON_VERIFY)
MODEL_SETS["tiny_tv"] = dict(MODEL_SETS["tiny"], ddtree_args=TRITON_VERIFY, ar_of="tiny")
# the tiny pair in fp32 (target and drafter; its own AR reference): bf16 logits of this model
# tie exactly at many positions, fp32 ones almost never, so divergences should vanish
MODEL_SETS["tiny_fp32"] = dict(MODEL_SETS["tiny"], extra_args=["--dtype", "float32"])
# SGLang's default sampling backend (the suite pins pytorch): T > 0 nodes through flashinfer
MODEL_SETS["tiny_fisample"] = dict(MODEL_SETS["tiny"], ar_of="tiny",
                                   ddtree_args=["--sampling-backend", "flashinfer"])
# the accepted path's KV moved by SGLang's move_kv_cache per path column (the fused one-launch
# mover is the default since session 8; SGLANG_DDTREE_KV_MOVE=sglang keeps SGLang's way)
MODEL_SETS["tiny_kvsglang"] = dict(MODEL_SETS["tiny"], ar_of="tiny",
                                   ddtree_env={"SGLANG_DDTREE_KV_MOVE": "sglang"})
MODEL_SETS["mla_kvsglang"] = dict(MODEL_SETS["mla"], ar_of="mla",
                                  ddtree_env={"SGLANG_DDTREE_KV_MOVE": "sglang"})
MODEL_SETS["mla_tv"] = dict(MODEL_SETS["mla"], ddtree_args=TRITON_VERIFY, ar_of="mla")
# the drafter's block attention on our tree kernel (SGLANG_DDTREE_DRAFT_ATTENTION=triton): the
# drafter's block K/V writes must stay inside its block slots and the target's tokens unchanged
DRAFT_ON_TRITON = {"SGLANG_DDTREE_DRAFT_ATTENTION": "triton"}
MODEL_SETS["tiny_dtv"] = dict(MODEL_SETS["tiny"], ar_of="tiny", ddtree_env=DRAFT_ON_TRITON)
MODEL_SETS["mla_dtv"] = dict(MODEL_SETS["mla"], ar_of="mla", ddtree_env=DRAFT_ON_TRITON)
# since session 24 a triton drafter is on our kernel by default (auto): the tiny pair with the
# drafter kept on SGLang's triton extend kernel
MODEL_SETS["tiny_dnat"] = dict(MODEL_SETS["tiny"], ar_of="tiny",
                               ddtree_env={"SGLANG_DDTREE_DRAFT_ATTENTION": "native"})
# MLA + MoE on SGLang's flashmla backend (pages of 64, Hopper; AR decodes on FlashMLA too):
# the verify on our Triton kernels alone (SGLANG_DDTREE_MLA_PREFIX=triton: since session 34
# the default, auto, takes FlashMLA here), and with its prefix part on FlashMLA
# (SGLANG_DDTREE_MLA_PREFIX=flashmla); the dense drafter stays on triton
FLASHMLA_PAGES = {"backend": "flashmla", "extra_args": ["--page-size", "64"]}
FLASHMLA_DDTREE_ARGS = TRITON_VERIFY + ["--speculative-draft-attention-backend", "triton"]
MODEL_SETS["mla_fmla_tv"] = dict(
    MODEL_SETS["mla"], **FLASHMLA_PAGES, ddtree_args=FLASHMLA_DDTREE_ARGS,
    ddtree_env={"SGLANG_DDTREE_MLA_PREFIX": "triton"})
# the defaults on FlashMLA pages: auto puts the prefix on FlashMLA
MODEL_SETS["mla_fmla_auto"] = dict(MODEL_SETS["mla_fmla_tv"], ar_of="mla_fmla_tv", ddtree_env={})
MODEL_SETS["mla_fmla"] = dict(MODEL_SETS["mla_fmla_tv"], ar_of="mla_fmla_tv",
                              ddtree_env={"SGLANG_DDTREE_MLA_PREFIX": "flashmla"})
# flashmla:8 (session 33): the prefix on FlashMLA for verify batches of 8 and more only; a
# batch-1 case then runs our kernel alone, batch 8 the merged path
MODEL_SETS["mla_fmla8"] = dict(MODEL_SETS["mla_fmla_tv"], ar_of="mla_fmla_tv",
                               ddtree_env={"SGLANG_DDTREE_MLA_PREFIX": "flashmla:8"})
# the tiny pair on SGLang's fa3 backend with the verify's prefix part on FA3 and the tree keys
# on our kernel (SGLANG_DDTREE_MHA_PREFIX=fa3, session 34), against the same target's AR on fa3;
# fa3:4 takes FA3 from verify batches of 4 only (batch 1 our kernel alone)
MODEL_SETS["tiny_fa3p"] = dict(MODEL_SETS["tiny_fa3"], ar_of="tiny_fa3",
                               ddtree_env={"SGLANG_DDTREE_MHA_PREFIX": "fa3"})
MODEL_SETS["tiny_fa3p4"] = dict(MODEL_SETS["tiny_fa3"], ar_of="tiny_fa3",
                                ddtree_env={"SGLANG_DDTREE_MHA_PREFIX": "fa3:4"})
# an 8-layer Kimi K2.6 TP8 rank with int4 experts through our fused MoE, in the AR reference
# too (server_env goes to every server of the set): the verify's MoE calls (M = N x batch)
# run other config bands than a decode step's (M = batch), so this checks that those bands'
# numerics keep DDTREE's tokens equal to AR's. Dummy weights, experts seeded alike in both.
KIMI_CONFIGS = os.path.join(HERE, "..", "bench_assets", "model-configs")
MODEL_SETS["kimi_int4"] = {
    "target": os.path.abspath(os.path.join(KIMI_CONFIGS, "kimi-k2.6-tp8rank-l8-int4")),
    "draft": os.path.abspath(os.path.join(KIMI_CONFIGS, "kimi-k2.6-tp8rank-l8-int4-dflash-draft")),
    "random_target": False, "backend": "triton",
    "server_env": {"SGLANG_DDTREE_FUSED_MOE": "1", "SGLANG_DDTREE_MOE_DUMMY_INT4_SEED": "1234"}}
# the same rank with an fp8 e4m3 KV cache (AR reference too: both read the same quantised
# latents), the verify's latent rows written by the pool's set_mla_kv_buffer from the split
# query / latent parts (mla_split) and read by our kernel's fp8 path
MODEL_SETS["kimi_int4_fp8kv"] = dict(MODEL_SETS["kimi_int4"],
                                     extra_args=["--kv-cache-dtype", "fp8_e4m3"])
# the rank on SGLang's fa3 backend (Hopper): the model hands the verify its split parts itself
# (fa3 is one of SGLang's split-convention backends); prefill and AR decode on FA3. SGLang's
# default for an MLA model on Hopper. The kit's sgl_kernel has no FA3: install it first with
# scripts/devkit_fa3.py (session 67's fa3 servers died at start-up without it)
MODEL_SETS["kimi_int4_fa3"] = dict(MODEL_SETS["kimi_int4"], backend="fa3",
                                   ddtree_args=TRITON_VERIFY)
# the rank on FlashMLA pages of 64 with the defaults (auto: the verify's prefix on FlashMLA,
# which takes the whole query row, so the split parts are joined for it)
MODEL_SETS["kimi_int4_fmla"] = dict(MODEL_SETS["kimi_int4"], **FLASHMLA_PAGES,
                                    ddtree_args=FLASHMLA_DDTREE_ARGS)


HOST_SYNC_DEBUG_ENV = ("SGLANG_DDTREE_CHECK_RANKS",)


def port_free(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:port (a bind test, closed at once). SO_REUSEADDR,
    as the servers set it: connections of a finished run in TIME_WAIT do not count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def http(url, payload=None, timeout=600):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


LIVE_SERVERS = []  # every started, not yet stopped Server: stop_on_sigterm stops them


def stop_on_sigterm(on_exit=None):
    """``timeout`` ends a time-boxed step with SIGTERM, whose default action kills Python
    without running any ``finally``: the servers (own sessions) would live on, holding the GPU
    and their ports, and answer the next step's requests (seen on the two-GPU host). Instead
    stop them, let ``on_exit`` save partial results, and exit."""
    def handler(signum, frame):
        for s in list(LIVE_SERVERS):
            s.stop()
        if on_exit is not None:
            on_exit()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def parse_server_env(pairs: list) -> dict:
    """{KEY: VALUE} from ``--server-env KEY=VALUE`` strings (the scripts that start servers
    with extra environment: profile_step.py, bench_cost_curves.py)."""
    out = {}
    for kv in pairs:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise SystemExit(f"--server-env {kv!r}: expected KEY=VALUE")
        out[key] = value
    return out


class Server:
    """One ``sglang.launch_server`` process; ``wait=False`` returns at once (call wait_ready).

    Several servers share the GPU: each gets a fixed KV pool (``--max-total-tokens``) and a high
    ``--mem-fraction-static``, so SGLang's sizing (free memory now minus a slack proportional to
    the free memory at its start) stays positive however the concurrent starts interleave."""

    def __init__(self, args, log, port, env=None, wait=True):
        self.port, self.log = port, log
        if not port_free(port):
            # a leftover server there would answer this one's requests (seen on the H200: a
            # previous run's server served a whole case)
            raise RuntimeError(f"port {port} is already in use: stop what listens there")
        cmd = [sys.executable, "-m", "sglang.launch_server", "--port", str(port), *args]
        if "--nccl-port" not in args:
            # concurrent starts: a fixed NCCL port per server. SGLang's own pick lies within
            # port + 100..1000, where the other servers' HTTP ports are
            cmd += ["--nccl-port", str(port + 1000)]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        LIVE_SERVERS.append(self)
        self.t0 = time.time()
        if wait:
            self.wait_ready()

    def _wait(self, done, limit=600):
        while not done():
            if self.proc.poll() is not None:
                raise RuntimeError(f"server died: see {self.log}\n" + tail(self.log))
            if time.time() - self.t0 > limit:
                self.stop()
                raise RuntimeError(f"server not up in {limit} s: {self.log}\n" + tail(self.log))
            time.sleep(1)

    def wait_ready(self):
        def up():
            try:
                http(f"http://127.0.0.1:{self.port}/health_generate", timeout=5)
                return True
            except Exception:
                return False

        self._wait(up)
        if self.proc.poll() is not None:  # something else answered on our port
            raise RuntimeError(f"server died, yet port {self.port} answers: see {self.log}")
        self.startup_s = time.time() - self.t0
        return self

    def generate(self, input_ids, max_new_tokens, sampling=None, logprob=False, timeout=180,
                 token_ids_logprob=None):
        """One request. ``timeout``: a request of this suite takes seconds; a server that sits
        on one longer is hung (seen once on the two-GPU host), and the case should say so
        instead of holding the whole run until its time limit. ``logprob``: the top-8
        log-probs of each output position, and those of ``token_ids_logprob`` if given."""
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        params.update(sampling or {})
        payload = {"input_ids": input_ids, "sampling_params": params}
        if logprob:
            payload.update(return_logprob=True, top_logprobs_num=8, logprob_start_len=-1)
            if token_ids_logprob:
                payload.update(token_ids_logprob=list(token_ids_logprob))
        try:
            return http(f"http://127.0.0.1:{self.port}/generate", payload, timeout=timeout)
        except OSError as e:  # timeouts and refused connections; the log says the rest
            raise RuntimeError(f"{os.path.basename(self.log)}: request failed ({e!r}); log "
                               f"tail:\n{tail(self.log, 15)}") from e

    def stop(self):
        if self in LIVE_SERVERS:
            LIVE_SERVERS.remove(self)
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except Exception:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except Exception:
                pass


def tail(path, n=40):
    try:
        return "".join(open(path).readlines()[-n:])
    except OSError:
        return ""


# --- the DDTREE server log lines the plugin's stage timers write ------------------------------

STAGE_RE = re.compile(r"DDTREE stage ms/step(?: \((\w+)\))? over (\d+) steps .*?: (\{.*\})")
BY_BUDGET_RE = re.compile(r"DDTREE accept length by budget \(this server's trees\): (\{.*\})")
BY_BS_RE = re.compile(r"DDTREE stage ms/step by batch size \((\w+)\): (\{.*\})")
MOE_STATS_RE = re.compile(r"DDTREE MoE distinct experts per call by tokens M \(mean, calls\): "
                          r"(\{.*\})")


def _last_match(log, regex, build):
    """build(match) of the last line of ``log`` that ``regex`` matches, or None."""
    found = None
    for line in open(log):
        m = regex.search(line)
        if m:
            found = build(m)
    return found


def accept_by_budget(log):
    """The last {budget: tokens per step} line a DDTREE server with timers logged, or None."""
    return _last_match(log, BY_BUDGET_RE, lambda m: json.loads(m.group(1)))


def stage_times_by_bs(log):
    """The last per-batch-size stage line: {"mode": ..., "bs": {bs: {"steps", stage: ms}}}."""
    return _last_match(log, BY_BS_RE,
                       lambda m: {"mode": m.group(1), "bs": json.loads(m.group(2))})


def moe_distinct_experts(log):
    """{M: [mean distinct experts per MoE call, calls]} from the last SGLANG_DDTREE_MOE_STATS
    line, or None."""
    return _last_match(log, MOE_STATS_RE, lambda m: json.loads(m.group(1)))


def stage_times(log):
    """The last per-stage ms/step line the DDTREE timers logged (mode: sync or cpu)."""
    return _last_match(log, STAGE_RE, lambda m: {
        "mode": m.group(1) or "sync", "steps": int(m.group(2)),
        **json.loads(m.group(3).replace("'", '"'))})


def run_batch(server, prompts, max_new, concurrency, sampling=None):
    """Send prompts with `concurrency` in flight; returns (outputs, metas, wall seconds)."""
    t0 = time.time()
    with cf.ThreadPoolExecutor(concurrency) as ex:
        res = list(ex.map(lambda p: server.generate(p, max_new, sampling), prompts))
    wall = time.time() - t0
    return [r["output_ids"] for r in res], [r["meta_info"] for r in res], wall


def make_random_target(src_dir, dst_dir, seed=0):
    """Random normal init (std = initializer_range) so that greedy output depends on context."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(src_dir)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model.save_pretrained(dst_dir, safe_serialization=True)
    del model
    torch.cuda.empty_cache()


def make_prompts(n, vocab, seed=1):
    rng = random.Random(seed)
    # varied lengths; a few share a prefix so the radix cache gets hits
    shared = [rng.randrange(3, vocab - 1) for _ in range(40)]
    prompts = []
    for i in range(n):
        length = rng.choice([8, 17, 33, 64, 120])
        body = [rng.randrange(3, vocab - 1) for _ in range(length)]
        prompts.append(shared + body if i % 4 == 0 else body)
    return prompts


# a T > 0 smoke run on every graph server (filtered: top-k and top-p)
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "top_k": 40}

# the oracle plants the target's continuation at rank r with these odds (not always rank 0)
ORACLE_RANK_PROBS = [0.75, 0.2, 0.05]


def write_oracle(path, prompts, outputs):
    """The test-only oracle file (SGLANG_DDTREE_TEST_ORACLE) of these prompts' reference
    outputs, replaced atomically: a server never reads half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"seed": 0, "rank_probs": ORACLE_RANK_PROBS,
                   "items": [{"prompt": p, "output": o} for p, o in zip(prompts, outputs)]}, f)
    os.replace(tmp, path)


def run_header() -> dict:
    """Versions, the checkout's source digest, GPU, date and command of this run."""
    import sglang
    import torch

    return {
        "sglang_version": sglang.__version__, "torch_version": torch.__version__,
        "source_digest": checkout_digest(__file__),
        "gpu": torch.cuda.get_device_name(0),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "command": " ".join(["python", "scripts/" + os.path.basename(sys.argv[0])] + sys.argv[1:]),
    }


def case_wave(n_jobs: int, max_servers: int) -> int:
    """How many lossless-case servers run at once: every case's (``max_servers`` 0), else at
    most ``max_servers``."""
    return n_jobs if max_servers <= 0 else min(n_jobs, max_servers)


def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def accept_length(metas):
    toks = sum(m["completion_tokens"] for m in metas)
    steps = sum(m.get("spec_verify_ct", 0) for m in metas)
    return toks / steps if steps else None


def compare(ar, prompts, outs, ref, tie_tol, tag):
    """(identical, near_ties, mismatches): a divergence is a near tie only if the target's own
    log-prob of the token DDTREE emitted there is within tie_tol of its best token's (queried
    from the AR server, top-8 log-probs); anything else is a mismatch."""
    identical = near = 0
    mismatches = []
    for p, o, r in zip(prompts, outs, ref):
        i = first_diff(o, r)
        if i is None:
            identical += 1
            continue
        q = ar.generate(p + r[:i], 1, logprob=True)
        top = q["meta_info"]["output_top_logprobs"][0]  # [(logprob, token, text), ...] best first
        gap = float(top[0][0] - top[1][0])
        got = o[i] if i < len(o) else None
        runner_up = got == top[1][1]
        # the target's own log-prob gap between its argmax and the token DDTREE emitted
        got_lp = next((float(lp) for lp, tok, *_ in top if tok == got), None)
        token_gap = None if got_lp is None else float(top[0][0]) - got_lp
        entry = {"prompt_len": len(p), "position": i, "top2_gap": gap, "ddtree_token": got,
                 "ddtree_token_gap": token_gap, "ar_top_tokens": [t[1] for t in top[:4]],
                 "is_runner_up": runner_up}
        shown = "not in top-%d" % len(top) if token_gap is None else f"{token_gap:.4f}"
        print(f"[{tag}] divergence at {i}: top-2 gap {gap:.4f}, gap to DDTREE's token {shown}")
        if token_gap is not None and token_gap <= tie_tol:
            near += 1
        else:
            mismatches.append(entry)
    return identical, near, mismatches


def deterministic_checks(ar_srv, dd_srv, prompts, max_new, tie_tol, tag, n_seeded=8):
    """Checks on an AR + DDTREE pair that both run with --enable-deterministic-inference.

    There SGLang seeds every draw (a request's ``sampling_seed``, else 42) by hashing (seed,
    position), and DDTREE draws every tree node the same way (sampling.seeded_draw), so:
    a seeded request must give the same output alone, again, and inside a batch; another seed
    must give another output; and the seeded DDTREE output should equal the seeded AR output
    except where the verify forward's distribution differs numerically from the decode step's
    (reported, with the positions). Greedy DDTREE vs AR uses the near-tie rule of ``compare``.
    """
    ref, _, _ = run_batch(ar_srv, prompts, max_new, 1)
    outs, metas, _ = run_batch(dd_srv, prompts, max_new, 1)
    ident, near, bad = compare(ar_srv, prompts, outs, ref, tie_tol, tag + " greedy")
    greedy = {"prompts": len(prompts), "identical": ident, "near_ties": near,
              "mismatches": bad, "accept_length": accept_length(metas)}
    samp = {"temperature": 0.8, "top_p": 0.95, "top_k": 50}
    sel = prompts[:n_seeded]
    params = [dict(samp, sampling_seed=100 + i) for i in range(len(sel))]
    gen = lambda srv, ps: [r["output_ids"] for r in cf.ThreadPoolExecutor(  # noqa: E731
        len(sel)).map(lambda a: srv.generate(a[0], max_new, a[1]), zip(sel, ps))]
    one = lambda srv, ps: [srv.generate(p, max_new, q)["output_ids"]  # noqa: E731
                           for p, q in zip(sel, ps)]
    ar_out = one(ar_srv, params)
    o1, o2 = one(dd_srv, params), one(dd_srv, params)
    batched = gen(dd_srv, params)  # all at once: other requests in the batch
    other = one(dd_srv, [dict(q, sampling_seed=q["sampling_seed"] + 10_000) for q in params])
    rows = [{"same_seed_again": a == b, "same_seed_batched": a == c, "other_seed_differs": a != d,
             "equals_ar": a == r, "first_divergence_from_ar": first_diff(a, r)}
            for a, b, c, d, r in zip(o1, o2, batched, other, ar_out)]
    seeded = {"params": samp, "prompts": len(sel), "rows": rows,
              "all_reproducible": all(r["same_seed_again"] and r["same_seed_batched"]
                                      for r in rows),
              "other_seed_differs": sum(r["other_seed_differs"] for r in rows),
              "equal_to_ar": sum(r["equals_ar"] for r in rows)}
    print(f"[{tag}] seeded: reproducible={seeded['all_reproducible']} "
          f"equal_to_ar={seeded['equal_to_ar']}/{len(sel)} greedy identical={ident} near={near}")
    return {"greedy": greedy, "seeded": seeded}


def measure_tps(server, prompts, max_new, concs, repeats):
    """Median output tokens/s over repeats, per concurrency, after one warm-up pass."""
    run_batch(server, prompts[: max(concs)], max_new, max(concs))
    out = {}
    for c in concs:
        vals = []
        for _ in range(repeats):
            outs, metas, wall = run_batch(server, prompts, max_new, c)
            vals.append(sum(map(len, outs)) / wall)
        out[c] = {"tokens_per_s": sorted(vals)[len(vals) // 2],
                  "accept_length": accept_length(metas)}
    return out


def output_digest(tokens) -> str:
    """A short digest of one generation's token ids (equal digests: equal outputs)."""
    return hashlib.sha1(json.dumps(list(tokens)).encode()).hexdigest()[:16]


def summarize(result, hist, outputs):
    """The run's verdict from what ``result`` holds: graph vs eager (from ``outputs``), the
    accept histogram (``hist``), mean accept lengths and the failure counts. Also run on a
    partial result (a step's time limit), where it counts only what finished."""
    # CUDA graphs on and off: the same requests, the same outputs
    for (m, b, graph, c), outs in sorted(outputs.items(), key=str):
        on = outputs.get((m, b, True, c))
        if not graph and on is not None:
            result["graph_vs_eager"].append({
                "model": m, "budget": b, "batch_size": c, "prompts": len(outs),
                "equal": sum(x == y for x, y in zip(outs, on)),
                "first_divergences": [first_diff(x, y) for x, y in zip(outs, on) if x != y]})
    if not outputs:  # a result read back from its JSON: compare the cases' output digests
        by_key = {(c["model"], str(c["budget"]), c["batch_size"], c["cuda_graph"]): c
                  for c in result["cases"] if c.get("output_digests")}
        for (m, b, bs, graph), off in sorted(by_key.items(), key=str):
            on = by_key.get((m, b, bs, True))
            if not graph and on is not None:
                pairs = list(zip(off["output_digests"], on["output_digests"]))
                result["graph_vs_eager"].append({
                    "model": m, "budget": off["budget"], "batch_size": bs, "prompts": len(pairs),
                    "equal": sum(x == y for x, y in pairs), "first_divergences": None})

    result["accept_histogram"] = {str(k): v for k, v in sorted(hist.items())}
    total = sum(hist.values())
    result["mean_accept_length"] = sum(k * v for k, v in hist.items()) / total if total else None
    per_req = [c["accept_length"] for c in result["cases"] if c["accept_length"]]
    result["mean_accept_length_over_cases"] = sum(per_req) / len(per_req) if per_req else None
    bad = sum(len(c["mismatches"]) for c in result["cases"])
    edge_bad = sum(not e["all_equal"] for e in result["edge_checks"])
    dets = list(result["deterministic"].values())
    seed_bad = sum(not d["seeded"]["all_reproducible"] for d in dets if "seeded" in d)
    sampled_bad = sum(r["completed"] != r["requests"] for r in result["sampled_runs"])
    bad += sum(len(d["greedy"]["mismatches"]) for d in dets if "greedy" in d)
    leaks = sum(bool(k["num_used_tokens_after_flush"] or k["leak_log_lines"])
                for k in result["kv_idle_checks"])
    result["failures"] = {"mismatches": bad, "edge_checks": edge_bad,
                          "seeded_not_reproducible": seed_bad, "kv_not_idle": leaks,
                          "sampled_incomplete": sampled_bad,
                          "errors": len(result.get("errors", []))}
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_results/e2e_lossless_h200.json")
    ap.add_argument("--cases", default="tiny:8,32,64,auto;mla:8,32,64;tiny_page16:32;"
                                       "tiny_flashinfer:32;tiny_tv:32;mla_tv:32",
                    help="model:budgets;... oracle-mode lossless cases (run concurrently)")
    ap.add_argument("--eager-check", default="tiny:32",
                    help="model:budget also run with --disable-cuda-graph")
    ap.add_argument("--speed", default="tiny:32",
                    help="model:budget for the sequential AR / DFLASH / DDTREE speed runs "
                    "(no oracle: the drafter's own proposals)")
    ap.add_argument("--deterministic", default="tiny:32",
                    help="model:budget of an AR + DDTREE server pair with SGLang's "
                         "--enable-deterministic-inference: seeded T>0 reproducibility (alone "
                         "and batched), seeded DDTREE vs seeded AR, greedy vs AR; '' skips")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tie-tol", type=float, default=0.25,
                    help="log-prob gap (nats) between the target's best token and DDTREE's "
                    "below which a divergence is a near tie; bf16 logits of magnitude 16-32 "
                    "are quantised to 0.125")
    ap.add_argument("--port", type=int, default=30100)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "ddtree_e2e"))
    ap.add_argument("--kv-tokens", type=int, default=65536, help="--max-total-tokens per server")
    ap.add_argument("--verify-backend", choices=("native", "triton"), default=None,
                    help="pass --speculative-ddtree-verify-backend to every DDTREE server "
                    "(default: not passed, i.e. the plugin's default)")
    ap.add_argument("--tp", type=int, default=1, help="--tp-size of every server (AR too)")
    ap.add_argument("--chunked-prefill-size", type=int, default=128,
                    help="small, so that prompts longer than it are prefilled in chunks")
    ap.add_argument("--max-servers", type=int, default=0,
                    help="at most this many lossless-case servers at once (0: every case's at "
                    "once, as on an H200); each case's server starts when an earlier one has "
                    "stopped. The AR reference server stays up throughout. On an 80 GB H100, 2 "
                    "worked for the 8-layer int4 Kimi rank; its four cases at once did not")
    ap.add_argument("--ddtree-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for every DDTREE server, e.g. "
                    "SGLANG_DDTREE_KV_MOVE=sglang (repeatable)")
    args = ap.parse_args()
    ddtree_env = dict(kv.split("=", 1) for kv in args.ddtree_env)
    # the speed servers leave out debug switches that synchronize the host every step
    speed_env = {k: v for k, v in ddtree_env.items() if k not in HOST_SYNC_DEBUG_ENV}

    os.makedirs(args.workdir, exist_ok=True)
    concs = [int(x) for x in args.batch_sizes.split(",") if x]
    # "auto": the auto table; "online": auto with SGLANG_DDTREE_AUTO_MODE=online
    budget = lambda b: b if b in ("auto", "online") else int(b)  # noqa: E731
    parse = lambda spec: [(m, [budget(b) for b in bs.split(",")])  # noqa: E731
                          for m, bs in (x.split(":") for x in spec.split(";") if x)]
    cases = parse(args.cases)
    eager = parse(args.eager_check)
    speed = parse(args.speed)
    result = {
        **run_header(),
        "max_new_tokens": args.max_new_tokens, "tie_tolerance_logprob": args.tie_tol,
        "verify_backend": args.verify_backend, "ddtree_env": ddtree_env, "tp_size": args.tp,
        "max_servers": args.max_servers,
        "notes": "lossless cases run with the test-only oracle draft (SGLANG_DDTREE_TEST_ORACLE) "
                 "and several servers at once on one GPU: their tokens/s is not a speed figure. "
                 "Speed figures are in 'speed' (one server at a time, no oracle).",
        "cases": [], "speed": {}, "kv_idle_checks": [],
        "edge_checks": [], "graph_vs_eager": [], "deterministic": {}, "sampled_runs": [],
    }
    outputs = {}  # (model, budget, cuda graph, batch size) -> DDTREE outputs
    hist = {}
    lock = __import__("threading").Lock()

    def dump():  # partial results survive a time-limited run
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        json.dump(result, open(args.out, "w"), indent=1)

    ports = iter(range(args.port, args.port + 100))
    det = parse(args.deterministic)
    models = sorted({m for m, _ in cases + eager + speed + det})

    def ar_base(m):
        """Model sets whose AR server would be identical (same target, backend and flags)
        share one: the set ``ar_of`` names if it runs, else the first of the sharing sets."""
        key = MODEL_SETS[m].get("ar_of", m)
        if key in models:
            return key
        return min(x for x in models if MODEL_SETS[x].get("ar_of", x) == key)

    ar_models = [m for m in models if ar_base(m) == m]

    def model_args(name):
        ms = MODEL_SETS[name]
        if ms.get("real_weights"):
            target = ms["target"]
        else:
            target = os.path.join(args.workdir, ms["target"])
        if not os.path.isdir(target):
            shutil.copytree(os.path.join(MODELS, ms["target"]), target)
            if ms["random_target"]:
                make_random_target(target, target)
        common = ["--model-path", target, "--skip-tokenizer-init", "--grammar-backend", "none",
                  "--attention-backend", ms["backend"], "--cuda-graph-max-bs", str(max(concs)),
                  "--mem-fraction-static", "0.85", "--max-total-tokens", str(args.kv_tokens),
                  "--disable-prefill-cuda-graph",
                  "--max-running-requests", str(max(concs)), "--sampling-backend", "pytorch",
                  "--sleep-on-idle", "--tp-size", str(args.tp),
                  "--chunked-prefill-size", str(args.chunked_prefill_size)]
        common += ms.get("extra_args", [])
        if not ms["random_target"] and not ms.get("real_weights"):
            common += ["--load-format", "dummy"]
        spec = ["--speculative-draft-model-path", os.path.join(MODELS, ms["draft"])]
        if not ms.get("real_weights"):
            spec += ["--speculative-draft-load-format", "dummy"]
        if ms.get("prompts_file"):
            rows = [json.loads(line)["input_ids"] for line in open(ms["prompts_file"])]
            # every 4th prompt starts with the first prompt's first 64 tokens: radix-cache hits
            prompts = [rows[0][:64] + r if i % 4 == 0 and i else r
                       for i, r in enumerate(rows[: args.prompts])]
            return common, spec, prompts
        vocab = json.load(open(os.path.join(target, "config.json")))["vocab_size"]
        return common, spec, make_prompts(args.prompts, vocab)

    log = lambda tag: os.path.join(args.workdir, f"{tag}.log")  # noqa: E731
    setup = {m: model_args(m) for m in models}
    ar, ref, oracle_path = {}, {}, {}

    errors = []  # a server that fails costs its own cases, not the run

    def dump_partial():
        result["status"] = ("partial: ended by SIGTERM (the step's time limit); the summary "
                            "counts only what had finished")
        result["errors"] = errors
        try:
            summarize(result, hist, outputs)
        finally:
            dump()

    stop_on_sigterm(dump_partial)

    def start_ar(m):
        common, _, prompts = setup[m]
        try:
            ar[m].wait_ready()
            ref[m], _, _ = run_batch(ar[m], prompts, args.max_new_tokens, 1)
        except Exception as e:  # noqa: BLE001 -- recorded; this model's cases are skipped
            with lock:
                errors.append(f"{m}: AR reference failed: {e!r}"[:2000])
            ar[m].stop()
            return
        write_oracle(oracle_path[m], prompts, ref[m])

    def ddtree_args(m, b):
        common, spec, _ = setup[m]
        verify = (MODEL_SETS[m].get("ddtree_args", []) if args.verify_backend is None
                  else ["--speculative-ddtree-verify-backend", args.verify_backend])
        return common + spec + ["--speculative-algorithm", "DDTREE",
                                "--speculative-ddtree-budget",
                                "auto" if b == "online" else str(b)] + verify

    def budget_env(b):
        return {"SGLANG_DDTREE_AUTO_MODE": "online"} if b == "online" else {}

    def env_of(m, *extra):
        """The set's server_env (every server of model set m), then ``extra`` dicts; None if
        empty (the server inherits this process's environment only)."""
        env = dict(MODEL_SETS[m].get("server_env", {}))
        for e in extra:
            env.update(e)
        return env or None

    servers, speed_servers, det_servers = {}, {}, {}
    jobs = [(m, b, True) for m, bs in cases for b in bs] + \
           [(m, b, False) for m, bs in eager for b in bs]
    if args.max_servers < 0:
        raise SystemExit(f"--max-servers {args.max_servers}: expected 0 (no cap) or more")
    wave = case_wave(len(jobs), args.max_servers)

    def start_case(m, b, graph):
        tag = f"{m}-ddtree-b{b}" + ("" if graph else "-eager")
        with lock:
            port = next(ports)
        servers[(m, b, graph)] = Server(
            ddtree_args(m, b) + ([] if graph else ["--disable-cuda-graph"]), log(tag),
            port, env=env_of(m, {"SGLANG_DDTREE_TEST_ORACLE": oracle_path[m]},
                             ddtree_env, MODEL_SETS[m].get("ddtree_env", {}),
                             budget_env(b)),
            wait=False)
        return servers[(m, b, graph)]
    try:
        # every server starts now (fixed KV pools, --sleep-on-idle); the oracle servers read
        # their oracle file at their first step, after the AR reference below has written it
        for m in ar_models:
            oracle_path[m] = os.path.join(args.workdir, f"{m}-oracle.json")
            if os.path.exists(oracle_path[m]):
                os.remove(oracle_path[m])
            ar[m] = Server(setup[m][0], log(f"{m}-ar"), next(ports), wait=False,
                           env=env_of(m))
        for m in models:  # a set that differs only on the DDTREE side shares its AR reference
            if m not in ar_models:
                oracle_path[m] = oracle_path[ar_base(m)]
                ar[m] = ar[ar_base(m)]
        for m, budgets in speed:
            common, spec, _ = setup[m]
            for algo, extra in (("dflash", ["--speculative-algorithm", "DFLASH"] + spec),
                                ("ddtree", ddtree_args(m, budgets[0])[len(common):])):
                speed_servers[(m, algo)] = Server(
                    common + extra, log(f"{m}-speed-{algo}"), next(ports), wait=False,
                    env=env_of(m, {"SGLANG_DDTREE_TIMERS": "cpu", **speed_env}
                               if algo == "ddtree" else {}))
        for m, b, graph in jobs[:wave]:  # the later cases' servers start as these stop
            start_case(m, b, graph)
        for m, budgets in det:
            # SGLang's deterministic mode aligns every prefill chunk of the triton/flashinfer
            # backends to 4096 tokens and never schedules a chunk below that: with this suite's
            # small --chunked-prefill-size, a prompt longer than one chunk hangs (measured on
            # the H200, AR server too). SGLang's argparse keeps the last value given.
            det_flag = ["--enable-deterministic-inference",
                        "--chunked-prefill-size", str(max(args.chunked_prefill_size, 4096))]
            det_servers[(m, "ar")] = Server(setup[m][0] + det_flag, log(f"{m}-ar-det"),
                                            next(ports), wait=False,
                                            env=env_of(m))
            det_servers[(m, "ddtree")] = Server(
                ddtree_args(m, budgets[0]) + det_flag, log(f"{m}-ddtree-b{budgets[0]}-det"),
                next(ports), env=env_of(m, ddtree_env),
                wait=False)
        with cf.ThreadPoolExecutor(len(models)) as ex:
            list(ex.map(start_ar, ar_models))
        for m in models:
            if m not in ar_models and ar_base(m) in ref:
                ref[m] = ref[ar_base(m)]
        others = list(speed_servers.values()) + list(servers.values()) + \
            list(det_servers.values())
        for srv in others:
            try:
                srv.wait_ready()  # measure speed only once nothing is compiling or capturing
            except Exception as e:  # noqa: BLE001 -- its case reports it again
                errors.append(f"{os.path.basename(srv.log)}: {e!r}"[:2000])
        result["startup_s"] = {os.path.basename(s.log)[:-4]: round(s.startup_s, 1) for s in
                               list(ar.values()) + others if hasattr(s, "startup_s")}

        # 1) speed: one server at a time (all others idle)
        for m, budgets in speed:
            common, spec, prompts = setup[m]
            try:
                entry = {"budget": budgets[0], "ar": measure_tps(
                    ar[m], prompts, args.max_new_tokens, concs, args.repeats)}
                for algo in ("dflash", "ddtree"):
                    entry[algo] = measure_tps(speed_servers[(m, algo)], prompts,
                                              args.max_new_tokens, concs, args.repeats)
            except Exception as e:  # noqa: BLE001 -- recorded; the lossless cases still run
                errors.append(f"{m}: speed failed: {e!r}"[:2000])
                continue
            finally:
                for algo in ("dflash", "ddtree"):
                    speed_servers[(m, algo)].stop()
            entry["ddtree_cpu_stage_ms_per_step"] = stage_times(speed_servers[(m, "ddtree")].log)
            result["speed"][m] = entry
            dump()
            print("speed", m, json.dumps(entry))

        # 2) lossless, oracle drafts, all cases concurrently
        def run_case(m, b, graph):
            _, _, prompts = setup[m]
            tag = f"{m}-ddtree-b{b}" + ("" if graph else "-eager")
            # started by now, or (past the first wave) here, once an earlier case's server
            # has stopped: the pool runs at most `wave` cases at once
            srv = servers.get((m, b, graph)) or start_case(m, b, graph)
            try:
                srv.wait_ready()
                for c in concs:
                    outs, metas, wall = run_batch(srv, prompts, args.max_new_tokens, c)
                    with lock:
                        outputs[(m, b, graph, c)] = outs
                    ident, near, bad = compare(ar[m], prompts, outs, ref[m], args.tie_tol,
                                               f"{tag} c={c}")
                    # SGLang's own spec metrics, as every request's meta_info reports them
                    sgl_hist = []
                    for mt in metas:
                        for i, v in enumerate(mt.get("spec_accept_histogram") or []):
                            sgl_hist += [0] * (i + 1 - len(sgl_hist))
                            sgl_hist[i] += v
                    case = {"model": m, "attention_backend": MODEL_SETS[m]["backend"],
                            "verify_backend": args.verify_backend or (
                                "triton" if "--speculative-ddtree-verify-backend" in
                                MODEL_SETS[m].get("ddtree_args", []) else "auto"),
                            "budget": b, "batch_size": c, "prompts": len(prompts),
                            "cuda_graph": graph, "identical": ident, "near_ties": near,
                            "mismatches": bad, "accept_length": accept_length(metas),
                            # per prompt: where it leaves AR's output (None: identical) and a
                            # digest, so graph vs eager can be compared from the JSON alone
                            "first_divergence_from_ar": [first_diff(o, r)
                                                         for o, r in zip(outs, ref[m])],
                            "output_digests": [output_digest(o) for o in outs],
                            "sglang_spec_metrics": {
                                "spec_accept_length_in_every_response": all(
                                    "spec_accept_length" in mt for mt in metas),
                                "spec_accept_histogram_summed": sgl_hist},
                            "tokens_per_s": {"oracle_mode_concurrent_servers":
                                             sum(map(len, outs)) / wall}}
                    spd = result["speed"].get(m)
                    if spd and spd["budget"] == b:
                        case["tokens_per_s"].update(
                            ar=spd["ar"][c]["tokens_per_s"],
                            dflash=spd["dflash"][c]["tokens_per_s"],
                            ddtree_no_oracle=spd["ddtree"][c]["tokens_per_s"])
                    with lock:
                        result["cases"].append(case)
                        dump()
                        for mt in metas:
                            if mt.get("spec_verify_ct"):
                                a = mt["completion_tokens"] / mt["spec_verify_ct"]
                                hist[round(a)] = hist.get(round(a), 0) + 1
                    print(json.dumps({k: v for k, v in case.items() if k != "mismatches"}))
                if graph:
                    # stop tokens and max_new_tokens that land inside an accepted path: DDTREE
                    # must stop exactly where the target alone stops with the same params
                    # on prompts this server reproduced exactly at the first batch size (a
                    # near-tie divergence elsewhere would hide what the check is about)
                    same = [i for i, (o, r) in enumerate(zip(outputs[(m, b, graph, concs[0])],
                                                              ref[m]))
                            if o == r and len(r) > 11][:2]
                    edges = []
                    for i in same:
                        r = ref[m][i]
                        # ignore_eos (the default of generate) also disables stop_token_ids
                        for params, max_new in (({"stop_token_ids": [r[5]], "ignore_eos": False},
                                                 48),
                                                ({"stop_token_ids": [r[11]],
                                                  "ignore_eos": False}, 48),
                                                ({}, 7), ({}, 13)):
                            want = ar[m].generate(prompts[i], max_new, params)["output_ids"]
                            got = srv.generate(prompts[i], max_new, params)["output_ids"]
                            edges.append({"prompt": i, "params": params, "max_new_tokens": max_new,
                                          "ar_len": len(want), "ddtree_len": len(got),
                                          "stopped_early": len(want) < max_new,
                                          "equal": got == want})
                    with lock:
                        result["edge_checks"].append({"model": m, "budget": b,
                                                      "prompts": same,
                                                      "all_equal": bool(edges) and
                                                      all(e["equal"] for e in edges),
                                                      "checks": edges})
                    # T > 0 through this server's sampling path (top-k/top-p filtered nodes),
                    # 8 requests at once: every one completes with its full length
                    outs, metas, _ = run_batch(srv, prompts[:8], 32, 8, SAMPLED)
                    with lock:
                        result["sampled_runs"].append({
                            "model": m, "budget": b, "params": SAMPLED, "requests": len(outs),
                            "completed": sum(len(o) == 32 for o in outs),
                            "accept_length": accept_length(metas)})
                time.sleep(3)  # let the scheduler go idle: SGLang checks its pools for leaks
                urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/flush_cache").read()
                loads = http(f"http://127.0.0.1:{srv.port}/v1/loads")["loads"][0]
                leak = [l.strip() for l in open(srv.log) if "leak" in l.lower()]
                with lock:
                    result["kv_idle_checks"].append(
                        {"model": m, "budget": b, "cuda_graph": graph,
                         "num_used_tokens_after_flush": loads["num_used_tokens"],
                         "leak_log_lines": leak[:5]})
            finally:
                srv.stop()

        def run_det(m, b):
            _, _, prompts = setup[m]
            a, d = det_servers[(m, "ar")], det_servers[(m, "ddtree")]
            try:
                entry = deterministic_checks(a, d, prompts, args.max_new_tokens, args.tie_tol,
                                             f"{m}-ddtree-b{b}-det")
                entry.update(model=m, budget=b)
                with lock:
                    result["deterministic"][m] = entry
                    dump()
            finally:
                a.stop()
                d.stop()

        runnable = [j for j in jobs if j[0] in ref]
        for m, b, graph in jobs:
            if m not in ref:
                if (m, b, graph) in servers:
                    servers[(m, b, graph)].stop()
                errors.append(f"{m} budget {b}: skipped, no AR reference")
        # the cases in job order, at most `wave` at once (their servers: the first wave's
        # started above; each later one when a worker frees), the deterministic pair beside
        with cf.ThreadPoolExecutor(max(1, min(wave, len(runnable)))) as ex, \
                cf.ThreadPoolExecutor(max(1, len(det))) as ex_det:
            futs = [ex.submit(run_case, *j) for j in runnable] + \
                [ex_det.submit(run_det, m, bs[0]) for m, bs in det]
            for f in futs:
                try:
                    f.result()
                except Exception as e:  # keep the other cases' results; report the failure
                    errors.append(repr(e)[:2000])
        # start-up times of the servers started past the first wave
        result["startup_s"].update({os.path.basename(s.log)[:-4]: round(s.startup_s, 1)
                                    for s in servers.values() if hasattr(s, "startup_s")})
    finally:
        result["errors"] = errors
        for s in (list(ar.values()) + list(servers.values()) + list(det_servers.values())
                  + list(speed_servers.values())):
            s.stop()

    summarize(result, hist, outputs)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    json.dump(result, open(args.out, "w"), indent=1)
    print(f"cases={len(result['cases'])} failures={result['failures']} "
          f"mean_accept={result['mean_accept_length_over_cases']} -> {args.out}")
    return 1 if any(result["failures"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
