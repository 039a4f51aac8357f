#!/usr/bin/env python
"""Compile the tree-verify attention kernel for a GPU arch on any machine (no GPU needed) and
report, per tile config, what the compiler made of it: registers, spill bytes, shared memory and
whether the dots became Hopper ``wgmma``, Blackwell ``tcgen05.mma`` or Ampere-style ``mma.sync``
instructions (``--arch 90``, ``100``, ``103``).

Spills and ``mma.sync`` on sm_90 are the usual reasons a Triton attention kernel runs far below
the tensor-core roof (``bench_tree_verify.py --roofline-of``); this screens candidate configs
for ``bench_tree_verify.py --sweep`` before GPU time is spent on them. It needs ``ptxas``: the
one Triton's wheel ships by default, or ``--ptxas``. The GPU benchmark stays the measure of speed.

``--budget B`` compiles what a launch for trees of B + 1 tokens compiles: Triton specializes an
integer argument divisible by 16 (the token count N and the mask strides N and N x N) unless the
kernel opts out (tree verify's does; the drafter block's, ``--draft-block``, does not), and a
specialized binary can take more shared memory. ``ctas_per_sm`` is how
many programs of the binary an SM holds (shared memory with its 1 KB reserve, registers, warps):
the MLA split planner counts 2.

    python scripts/tree_verify_static.py --kind mla \\
        --configs "32,64,4,2;64,64,8,2,2,64;64,32,4,2,2,64"
    python scripts/tree_verify_static.py --kind mla --configs "32,64,4,2" --budget 31 \\
        --min-split-keys 128       # the tile budget 31 is served with

A config is block_m,block_n,num_warps,num_stages[,dv_split[,dk_chunk]] (KernelConfig's order).
"""
from __future__ import annotations

import argparse
import hashlib
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


# largest dynamic shared memory per block (opt-in), bytes: sm_80 163 KB, sm_86 / sm_89 /
# sm_120 99 KB, sm_90 / sm_100 / sm_103 227 KB (the CUDA programming guide's tables)
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 103: 232448,
              120: 101376}
# per SM: shared memory (of which each resident block reserves 1 KB) and resident warps;
# 64K 32-bit registers and 32 blocks on all of these
SM_SHARED = {80: 167936, 86: 102400, 89: 102400, 90: 233472, 100: 233472, 103: 233472,
             120: 102400}
SM_WARPS = {80: 64, 86: 48, 89: 48, 90: 64, 100: 64, 103: 64, 120: 48}
BLOCK_RESERVE, SM_REGS, SM_BLOCKS = 1024, 65536, 32
REG_UNIT = 256  # registers are allocated per warp in units of 256


def bundled_ptxas(arch: int = 90) -> str:
    """The ptxas of Triton's wheel that Triton itself compiles ``arch`` with (its Blackwell
    build from sm_100 on), else the toolkit's."""
    try:
        import triton

        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "ptxas-blackwell" if arch >= 100 else "ptxas")
        if os.path.exists(path):
            return path
    except ImportError:
        pass
    return shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"


def ctas_per_sm(shared: int, registers: int, warps: int, arch: int = 90) -> dict:
    """Resident programs per SM of a binary, by each limit and overall."""
    by_smem = SM_SHARED.get(arch, 102400) // (shared + BLOCK_RESERVE)
    per_warp = -(-registers * 32 // REG_UNIT) * REG_UNIT
    by_regs = SM_REGS // (per_warp * warps)
    by_warps = SM_WARPS.get(arch, 48) // warps
    return {"shared": by_smem, "registers": by_regs, "warps": by_warps,
            "ctas": min(by_smem, by_regs, by_warps, SM_BLOCKS)}


def budget_specialized(fn, budget: int) -> set:
    """Arguments a launch for trees of ``budget + 1`` tokens specializes as divisible by 16:
    the token count and the mask strides ([bs, N, N] uint8), less the kernel's
    ``do_not_specialize``."""
    n = budget + 1
    values = {"N": n, "stride_mi": n, "stride_mb": n * n}
    skip = {fn.arg_names[a] if isinstance(a, int) else a
            for a in (getattr(fn, "do_not_specialize", None) or ())}
    return {name for name, v in values.items() if v % 16 == 0 and name not in skip}


def next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def analyse(kind: str, cfg: list, arch: int, ptxas: str, merge_prefix: bool = False,
            group: int = 0, budget: int = 0, min_split_keys: int = 0,
            draft_block: bool = False, tail_m: int = 0) -> dict:
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
    # the verify launches' kernel (N and the mask strides unspecialized; an older checkout has
    # one kernel for both), or the drafter block's (unordered mask, specializing)
    fn = ta._tree_attn_fwd_kernel if draft_block else \
        getattr(ta, "_tree_attn_verify_kernel", ta._tree_attn_fwd_kernel)
    consts = dict(G=shape["G"], DK=shape["DK"], BLOCK_DK=next_pow2(shape["DK"]),
                  D_PE=shape["D_PE"], DV=shape["DV"],
                  BLOCK_DV=next_pow2(shape["DV"]) // dv_split, BLOCK_M=block_m,
                  BLOCK_N=block_n, SPLIT=not merge_prefix, USE_INDPTR=False,
                  SHARED_KV=shape["SHARED_KV"], HAS_CAP=False, INTERPRET=False,
                  DV_SPLIT=dv_split, DK_CHUNK=dk_chunk, MERGE_PREFIX=merge_prefix)
    # the constexprs with defaults, as a launch passes them (an argument left out of consts
    # would compile as a runtime integer; an older checkout lacks TAIL_M)
    consts["ORDERED_MASK"] = not draft_block
    consts["MIN_CHUNK"] = min_split_keys or 256
    if "TAIL_M" in fn.arg_names:
        consts["TAIL_M"] = tail_m
    ptrs = {"q_ptr": "*bf16", "qpe_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16",
            "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "kv_table_ptr": "*i32",
            "kv_row_ptr": "*i64", "seq_lens_ptr": "*i64", "tree_loc_ptr": "*i64",
            "tree_mask_ptr": "*u8", "pre_o_ptr": "*bf16", "pre_lse_ptr": "*fp32"}
    signature = {n: ("constexpr" if n in consts else ptrs.get(n) or
                     ("fp32" if n in ("qk_scale", "v_scale", "logit_cap") else "i32"))
                 for n in fn.arg_names}
    # what Triton specializes at a real launch: 16-byte aligned pointers and the strides that
    # are multiples of 16 at these shapes (without it every load is scalar and every element
    # needs its own 64-bit address, which misreports the register use)
    div16 = set(ptrs) | {"stride_qt", "stride_qh", "stride_qpt", "stride_qph", "stride_kt", "stride_kh", "stride_vt",
                         "stride_vh", "stride_ot", "stride_oh", "stride_table"}
    specialized = budget_specialized(fn, budget) if budget else set()
    div16 |= specialized
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
    occupancy = ctas_per_sm(out.metadata.shared, int(regs.group(1)), warps, arch) if regs else None
    return {"kind": kind, "config": ",".join(map(str, cfg)),
            **({"budget": budget, "specialized": sorted(specialized)} if budget else {}),
            **({"draft_block": True} if draft_block else {}),
            **({"min_split_keys": min_split_keys} if min_split_keys else {}),
            **({"tail_m": tail_m} if tail_m else {}),
            "registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spill.group(1)) if spill else None,
            "shared_bytes": out.metadata.shared,
            "fits_shared_memory": out.metadata.shared <= SMEM_LIMIT.get(arch, 101376),
            "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
            "tcgen05_mma": ptx.count("tcgen05.mma"),  # Blackwell (sm_100 / sm_103) tensor cores
            # how tiles reach shared memory: asynchronous copies (the pipeliner's cp.async,
            # Hopper's bulk/TMA copies) against plain global loads through registers
            "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
            "bulk_copies": ptx.count("cp.async.bulk"),
            "ld_global": len(re.findall(r"\bld\.global", ptx)),
            # the PTX itself, for same-binary checks across checkouts (a refactor that should
            # leave the compiled kernel alone)
            "ptx_sha256": hashlib.sha256(ptx.encode()).hexdigest()[:16],
            "ctas_per_sm": occupancy,
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
    ap.add_argument("--ptxas", default=None, help="default: Triton's own, else the toolkit's")
    ap.add_argument("--budget", type=int, default=0,
                    help="compile as a launch for trees of budget + 1 tokens specializes it")
    ap.add_argument("--draft-block", action="store_true",
                    help="the drafter block's kernel (unordered mask; --budget 15 for its 16 "
                         "tokens) instead of tree verify's")
    ap.add_argument("--min-split-keys", type=int, default=0,
                    help="the kernel's MIN_CHUNK (the plan's min_split_keys; default the "
                         "kernel's 256; MLA trees of 145-264 rows are served with 128)")
    ap.add_argument("--tail-m", type=int, default=0,
                    help="the kernel's TAIL_M: rows past the last full block in a tail tile of "
                         "this height (KernelConfig.tail_m; MHA)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for spec in args.configs.split(";"):
        cfg = [int(x) for x in spec.split(",") if x]
        try:
            row = analyse(args.kind, cfg, args.arch, args.ptxas or bundled_ptxas(args.arch),
                          args.merge_prefix, args.group, args.budget, args.min_split_keys,
                          args.draft_block, args.tail_m)
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
