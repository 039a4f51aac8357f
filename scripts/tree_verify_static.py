#!/usr/bin/env python
"""Compile the tree-verify attention kernel for a GPU arch on any machine (no GPU needed) and
report, per tile config, what the compiler made of it: registers, spill bytes, shared memory and
whether the dots became Hopper ``wgmma``, Blackwell ``tcgen05.mma`` or Ampere-style ``mma.sync``
instructions (``--arch 90``, ``100``, ``103``).

Spills and ``mma.sync`` on sm_90 are the usual reasons a Triton attention kernel runs far below
the tensor-core roof (``bench_tree_verify.py --roofline-of``); this screens candidate configs
for ``bench_tree_verify.py --sweep`` before GPU time is spent on them. It needs ``ptxas`` (CUDA
toolkit, ``--ptxas``). The GPU benchmark stays the measure of speed.

    python scripts/tree_verify_static.py --kind mla \\
        --configs "32,64,4,2;64,64,8,2,2,64;64,32,4,2,2,64"

A config is block_m,block_n,num_warps,num_stages[,dv_split[,dk_chunk]] (KernelConfig's order).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

def shapes() -> dict:
    """Kernel constants of the per-rank shapes ``sglang-ddtree doctor`` and the verify
    benchmark use (Qwen3-8B layer; Kimi K2.6 on TP8, absorbed MLA: one latent KV head)."""
    from sglang_ddtree.doctor import MHA_SHAPE, MLA_SHAPE

    return {
        "mha": dict(G=MHA_SHAPE["num_q_heads"] // MHA_SHAPE["num_kv_heads"],
                    DK=MHA_SHAPE["head_dim"], D_PE=0, DV=MHA_SHAPE["head_dim"], SHARED_KV=False),
        "mla": dict(G=MLA_SHAPE["num_heads"], DK=MLA_SHAPE["kv_lora_rank"],
                    D_PE=MLA_SHAPE["rope_dim"], DV=MLA_SHAPE["kv_lora_rank"], SHARED_KV=True),
    }


# largest dynamic shared memory per block (opt-in), bytes: sm_90 / sm_100 227 KB
SMEM_LIMIT = {90: 232448, 100: 232448, 103: 232448}


def next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def analyse(kind: str, cfg: list, arch: int, ptxas: str, merge_prefix: bool = False,
            group: int = 0) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.triton_kernels import load_kernels

    ta = load_kernels(interpret=False).tree_attention
    shape = dict(shapes()[kind])
    if group:  # another GQA group (query heads per KV head), e.g. 8 for the Kimi drafter's 8:1
        shape["G"] = group
    block_m, block_n, warps, stages = cfg[:4]
    dv_split = cfg[4] if len(cfg) > 4 else 1
    dk_chunk = cfg[5] if len(cfg) > 5 else 0
    fn = ta._tree_attn_fwd_kernel
    consts = dict(G=shape["G"], DK=shape["DK"], BLOCK_DK=next_pow2(shape["DK"]),
                  D_PE=shape["D_PE"], DV=shape["DV"],
                  BLOCK_DV=next_pow2(shape["DV"]) // dv_split, BLOCK_M=block_m,
                  BLOCK_N=block_n, SPLIT=not merge_prefix, USE_INDPTR=False,
                  SHARED_KV=shape["SHARED_KV"], HAS_CAP=False, INTERPRET=False,
                  DV_SPLIT=dv_split, DK_CHUNK=dk_chunk, MERGE_PREFIX=merge_prefix)
    ptrs = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16",
            "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "kv_table_ptr": "*i32",
            "kv_row_ptr": "*i64", "seq_lens_ptr": "*i64", "tree_loc_ptr": "*i64",
            "tree_mask_ptr": "*u8", "pre_o_ptr": "*bf16", "pre_lse_ptr": "*fp32"}
    signature = {n: ("constexpr" if n in consts else ptrs.get(n) or
                     ("fp32" if n in ("qk_scale", "v_scale", "logit_cap") else "i32"))
                 for n in fn.arg_names}
    # what Triton specializes at a real launch: 16-byte aligned pointers and the strides that
    # are multiples of 16 at these shapes (without it every load is scalar and every element
    # needs its own 64-bit address, which misreports the register use)
    div16 = set(ptrs) | {"stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt",
                         "stride_vh", "stride_ot", "stride_oh", "stride_table"}
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(fn.arg_names.index(c),): v for c, v in consts.items()},
                    attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16})
    out = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                         options=dict(num_warps=warps, num_stages=stages))
    ptx = out.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        r = subprocess.run([ptxas, f"-arch=sm_{arch}a" if arch >= 90 else f"-arch=sm_{arch}",
                            "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    log = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return {"kind": kind, "config": ",".join(map(str, cfg)),
            "registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spill.group(1)) if spill else None,
            "shared_bytes": out.metadata.shared,
            "fits_shared_memory": out.metadata.shared <= SMEM_LIMIT.get(arch, 101376),
            "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
            "tcgen05_mma": ptx.count("tcgen05.mma"),  # Blackwell (sm_100 / sm_103) tensor cores
            "ptxas_error": None if r.returncode == 0 else log[-500:]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("mha", "mla"), default="mla")
    ap.add_argument("--merge-prefix", action="store_true",
                    help="the variant that merges a prefix part given by another kernel "
                         "(one split, tree keys only)")
    ap.add_argument("--group", type=int, default=0,
                    help="query heads per KV head instead of the kind's (MHA: Qwen3-8B's 4; "
                         "the Kimi drafter under SGLANG_DDTREE_DRAFT_ATTENTION has 8)")
    ap.add_argument("--configs", required=True, help="';'-separated configs")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--ptxas", default=shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for spec in args.configs.split(";"):
        cfg = [int(x) for x in spec.split(",") if x]
        try:
            row = analyse(args.kind, cfg, args.arch, args.ptxas, args.merge_prefix, args.group)
            row["group"] = args.group or shapes()[args.kind]["G"]
        except Exception as exc:  # noqa: BLE001 -- a config Triton rejects is a result too
            row = {"kind": args.kind, "config": spec, "error": f"{type(exc).__name__}: {exc}"[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(arch=args.arch, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
