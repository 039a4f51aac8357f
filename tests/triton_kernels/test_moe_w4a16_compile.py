"""CPU-only check that the fused-MoE kernels compile for Hopper (sm_90) with every shipped config.

Triton compiles ahead of time for a named target without a GPU (ptxas ships with the wheel). This
catches what the interpreter cannot: non-constexpr globals, inline-PTX operand mismatches, shared
memory over the 227 KB limit, and a lost in-register dequant path (the packed int32 tile must
reach the MMA operand layout before the inline PTX runs, or weights would round-trip through
shared memory as bf16).
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.triton_kernels._moe_kernels import load_moe

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

K = load_moe(interpret=False)
MOE = K.moe
H, I, TOPK = 7168, 256, 8
SMEM_LIMIT = 227 * 1024
_NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _compile(fn, sig: dict, const: dict, warps: int, stages: int):
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t[0] == "*"}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def _gate_up(bm, g):
    sig = {"xp_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "sorted_ids_ptr": "*i32",
           "block_expert_ptr": "*i32", "h_ptr": "*bf16", "T": "i32"}
    const = dict(K=H, I=I, TOPK=TOPK, BLOCK_M=bm, BLOCK_N=g.block_n, BLOCK_K=g.block_k,
                 DOWN_BLOCK_K=256, PORTABLE=False)
    sig.update({k: "constexpr" for k in const})
    return _compile(MOE._gate_up_kernel, sig, const, g.num_warps, g.num_stages)


def _down(bm, g):
    sig = {"h_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "sorted_ids_ptr": "*i32",
           "block_expert_ptr": "*i32", "topk_w_ptr": "*fp32", "y_ptr": "*bf16", "T": "i32"}
    const = dict(N=H, I=I, BLOCK_M=bm, BLOCK_N=g.block_n, BLOCK_K=g.block_k, PORTABLE=False)
    sig.update({k: "constexpr" for k in const})
    return _compile(MOE._down_kernel, sig, const, g.num_warps, g.num_stages)


def _shipped():
    seen = {}
    for _, cfg in MOE._config_table(MOE._CONFIG_PATH):
        seen[("gate_up", cfg.block_m, cfg.gate_up)] = None
        seen[("down", cfg.block_m, cfg.down)] = None
    return list(seen)


@pytest.mark.parametrize("kind,bm,g", _shipped(), ids=lambda v: str(v))
def test_compiles_for_sm90(kind, bm, g, tmp_path):
    kern = (_gate_up if kind == "gate_up" else _down)(bm, g)
    assert kern.metadata.shared <= SMEM_LIMIT, kern.metadata.shared
    ttgir = kern.asm["ttgir"]
    assert "tt.elementwise_inline_asm" in ttgir
    # The packed words are loaded straight into the MMA operand layout (dequant in registers).
    assert re.search(r"-> tensor<\d+x\d+xi32, #ttg\.dot_op<\{opIdx = 0", ttgir), "dequant left registers"
    cuobjdump = _NVIDIA_BIN / "cuobjdump"
    if cuobjdump.exists() and shutil.which(str(cuobjdump)):
        cubin = tmp_path / "k.cubin"
        cubin.write_bytes(kern.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)],
                               capture_output=True, text=True).stdout
        assert "STACK:0" in usage, f"register spills: {usage.strip()[-200:]}"


def test_prologue_and_combine_compile():
    sig = {"topk_ids_ptr": "*i32", "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32",
           "x_ptr": "*bf16", "xp_ptr": "*bf16", "T": "i32", "max_blocks": "i32", "stride_xm": "i32"}
    const = dict(NUM_EXPERTS=384, E_PAD=512, BLOCK_M=16, BLOCK_T=1024, NUM_T_BLOCKS=1, BLOCK_B=16,
                 K=H, BLOCK_K=256)
    sig.update({k: "constexpr" for k in const})
    _compile(MOE._prologue_kernel, sig, const, 4, 1)
    sig = {"y_ptr": "*bf16", "out_ptr": "*bf16", "scale": "fp32", "stride_om": "i32"}
    const = dict(N=H, TOPK=TOPK, BLOCK_N=1024)
    sig.update({k: "constexpr" for k in const})
    _compile(MOE._combine_kernel, sig, const, 4, 1)
