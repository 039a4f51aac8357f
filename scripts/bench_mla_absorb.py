#!/usr/bin/env python3
"""Benchmark the MLA absorb bmm (``triton_kernels/mla_absorb.py``) against ``torch.bmm``
(cuBLAS) as SGLang's DeepSeek attention calls it, at verify-sized token counts.

The two products of a layer, with the model's layouts:

- ``q``: ``torch.bmm(q_nope.transpose(0, 1), w_kc)``, ``q_nope`` the first 128 of each head's
  192 query columns, ``w_kc [H, 128, 512]`` K-contiguous; the model then transposes the result;
- ``v``: ``torch.bmm(o.transpose(0, 1), w_vc, out=y.view(T, H, 128).transpose(0, 1))``, ``o``
  the attention's ``[T, H * 512]`` output, ``w_vc [H, 512, 128]`` K-contiguous.

Timing: ``--layers`` distinct weight sets (a 61-layer forward reads each layer's once, from
HBM), run back to back inside one CUDA graph; a call's time is the graph's time over the layer
count; the median of ``--rounds`` interleaved rounds. ``--sweep`` times other tiles too.

    python scripts/bench_mla_absorb.py --out bench_results/mla_absorb_h200.json
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
from bench_fused_moe import _device_name, graph_time_us  # noqa: E402

from sglang_ddtree.provenance import checkout_digest  # noqa: E402

ma = importlib.import_module("_ddtree_bench_kernels.mla_absorb")  # bench_fused_moe's private copy

PROJ = {"q": (128, 512, 192), "v": (512, 128, 512)}  # K, N, row width of a's source


def parse_sweep(spec: str) -> list:
    """``block_n,block_k,swap,num_warps,num_stages;...`` -> [(label, AbsorbConfig kwargs)]."""
    out = []
    for item in filter(None, (p.strip() for p in spec.split(";"))):
        vals = item.split(",")
        if len(vals) != 5 or not all(v.isdigit() for v in vals):
            raise SystemExit(f"--sweep: block_n,block_k,swap,warps,stages items, got {item!r}")
        bn, bk, sw, nw, ns = map(int, vals)
        out.append((item, dict(block_n=bn, block_k=bk, swap=bool(sw), num_warps=nw,
                               num_stages=ns)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_results/mla_absorb_h200.json")
    ap.add_argument("--heads", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--ts", type=int, nargs="+",
                    default=[1, 2, 8, 9, 16, 17, 32, 33, 64, 128, 264])
    ap.add_argument("--proj", default="q,v")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sweep", default="")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    sweep = parse_sweep(args.sweep)
    result = {"command": " ".join([sys.executable] + (sys.argv if argv is None else
                                                      ["scripts/bench_mla_absorb.py"] + argv)),
              "gpu": _device_name(dev),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "versions": {"torch": torch.__version__,
                           "triton": __import__("triton").__version__},
              "source_digest": checkout_digest(__file__),
              "note": "us per call: mean of CUDA-graph replays over the layers' distinct "
                      "weights, median of the rounds; cublas = torch.bmm as SGLang calls it, "
                      "ours = absorb_bmm with default_config",
              "rows": []}

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    for proj in args.proj.split(","):
        k, n, row = PROJ[proj]
        for h in args.heads:
            g = torch.Generator(device=dev).manual_seed(h * 7 + k)
            ws = [(torch.randn(h, n, k, device=dev, generator=g) * 0.05).to(torch.bfloat16)
                  .transpose(1, 2) for _ in range(args.layers)]
            for t in args.ts:
                srcs = [torch.randn(t, h, row, device=dev, generator=g).to(torch.bfloat16)
                        for _ in ws]
                as_ = [s[:, :, :k].transpose(0, 1) for s in srcs]
                flats = [torch.empty(t, h * n, device=dev, dtype=torch.bfloat16) for _ in ws]
                outs = [f.view(t, h, n).transpose(0, 1) for f in flats]
                if proj == "q":
                    def cublas():
                        return [torch.bmm(a, w).transpose(0, 1) for a, w in zip(as_, ws)]

                    def ours(cfg=None):
                        return [ma.absorb_bmm(a, w, config=cfg).transpose(0, 1)
                                for a, w in zip(as_, ws)]
                else:
                    def cublas():
                        return [torch.bmm(a, w, out=o) for a, w, o in zip(as_, ws, outs)]

                    def ours(cfg=None):
                        return [ma.absorb_bmm(a, w, out=o, config=cfg)
                                for a, w, o in zip(as_, ws, outs)]
                ref = ma.absorb_bmm_reference(as_[0], ws[0])
                got = ma.absorb_bmm(as_[0], ws[0])
                err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
                cub = torch.bmm(as_[0], ws[0])
                cerr = ((cub.float() - ref).abs().max() / ref.abs().max()).item()
                runs = {"cublas": cublas, "ours": ours}
                rounds = {key: [] for key in runs}
                for _ in range(args.rounds):
                    for key, fn in runs.items():
                        rounds[key].append(graph_time_us(fn, args.iters, dev) / len(ws))
                us = {key: round(statistics.median(v), 2) for key, v in rounds.items()}
                sweep_us = {}
                for label, fields in sweep:
                    cfg = ma.AbsorbConfig(**fields)
                    if k % cfg.block_k or n % cfg.block_n:
                        sweep_us[label] = "does not tile"
                        continue
                    try:
                        sgot = ma.absorb_bmm(as_[0], ws[0], config=cfg)
                        serr = ((sgot.float() - ref).abs().max() / ref.abs().max()).item()
                        if serr > 1e-2:
                            sweep_us[label] = f"error {serr:.1e} vs fp32"
                            continue
                        sweep_us[label] = round(statistics.median(
                            graph_time_us(lambda c=cfg: ours(c), args.iters, dev) / len(ws)
                            for _ in range(args.rounds)), 2)
                    except Exception as exc:  # a config that fails to compile: recorded
                        sweep_us[label] = f"error: {exc!r}"[:200]
                row_ = {"proj": proj, "heads": h, "t": t, "k": k, "n": n, "us": us,
                        "speedup": round(us["cublas"] / us["ours"], 3),
                        "rel_err_ours": err, "rel_err_cublas": cerr,
                        "weight_gbs_ours": round(h * k * n * 2 / us["ours"] / 1e3, 1)}
                if sweep_us:
                    row_["sweep_us"] = sweep_us
                result["rows"].append(row_)
                print(json.dumps(row_), flush=True)
                save()
    save()
    print("->", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
