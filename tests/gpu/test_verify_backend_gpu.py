"""GPU, real SGLang servers: DDTREE's triton verify backend keeps greedy output lossless.

For one model set of ``scripts/e2e_lossless.py`` (dense random-weight Qwen3, or the MLA + MoE
dummy), one plain (AR) server gives the reference continuations and the oracle file (test-only
draft mode, so trees are deep and accepted paths long). Then DDTREE servers run concurrently:

- ``native`` verify on the triton target backend (the reference DDTREE run), graphs on and off;
- ``--speculative-ddtree-verify-backend triton`` on the triton target backend, graphs on and off;
- ``triton`` verify behind target backends that cannot verify a tree themselves (dense: fa3;
  MLA: flashinfer (SGLang's flashinfer MLA backend) and fa3), graphs on.

Each triton-verify run must equal the native run of the same graph setting and the AR reference,
token for token, except at near ties (``e2e_lossless.compare``: the target's own top-2 log-prob gap
at the first difference below ``TIE_TOL`` and the runner-up emitted). Its accept length must be at
least 90% of native's: a wrong tree mask shows up there first.

    python -m pytest -q tests/gpu/test_verify_backend_gpu.py -k dense   # or -k mla
    python tests/gpu/test_verify_backend_gpu.py --models dense,mla --out bench_results/x.json

JSON goes to ``--out`` (pytest: ``$SGLANG_DDTREE_VERIFY_E2E_OUT`` or
``bench_results/verify_backend_e2e_<model>_h200.json``); a table is printed at the end.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import importlib.util
import json
import os
import shutil
import sys
import tempfile

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIE_TOL = 0.25  # as scripts/e2e_lossless.py: bf16 logits of magnitude 16-32 step by 0.125
ACCEPT_RATIO = 0.9

# (verify backend, target attention backend, cuda graphs)
CASES = {
    "dense": [("native", "triton", True), ("native", "triton", False),
              ("triton", "triton", True), ("triton", "triton", False),
              ("triton", "fa3", True)],
    "mla": [("native", "triton", True), ("native", "triton", False),
            ("triton", "triton", True), ("triton", "triton", False),
            ("triton", "flashinfer", True), ("triton", "fa3", True)],
}


def load_e2e():
    """scripts/e2e_lossless.py as a module (its Server, run_batch, compare, MODEL_SETS...)."""
    path = os.path.join(ROOT, "scripts", "e2e_lossless.py")
    spec = importlib.util.spec_from_file_location("_ddtree_e2e_lossless", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tag(case):
    verify, backend, graph = case
    return f"{verify}-verify_{backend}" + ("" if graph else "_eager")


def run(model, *, budget=32, prompts=12, max_new=32, concs=(1, 4), port=30300, kv_tokens=65536,
        workdir=None):
    """Run one model set; returns the result dict (cases, comparisons, errors)."""
    e2e = load_e2e()
    import sglang
    import torch

    ms = e2e.MODEL_SETS[model]
    workdir = workdir or os.path.join(tempfile.gettempdir(), "ddtree_verify_e2e")
    os.makedirs(workdir, exist_ok=True)
    target = os.path.join(workdir, ms["target"])
    if not os.path.isdir(target):
        shutil.copytree(os.path.join(e2e.MODELS, ms["target"]), target)
        if ms["random_target"]:
            e2e.make_random_target(target, target)
    vocab = json.load(open(os.path.join(target, "config.json")))["vocab_size"]
    prompt_ids = e2e.make_prompts(prompts, vocab)

    def common(backend):
        args = ["--model-path", target, "--skip-tokenizer-init", "--grammar-backend", "none",
                "--attention-backend", backend, "--cuda-graph-max-bs", str(max(concs)),
                "--mem-fraction-static", "0.85", "--max-total-tokens", str(kv_tokens),
                "--disable-prefill-cuda-graph", "--max-running-requests", str(max(concs)),
                "--sampling-backend", "pytorch"]
        return args + ([] if ms["random_target"] else ["--load-format", "dummy"])

    def ddtree(case):
        verify, backend, graph = case
        return common(backend) + [
            "--speculative-draft-model-path", os.path.join(e2e.MODELS, ms["draft"]),
            "--speculative-draft-load-format", "dummy", "--speculative-algorithm", "DDTREE",
            "--speculative-ddtree-budget", str(budget),
            "--speculative-ddtree-verify-backend", verify,
        ] + ([] if graph else ["--disable-cuda-graph"])

    log = lambda name: os.path.join(workdir, f"{model}-{name}.log")  # noqa: E731
    result = {
        "sglang_version": sglang.__version__, "torch_version": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "command": " ".join(sys.argv), "model": model, "budget": budget, "prompts": prompts,
        "max_new_tokens": max_new, "batch_sizes": list(concs), "tie_tolerance_logprob": TIE_TOL,
        "cases": [], "errors": {},
    }
    ports = iter(range(port, port + 50))
    ar = e2e.Server(common("triton"), log("ar"), next(ports))
    servers = {}
    try:
        ref, _, _ = e2e.run_batch(ar, prompt_ids, max_new, 1)
        oracle = os.path.join(workdir, f"{model}-oracle.json")
        json.dump({"seed": 0, "items": [{"prompt": p, "output": o}
                                        for p, o in zip(prompt_ids, ref)]}, open(oracle, "w"))
        for case in CASES[model]:
            servers[case] = e2e.Server(ddtree(case), log(tag(case)), next(ports),
                                       env={"SGLANG_DDTREE_TEST_ORACLE": oracle}, wait=False)

        def serve(case):
            srv = servers[case]
            srv.wait_ready()
            out = {}
            for c in concs:
                outs, metas, _ = e2e.run_batch(srv, prompt_ids, max_new, c)
                out[c] = (outs, e2e.accept_length(metas))
            srv.stop()
            return out

        outputs = {}
        with cf.ThreadPoolExecutor(len(servers)) as ex:
            futures = {case: ex.submit(serve, case) for case in servers}
            for case, fut in futures.items():
                try:
                    outputs[case] = fut.result()
                except Exception as e:  # keep the other cases; the test fails on any error
                    result["errors"][tag(case)] = repr(e)[:3000]

        for case, per_conc in outputs.items():
            verify, backend, graph = case
            native = ("native", "triton", graph)
            for c, (outs, accept) in per_conc.items():
                ident, near, bad = e2e.compare(ar, prompt_ids, outs, ref, TIE_TOL,
                                               f"{tag(case)} c={c} vs AR")
                entry = {"verify_backend": verify, "attention_backend": backend,
                         "cuda_graph": graph, "batch_size": c, "accept_length": accept,
                         "vs_ar": {"identical": ident, "near_ties": near, "mismatches": bad}}
                if verify == "triton" and native in outputs:
                    n_outs, n_accept = outputs[native][c]
                    ident, near, bad = e2e.compare(ar, prompt_ids, outs, n_outs, TIE_TOL,
                                                   f"{tag(case)} c={c} vs native")
                    entry["vs_native"] = {"identical": ident, "near_ties": near,
                                          "mismatches": bad, "native_accept_length": n_accept}
                result["cases"].append(entry)
    finally:
        for srv in [ar, *servers.values()]:
            srv.stop()
    return result


def failures(result) -> list:
    """What makes the run fail: errors, non-tie mismatches, a collapsed accept length."""
    out = [f"{name}: {err}" for name, err in result["errors"].items()]
    for case in CASES[result["model"]]:
        if not any((e["verify_backend"], e["attention_backend"], e["cuda_graph"]) == case
                   for e in result["cases"]) and tag(case) not in result["errors"]:
            out.append(f"{tag(case)}: no result")
    for e in result["cases"]:
        name = f"{tag((e['verify_backend'], e['attention_backend'], e['cuda_graph']))} " \
               f"c={e['batch_size']}"
        if e["vs_ar"]["mismatches"]:
            out.append(f"{name}: {len(e['vs_ar']['mismatches'])} mismatches vs AR")
        native = e.get("vs_native")
        if native is not None:
            if native["mismatches"]:
                out.append(f"{name}: {len(native['mismatches'])} mismatches vs native verify")
            a, n = e["accept_length"], native["native_accept_length"]
            if a is not None and n is not None and a < ACCEPT_RATIO * n:
                out.append(f"{name}: accept length {a:.2f} < {ACCEPT_RATIO} x native {n:.2f}")
    return out


def table(result) -> str:
    rows = [f"{'case':36s} {'bs':>3s} {'accept':>7s} {'=AR':>4s} {'tie':>4s} {'bad':>4s} "
            f"{'=native':>7s} {'bad':>4s}"]
    for e in result["cases"]:
        name = tag((e["verify_backend"], e["attention_backend"], e["cuda_graph"]))
        nat = e.get("vs_native")
        acc = "-" if e["accept_length"] is None else f"{e['accept_length']:.2f}"
        rows.append(f"{name:36s} {e['batch_size']:3d} {acc:>7s} {e['vs_ar']['identical']:4d} "
                    f"{e['vs_ar']['near_ties']:4d} {len(e['vs_ar']['mismatches']):4d} "
                    f"{'-' if nat is None else nat['identical']:>7} "
                    f"{'-' if nat is None else len(nat['mismatches']):>4}")
    rows += [f"ERROR {k}: {v[:300]}" for k, v in result["errors"].items()]
    return "\n".join(rows)


def write(result, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


@pytest.mark.parametrize("model", ["dense", "mla"])
def test_triton_verify_matches_native(model):
    pytest.importorskip("sglang")
    result = run(model, port=30300 if model == "dense" else 30400)
    path = os.environ.get("SGLANG_DDTREE_VERIFY_E2E_OUT",
                          os.path.join(ROOT, "bench_results",
                                       f"verify_backend_e2e_{model}_h200.json"))
    write(result, path)
    print("\n" + table(result) + f"\n-> {path}")
    problems = failures(result)
    assert not problems, "\n".join(problems)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="dense,mla")
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--port", type=int, default=30300)
    ap.add_argument("--out", default="bench_results/verify_backend_e2e_h200.json")
    args = ap.parse_args(argv)
    concs = tuple(int(x) for x in args.batch_sizes.split(","))
    models = [m for m in args.models.split(",") if m]
    with cf.ThreadPoolExecutor(len(models)) as ex:  # model sets side by side on the GPU
        results = list(ex.map(lambda im: run(im[1], budget=args.budget, prompts=args.prompts,
                                             max_new=args.max_new_tokens, concs=concs,
                                             port=args.port + 100 * im[0]),
                              enumerate(models)))
    write({"runs": results}, args.out)
    bad = []
    for r in results:
        print(f"\n== {r['model']} (budget {r['budget']})\n{table(r)}")
        bad += failures(r)
    print(f"\n{'PASS' if not bad else 'FAIL'}: {len(bad)} problem(s) -> {args.out}")
    for b in bad:
        print("  " + b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
