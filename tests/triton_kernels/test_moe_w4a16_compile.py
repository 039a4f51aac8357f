"""CPU-only check that the fused-MoE kernels compile for Hopper (sm_90) with every shipped config.

Triton compiles ahead of time for a named target without a GPU (ptxas ships with the wheel). This
catches what the interpreter cannot: non-constexpr globals, inline-PTX operand mismatches, shared
memory over the 227 KB limit, register spills, and a lost in-register dequant path (the packed
int32 tile must reach the MMA operand layout before the inline PTX runs, or weights would
round-trip through shared memory as bf16).

Nothing imports triton at collection time: ``triton.language``'s own jit functions take the mode
of the first ``import triton`` in a process, and this module must not decide it for others. If
the process already has triton in interpreter mode, the module reruns itself in a fresh process.
"""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from tests.triton_kernels._moe_kernels import lang_mode_matches, load_moe, run_isolated
from tests.triton_kernels._sm90 import (
    SMEM_LIMIT, assert_no_spills, compile_sm90, registers,
)

H, I, TOPK = 7168, 256, 8
_CONFIGS = Path(__file__).resolve().parents[2] / "triton_kernels" / "moe_w4a16_configs.json"
_MOE_CONFIG_PY = _CONFIGS.parent / "moe_config.py"


def _mode_ok() -> bool:
    load_moe(interpret=False)
    return lang_mode_matches(interpret=False)


@pytest.fixture(scope="module")
def MOE():
    if not _mode_ok():
        pytest.skip("triton was imported in interpreter mode here; see test_rerun_in_clean_process")
    return load_moe(interpret=False).moe


_compile = compile_sm90  # (scripts/moe_ptx_digest.py calls it by this name)


def _gemm(MOE, kind: str, bm: int, tiles: tuple, half_m: bool = False, wide: bool = False,
          pdl: int = 0, early: bool = False):
    """Compile one GEMM kernel; ``tiles`` = (block_n, block_k, warps, stages[, n_per_cta,
    split_dq, split_k, split_target[, par_acc[, scale_once[, max_regs]]]]) as in GemmConfig;
    ``half_m``: whether that GEMM runs HALF_M; ``wide``: the gate-up's WIDE_HALVES
    (MoeConfig.wide_halves); ``pdl``: moe_pdl's mode, ``early`` the looped down's EARLY
    (each passed only when set)."""
    extra = dict({"PDL": pdl} if pdl else {}, **({"EARLY": early} if early else {}))
    (bn, bk, warps, stages, n_per_cta, split_dq, split_k, split_target, par_acc, scale_once,
     max_regs) = tuple(tiles) + (0, 0, 1, 0, 0, 0, 0)[len(tiles) - 4:]
    # (passed only when set, as the launch does)
    limit = {"maxnreg": max_regs} if max_regs else {}
    if kind == "gate_up":
        sig = {"xp_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "sorted_ids_ptr": "*i32",
               "block_expert_ptr": "*i32", "h_ptr": "*bf16", "part_ptr": "*fp32",
               "cnt_ptr": "*i32", "T": "i32", "part_rows": "i32"}
        # split-K as served: each tile's last program sums the partials (SERIAL)
        const = dict(K=H, I=I, TOPK=TOPK, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOWN_BLOCK_K=256,
                     PORTABLE=False, SPLIT_DQ=bool(split_dq), SPLIT_K=split_k, HALF_M=half_m,
                     SERIAL=split_k > 1, SPLIT_TARGET=split_target,
                     NUM_EXPERTS=384 if split_target else 0)
        # (passed only when set: older checkouts' kernels lack them, moe_ptx_digest)
        if par_acc:
            const["PAR_ACC"] = True
        if scale_once:
            const["SCALE_ONCE"] = True
        if wide:
            const["WIDE_HALVES"] = True
        return _compile(MOE._gate_up_kernel, sig, dict(const, **extra), warps, stages, **limit)
    sig = {"h_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "sorted_ids_ptr": "*i32",
           "block_expert_ptr": "*i32", "topk_w_ptr": "*fp32", "y_ptr": "*bf16", "T": "i32"}
    if n_per_cta:
        const = dict(N=H, I=I, BLOCK_M=bm, BLOCK_N=bn, N_PER_CTA=n_per_cta, PORTABLE=False,
                     HALF_M=half_m, NUM_EXPERTS=384 if split_target else 0,
                     SPLIT_TARGET=split_target)
        if par_acc:
            const["PAR_ACC"] = True
        if scale_once:
            const["SCALE_ONCE"] = True
        return _compile(MOE._down_loop_kernel, sig, dict(const, **extra), warps, stages, **limit)
    const = dict(N=H, I=I, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PORTABLE=False, HALF_M=half_m)
    return _compile(MOE._down_kernel, sig, dict(const, **extra), warps, stages, **limit)


def _shipped(max_ms=None):
    """(kind, block_m, tiles, half_m, wide) of every config in the shipped table, its device
    overrides' included (or of its bands of these ``max_m``s) (half_m:
    whether that GEMM runs with HALF_M, as fused_moe_w4a16 launches it for the band's half_m;
    wide: the gate-up's WIDE_HALVES; tiles end with par_acc / scale_once (/ max_regs) where a
    band sets them)."""
    seen = []
    # the bands as written, then as each card with overrides (the devices section) gets them
    # (moe_config loaded from its file: it imports no triton)
    spec = importlib.util.spec_from_file_location("_moe_config_tables", _MOE_CONFIG_PY)
    mc = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (its dataclasses)
    spec.loader.exec_module(mc)
    bands = [b for name in [None] + mc.device_overrides(str(_CONFIGS))
             for b in mc.table_json(str(_CONFIGS), name)["bands"]]
    for band in bands:
        if max_ms is not None and band["max_m"] not in max_ms:
            continue
        for kind in ("gate_up", "down"):
            g = band[kind]
            half = band.get("half_m", 0)
            opts = (g.get("par_acc", 0), g.get("scale_once", 0), g.get("max_regs", 0))
            if not opts[2]:
                opts = opts[:2]
            key = (kind, band["block_m"], (g["block_n"], g["block_k"], g["num_warps"],
                                           g["num_stages"], g.get("n_per_cta", 0),
                                           g.get("split_dq", 0), g.get("split_k", 1),
                                           g.get("split_target", 0)) + (opts if any(opts) else ()),
                   half == 1 or (kind == "gate_up" and half == 2),
                   kind == "gate_up" and bool(band.get("wide_halves", 0)))
            if key not in seen:
                seen.append(key)
    return seen


def test_shipped_configs_carry_the_bands_options(tmp_path, monkeypatch):
    """A band with wide_halves and par_acc / scale_once is compiled with them (no GPU)."""
    table = json.loads(_CONFIGS.read_text())
    band = next(b for b in table["bands"] if b["max_m"] == 16)
    band.update(block_m=16, half_m=2, wide_halves=1)
    band["gate_up"] = dict(band["gate_up"], par_acc=1, scale_once=0)
    band["down"] = dict(band["down"], par_acc=0, scale_once=1)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    monkeypatch.setitem(globals(), "_CONFIGS", path)  # (_shipped reads the module's table path)
    got = [k for k in _shipped() if k[1] == 16 and k[2][:4] == (
        band["gate_up"]["block_n"], band["gate_up"]["block_k"],
        band["gate_up"]["num_warps"], band["gate_up"]["num_stages"]) and k[0] == "gate_up"]
    down = [k for k in _shipped() if k[0] == "down" and k[2][-2:] == (0, 1)]
    assert any(k[3] and k[4] and k[2][-2:] == (1, 0) for k in got), got
    assert down and not any(k[4] for k in down), down


@pytest.mark.parametrize("kind,bm,tiles,half,wide", _shipped(), ids=str)
def test_compiles_for_sm90(MOE, kind, bm, tiles, half, wide, tmp_path):
    _check_compiles(MOE, kind, bm, tiles, tmp_path, half_m=half, wide=wide)


def _check_compiles(MOE, kind, bm, tiles, tmp_path, half_m=False, wide=False):
    _check_kernel(_gemm(MOE, kind, bm, tiles, half_m, wide), tmp_path)


def _check_kernel(kern, tmp_path):
    """Within shared memory, the in-register dequant kept, no spills."""
    assert kern.metadata.shared <= SMEM_LIMIT, kern.metadata.shared
    ttgir = kern.asm["ttgir"]
    assert "tt.elementwise_inline_asm" in ttgir
    assert re.search(r"-> tensor<\d+x\d+xi32, #ttg\.dot_op<\{opIdx = 0", ttgir), \
        "packed weights no longer reach the MMA operand layout (dequant left registers)"
    assert_no_spills(kern, tmp_path)


# runtime signatures of the launches around the two GEMMs (the groupings', the split-K
# reduce's and the combine's)
_GROUPING_SIG = {"topk_ids_ptr": "*i32", "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32",
                 "x_ptr": "*bf16", "xp_ptr": "*bf16", "T": "i32", "max_blocks": "i32",
                 "stride_xm": "i32"}  # _prologue_kernel and _align_small_kernel
_COUNT_SIG = {"topk_ids_ptr": "*i32", "counts_ptr": "*i32", "x_ptr": "*bf16", "xp_ptr": "*bf16",
              "T": "i32", "stride_xm": "i32"}
_PLACE_SIG = {"topk_ids_ptr": "*i32", "counts_ptr": "*i32", "base_ptr": "*i32",
              "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "T": "i32",
              "max_blocks": "i32"}
_REDUCE_SIG = {"part_ptr": "*fp32", "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32",
               "h_ptr": "*bf16", "T": "i32", "part_rows": "i32"}
_COMBINE_SIG = {"y_ptr": "*bf16", "topk_ids_ptr": "*i32", "out_ptr": "*bf16", "scale": "fp32",
                "stride_om": "i32"}


def test_prologue_and_combine_compile(MOE, tmp_path):
    sig = _GROUPING_SIG
    const = dict(NUM_EXPERTS=384, E_PAD=512, BLOCK_M=16, BLOCK_T=1024, NUM_T_BLOCKS=1, BLOCK_B=16,
                 K=H, BLOCK_K=256, COPY_FIRST=False, COPY_PROGS=1)
    _compile(MOE._prologue_kernel, sig, const, 4, 1)
    _compile(MOE._prologue_kernel, sig, dict(const, COPY_FIRST=True, COPY_PROGS=7), 4, 1)
    sig = _COMBINE_SIG
    _compile(MOE._combine_kernel, sig, dict(N=H, TOPK=TOPK, NUM_EXPERTS=384, BLOCK_N=1024), 4, 1)
    block_n, warps = MOE.COMBINE_DEFAULT
    _compile(MOE._combine_kernel, sig, dict(N=H, TOPK=TOPK, NUM_EXPERTS=384, BLOCK_N=block_n),
             warps, 1)
    # the two-pass grouping (large calls): 16 chunks of 1,024 pairs (M = 2,048 at top-8)
    sig = _COUNT_SIG
    for copy_progs in (1, 7):
        _compile(MOE._align_count_kernel, sig, dict(NUM_EXPERTS=384, E_PAD=512, CH=1024,
                                                    NUM_CH=16, K=H, BLOCK_K=256,
                                                    COPY_PROGS=copy_progs), MOE.ALIGN_WARPS, 1)
    sig = _PLACE_SIG
    _compile(MOE._align_place_kernel, sig, dict(NUM_EXPERTS=384, E_PAD=512, BLOCK_M=64,
                                                CH=1024, NUM_CH=16, BLOCK_B=64),
             MOE.ALIGN_WARPS, 1)
    # the one-program grouping (a histogram and a sort) at M = 8 and at its largest sort
    # (1,024 pairs), with the copy per row and per chunk
    sig = _GROUPING_SIG
    for t_pad, bm, b_pad, copy_progs in ((64, 8, 64, 1), (1024, 16, 512, 1), (1024, 16, 512, 7)):
        kern = _compile(MOE._align_small_kernel, sig,
                        dict(NUM_EXPERTS=384, E_PAD=512, BLOCK_M=bm, T_PAD=t_pad, B_PAD=b_pad,
                             K=H, BLOCK_K=256, COPY_PROGS=copy_progs), MOE.ALIGN_WARPS, 1)
        assert_no_spills(kern, tmp_path)
    sig = _REDUCE_SIG
    const = dict(I=I, SPLIT_K=4, BLOCK_M=16, BLOCK_C=128, DOWN_BLOCK_K=256, SPLIT_TARGET=0,
                 NUM_N=4, KS=28)
    _compile(MOE._gate_up_reduce_kernel, sig, const, 4, 1)
    _compile(MOE._gate_up_reduce_kernel, sig, dict(const, SPLIT_TARGET=256), 4, 1)


# (32, 256, 2, 2, 0, 1, 4), a tuning candidate never shipped, spills 24 bytes with the serial
# split-K fix-up (session 26) and is left out.
@pytest.mark.parametrize("tiles", [(32, 256, 2, 3, 0, 1, 2), (32, 256, 2, 3, 0, 1, 7),
                                   (64, 256, 4, 3, 0, 1, 2), (32, 128, 2, 4, 0, 1, 2),
                                   (32, 128, 2, 4, 0, 1, 4),
                                   # live splits (split_target > 0)
                                   (32, 128, 2, 4, 0, 1, 8, 256), (32, 256, 2, 3, 0, 1, 4, 256),
                                   (64, 256, 4, 3, 0, 1, 4, 512)], ids=str)
def test_split_variants_compile_without_spills(MOE, tiles, tmp_path):
    _check_compiles(MOE, "gate_up", 16, tiles, tmp_path)


# par_acc (session 52, not in the table): the M = 2-16 bands' gate-up tiles with two
# accumulators per tile, on 8-row blocks (live and fixed splits) and 16-row half_m blocks
@pytest.mark.parametrize("bm,tiles,half", [
    (8, (32, 256, 2, 3, 0, 1, 4, 256, 1), False), (8, (64, 256, 4, 3, 0, 1, 4, 512, 1), False),
    (8, (32, 256, 2, 3, 0, 1, 4, 0, 1), False), (16, (64, 256, 4, 3, 0, 1, 4, 512, 1), True),
    # with scale_once too, and scale_once alone
    (8, (32, 256, 2, 3, 0, 1, 4, 256, 1, 1), False),
    (8, (32, 256, 2, 3, 0, 1, 4, 256, 0, 1), False),
    (8, (64, 256, 4, 3, 0, 1, 4, 512, 0, 1), False),
    (16, (64, 256, 4, 3, 0, 1, 4, 512, 0, 1), True),
    (16, (64, 256, 4, 3, 0, 1, 2, 512, 1, 1), True)],
    ids=str)
def test_two_accumulator_gate_up_compiles_without_spills(MOE, bm, tiles, half, tmp_path):
    _check_compiles(MOE, "gate_up", bm, tiles, tmp_path, half_m=half)


# ... and the looped down tiles of the M 1-48 bands with them
@pytest.mark.parametrize("bm,tiles,half", [
    (8, (64, 256, 4, 3, 256, 0, 1, 0, 1), False), (8, (64, 256, 4, 3, 512, 0, 1, 896, 1), False),
    (16, (64, 256, 4, 3, 512, 0, 1, 0, 1), True),
    # scale_once, alone and with par_acc
    (8, (64, 256, 4, 3, 256, 0, 1, 0, 0, 1), False),
    (8, (64, 256, 4, 3, 256, 0, 1, 0, 1, 1), False),
    (16, (64, 256, 4, 3, 512, 0, 1, 0, 0, 1), True)], ids=str)
def test_two_accumulator_down_compiles_without_spills(MOE, bm, tiles, half, tmp_path):
    _check_compiles(MOE, "down", bm, tiles, tmp_path, half_m=half)


_HALF_M_TILES = [(16, "gate_up", (32, 256, 2, 3, 0, 1, 4)),
                 (16, "gate_up", (64, 256, 4, 3, 0, 1, 1)),
                 (16, "gate_up", (64, 256, 4, 3, 0, 1, 4, 512)),
                 (16, "gate_up", (64, 256, 4, 3, 0, 1, 2, 512)), (16, "down", (64, 256, 4, 3, 512)),
                 (32, "gate_up", (32, 256, 2, 3, 0, 1, 4)),
                 (32, "gate_up", (64, 256, 4, 3, 0, 1, 2)),
                 (32, "gate_up", (32, 128, 2, 4, 0, 1, 1)), (32, "down", (64, 256, 4, 3, 512)),
                 (32, "down", (32, 256, 2, 3, 512)),
                 # 64-row blocks: 4-warp gate-up tiles (2 warps at 32 x 256 spill, half_m or
                 # not: 255 registers and 80-264 bytes of stack on sm_90)
                 (64, "gate_up", (64, 256, 4, 3, 0, 1, 2)),
                 (64, "gate_up", (32, 256, 4, 3, 0, 1, 4)),
                 (64, "gate_up", (32, 128, 2, 4, 0, 1, 4)), (64, "down", (64, 256, 4, 3, 512))]


@pytest.mark.parametrize("bm,kind,tiles", _HALF_M_TILES, ids=str)
def test_half_m_variants_compile_without_spills(MOE, bm, kind, tiles, tmp_path):
    """16-, 32- and 64-row blocks with HALF_M (every tile width in one kernel): in-register
    dequant kept, no spills, within shared memory, for gate-up and down tiles of the M 5-128
    bands."""
    _check_compiles(MOE, kind, bm, tiles, tmp_path, half_m=True)


@pytest.mark.parametrize("bm,tiles,half,wide,regs", [
    (16, (64, 256, 4, 3, 0, 1, 4, 512, 0, 0, 128), True, True, 128),
    (16, (64, 256, 4, 3, 0, 1, 2, 512, 0, 1, 128), True, True, 128),
    (8, (64, 256, 4, 3, 512, 0, 1, 896, 0, 0, 72), False, False, 72)], ids=str)
def test_register_limit_holds_without_spills(MOE, bm, tiles, half, wide, regs, tmp_path):
    """GemmConfig.max_regs (session 53): the launch's limit reaches ptxas (the kernel uses at
    most that many registers) with no spill, for wide_halves' gate-up at 128 (4 programs an
    SM; 130 without) and a looped down at 72."""
    kind = "down" if tiles[4] else "gate_up"
    _check_compiles(MOE, kind, bm, tiles, tmp_path, half_m=half, wide=wide)
    used = registers(_gemm(MOE, kind, bm, tiles, half, wide), tmp_path)
    if used is None:
        pytest.skip("no cuobjdump in the triton wheel")
    assert used <= regs, used


# wide_halves (session 53, not in the table): the M 9-48 bands' 4-warp gate-up tiles on 16-row
# half_m blocks, full blocks as two half-width tiles; with a fixed split and on 32-row blocks.
# Registers and shared memory as the narrow tile's (8-row blocks: 128 / 56 KB), not as plain
# HALF_M's (167 / 72 KB). The 2-warp 32-column tile spills with it (16-column halves): left out.
@pytest.mark.parametrize("bm,tiles", [
    (16, (64, 256, 4, 3, 0, 1, 4, 512)), (16, (64, 256, 4, 3, 0, 1, 2, 512)),
    (16, (64, 256, 4, 3, 0, 1, 4)), (16, (64, 256, 4, 3, 0, 1, 4, 512, 1, 1)),
    (32, (64, 256, 4, 3, 0, 1, 4, 512))], ids=str)
def test_wide_halves_gate_up_compiles_without_spills(MOE, bm, tiles, tmp_path):
    _check_compiles(MOE, "gate_up", bm, tiles, tmp_path, half_m=True, wide=True)
    if bm == 16 and len(tiles) == 8:
        kern = _gemm(MOE, "gate_up", bm, tiles, True, True)
        plain = _gemm(MOE, "gate_up", bm, tiles, True, False)
        assert kern.metadata.shared < plain.metadata.shared, (kern.metadata.shared,
                                                               plain.metadata.shared)


# Live down column ranges (the down config's split_target): the looped down tiles of the
# M 1-128 bands with a live range, on 8- / 16-row blocks, narrowed (half_m) or not
@pytest.mark.parametrize("bm,tiles,half", [
    (8, (64, 256, 4, 3, 256, 0, 1, 512), False), (8, (64, 256, 4, 3, 512, 0, 1, 896), False),
    (8, (32, 256, 2, 3, 448, 0, 1, 896), False), (16, (64, 256, 4, 3, 512, 0, 1, 896), True),
    (16, (64, 256, 4, 3, 512, 0, 1, 896), False)], ids=str)
def test_live_down_compiles_without_spills(MOE, bm, tiles, half, tmp_path):
    """In-register dequant kept, no spills, within shared memory."""
    _check_compiles(MOE, "down", bm, tiles, tmp_path, half_m=half)


def _ptx_order(ptx: str, *needles: str) -> list[int]:
    """Where each needle first occurs in ``ptx`` (-1: nowhere)."""
    return [ptx.find(n) for n in needles]


# the M = 1 band (per-tile down), M = 8 (looped down, fixed ranges), 9-16 (live ranges),
# 17-32 (half_m 1), 65-128 (half_m 2); a kernel's PDL constexpr is 1 (wait) or 2 (wait and
# release early), moe_pdl.Pdl.launch
@pytest.mark.parametrize("pdl", [1, 2])
def test_pdl_modes_compile_without_spills(MOE, pdl, tmp_path):
    """moe_pdl's waits and early releases in shipped GEMM configs (and the grouping, reduce
    and combine launches): no spills, the dequant still in registers, the same registers as
    without, and the PTX as each says: ``griddepcontrol.wait`` before any global load,
    ``launch_dependents`` under 2 only (the gate-up's after its first MMA), never in the
    combine. (Without PDL the kernels compile as before: moe_ptx_digest.py's digests.)"""
    wait, release = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
    cases = _shipped((1, 8, 16, 32, 128))
    assert len(cases) >= 8, cases
    for kind, bm, tiles, half, wide in cases:
        kern = _gemm(MOE, kind, bm, tiles, half, wide, pdl=pdl)
        _check_kernel(kern, tmp_path)
        assert registers(kern, tmp_path) == registers(_gemm(MOE, kind, bm, tiles, half, wide),
                                                      tmp_path), (kind, tiles)
        ptx = kern.asm["ptx"]
        at_wait, at_release, at_load = _ptx_order(ptx, wait, release, "ld.global")
        assert 0 <= at_wait < at_load and (at_release >= 0) == (pdl == 2), (kind, tiles)
        if kind == "gate_up" and pdl == 2:
            mma = min(i for i in _ptx_order(ptx, "mma.sync", "wgmma.mma_async") if i >= 0)
            assert mma < at_release, tiles
    sig = _GROUPING_SIG
    kerns = [_compile(MOE._align_small_kernel, sig,
                      dict(NUM_EXPERTS=384, E_PAD=512, BLOCK_M=8, T_PAD=64, B_PAD=64, K=H,
                           BLOCK_K=256, COPY_PROGS=1, PDL=pdl), MOE.ALIGN_WARPS, 1),
             _compile(MOE._prologue_kernel, sig,
                      dict(NUM_EXPERTS=384, E_PAD=512, BLOCK_M=16, BLOCK_T=1024, NUM_T_BLOCKS=1,
                           BLOCK_B=16, K=H, BLOCK_K=256, PDL=pdl), 4, 1)]
    kerns.append(_compile(MOE._align_count_kernel, _COUNT_SIG,
                          dict(NUM_EXPERTS=384, E_PAD=512, CH=1024, NUM_CH=16, K=H, BLOCK_K=256,
                               COPY_PROGS=7, PDL=pdl), MOE.ALIGN_WARPS, 1))
    kerns.append(_compile(MOE._align_place_kernel, _PLACE_SIG,
                          dict(NUM_EXPERTS=384, E_PAD=512, BLOCK_M=64, CH=1024, NUM_CH=16,
                               BLOCK_B=64, PDL=pdl), MOE.ALIGN_WARPS, 1))
    kerns.append(_compile(MOE._gate_up_reduce_kernel, _REDUCE_SIG,
                          dict(I=I, SPLIT_K=4, BLOCK_M=16, BLOCK_C=128, DOWN_BLOCK_K=256,
                               SPLIT_TARGET=256, NUM_N=4, KS=28, PDL=pdl), 4, 1))
    block_n, warps = MOE.COMBINE_DEFAULT
    kerns.append(_compile(MOE._combine_kernel, _COMBINE_SIG, dict(N=H, TOPK=TOPK, NUM_EXPERTS=384,
                                                         BLOCK_N=block_n, PDL=pdl), warps, 1))
    for kern in kerns:
        ptx = kern.asm["ptx"]
        at_wait, at_release, at_load = _ptx_order(ptx, wait, release, "ld.global")
        assert 0 <= at_wait < at_load, kern.name
        # (the combine leaves the release to its exit: its successor is the caller's)
        assert (at_release >= 0) == (pdl == 2 and kern.name != "_combine_kernel"), kern.name
        assert_no_spills(kern, tmp_path)


def _loads_from(ptx: str, params: set) -> tuple[int, int]:
    """Global loads (``ld.global``, ``cp.async``) whose address derives from the kernel
    parameters ``params`` (their indices), before and after the first ``griddepcontrol.wait``:
    a forward walk of the PTX's register definitions (virtual registers, each written once
    apart from loop-carried ones, which take their first definition's taint)."""
    tainted, counts, after = set(), [0, 0], 0
    for line in ptx.splitlines():
        line = re.sub(r"^\s*@!?%p\d+\s+", "", line.strip())
        if "griddepcontrol.wait" in line:
            after = 1
            continue
        m = re.match(r"ld\.param\.\S+\s+(%\w+),\s*\[\w+_param_(\d+)\]", line)
        if m:
            if int(m.group(2)) in params:
                tainted.add(m.group(1))
            continue
        op, _, rest = line.partition(" ")
        if not rest or op.startswith(("//", ".")) or op.endswith(":"):
            continue
        if op.startswith(("ld.global", "cp.async")):
            addrs = re.findall(r"\[\s*(%\w+)", rest)  # (cp.async: shared, then global)
            addr = addrs[0] if op.startswith("ld") else addrs[1] if len(addrs) > 1 else None
            if addr in tainted:
                counts[after] += 1
        if rest.lstrip().startswith("["):  # a store / copy: no register written
            continue
        dest, _, srcs = rest.partition(",") if not rest.lstrip().startswith("{") else \
            rest.partition("}")
        if set(re.findall(r"%\w+", srcs)) & tainted:
            tainted.update(re.findall(r"%\w+", dest))
    return counts[0], counts[1]


# The looped downs of the M = 8 / 9-16 / 17-32 / 65-128 bands (fixed, live, narrowed)
def test_early_loads_stop_at_the_wait(MOE, tmp_path):
    """moe_pdl's loads before the wait (``e``, ``c``): in the shipped looped downs with PDL the
    routing weights (parameter 5) come before the wait, and the activations (0, the gate-up's
    output) and the weights (1) only after it; in the combine the expert ids (1) before and y
    (0, the down's output) after. The same registers, no spills, dequant kept."""
    cases = [c for c in _shipped((8, 16, 32, 128)) if c[0] == "down" and len(c[2]) > 4
             and c[2][4]]
    assert len(cases) >= 3, cases
    for kind, bm, tiles, half, wide in cases:
        kern = _gemm(MOE, kind, bm, tiles, half, wide, pdl=2, early=True)
        _check_kernel(kern, tmp_path)
        assert registers(kern, tmp_path) <= registers(_gemm(MOE, kind, bm, tiles, half, wide,
                                                            pdl=2), tmp_path), tiles
        ptx = kern.asm["ptx"]
        routing, h, w = (_loads_from(ptx, {p}) for p in (5, 0, 1))
        assert routing[0] > 0 and h[0] == w[0] == 0 and h[1] > 0 and w[1] > 0, (tiles, routing,
                                                                                 h, w)
    kern = _compile(MOE._combine_kernel, _COMBINE_SIG,
                    dict(N=H, TOPK=TOPK, NUM_EXPERTS=384, BLOCK_N=512, PDL=1, EARLY=True), 4, 1)
    ids, y = _loads_from(kern.asm["ptx"], {1}), _loads_from(kern.asm["ptx"], {0})
    assert ids[0] > 0 and ids[1] == 0 and y[0] == 0 and y[1] > 0, (ids, y)
    assert_no_spills(kern, tmp_path)
    # the walk itself: without the early loads, nothing before the wait
    plain = _compile(MOE._combine_kernel, _COMBINE_SIG,
                     dict(N=H, TOPK=TOPK, NUM_EXPERTS=384, BLOCK_N=512, PDL=1), 4, 1)
    assert _loads_from(plain.asm["ptx"], {0, 1})[0] == 0


def test_rerun_in_clean_process():
    if _mode_ok():
        pytest.skip("ran in this process")
    run_isolated(__file__, interpret=False)


