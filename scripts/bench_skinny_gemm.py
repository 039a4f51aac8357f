#!/usr/bin/env python3
"""Benchmark the skinny bf16 GEMM (``triton_kernels/skinny_gemm.py``) against cuBLAS
(``x @ w.T``, what SGLang's unquantized linear layers run) at the Kimi K2.6 TP8 rank's dense
shapes and verify-sized token counts.

Timing: ``--layers`` distinct weight sets per shape (at least ``--min-bytes`` of weights
together, several times the 50 MB L2, as a forward's layers read them), run back to back inside
one CUDA graph; a call's time is the graph's time divided by the layer count; the median of
``--rounds`` interleaved rounds. Bandwidth: weight bytes (N x K x 2) per call over its time,
against a measured device-to-device copy (bytes read + written).

    python scripts/bench_skinny_gemm.py --out bench_results/skinny_gemm_h200.json
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fused_moe import (_device_name, copy_bandwidth_gbs,  # noqa: E402
                             graph_time_us)

from sglang_ddtree.provenance import checkout_digest  # noqa: E402

sg = importlib.import_module("_ddtree_bench_kernels.skinny_gemm")  # bench_fused_moe's private copy

# (name, N, K) of the rank's dense GEMMs (see tests/gpu/test_skinny_gemm_gpu.py)
KIMI_SHAPES = [("qkv_a", 2112, 7168), ("q_b", 1536, 1536), ("o_proj", 7168, 1024),
               ("shared_gate_up", 512, 7168), ("shared_down", 7168, 256),
               ("router", 384, 7168), ("dense_down", 7168, 2304)]


def parse_shapes(spec: str) -> list:
    """``kimi`` or a comma list of NxK (named by themselves)."""
    if spec == "kimi":
        return KIMI_SHAPES
    out = []
    for item in spec.split(","):
        n, sep, k = item.partition("x")
        if not sep or not n.isdigit() or not k.isdigit():
            raise SystemExit(f"--shapes: 'kimi' or NxK[,NxK], got {spec!r}")
        out.append((item, int(n), int(k)))
    return out


def parse_sweep(spec: str) -> list:
    """``block_n,block_k,split_k[,num_warps,num_stages];...`` (split_k 0: plan_split's for
    that tile on this GPU; num_stages 0 or left out: launch_stages's for each M) -> [(label,
    partial config dict)]."""
    out = []
    for item in filter(None, (p.strip() for p in spec.split(";"))):
        vals = item.split(",")
        if not 3 <= len(vals) <= 5 or not all(v.isdigit() for v in vals):
            raise SystemExit(f"--sweep: block_n,block_k,split_k[,warps,stages] items, got {item!r}")
        keys = ("block_n", "block_k", "split_k", "num_warps", "num_stages")
        out.append((item, dict(zip(keys, map(int, vals)))))
    return out


def cublas_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16 x bf16 -> fp32 as SGLang's ``linear_bf16_fp32`` falls back to it (cuBLAS through
    ``torch.mm(out_dtype=float32)``, CUDA-only; fp32 matmul elsewhere)."""
    if x.is_cuda:
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    return torch.mm(x.float(), w.float().t())


def sglang_kernel(module: str, name: str):
    """One of SGLang's own GEMM kernels (``module``.``name``), or the import error as a string
    (no SGLang here, as in the kernel-only runs: recorded, not fatal)."""
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as exc:  # noqa: BLE001
        return f"unavailable: {exc!r}"[:200]


def sglang_tiny_router():
    """SGLang's own router GEMM for up to 16 tokens (0.5.17: the dsv3 JIT kernel that its
    DeepseekV2 ``MoEGate`` calls with fp32 output), or the import error as a string."""
    return sglang_kernel("sglang.kernels.ops.gemm.dsv3_router_gemm", "dsv3_router_gemm")


def sglang_fused_a():
    """SGLang's min-latency GEMM for up to 16 tokens (0.5.17: ``dsv3_fused_a_gemm``, which its
    DeepSeek-family attention runs for the q / kv down-projection and, at verified shapes,
    ``q_b_proj``; above 16 tokens the layer's own linear, cuBLAS), or the import error."""
    return sglang_kernel("sglang.kernels.ops.gemm.fused_a_gemm", "dsv3_fused_a_gemm")


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (ref in fp32)."""
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


def prefer_blas(library: str, fn):
    """``fn`` run with torch's preferred BLAS library set to ``library`` (the earlier choice
    restored after): a CUDA graph captured through it holds that library's kernels."""
    def run():
        before = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(library)
        try:
            return fn()
        finally:
            torch.backends.cuda.preferred_blas_library(before)
    return run


def sweep_config(fields: dict, n: int, k: int, sms: int):
    """The sweep item as a SkinnyConfig for ``N x K``, or None where its tiles do not fit."""
    bn, bk = fields["block_n"], fields["block_k"]
    if n % bn or k % bk:
        return None
    split = fields["split_k"] or sg.plan_split(n // bn, k // bk, 2 * sms)
    if k % (bk * split):
        return None
    return sg.SkinnyConfig(bn, bk, split, fields.get("num_warps", 4), fields.get("num_stages", 0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_results/skinny_gemm_h200.json")
    ap.add_argument("--shapes", default="kimi")
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 8, 16, 17, 24, 32, 33, 48, 64])
    ap.add_argument("--min-bytes", type=float, default=256e6,
                    help="weights per shape across the layers of one graph")
    ap.add_argument("--layers", type=int, default=0, help="override: weight sets per shape")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    ap.add_argument("--fp32-out", action="store_true",
                    help="fp32 outputs, as the MoE router's GEMM returns them: ours into an fp32 "
                         "out, cuBLAS as SGLang's linear_bf16_fp32 calls it (torch.mm with "
                         "out_dtype=float32)")
    ap.add_argument("--sglang-router", action="store_true",
                    help="also time SGLang's tiny router GEMM (dsv3_router_gemm, fp32 out) where "
                         "it serves: N 256 / 384, K a multiple of 1,024, M <= 16")
    ap.add_argument("--sglang-fused-a", action="store_true",
                    help="also time SGLang's min-latency GEMM (dsv3_fused_a_gemm, x @ w.T with "
                         "w.T column-major) where it serves: N a multiple of 16, K of 256, "
                         "M <= 16, bf16 out")
    ap.add_argument("--cublaslt", action="store_true",
                    help="also time x @ w.T with torch's BLAS preference set to cuBLASLt during "
                         "its capture ('cublaslt'; TORCH_BLAS_PREFER_CUBLASLT=1 sets it for a "
                         "whole server)")
    ap.add_argument("--pdl", action="store_true",
                    help="also time ours with programmatic dependent launch (skinny_gemm's "
                         "PDL mode 1), as 'ours_pdl1', each call's programs starting while the "
                         "call before drains (sm_90+)")
    ap.add_argument("--sweep", default="",
                    help="also time these configs (see parse_sweep), outputs checked against "
                         "the fp32 reference, under 'sweep_us'")
    args = ap.parse_args(argv)
    sweep = parse_sweep(args.sweep)
    pdl_modes = [1] if args.pdl else []
    if pdl_modes and args.device == "cpu":
        ap.error("--pdl needs an sm_90+ GPU (programmatic dependent launch)")
    tiny_router = sglang_tiny_router() if args.sglang_router else None
    fused_a = sglang_fused_a() if args.sglang_fused_a else None
    dev = torch.device(args.device)
    out_dtype = torch.float32 if args.fp32_out else torch.bfloat16
    shapes = parse_shapes(args.shapes)
    copy_gbs = copy_bandwidth_gbs(dev) if dev.type == "cuda" else None
    result = {"command": " ".join([sys.executable] + (sys.argv if argv is None else
                                                      ["scripts/bench_skinny_gemm.py"] + argv)),
              "gpu": _device_name(dev),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "versions": {"torch": torch.__version__,
                           "triton": __import__("triton").__version__},
              "source_digest": checkout_digest(__file__), "copy_bandwidth_gbs": copy_gbs,
              "note": "us per call: mean of CUDA-graph replays over the layers, median of the "
                      "rounds; ours = skinny_gemm with its default config, cublas = x @ w.T"
                      + (" with fp32 output (torch.mm out_dtype=float32, as SGLang's "
                         "linear_bf16_fp32)" if args.fp32_out else ""),
              "out_dtype": "float32" if args.fp32_out else "bfloat16",
              **({"sglang_fused_a": fused_a if isinstance(fused_a, str) else
                  "sglang.kernels.ops.gemm.fused_a_gemm.dsv3_fused_a_gemm (bf16 out)"}
                 if args.sglang_fused_a else {}),
              **({"sglang_router": tiny_router if isinstance(tiny_router, str) else
                  "sglang.kernels.ops.gemm.dsv3_router_gemm.dsv3_router_gemm (fp32 out)"}
                 if args.sglang_router else {}),
              "rows": []}

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    for name, n, k in shapes:
        nbytes = n * k * 2
        layers = args.layers or max(1, min(64, int(-(-args.min_bytes // nbytes))))
        g = torch.Generator(device=dev).manual_seed(n * 31 + k)
        ws = [(torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
              for _ in range(layers)]
        cfg = sg.default_config(n, k, sg._sms(dev))
        for m in args.ms:
            xs = [torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16) for _ in ws]
            outs = [torch.empty(m, n, device=dev, dtype=out_dtype) for _ in ws]
            # counters outside the capture; a copy, as outs[0] is written again below
            ours = sg.skinny_gemm(xs[0], ws[0], out=outs[0], pdl=0).clone()
            ref = sg.skinny_gemm_reference(xs[0], ws[0])
            err = rel_err(ours, ref)
            if args.fp32_out:
                def cublas():
                    return [cublas_fp32(x, w) for x, w in zip(xs, ws)]
            else:
                def cublas():
                    return [torch.mm(x, w.t(), out=o) for x, w, o in zip(xs, ws, outs)]
            runs = {
                "ours": lambda: [sg.skinny_gemm(x, w, out=o, pdl=0)
                                 for x, w, o in zip(xs, ws, outs)],
                "cublas": cublas,
            }
            pdl_err = {}
            for mode in pdl_modes:
                got = sg.skinny_gemm(xs[0], ws[0], out=outs[0], pdl=mode)
                pdl_err[mode] = (rel_err(got, ref), torch.equal(got, ours))
                runs[f"ours_pdl{mode}"] = (
                    lambda mode=mode: [sg.skinny_gemm(x, w, out=o, pdl=mode)
                                       for x, w, o in zip(xs, ws, outs)])
            if args.cublaslt and dev.type == "cuda":
                runs["cublaslt"] = prefer_blas("cublaslt", cublas)
                lt = runs["cublaslt"]()[0]
                lt_err = rel_err(lt, ref)
            if (callable(fused_a) and n % 16 == 0 and k % 256 == 0 and m <= 16
                    and not args.fp32_out and dev.type == "cuda"):
                got = fused_a(xs[0], ws[0].t())
                ferr = rel_err(got, ref)
                print(f"  sglang fused_a M={m}: err {ferr:.1e} vs fp32", flush=True)
                runs["sglang_fused_a"] = lambda: [fused_a(x, w.t()) for x, w in zip(xs, ws)]
            if (callable(tiny_router) and n in (256, 384) and k % 1024 == 0 and m <= 16
                    and dev.type == "cuda"):
                got = tiny_router(xs[0], ws[0], out_dtype=torch.float32)
                rerr = rel_err(got, ref)
                print(f"  sglang router M={m}: err {rerr:.1e} vs fp32", flush=True)
                runs["sglang_router"] = lambda: [tiny_router(x, w, out_dtype=torch.float32)
                                                 for x, w in zip(xs, ws)]
            rounds = {key: [] for key in runs}
            for _ in range(args.rounds):
                for key, fn in runs.items():
                    rounds[key].append(graph_time_us(fn, args.iters, dev) / layers)
            us = {key: round(statistics.median(v), 2) for key, v in rounds.items()}
            sweep_us = {}
            for label, fields in sweep:
                scfg = sweep_config(fields, n, k, sg._sms(dev))
                if scfg is None:
                    sweep_us[label] = "does not tile"
                    continue
                try:
                    got = sg.skinny_gemm(xs[0], ws[0], out=outs[0], config=scfg, pdl=0)
                    serr = rel_err(got, ref)
                    if serr > 1e-2:
                        sweep_us[label] = f"error {serr:.1e} vs fp32"
                        continue
                    sweep_us[label] = round(statistics.median(
                        graph_time_us(lambda c=scfg: [sg.skinny_gemm(x, w, out=o, config=c, pdl=0)
                                                      for x, w, o in zip(xs, ws, outs)],
                                      args.iters, dev) / layers
                        for _ in range(args.rounds)), 2)
                except Exception as exc:  # a config that fails to compile: recorded, not fatal
                    sweep_us[label] = f"error: {exc!r}"[:200]
            row = {"shape": name, "n": n, "k": k, "m": m, "layers": layers,
                   "config": {"block_n": cfg.block_n, "block_k": cfg.block_k,
                              "split_k": cfg.split_k, "num_warps": cfg.num_warps,
                              "num_stages": sg.launch_stages(cfg, sg.block_m_for(m))},
                   "us": us, "us_rounds": {key: [round(t, 2) for t in v]
                                           for key, v in rounds.items()},
                   "gbs": {key: round(nbytes / (u * 1e3), 1) for key, u in us.items()},
                   "speedup_vs_cublas": round(us["cublas"] / us["ours"], 3),
                   **({"sweep_us": sweep_us} if sweep else {}),
                   "max_rel_err_vs_fp32": round(err, 5),
                   **({"cublaslt_max_rel_err_vs_fp32": round(lt_err, 5)} if "cublaslt" in us
                      else {}),
                   **{f"ours_pdl{mode}_max_rel_err_vs_fp32": round(e, 5)
                      for mode, (e, _) in pdl_err.items()},
                   **{f"ours_pdl{mode}_bits_equal_ours": same
                      for mode, (_, same) in pdl_err.items()}}
            if copy_gbs:
                row["pct_copy_bw"] = {key: round(100 * g / copy_gbs, 1)
                                      for key, g in row["gbs"].items()}
            result["rows"].append(row)
            save()  # a run cut by its time limit keeps what it measured
            print(f"{name} N={n} K={k} M={m}: ours {us['ours']} us, cuBLAS {us['cublas']} us "
                  f"({row['speedup_vs_cublas']}x), split {cfg.split_k}, err {err:.1e}"
                  + (f", SGLang router {us['sglang_router']} us" if "sglang_router" in us else "")
                  + (f", cuBLASLt {us['cublaslt']} us" if "cublaslt" in us else "")
                  + "".join(f", PDL {mode} {us[f'ours_pdl{mode}']} us" for mode in pdl_modes)
                  + (f", SGLang fused_a {us['sglang_fused_a']} us" if "sglang_fused_a" in us
                     else "")
                  + (f", sweep {sweep_us}" if sweep else ""), flush=True)
    save()
    print("->", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
