#!/usr/bin/env python3
"""Grammar-constrained decoding end to end on a GPU: DDTREE greedy == the target's plain greedy.

Real SGLang servers on the project's trained tiny pair (bench_assets/tiny-code, with its
tokenizer, ``--grammar-backend xgrammar``): the target alone (AR), DFLASH and DDTREE at each
``--budgets``, all with the same settings. The held-out code prompts go out at every
``--batch-sizes`` concurrency, each prompt with one of the constraints below or none, so every
batch mixes regex, JSON-schema, EBNF and unconstrained requests. For each server the script
checks, token for token against AR, that the outputs are equal (a divergence is a *near tie*
only when the target's own log-probs of the two emitted tokens at the first differing position
lie within ``--tie-tol``, queried from the AR server without the constraint: the grammar's mask
only removes tokens, so the gap between two allowed tokens is the unconstrained one), and with
xgrammar that every constrained output is a prefix the grammar accepts (and a complete match
when the request stopped on its own). DFLASH runs the same checks: SGLang's own grammar path,
the baseline DDTREE has to match.

All servers share one GPU and start at once (fixed KV pools). First a speed phase times them
one at a time (the others idle under ``--sleep-on-idle``) on the same constrained mix: output
tokens/s, medians of ``--speed-repeats`` passes after a warm-up, DDTREE / DFLASH in the same
run. Accept lengths come from SGLang's ``spec_verify_ct``.

    python scripts/e2e_grammar.py --out bench_results/e2e_grammar_h200.json

``--model mla`` runs the same checks on e2e_lossless's MLA + MoE target (DeepSeek-V2 layout,
SGLang's dummy weights, config only) and its DFlash drafter, given the tiny pair's tokenizer:
the tree verify on MLA attention and MoE layers under a grammar (no speed figure: dummy weights).
``--budgets`` takes ``auto`` beside integers. ``--oracle`` (no speed phase) has the DDTREE
servers plant AR's constrained outputs in their drafts, as e2e_lossless's oracle mode does, so a
dummy drafter still gives long accepted paths through the grammar mask.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import e2e_lossless as lossless  # noqa: E402  (Server, compare, run_header, the tiny pair)

ASSETS = lossless.ASSETS

# name -> (SGLang sampling parameter, its value). Written for the tiny pair, a code model:
# indented assignment lines, a small JSON object, a one-function Python grammar
CONSTRAINTS = {
    "regex": ("regex", r"(    [a-z_][a-z_0-9]*( = [a-z_0-9.()\[\]', ]+)?\n){2,5}"),
    "json": ("json_schema", json.dumps({
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "line": {"type": "integer"},
                       "args": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                "maxItems": 3}},
        "required": ["name", "line", "args"], "additionalProperties": False})),
    "ebnf": ("ebnf", "\n".join([
        'root ::= "def " name "(" params "):\\n" body',
        'body ::= ("    " stmt "\\n"){1,3}',
        'stmt ::= "return " name | name " = " name',
        "name ::= [a-z_] [a-z_0-9]*",
        'params ::= (name (", " name)*)?'])),
}


# The MLA + MoE target of e2e_lossless's ``mla`` case (DeepSeek-V2 layout, SGLang's dummy weights,
# config only) and its DFlash drafter, given the tiny pair's tokenizer so that grammars compile:
# the vocabulary shrinks to the tokenizer's, the drafter's mask token becomes the tokenizer's
MLA_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def mla_with_tokenizer(workdir):
    """(target_dir, draft_dir) under ``workdir``: the ``mla`` case's configs with the tiny
    pair's tokenizer (vocabulary, BOS / EOS and the drafter's mask token made to match)."""
    tiny_target = os.path.join(ASSETS, "target")
    tiny_cfg = json.load(open(os.path.join(tiny_target, "config.json")))
    tiny_draft = json.load(open(os.path.join(ASSETS, "dflash-draft", "config.json")))
    vocab = tiny_cfg["vocab_size"]
    dirs = []
    for name in ("mla-moe-target", "mla-moe-dflash-draft"):
        cfg = json.load(open(os.path.join(lossless.MODELS, name, "config.json")))
        cfg["vocab_size"] = vocab
        cfg["bos_token_id"], cfg["eos_token_id"] = tiny_cfg["bos_token_id"], tiny_cfg["eos_token_id"]
        if "dflash_config" in cfg:
            cfg["dflash_config"] = dict(cfg["dflash_config"],
                                        mask_token_id=tiny_draft["dflash_config"]["mask_token_id"])
        out = os.path.join(workdir, name + "-tok")
        os.makedirs(out, exist_ok=True)
        json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=1)
        for f in MLA_TOKENIZER_FILES:
            shutil.copy(os.path.join(tiny_target, f), out)
        dirs.append(out)
    return tuple(dirs)


def constraint_of(i: int, names):
    """Prompt i's constraint name, or None (every len(names) + 1-th prompt is unconstrained)."""
    k = i % (len(names) + 1)
    return names[k] if k < len(names) else None


def sampling_of(name):
    params = {"ignore_eos": False}  # a grammar that completes ends its request
    if name is not None:
        key, value = CONSTRAINTS[name]
        params[key] = value
    return params


def judge(ar, prompts, outs, ref, kinds, tie_tol, tag):
    """(identical, near_ties, mismatches) against AR. Unconstrained prompts: ``compare``'s rule
    (DDTREE's token within ``tie_tol`` of the target's best). Constrained ones: the target's
    best token may be one the grammar bans, so the rule compares the two tokens the servers
    emitted, both allowed: AR's own log-prob of its token minus that of DDTREE's at the first
    difference (unconstrained log-probs; the grammar's mask only removes tokens). A divergence
    in length only (one output stopped) is a mismatch."""
    identical = near = 0
    mismatches = []
    for p, o, r, kind in zip(prompts, outs, ref, kinds):
        if kind is None:
            i, n, bad = lossless.compare(ar, [p], [o], [r], tie_tol, tag)
            identical, near, mismatches = identical + i, near + n, mismatches + bad
            continue
        i = lossless.first_diff(o, r)
        if i is None:
            identical += 1
            continue
        entry = {"constraint": kind, "prompt_len": len(p), "position": i,
                 "ddtree_token": o[i] if i < len(o) else None,
                 "ar_token": r[i] if i < len(r) else None}
        if i < len(o) and i < len(r):
            q = ar.generate(p + r[:i], 1, logprob=True, token_ids_logprob=[r[i], o[i]])
            lps = {int(t): float(lp) for lp, t, *_ in
                   q["meta_info"]["output_token_ids_logprobs"][0]}
            entry["token_gap"] = lps[r[i]] - lps[o[i]]
            print(f"[{tag}] {kind} divergence at {i}: AR's token {entry['token_gap']:.4f} "
                  "above DDTREE's")
            if entry["token_gap"] <= tie_tol:
                near += 1
                continue
        mismatches.append(entry)
    return identical, near, mismatches


def constraint_compiler(target_dir, vocab_size):
    """(tokenizer, xgrammar GrammarCompiler) over the target's tokenizer, its EOS the stop token
    (as SGLang's xgrammar backend builds it)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size,
                                              stop_token_ids=[tok.eos_token_id])
    return tok, xgr.GrammarCompiler(info)


def compile_constraint(compiler, name):
    """CONSTRAINTS[name] compiled by xgrammar, as SGLang's backend compiles that parameter."""
    key, value = CONSTRAINTS[name]
    if key == "regex":
        return compiler.compile_regex(value)
    if key == "json_schema":
        return compiler.compile_json_schema(value)
    return compiler.compile_grammar(value)


def allowed_tokens(matcher, vocab_size):
    """The token ids ``matcher`` allows next (its bitmask unpacked)."""
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(mask)
    words = mask[0].tolist()
    return [t for t in range(vocab_size) if (words[t // 32] >> (t % 32)) & 1]


def grammar_checker(target_dir, vocab_size):
    """check(name, output_ids, finish) -> dict: whether xgrammar accepts the output as a prefix
    of the constraint's language, and whether it is a whole sentence when the request stopped
    on its own (its stop token, if SGLang returned it, is fed too)."""
    import xgrammar as xgr

    tok, compiler = constraint_compiler(target_dir, vocab_size)
    eos = [tok.eos_token_id]
    compiled = {name: compile_constraint(compiler, name) for name in CONSTRAINTS}

    def check(name, output_ids, finish):
        m = xgr.GrammarMatcher(compiled[name])
        accepted = 0
        for t in output_ids:
            if not m.accept_token(int(t)):
                break
            accepted += 1
        stopped = (finish or {}).get("type") == "stop"
        complete = m.is_terminated() or (stopped and m.accept_token(eos[0]))
        return {"accepted_prefix": accepted == len(output_ids), "complete": bool(complete),
                "stopped": stopped, "text": tok.decode(output_ids)[:120]}

    return check


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_results/e2e_grammar_h200.json")
    ap.add_argument("--model", choices=("tiny", "mla"), default="tiny",
                    help="tiny: the trained tiny pair; mla: the MLA + MoE target of "
                         "e2e_lossless's mla case (dummy weights) with the tiny pair's tokenizer")
    ap.add_argument("--budgets", default="8,32", help="DDTREE budgets (integers or auto)")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--constraints", default=",".join(CONSTRAINTS))
    ap.add_argument("--tie-tol", type=float, default=0.25,
                    help="target log-prob gap (nats) below which a divergence is a near tie")
    ap.add_argument("--no-dflash", action="store_true", help="skip SGLang's DFLASH baseline")
    ap.add_argument("--speed-batch-sizes", default="1,8",
                    help="concurrencies of the speed phase ('' skips it)")
    ap.add_argument("--speed-repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=30400)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "ddtree_grammar"))
    ap.add_argument("--kv-tokens", type=int, default=65536, help="--max-total-tokens per server")
    ap.add_argument("--oracle", action="store_true",
                    help="DDTREE servers plant AR's constrained outputs in their drafts "
                         "(test-only SGLANG_DDTREE_TEST_ORACLE, as e2e_lossless does): long "
                         "accepted paths under the grammar mask even with a dummy drafter; "
                         "no speed phase (oracle drafts are no speed figure)")
    args = ap.parse_args()

    os.makedirs(args.workdir, exist_ok=True)
    names = [c for c in args.constraints.split(",") if c]
    unknown = sorted(set(names) - set(CONSTRAINTS))
    if unknown:
        ap.error(f"unknown constraints {unknown}; known: {sorted(CONSTRAINTS)}")
    concs = [int(x) for x in args.batch_sizes.split(",") if x]
    speed_concs = [int(x) for x in args.speed_batch_sizes.split(",") if x]
    if args.oracle and speed_concs:
        ap.error("--oracle times nothing: pass --speed-batch-sizes= with it")
    widest = max(concs + speed_concs)
    budgets = [b if b == "auto" else int(b) for b in args.budgets.split(",") if b]
    if args.model == "mla":
        target, draft = mla_with_tokenizer(args.workdir)
    else:
        target = os.path.join(ASSETS, "target")
        draft = os.path.join(ASSETS, "dflash-draft")
    vocab = json.load(open(os.path.join(target, "config.json")))["vocab_size"]
    rows = [json.loads(line)["input_ids"] for line in open(os.path.join(ASSETS,
                                                                        "eval_prompts.jsonl"))]
    prompts = rows[: args.prompts]
    kinds = [constraint_of(i, names) for i in range(len(prompts))]
    check = grammar_checker(target, vocab)

    result = {
        **lossless.run_header(), "model": args.model, "target": target, "draft": draft,
        "max_new_tokens": args.max_new_tokens, "tie_tolerance_logprob": args.tie_tol,
        "constraints": {n: CONSTRAINTS[n] for n in names}, "prompt_constraints": kinds,
        "notes": "all servers share one GPU and start at once: the lossless runs' wall times "
                 "are not speed figures; 'speed' times one server at a time (the others idle "
                 "under --sleep-on-idle), medians of --speed-repeats passes after a warm-up",
        "speed": {}, "servers": {}, "errors": [],
    }

    def dump():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        json.dump(result, open(args.out, "w"), indent=1)

    lossless.stop_on_sigterm(lambda: (result.update(status="partial: SIGTERM"), dump()))
    common = ["--model-path", target, "--grammar-backend", "xgrammar",
              "--attention-backend", "triton", "--cuda-graph-max-bs", str(widest),
              "--mem-fraction-static", "0.85", "--max-total-tokens", str(args.kv_tokens),
              "--disable-prefill-cuda-graph", "--max-running-requests", str(widest),
              "--sampling-backend", "pytorch", "--sleep-on-idle"]
    spec = ["--speculative-draft-model-path", draft]
    if args.model == "mla":  # config only: SGLang's dummy weights, the same in every server
        common += ["--load-format", "dummy"]
        spec += ["--speculative-draft-load-format", "dummy"]
    configs = {"ar": common}
    if not args.no_dflash:
        configs["dflash"] = common + spec + ["--speculative-algorithm", "DFLASH"]
    for b in budgets:
        configs[f"ddtree_b{b}"] = common + spec + ["--speculative-algorithm", "DDTREE",
                                                   "--speculative-ddtree-budget", str(b)]
    ports = iter(range(args.port, args.port + 100))
    log = lambda tag: os.path.join(args.workdir, f"{tag}.log")  # noqa: E731
    oracle_path = os.path.join(args.workdir, "oracle.json")
    if os.path.exists(oracle_path):
        os.remove(oracle_path)
    result["oracle"] = args.oracle
    servers = {}
    try:
        for tag, cmd in configs.items():
            # the oracle servers read the file at their first step, after AR's reference
            env = ({"SGLANG_DDTREE_TEST_ORACLE": oracle_path}
                   if args.oracle and tag.startswith("ddtree") else None)
            servers[tag] = lossless.Server(cmd, log(tag), next(ports), wait=False, env=env)
        for tag, srv in list(servers.items()):
            try:
                srv.wait_ready()
            except Exception as e:  # noqa: BLE001 -- recorded; that server's checks are skipped
                result["errors"].append(f"{tag}: {e!r}"[:2000])
                servers.pop(tag).stop()
        if "ar" not in servers:
            raise RuntimeError("the AR server did not start: " + "; ".join(result["errors"]))

        def run(srv, conc):
            t0 = time.time()
            with cf.ThreadPoolExecutor(conc) as ex:
                res = list(ex.map(lambda pk: srv.generate(pk[0], args.max_new_tokens,
                                                          sampling_of(pk[1])),
                                  zip(prompts, kinds)))
            return res, time.time() - t0

        # 1) speed: one server at a time (the others idle under --sleep-on-idle), the same
        # constrained mix, a warm-up pass, then the median of --speed-repeats passes
        for conc in speed_concs:
            row = result["speed"].setdefault(str(conc), {})
            for tag, srv in servers.items():
                try:
                    run(srv, conc)  # warm-up
                    passes = [run(srv, conc) for _ in range(args.speed_repeats)]
                except Exception as e:  # noqa: BLE001 -- recorded; the lossless checks still run
                    result["errors"].append(f"{tag} speed c{conc}: {e!r}"[:2000])
                    continue
                tps = sorted(sum(len(r["output_ids"]) for r in res) / wall
                             for res, wall in passes)
                row[tag] = {"tokens_per_s": tps[len(tps) // 2], "tokens_per_s_passes": tps,
                            "accept_length": lossless.accept_length(
                                [r["meta_info"] for r in passes[-1][0]])}
            if "dflash" in row:
                for tag in row:
                    if tag.startswith("ddtree"):
                        row[tag]["over_dflash"] = (row[tag]["tokens_per_s"]
                                                   / row["dflash"]["tokens_per_s"])
            print(f"[speed] c={conc}: " + json.dumps(row))
            dump()

        # 2) lossless: every server against AR's reference, at every --batch-sizes concurrency
        ref, _ = run(servers["ar"], 1)
        ref_ids = [r["output_ids"] for r in ref]
        if args.oracle:
            lossless.write_oracle(oracle_path, prompts, ref_ids)
        for tag, srv in servers.items():
            entry = result["servers"][tag] = {"command": configs[tag], "runs": []}
            for conc in ([1] if tag == "ar" else concs):
                try:
                    res, wall = (ref, None) if tag == "ar" else run(srv, conc)
                except Exception as e:  # noqa: BLE001 -- a failing server costs its own runs
                    result["errors"].append(f"{tag} c{conc}: {e!r}"[:2000])
                    dump()
                    break
                outs = [r["output_ids"] for r in res]
                metas = [r["meta_info"] for r in res]
                grammar = {}
                for i, (name, o, m) in enumerate(zip(kinds, outs, metas)):
                    if name is not None:
                        c = check(name, o, m.get("finish_reason"))
                        g = grammar.setdefault(name, {"requests": 0, "accepted": 0,
                                                      "complete": 0, "stopped": 0,
                                                      "example": c["text"]})
                        g["requests"] += 1
                        g["accepted"] += c["accepted_prefix"]
                        g["complete"] += c["complete"]
                        g["stopped"] += c["stopped"]
                run_entry = {"concurrency": conc, "wall_s": wall, "grammar": grammar,
                             "output_tokens": sum(len(o) for o in outs),
                             "accept_length": lossless.accept_length(metas)}
                if tag != "ar":
                    ident, near, bad = judge(servers["ar"], prompts, outs, ref_ids, kinds,
                                             args.tie_tol, f"{tag} c{conc}")
                    by_kind = {}
                    for name, o, r in zip(kinds, outs, ref_ids):
                        k = by_kind.setdefault(name or "none", [0, 0])
                        k[0] += o == r
                        k[1] += 1
                    run_entry.update(identical=ident, near_ties=near, mismatches=bad,
                                     identical_by_constraint=by_kind)
                entry["runs"].append(run_entry)
                print(f"[{tag}] c={conc}: " + json.dumps(
                    {k: v for k, v in run_entry.items() if k not in ("mismatches",)}))
                dump()
    finally:
        for srv in servers.values():
            srv.stop()
    dd = [r for t, e in result["servers"].items() if t.startswith("ddtree") for r in e["runs"]]
    every = [r for e in result["servers"].values() for r in e["runs"]]
    result["summary"] = {
        "ddtree_runs": len(dd),
        "ddtree_requests": sum(len(prompts) for _ in dd),
        "ddtree_identical": sum(r["identical"] for r in dd),
        "ddtree_near_ties": sum(r["near_ties"] for r in dd),
        "ddtree_mismatches": sum(len(r["mismatches"]) for r in dd),
        "constrained_outputs_rejected_by_grammar": sum(
            g["requests"] - g["accepted"] for r in every for g in r["grammar"].values()),
    }
    result["status"] = "complete" if not result["errors"] else "complete with server errors"
    dump()
    print(json.dumps(result["summary"]))
    s = result["summary"]
    ok = (s["ddtree_mismatches"] == 0 and s["constrained_outputs_rejected_by_grammar"] == 0
          and s["ddtree_runs"] > 0 and not result["errors"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
