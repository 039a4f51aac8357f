"""Do two fused-MoE config tables give the same outputs, bit for bit? (GPU)

A table change that only re-tiles a GEMM (another block_n or columns per program, the same K
tiling) should not change a single output bit: every output element is still one program's
fp32 sum over the same K tiles in the same order. Where that holds, a lossless end-to-end result
measured with one table carries over to the other. This script runs ``fused_moe_w4a16`` with
each table's config for every M given, on random routing and on routing concentrated on a few
experts (as a tree's tokens and SGLang's dummy fill route), Kimi K2 TP8-rank shapes, and prints
per M whether the outputs are identical and, where not, the largest difference. Exit status 1
when any M differs.

    python scripts/moe_tables_equal.py --a OLD.json --b triton_kernels/moe_w4a16_configs.json \\
        --ms 17 33 64 128 --out result.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch

from sglang_ddtree.provenance import checkout_digest
from sglang_ddtree.triton_kernels import moe_w4a16 as mw
from sglang_ddtree.triton_kernels.moe_reference import make_random_moe


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="first config table (JSON)")
    ap.add_argument("--b", default=mw._CONFIG_PATH, help="second config table (JSON)")
    ap.add_argument("--ms", type=int, nargs="+", required=True)
    ap.add_argument("--concentrated", type=int, default=8,
                    help="experts the concentrated routing uses (0: random routing only)")
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    moe = make_random_moe(args.experts, args.hidden, args.inter, device=dev, seed=0)
    routings = ["random"] + ([f"concentrated:{args.concentrated}"] if args.concentrated else [])
    rows, differ = [], False
    for m in args.ms:
        for routing in routings:
            g = torch.Generator(device=dev).manual_seed(m)
            x = torch.randn(m, args.hidden, device=dev, generator=g, dtype=torch.bfloat16)
            logits = torch.randn(m, args.experts, device=dev, generator=g)
            if routing != "random":
                few = torch.randperm(args.experts, device=dev, generator=g)[:args.concentrated]
                logits[:, few] += 100.0
            w, ids = torch.topk(logits.softmax(-1), args.topk)
            outs = [mw.fused_moe_w4a16(x, moe["w13_packed"], moe["w13_scale"], moe["w2_packed"],
                                       moe["w2_scale"], w.float(), ids.to(torch.int32),
                                       routed_scaling_factor=2.827, config=mw.select_config(m, t))
                    for t in (args.a, args.b)]
            same = torch.equal(outs[0], outs[1])
            diff = (outs[0].float() - outs[1].float()).abs().max().item()
            differ |= not same
            rows.append({"m": m, "routing": routing, "identical": same, "max_abs_diff": diff,
                         "configs_differ": (mw.select_config(m, args.a)
                                            != mw.select_config(m, args.b))})
            print(f"M={m:5d} {routing:16s} identical={same} max|diff|={diff:.3g} "
                  f"(configs differ: {rows[-1]['configs_differ']})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join([sys.executable] + sys.argv),
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "gpu": torch.cuda.get_device_name(dev),
                       "source_digest": checkout_digest(__file__),
                       "versions": {"torch": torch.__version__,
                                    "triton": __import__("triton").__version__},
                       "rows": rows}, f, indent=1)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
