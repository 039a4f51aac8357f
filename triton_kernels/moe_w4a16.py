"""Fused W4A16 MoE (int4 weights, group 32, symmetric; bf16 activations) for verify-sized batches.

A tree verify sends batch x (budget + 1) tokens through every MoE layer: tens to a few thousand
tokens, a regime bound by reading expert weights. This module reads each touched expert's packed
weights once per step, dequantizes them in registers and fuses the rest around two GEMMs:

1. ``moe_align`` (``moe_align.py``; one launch, two from 2,048 pairs): group the ``T = M *
   topk`` (token, slot) pairs by expert into blocks of ``BLOCK_M`` rows (padding with the
   sentinel ``T``; static sizes, deterministic: pairs keep flat order inside an expert;
   CUDA-graph safe), and copy ``x`` into the plane-major order described below.
2. ``_gate_up_kernel``: ``h = silu(x @ G_e) * (x @ U_e)`` per block, int4 -> bf16 in registers,
   fp32 accumulation, SiLU-and-multiply in the epilogue; ``h`` is stored in bf16 (as SGLang does).
   With ``split_k`` > 1 the programs of a tile each sum part of K into fp32 partials (few
   touched experts); the tile's last program to finish adds them in fixed order and runs the
   epilogue (``_tile_counters``), or, where no counter buffer is at hand,
   ``_gate_up_reduce_kernel`` does the same in a second launch. With ``split_target`` > 0 the
   split is chosen per call on the GPU (``_live_split``): the smallest divisor of the K steps, at
   most ``split_k``, that gives the call's used blocks ``split_target`` programs, from the block
   count the prologue writes; the used tiles' programs come first at whatever split, in a grid
   sized to the most any call can need (``live_grid``), and the surplus leaves at once. One band
   then serves a call whose tokens share 8 experts (deep split) and one spread
   over hundreds (none) without a host sync or a per-routing config.
3. ``_down_kernel``: ``y = (h @ D_e) * topk_weight`` per (token, slot); ``_down_loop_kernel`` does
   the same with one long column loop per program (intermediate sizes that fit one K tile). Its
   column range can be live too (the down config's ``split_target``): a call on few experts
   splits each range into shorter ones, so its few blocks still fill the GPU.
4. ``_combine_kernel``: ``out[m] = routed_scaling_factor * sum_k y[m, k]`` in fp32, fixed order
   (deterministic, unlike an atomic-add combine).

With ``MoeConfig.half_m`` both GEMMs narrow a ``BLOCK_M``-row block (16, 32 or 64) to the
fewest rows that hold its real rows, down to 8 with 16-row blocks and to 16 with larger ones
(one kernel holds every width; a block's real rows precede its padding, so one or two ids tell
which): an expert with up to ``BLOCK_M`` rows in a call then dequantizes each weight tile once
for all of them, as a tree's tokens that share experts need, while a call that spreads over
many experts runs narrow tiles. With 32- or 64-row blocks it was up to 17 % faster on 8 experts
but 9-13 % slower on random routing (48-58 % with 64) on the H200 in session 26; with 16-row
blocks (session 46) it runs 8-row tiles for the one or two rows most experts hold at M 17-48 on
random routing, 5-7 % faster there, and 16-row ones for experts of 9-16 rows: the M 17-32 and
33-48 bands use it, and the M 49-64 and 65-128 bands ``half_m`` 2 (the gate-up only; the down's
two-width kernel cost 5-6 % where 32 experts hold 16 rows each).

Weight layout consumed as loaded by SGLang 0.5.17 (no repack; see ``sglang_ddtree/moe_hook.py``):
``w13_packed [E, H // 8, 2 I] int32`` (nibble ``j`` of row ``r`` holds ``q[8 r + j] + 8``),
``w13_scale [E, H // 32, 2 I] bf16``, ``w2_packed [E, I // 8, H] int32``, ``w2_scale [E, I // 32, H]``.

How that layout is consumed without shuffling weights:

* Nibble planes. The 8 nibbles of one int32 are 8 consecutive input rows ``k = 8 r + j``. A K tile
  of ``BLOCK_K`` rows (``KP = BLOCK_K / 8`` words) is summed as 8 dots of depth ``KP``: plane ``j``
  pairs nibble ``j`` of every word ``r`` with input column ``8 r + j``. Every weight plane is an
  elementwise function of the loaded int32 tile, so Triton keeps the packed tile in the MMA operand
  layout and dequantizes in registers (checked in the sm_90 TTGIR: cp.async -> shared ->
  ``local_load`` into the wgmma A-operand layout -> inline PTX -> wgmma).
* Plane-major activations. For contiguous, pipelined activation loads, the activations are stored
  so that inside each K tile column ``j * KP + r`` holds input column ``8 r + j`` (``x`` by the
  prologue, ``h`` directly by the gate-up epilogue); plane ``j`` is then a contiguous slice.
* Swap AB. The dots compute ``acc^T [BLOCK_N, BLOCK_M] = W^T @ x^T``: the weight tile is the MMA's
  M side (64 rows per warpgroup) and the few tokens of an expert block are the N side (>= 16).

On the GPU the nibble -> bf16 conversion is inline PTX on pairs of words (bf16x2: OR into the
mantissa of 128.0, subtract 136, multiply by the scale), exact up to the single bf16 rounding of
``q * scale``. The ``PORTABLE`` path (``TRITON_INTERPRET=1``, CPU, pre-Ampere) computes
``q * scale`` in fp32 and dots in fp32 instead.

Accuracy (fp32 accumulation everywhere): bf16 weights after scaling, bf16 ``h``, bf16 per-slot
outputs ``y`` and a bf16 result; the same rounding points as SGLang's Marlin and Triton paths.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._device import arrival_counters, portable
from .moe_config import (  # noqa: F401  (names re-exported for tests and scripts)
    _CONFIG_PATH, GemmConfig, MoeConfig, _config_table, _fit, _fitted, _split_candidates,
    check_config_table, live_grid, live_split, select_config,
)
from .moe_align import (  # noqa: F401  (step 1; names re-exported for tests and scripts)
    ALIGN_ENV, ALIGN_WARPS, ALIGN_WARPS_ENV, PACK_FACTOR, PROLOGUE_ENV, _PACK,
    _align_count_kernel, _align_place_kernel, _align_small_kernel, _env_ints, _plane_major_cols,
    _prologue_kernel, max_padded_rows, moe_align,
)

GROUP_SIZE = 32  # input rows per scale
# The same number as a Triton global (kernels may only read constexpr globals).
_GROUP = tl.constexpr(GROUP_SIZE)


# --------------------------------------------------------------------------------------------
# shared pieces: nibble planes of a packed weight tile and the matching activation planes
# --------------------------------------------------------------------------------------------
def _dequant_ptx(first_byte: int = 0, n_bytes: int = 4) -> str:
    """PTX for two packed words and their scales (bf16x2) -> ``2 * n_bytes`` bf16x2 planes.

    Outputs come first (``$0 .. $(2 n_bytes - 1)``), then the words and the scales. Output ``$i`` =
    (nibble ``j`` of word 0, nibble ``j`` of word 1) with ``j = 2 * first_byte + i``, the pair order
    of bf16 MMA operands. Byte t of both words goes into the two halves of one register (prmt); then
    ``0x4300 | n`` is bf16 ``128 + n``, minus 136 is ``n - 8 = q`` exactly, and the multiply by the
    scales rounds once, like ``(q * s).to(bf16)``. ``lop3`` with 0xEA computes ``(a & b) | c``.
    """
    n_out = 2 * n_bytes
    w0, w1, sc = f"${n_out}", f"${n_out + 1}", f"${n_out + 2}"
    lines = [".reg .b32 d, t, m, k, one, bias, nz;", "mov.b32 m, 0x000F000F;",
             "mov.b32 k, 0x43004300;", "mov.b32 one, 0x3F803F80;", "mov.b32 bias, 0xC308C308;",
             "mov.b32 nz, 0x80008000;"]
    for i, t in enumerate(range(first_byte, first_byte + n_bytes)):
        lines.append(f"prmt.b32 d, {w0}, {w1}, 0x{0x0400 + 0x0101 * t:04X};")
        for j, src in ((2 * i, "d"), (2 * i + 1, "t")):
            if src == "t":
                lines.append("shr.u32 t, d, 4;")
            lines += [f"lop3.b32 t, {src}, m, k, 0xEA;", "fma.rn.bf16x2 t, t, one, bias;",
                      f"fma.rn.bf16x2 ${j}, t, {sc}, nz;"]
    return "{\n" + "\n".join(lines) + "\n}"


_DEQUANT_PTX = tl.constexpr(_dequant_ptx())
# The same conversion in two halves (nibbles 0-3, then 4-7): half the planes live at a time.
_DEQUANT_PTX_LO = tl.constexpr(_dequant_ptx(0, 2))
_DEQUANT_PTX_HI = tl.constexpr(_dequant_ptx(2, 2))


@triton.jit
def _block_rows(sorted_ids_ptr, pid_m, T, BLOCK_M: tl.constexpr):
    """Padded positions of expert block ``pid_m``, the pair ids there, and which are real
    (padding slots hold the sentinel ``T``)."""
    return _rows_at(sorted_ids_ptr, pid_m * BLOCK_M, T, BLOCK_M)


@triton.jit
def _rows_at(sorted_ids_ptr, row0, T, BM: tl.constexpr):
    """Padded positions ``row0 .. row0 + BM - 1``, the pair ids there, and which are real."""
    offs_m = row0 + tl.arange(0, BM)
    rows = tl.load(sorted_ids_ptr + offs_m)
    return offs_m, rows, rows < T


@triton.jit
def _narrow_level(sorted_ids_ptr, pid_m, T, BLOCK_M: tl.constexpr):
    """How far block ``pid_m`` can narrow under HALF_M: 0 runs all BLOCK_M rows, 1 the first
    half, 2 the first quarter (BLOCK_M >= 64 only; never below 16 rows, 8 with BLOCK_M 16). An
    expert's real rows come before its padding (moe_align), so a half or quarter holds them all
    when the row just past it is padding. Fewer rows, narrower MMAs; more rows in one tile, each
    weight tile dequantized once for all of them."""
    row0 = pid_m * BLOCK_M
    level = tl.where(tl.load(sorted_ids_ptr + row0 + BLOCK_M // 2) < T, 0, 1)
    if BLOCK_M >= 64:
        quarter = tl.load(sorted_ids_ptr + row0 + BLOCK_M // 4) >= T
        level = tl.where((level == 1) & quarter, 2, level)
    return level


@triton.jit
def _dequant8(w, s, PORTABLE: tl.constexpr):
    """Packed int32 tile + bf16 scale tile (same shape) -> 8 planes, plane j = q_j * s."""
    if not PORTABLE:
        return tl.inline_asm_elementwise(
            _DEQUANT_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [w, s], dtype=(tl.bfloat16,) * 8,
            is_pure=True, pack=2)
    else:
        # fp32 planes: exact q * s (the interpreter's fp32 -> bf16 cast truncates instead of rounding).
        sf = s.to(tl.float32)
        return (((((w >> 0) & 15) - 8).to(tl.float32) * sf),
                ((((w >> 4) & 15) - 8).to(tl.float32) * sf),
                ((((w >> 8) & 15) - 8).to(tl.float32) * sf),
                ((((w >> 12) & 15) - 8).to(tl.float32) * sf),
                ((((w >> 16) & 15) - 8).to(tl.float32) * sf),
                ((((w >> 20) & 15) - 8).to(tl.float32) * sf),
                ((((w >> 24) & 15) - 8).to(tl.float32) * sf),
                ((((w >> 28) & 15) - 8).to(tl.float32) * sf))


@triton.jit
def _dequant4(w, s, HI: tl.constexpr, PORTABLE: tl.constexpr):
    """Like _dequant8 for nibbles 0-3 (``HI`` False) or 4-7 (``HI`` True) only."""
    if not PORTABLE:
        if HI:
            return tl.inline_asm_elementwise(
                _DEQUANT_PTX_HI, "=r,=r,=r,=r,r,r,r", [w, s], dtype=(tl.bfloat16,) * 4,
                is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(
                _DEQUANT_PTX_LO, "=r,=r,=r,=r,r,r,r", [w, s], dtype=(tl.bfloat16,) * 4,
                is_pure=True, pack=2)
    else:
        sf = s.to(tl.float32)
        sh: tl.constexpr = 16 if HI else 0
        return (((((w >> (sh + 0)) & 15) - 8).to(tl.float32) * sf),
                ((((w >> (sh + 4)) & 15) - 8).to(tl.float32) * sf),
                ((((w >> (sh + 8)) & 15) - 8).to(tl.float32) * sf),
                ((((w >> (sh + 12)) & 15) - 8).to(tl.float32) * sf))


@triton.jit
def _dot(w, a, acc, PORTABLE: tl.constexpr):
    if PORTABLE:
        # The interpreter's bf16 dot is wrong (triton 3.6 + numpy 2.4): use fp32 operands (the bf16
        # activations exactly) and "ieee" products.
        return tl.dot(w, a.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(w, a, acc)


@triton.jit
def _plane(acc, acc2, w, w2, a_ptrs, a_mask, TWO: tl.constexpr, PORTABLE: tl.constexpr):
    """One nibble plane: load its [KP, BM] activations once, feed one or two dots."""
    a = tl.load(a_ptrs, mask=a_mask, other=0.0)
    acc = _dot(w, a, acc, PORTABLE)
    if TWO:
        acc2 = _dot(w2, a, acc2, PORTABLE)
    return acc, acc2


@triton.jit
def _mma8(acc, acc2, w, s, w2, s2, a_ptrs, a_mask, KP: tl.constexpr, TWO: tl.constexpr,
          PORTABLE: tl.constexpr, SPLIT_DQ: tl.constexpr = False):
    """acc[BN, BM] += W_tile^T @ A_tile over one K tile of 8 * KP input rows (acc2 with W2).

    ``w``/``s``: [BN, KP] packed words and their scales; ``a_ptrs``: [KP, BM] pointers to the
    plane-major activation tile, plane j at ``a_ptrs + j * KP`` (input column ``8 r + j``, the
    rows nibble j of word r holds). With ``TWO`` (gate and up) a second weight tile shares the
    activation loads.
    """
    if SPLIT_DQ:
        # Halves: planes 0-3 of both tiles, their dots, then 4-7 (fewer planes live at once).
        p0, p1, p2, p3 = _dequant4(w, s, False, PORTABLE)
        q0, q1, q2, q3 = p0, p1, p2, p3
        if TWO:
            q0, q1, q2, q3 = _dequant4(w2, s2, False, PORTABLE)
        acc, acc2 = _plane(acc, acc2, p0, q0, a_ptrs + 0 * KP, a_mask, TWO, PORTABLE)
        acc, acc2 = _plane(acc, acc2, p1, q1, a_ptrs + 1 * KP, a_mask, TWO, PORTABLE)
        acc, acc2 = _plane(acc, acc2, p2, q2, a_ptrs + 2 * KP, a_mask, TWO, PORTABLE)
        acc, acc2 = _plane(acc, acc2, p3, q3, a_ptrs + 3 * KP, a_mask, TWO, PORTABLE)
        p4, p5, p6, p7 = _dequant4(w, s, True, PORTABLE)
        q4, q5, q6, q7 = p4, p5, p6, p7
        if TWO:
            q4, q5, q6, q7 = _dequant4(w2, s2, True, PORTABLE)
        acc, acc2 = _plane(acc, acc2, p4, q4, a_ptrs + 4 * KP, a_mask, TWO, PORTABLE)
        acc, acc2 = _plane(acc, acc2, p5, q5, a_ptrs + 5 * KP, a_mask, TWO, PORTABLE)
        acc, acc2 = _plane(acc, acc2, p6, q6, a_ptrs + 6 * KP, a_mask, TWO, PORTABLE)
        acc, acc2 = _plane(acc, acc2, p7, q7, a_ptrs + 7 * KP, a_mask, TWO, PORTABLE)
        return acc, acc2
    p0, p1, p2, p3, p4, p5, p6, p7 = _dequant8(w, s, PORTABLE)
    q0, q1, q2, q3, q4, q5, q6, q7 = p0, p1, p2, p3, p4, p5, p6, p7
    if TWO:
        q0, q1, q2, q3, q4, q5, q6, q7 = _dequant8(w2, s2, PORTABLE)
    acc, acc2 = _plane(acc, acc2, p0, q0, a_ptrs + 0 * KP, a_mask, TWO, PORTABLE)
    acc, acc2 = _plane(acc, acc2, p1, q1, a_ptrs + 1 * KP, a_mask, TWO, PORTABLE)
    acc, acc2 = _plane(acc, acc2, p2, q2, a_ptrs + 2 * KP, a_mask, TWO, PORTABLE)
    acc, acc2 = _plane(acc, acc2, p3, q3, a_ptrs + 3 * KP, a_mask, TWO, PORTABLE)
    acc, acc2 = _plane(acc, acc2, p4, q4, a_ptrs + 4 * KP, a_mask, TWO, PORTABLE)
    acc, acc2 = _plane(acc, acc2, p5, q5, a_ptrs + 5 * KP, a_mask, TWO, PORTABLE)
    acc, acc2 = _plane(acc, acc2, p6, q6, a_ptrs + 6 * KP, a_mask, TWO, PORTABLE)
    acc, acc2 = _plane(acc, acc2, p7, q7, a_ptrs + 7 * KP, a_mask, TWO, PORTABLE)
    return acc, acc2


# --------------------------------------------------------------------------------------------
# 2. gate-up GEMM + SiLU-and-multiply
# --------------------------------------------------------------------------------------------
@triton.jit
def _live_split(block_expert_ptr, max_blocks, NUM_N: tl.constexpr, KS: tl.constexpr,
                SPLIT_K: tl.constexpr, SPLIT_TARGET: tl.constexpr):
    """The K split of this call under a live split: the smallest divisor ``c`` of the ``KS``
    K steps, ``c <= SPLIT_K``, that gives the used blocks' tiles at least ``SPLIT_TARGET``
    programs (``SPLIT_K`` where none does). Every program of a launch reads the same count
    (moe_align's), so all agree; a call whose tokens share few experts gets more programs per
    tile, one that touches many gets fewer (no partial sums at split 1). Returns the split and
    the used tiles (used blocks x ``NUM_N``)."""
    live = tl.load(block_expert_ptr + max_blocks) * NUM_N
    s = tl.full([], SPLIT_K, tl.int32)
    for c in tl.static_range(SPLIT_K - 1, 0, -1):  # descending: the last match is the smallest
        if KS % c == 0:
            s = tl.where(live * c >= SPLIT_TARGET, c, s)
    return s, live


@triton.jit
def _max_blocks(T, NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr):
    """moe_align's block count bound (``max_padded_rows // BLOCK_M``) on the device: where its
    used-block count lies in ``block_expert``."""
    return (T + tl.minimum(T, NUM_EXPERTS) * (BLOCK_M - 1) + BLOCK_M - 1) // BLOCK_M


@triton.jit
def _gate_up_kernel(
    xp_ptr,  # [M, K] bf16, plane-major for BLOCK_K tiles (see _prologue_kernel)
    w_ptr,  # [E, K // 8, 2 * I] int32 (gate columns [0, I), up columns [I, 2I))
    s_ptr,  # [E, K // 32, 2 * I] bf16
    sorted_ids_ptr,  # [max_padded] int32
    block_expert_ptr,  # [max_blocks + 1] int32 (see _prologue_kernel)
    h_ptr,  # [max_padded, I] bf16 out, row = padded position, plane-major for DOWN_BLOCK_K tiles
    part_ptr,  # SPLIT_K > 1: [SPLIT_K, part_rows, 2 I] fp32 out (gate then up partial sums)
    cnt_ptr,  # SERIAL: [>= max_blocks * I // BLOCK_N] int32, zero between launches (self-rearming)
    T,
    part_rows,  # rows of a split's partial-sum slice (padded positions; see fused_moe_w4a16)
    K: tl.constexpr,
    I: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOWN_BLOCK_K: tl.constexpr,
    PORTABLE: tl.constexpr,  # no inline PTX, fp32 dots: interpreter / any device
    SPLIT_DQ: tl.constexpr = False,  # dequantize nibbles 0-3, then 4-7 (fewer live registers)
    SPLIT_K: tl.constexpr = 1,  # > 1: programs sum K / SPLIT_K rows each into part_ptr
    HALF_M: tl.constexpr = False,  # a block with no real row in its second half: BLOCK_M / 2 rows
    SERIAL: tl.constexpr = False,  # SPLIT_K > 1: a tile's last program sums its partials (no reduce kernel)
    SPLIT_TARGET: tl.constexpr = 0,  # > 0 (SPLIT_K > 1): the split per call, see _live_split
    NUM_EXPERTS: tl.constexpr = 0,  # (SPLIT_TARGET) experts, for moe_align's block count
):
    NUM_N: tl.constexpr = I // BLOCK_N
    pid = tl.program_id(0)
    if SPLIT_TARGET > 0:
        # The used tiles' programs first, n_split per tile (the used blocks lead block_expert),
        # whatever the split: the grid (live_grid) holds the most any call can need, and
        # programs past this call's leave at once. max_blocks as moe_align sized it.
        n_split, live = _live_split(block_expert_ptr, _max_blocks(T, NUM_EXPERTS, BLOCK_M), NUM_N,
                                    K // BLOCK_K, SPLIT_K, SPLIT_TARGET)
        if pid >= live * n_split:
            return
        pid_k = pid % n_split
        pid_mn = pid // n_split
    else:
        pid_k = pid % SPLIT_K
        pid_mn = pid // SPLIT_K
        n_split = SPLIT_K
    pid_m = pid_mn // NUM_N
    pid_n = pid_mn % NUM_N
    e = tl.load(block_expert_ptr + pid_m)
    level = 0  # all BLOCK_M rows
    if HALF_M:  # loaded beside e, not after it (in bounds for unused blocks too)
        level = _narrow_level(sorted_ids_ptr, pid_m, T, BLOCK_M)
    if e < 0:
        return
    row0 = pid_m * BLOCK_M
    if HALF_M:
        if level == 0:
            _gate_up_rows(xp_ptr, w_ptr, s_ptr, sorted_ids_ptr, h_ptr, part_ptr, T, part_rows,
                          e, row0, pid_n, pid_k, K, I, TOPK, BLOCK_M, BLOCK_N, BLOCK_K,
                          DOWN_BLOCK_K, PORTABLE, SPLIT_DQ, SPLIT_K, cnt_ptr, pid_mn, SERIAL,
                          n_split)
        elif BLOCK_M >= 64:
            if level == 1:
                _gate_up_rows(xp_ptr, w_ptr, s_ptr, sorted_ids_ptr, h_ptr, part_ptr, T, part_rows,
                              e, row0, pid_n, pid_k, K, I, TOPK, BLOCK_M // 2, BLOCK_N, BLOCK_K,
                              DOWN_BLOCK_K, PORTABLE, SPLIT_DQ, SPLIT_K, cnt_ptr, pid_mn, SERIAL,
                              n_split)
            else:
                _gate_up_rows(xp_ptr, w_ptr, s_ptr, sorted_ids_ptr, h_ptr, part_ptr, T, part_rows,
                              e, row0, pid_n, pid_k, K, I, TOPK, BLOCK_M // 4, BLOCK_N, BLOCK_K,
                              DOWN_BLOCK_K, PORTABLE, SPLIT_DQ, SPLIT_K, cnt_ptr, pid_mn, SERIAL,
                              n_split)
        else:
            _gate_up_rows(xp_ptr, w_ptr, s_ptr, sorted_ids_ptr, h_ptr, part_ptr, T, part_rows,
                          e, row0, pid_n, pid_k, K, I, TOPK, BLOCK_M // 2, BLOCK_N, BLOCK_K,
                          DOWN_BLOCK_K, PORTABLE, SPLIT_DQ, SPLIT_K, cnt_ptr, pid_mn, SERIAL,
                          n_split)
    else:
        _gate_up_rows(xp_ptr, w_ptr, s_ptr, sorted_ids_ptr, h_ptr, part_ptr, T, part_rows, e,
                      row0, pid_n, pid_k, K, I, TOPK, BLOCK_M, BLOCK_N, BLOCK_K, DOWN_BLOCK_K,
                      PORTABLE, SPLIT_DQ, SPLIT_K, cnt_ptr, pid_mn, SERIAL, n_split)


@triton.jit
def _gate_up_rows(xp_ptr, w_ptr, s_ptr, sorted_ids_ptr, h_ptr, part_ptr, T, part_rows, e, row0,
                  pid_n, pid_k, K: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr,
                  BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOWN_BLOCK_K: tl.constexpr, PORTABLE: tl.constexpr, SPLIT_DQ: tl.constexpr,
                  SPLIT_K: tl.constexpr, cnt_ptr, tile, SERIAL: tl.constexpr, n_split):
    """The gate-up tile of padded rows ``row0 .. row0 + BM - 1`` (expert ``e``), output columns
    ``pid_n``'s (``BLOCK_N`` wide, of gate and of up), K range ``pid_k``'s of ``n_split``
    (``SPLIT_K`` itself, or this call's live split, at most ``SPLIT_K``); ``tile`` indexes its
    counter under ``SERIAL``."""
    KP: tl.constexpr = BLOCK_K // _PACK
    N2: tl.constexpr = 2 * I
    K_STEPS = K // BLOCK_K // n_split
    offs_m, rows, row_ok = _rows_at(sorted_ids_ptr, row0, T, BM)
    tok = tl.where(row_ok, rows // TOPK, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, KP)
    e64 = e.to(tl.int64)
    # [BLOCK_N, KP] views of the packed gate tile and its scales (4 packed rows share a scale).
    k0 = pid_k * (K_STEPS * BLOCK_K)  # first input row of this program's K range
    w_ptrs = (w_ptr + e64 * (K // _PACK * N2) + (k0 // _PACK + offs_r[None, :]) * N2
              + offs_n[:, None])
    s_ptrs = (s_ptr + e64 * (K // _GROUP * N2) + (k0 // _GROUP + offs_r[None, :] // 4) * N2
              + offs_n[:, None])
    x_ptrs = xp_ptr + tok[None, :] * K + k0 + offs_r[:, None]  # [KP, BM], plane 0
    x_mask = row_ok[None, :]
    acc_g = tl.zeros([BLOCK_N, BM], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BM], dtype=tl.float32)
    if PORTABLE:
        # the interpreter cannot range() over a loaded bound (a live split): a while loop
        i = 0
        while i < K_STEPS:
            acc_g, acc_u = _mma8(acc_g, acc_u, tl.load(w_ptrs), tl.load(s_ptrs),
                                 tl.load(w_ptrs + I), tl.load(s_ptrs + I), x_ptrs, x_mask, KP,
                                 True, PORTABLE, SPLIT_DQ)
            x_ptrs += BLOCK_K
            w_ptrs += KP * N2
            s_ptrs += (BLOCK_K // _GROUP) * N2
            i += 1
    else:
        for _ in range(0, K_STEPS):
            acc_g, acc_u = _mma8(acc_g, acc_u, tl.load(w_ptrs), tl.load(s_ptrs),
                                 tl.load(w_ptrs + I), tl.load(s_ptrs + I), x_ptrs, x_mask, KP,
                                 True, PORTABLE, SPLIT_DQ)
            x_ptrs += BLOCK_K
            w_ptrs += KP * N2
            s_ptrs += (BLOCK_K // _GROUP) * N2
    if SPLIT_K > 1 and n_split > 1:
        # Partial sums of the real rows; _gate_up_reduce_kernel adds them in fixed order.
        p_ptrs = (part_ptr + (pid_k.to(tl.int64) * part_rows + offs_m[None, :]) * N2
                  + offs_n[:, None])
        tl.store(p_ptrs, acc_g, mask=x_mask)
        tl.store(p_ptrs + I, acc_u, mask=x_mask)
        if SERIAL:
            # Serial split-K fix-up: the tile's programs count themselves in; the last to arrive
            # adds every partial (its own re-read too) in split order, so the sum does not depend
            # on which program is last and matches _gate_up_reduce_kernel bit for bit, then
            # writes h and re-arms the counter for the next launch. The barrier puts every
            # thread's partial stores before the counter's release; the acquire and the L2-only
            # loads (.cg) let the last program see the other programs' partials.
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == n_split - 1:
                g = tl.zeros([BLOCK_N, BM], dtype=tl.float32)
                u = tl.zeros([BLOCK_N, BM], dtype=tl.float32)
                for k in tl.static_range(SPLIT_K):
                    if k < n_split:  # the live split's partials only, in split order
                        q_ptrs = (part_ptr + (k * part_rows + offs_m[None, :]).to(tl.int64) * N2
                                  + offs_n[:, None])
                        g += tl.load(q_ptrs, mask=x_mask, other=0.0, cache_modifier=".cg")
                        u += tl.load(q_ptrs + I, mask=x_mask, other=0.0, cache_modifier=".cg")
                _gate_up_store(g, u, h_ptr, offs_m, offs_n, I, DOWN_BLOCK_K)
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        _gate_up_store(acc_g, acc_u, h_ptr, offs_m, offs_n, I, DOWN_BLOCK_K)


@triton.jit
def _gate_up_store(acc_g, acc_u, h_ptr, offs_m, offs_n, I: tl.constexpr,
                   DOWN_BLOCK_K: tl.constexpr):
    """h = silu(gate) * up (fp32) for a [BLOCK_N, BM] tile, stored plane-major (all BM rows)."""
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    h_cols = _plane_major_cols(offs_n, DOWN_BLOCK_K)
    h_ptrs = h_ptr + offs_m[None, :].to(tl.int64) * I + h_cols[:, None]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty))


@triton.jit
def _gate_up_reduce_kernel(
    part_ptr,  # [SPLIT_K, part_rows, 2 I] fp32 partial sums (real rows written)
    sorted_ids_ptr,  # [max_padded] int32
    block_expert_ptr,  # [max_blocks + 1] int32 (see _prologue_kernel)
    h_ptr,  # [max_padded, I] bf16 out, plane-major for DOWN_BLOCK_K tiles
    T,
    part_rows,
    I: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    DOWN_BLOCK_K: tl.constexpr,
    SPLIT_TARGET: tl.constexpr = 0,  # the gate-up's live split (see _live_split)
    NUM_N: tl.constexpr = 1,  # (SPLIT_TARGET) the gate-up's column tiles ...
    KS: tl.constexpr = 1,  # ... and K steps
):
    """Split-K gate-up epilogue: sum the partials in fixed order, then SiLU(gate) * up -> h."""
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    n_split = SPLIT_K
    if SPLIT_TARGET > 0:
        n_split, _ = _live_split(block_expert_ptr, tl.num_programs(0), NUM_N, KS, SPLIT_K,
                                 SPLIT_TARGET)
        if n_split == 1:  # the gate-up wrote h itself
            return
    offs_m, rows, row_ok = _block_rows(sorted_ids_ptr, pid_m, T, BLOCK_M)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = row_ok[:, None]
    g = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    u = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for k in tl.static_range(SPLIT_K):
        if k < n_split:
            p_ptrs = (part_ptr + (k * part_rows + offs_m[:, None]).to(tl.int64) * (2 * I)
                      + offs_c[None, :])
            g += tl.load(p_ptrs, mask=mask, other=0.0)
            u += tl.load(p_ptrs + I, mask=mask, other=0.0)
    h = g / (1.0 + tl.exp(-g)) * u
    h_cols = _plane_major_cols(offs_c, DOWN_BLOCK_K)
    tl.store(h_ptr + offs_m[:, None].to(tl.int64) * I + h_cols[None, :],
             h.to(h_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# 3. down GEMM (times the routing weight)
# --------------------------------------------------------------------------------------------
@triton.jit
def _down_kernel(
    h_ptr,  # [max_padded, I] bf16, plane-major for BLOCK_K tiles
    w_ptr,  # [E, I // 8, N] int32
    s_ptr,  # [E, I // 32, N] bf16
    sorted_ids_ptr,  # [max_padded] int32
    block_expert_ptr,  # [max_blocks + 1] int32 (see _prologue_kernel)
    topk_w_ptr,  # [T] fp32/bf16 routing weight of pair t
    y_ptr,  # [T, N] bf16 out, row = pair id
    T,
    N: tl.constexpr,
    I: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PORTABLE: tl.constexpr,  # no inline PTX, fp32 dots: interpreter / any device
    HALF_M: tl.constexpr = False,  # as _gate_up_kernel's
):
    NUM_N: tl.constexpr = N // BLOCK_N
    pid = tl.program_id(0)
    pid_m = pid // NUM_N
    pid_n = pid % NUM_N
    e = tl.load(block_expert_ptr + pid_m)
    level = 0  # all BLOCK_M rows
    if HALF_M:  # loaded beside e, not after it (in bounds for unused blocks too)
        level = _narrow_level(sorted_ids_ptr, pid_m, T, BLOCK_M)
    if e < 0:
        return
    _down_blocks(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, level,
                 pid_m * BLOCK_M, pid_n, 0, N, I, BLOCK_M, BLOCK_N, BLOCK_K, 0, PORTABLE, HALF_M)


@triton.jit
def _down_blocks(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, level, row0,
                 pid_nc, tiles, N: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, N_PER_CTA: tl.constexpr,
                 PORTABLE: tl.constexpr, HALF_M: tl.constexpr):
    """Both down kernels' work for one expert block, at the width ``level`` picks under HALF_M
    (_narrow_level): the looped kernel's (N_PER_CTA > 0, ``pid_nc`` its column range of
    ``tiles`` BLOCK_N steps) or the per-tile one's (``pid_nc`` its column tile)."""
    if HALF_M:
        if level == 0:
            _down_width(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, row0,
                        pid_nc, tiles, N, I, BLOCK_M, BLOCK_N, BLOCK_K, N_PER_CTA, PORTABLE)
        elif BLOCK_M >= 64:
            if level == 1:
                _down_width(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, row0,
                            pid_nc, tiles, N, I, BLOCK_M // 2, BLOCK_N, BLOCK_K, N_PER_CTA,
                            PORTABLE)
            else:
                _down_width(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, row0,
                            pid_nc, tiles, N, I, BLOCK_M // 4, BLOCK_N, BLOCK_K, N_PER_CTA,
                            PORTABLE)
        else:
            _down_width(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, row0,
                        pid_nc, tiles, N, I, BLOCK_M // 2, BLOCK_N, BLOCK_K, N_PER_CTA, PORTABLE)
    else:
        _down_width(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, row0, pid_nc,
                    tiles, N, I, BLOCK_M, BLOCK_N, BLOCK_K, N_PER_CTA, PORTABLE)


@triton.jit
def _down_width(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, row0, pid_nc,
                tiles, N: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, N_PER_CTA: tl.constexpr, PORTABLE: tl.constexpr):
    if N_PER_CTA > 0:
        _down_loop_rows(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, row0,
                        pid_nc, tiles, N, I, BM, BLOCK_N, PORTABLE)
    else:
        _down_rows(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, row0, pid_nc,
                   N, I, BM, BLOCK_N, BLOCK_K, PORTABLE)


@triton.jit
def _down_rows(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, row0, pid_n,
               N: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, PORTABLE: tl.constexpr):
    """The down tile of padded rows ``row0 .. row0 + BM - 1`` (expert ``e``), columns
    ``pid_n``'s, times the routing weights, into y by pair id."""
    KP: tl.constexpr = BLOCK_K // _PACK
    offs_m, rows, row_ok = _rows_at(sorted_ids_ptr, row0, T, BM)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, KP)
    e64 = e.to(tl.int64)
    w_ptrs = w_ptr + e64 * (I // _PACK * N) + offs_r[None, :] * N + offs_n[:, None]
    s_ptrs = s_ptr + e64 * (I // _GROUP * N) + (offs_r[None, :] // 4) * N + offs_n[:, None]
    h_ptrs = h_ptr + offs_m[None, :].to(tl.int64) * I + offs_r[:, None]
    acc = tl.zeros([BLOCK_N, BM], dtype=tl.float32)
    for _ in range(0, I // BLOCK_K):
        w = tl.load(w_ptrs)
        acc, unused = _mma8(acc, acc, w, tl.load(s_ptrs), w, w, h_ptrs, row_ok[None, :], KP,
                            False, PORTABLE)
        h_ptrs += BLOCK_K
        w_ptrs += KP * N
        s_ptrs += (BLOCK_K // _GROUP) * N
    wt = tl.load(topk_w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    y = acc * wt[None, :]
    y_ptrs = y_ptr + rows[None, :].to(tl.int64) * N + offs_n[:, None]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=row_ok[None, :])


@triton.jit
def _down_loop_kernel(
    h_ptr,  # [max_padded, I] bf16, plane-major for one BLOCK_K = I tile
    w_ptr,  # [E, I // 8, N] int32
    s_ptr,  # [E, I // 32, N] bf16
    sorted_ids_ptr,  # [max_padded] int32
    block_expert_ptr,  # [max_blocks + 1] int32 (see _prologue_kernel)
    topk_w_ptr,  # [T] fp32/bf16 routing weight of pair t
    y_ptr,  # [T, N] bf16 out, row = pair id
    T,
    N: tl.constexpr,
    I: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_PER_CTA: tl.constexpr,  # output columns per program, a multiple of BLOCK_N
    PORTABLE: tl.constexpr,
    HALF_M: tl.constexpr = False,  # as _gate_up_kernel's
    NUM_EXPERTS: tl.constexpr = 0,  # (SPLIT_TARGET) experts, for moe_align's block count
    SPLIT_TARGET: tl.constexpr = 0,  # > 0: column ranges per call (GemmConfig.split_target)
):
    """Down GEMM for a small intermediate size (the whole K = I in one tile).

    ``_down_kernel`` gives every program one [BLOCK_N, I] weight tile: with I = 256 that is a
    single K step (~4 KB), so a program is mostly its start-up latency (block expert, then row
    ids, then weights) and nothing overlaps inside it. Here a program loads the expert block's
    activation planes once and then walks ``N_PER_CTA`` output columns in BLOCK_N steps: a loop
    whose weight loads the compiler pipelines (``num_stages``), one long stream per program.
    With SPLIT_TARGET > 0 the column range is chosen per call on the GPU, as the gate-up's live
    split chooses its K split (_live_split, from moe_align's used-block count): each
    N_PER_CTA range splits into the smallest number ``f`` of parts (a divisor of its BLOCK_N
    steps) that gives the used blocks at least SPLIT_TARGET programs, so a call whose tokens
    share few experts streams its weights from more programs of shorter ranges (the
    launch's grid, ``live_grid``, holds the most any call can need; the surplus leaves).
    """
    NUM_S: tl.constexpr = N // N_PER_CTA
    TILES: tl.constexpr = N_PER_CTA // BLOCK_N  # BLOCK_N steps of a column range
    pid = tl.program_id(0)
    if SPLIT_TARGET > 0:
        parts, live = _live_split(block_expert_ptr, _max_blocks(T, NUM_EXPERTS, BLOCK_M), NUM_S,
                                  TILES, TILES, SPLIT_TARGET)
        if pid >= live * parts:
            return
        pid_m = pid // (NUM_S * parts)
        pid_s = pid % (NUM_S * parts)
        tiles = TILES // parts
    else:
        pid_m = pid // NUM_S
        pid_s = pid % NUM_S
        tiles = TILES
    e = tl.load(block_expert_ptr + pid_m)
    level = 0  # all BLOCK_M rows
    if HALF_M:  # loaded beside e, not after it (in bounds for unused blocks too)
        level = _narrow_level(sorted_ids_ptr, pid_m, T, BLOCK_M)
    if e < 0:
        return
    _down_blocks(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, level,
                 pid_m * BLOCK_M, pid_s, tiles, N, I, BLOCK_M, BLOCK_N, I, N_PER_CTA,
                 PORTABLE, HALF_M)


@triton.jit
def _down_loop_rows(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, row0, pid_s,
                    tiles, N: tl.constexpr, I: tl.constexpr, BM: tl.constexpr,
                    BLOCK_N: tl.constexpr, PORTABLE: tl.constexpr):
    """_down_loop_kernel's work for padded rows ``row0 .. row0 + BM - 1`` (expert ``e``):
    column range ``pid_s`` of ``tiles`` BLOCK_N steps (a constant unless the range is live)."""
    KP: tl.constexpr = I // _PACK
    offs_m, rows, row_ok = _rows_at(sorted_ids_ptr, row0, T, BM)
    offs_r = tl.arange(0, KP)
    h_ptrs = h_ptr + offs_m[None, :].to(tl.int64) * I + offs_r[:, None]  # [KP, BM], plane 0
    a_mask = row_ok[None, :]
    a0 = tl.load(h_ptrs + 0 * KP, mask=a_mask, other=0.0)
    a1 = tl.load(h_ptrs + 1 * KP, mask=a_mask, other=0.0)
    a2 = tl.load(h_ptrs + 2 * KP, mask=a_mask, other=0.0)
    a3 = tl.load(h_ptrs + 3 * KP, mask=a_mask, other=0.0)
    a4 = tl.load(h_ptrs + 4 * KP, mask=a_mask, other=0.0)
    a5 = tl.load(h_ptrs + 5 * KP, mask=a_mask, other=0.0)
    a6 = tl.load(h_ptrs + 6 * KP, mask=a_mask, other=0.0)
    a7 = tl.load(h_ptrs + 7 * KP, mask=a_mask, other=0.0)
    wt = tl.load(topk_w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    e64 = e.to(tl.int64)
    offs_n = pid_s * (tiles * BLOCK_N) + tl.arange(0, BLOCK_N)
    w_ptrs = w_ptr + e64 * (KP * N) + offs_r[None, :] * N + offs_n[:, None]
    s_ptrs = s_ptr + e64 * (I // _GROUP * N) + (offs_r[None, :] // 4) * N + offs_n[:, None]
    y_ptrs = y_ptr + rows[None, :].to(tl.int64) * N + offs_n[:, None]
    if PORTABLE:
        # the interpreter cannot range() over a loaded bound (a live range): a while loop
        i = 0
        while i < tiles:
            _down_step(w_ptrs, s_ptrs, y_ptrs, a0, a1, a2, a3, a4, a5, a6, a7, wt, a_mask, BM,
                       BLOCK_N, PORTABLE)
            w_ptrs += BLOCK_N
            s_ptrs += BLOCK_N
            y_ptrs += BLOCK_N
            i += 1
    else:
        for _ in range(tiles):
            _down_step(w_ptrs, s_ptrs, y_ptrs, a0, a1, a2, a3, a4, a5, a6, a7, wt, a_mask, BM,
                       BLOCK_N, PORTABLE)
            w_ptrs += BLOCK_N
            s_ptrs += BLOCK_N
            y_ptrs += BLOCK_N


@triton.jit
def _down_step(w_ptrs, s_ptrs, y_ptrs, a0, a1, a2, a3, a4, a5, a6, a7, wt, a_mask,
               BM: tl.constexpr, BLOCK_N: tl.constexpr, PORTABLE: tl.constexpr):
    """One BLOCK_N step of _down_loop_rows: dequantize the [BLOCK_N, I] weight tile, its eight
    nibble-plane dots with the block's activation planes, the routing weights, y's store."""
    p0, p1, p2, p3, p4, p5, p6, p7 = _dequant8(tl.load(w_ptrs), tl.load(s_ptrs), PORTABLE)
    acc = tl.zeros([BLOCK_N, BM], dtype=tl.float32)
    acc = _dot(p0, a0, acc, PORTABLE)
    acc = _dot(p1, a1, acc, PORTABLE)
    acc = _dot(p2, a2, acc, PORTABLE)
    acc = _dot(p3, a3, acc, PORTABLE)
    acc = _dot(p4, a4, acc, PORTABLE)
    acc = _dot(p5, a5, acc, PORTABLE)
    acc = _dot(p6, a6, acc, PORTABLE)
    acc = _dot(p7, a7, acc, PORTABLE)
    tl.store(y_ptrs, (acc * wt[None, :]).to(y_ptrs.dtype.element_ty), mask=a_mask)


# --------------------------------------------------------------------------------------------
# 4. weighted top-k combine
# --------------------------------------------------------------------------------------------
@triton.jit
def _combine_kernel(
    y_ptr,  # [M * TOPK, N] bf16
    topk_ids_ptr,  # [M * TOPK] int32/int64: slots with ids outside [0, E) have no y row
    out_ptr,  # [M, N] bf16, row stride stride_om
    scale,
    stride_om,
    N: tl.constexpr,
    TOPK: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = offs < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(TOPK):  # fixed order: deterministic sum
        e = tl.load(topk_ids_ptr + m * TOPK + k)
        live = ok & (e >= 0) & (e < NUM_EXPERTS)
        acc += tl.load(y_ptr + (m * TOPK + k) * N + offs, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs, (acc * scale).to(out_ptr.dtype.element_ty), mask=ok)


# The combine launch's shape: (columns per program, warps). On the H200 (session 39,
# bench_results/fused_moe_combine_shapes_h200_s39.json) 512 columns and 4 warps were the fastest
# or within 1 % of it at every M from 1 to 2,048 (1,024 / 4 before: 0.1-0.4 us more a call up
# to M = 64). SGLANG_DDTREE_MOE_COMBINE="block_n:num_warps" (read per call) overrides it.
COMBINE_ENV = "SGLANG_DDTREE_MOE_COMBINE"
COMBINE_DEFAULT = (512, 4)


def combine(y: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor, scale: float,
            num_experts: int, shape: tuple[int, int] | None = None) -> torch.Tensor:
    """``out[m] = scale * sum_k y[m * topk + k]`` over the slots with a valid expert id, in slot
    order (fp32), one launch (``_combine_kernel``); ``shape`` = (block_n, num_warps). Any
    shape gives the same bits."""
    m, topk = topk_ids.shape
    hidden = y.shape[1]
    if shape is None:
        env = os.environ.get(COMBINE_ENV)
        shape = _env_ints(COMBINE_ENV, env, 2, "block_n:num_warps, e.g. 512:4") if env else \
            COMBINE_DEFAULT
    block_n, warps = shape
    block_n = min(block_n, triton.next_power_of_2(hidden))
    _combine_kernel[(m, triton.cdiv(hidden, block_n))](
        y, topk_ids, out, float(scale), out.stride(0), N=hidden, TOPK=topk,
        NUM_EXPERTS=num_experts, BLOCK_N=block_n, num_warps=warps)
    return out


# --------------------------------------------------------------------------------------------
# the wrapper (configs: moe_config.py)
# --------------------------------------------------------------------------------------------
# Split-K gate-up sums its partials inside the GEMM launch (the last program of each tile, see
# _gate_up_rows) instead of in _gate_up_reduce_kernel: one launch less per MoE call. Its
# per-tile arrival counters live in one int32 buffer per device, zero between launches (each
# tile's last program re-arms its counter), allocated outside CUDA-graph capture only: a call
# captured before the buffer exists, or that needs more counters than it has, takes the reduce
# kernel instead (same result, bit for bit). Two MoE calls must not run at the same time on two
# streams of one device (SGLang runs one forward at a time). SGLANG_DDTREE_MOE_SERIAL_REDUCE=0
# (read per call) always takes the reduce kernel.
SERIAL_REDUCE_ENV = "SGLANG_DDTREE_MOE_SERIAL_REDUCE"
_MIN_COUNTERS = 1 << 16  # 256 KB: every split band of the shipped table at Kimi's shapes
_counters: dict = {}


def _tile_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """The device's arrival counters (at least ``n``), or None: use the reduce kernel."""
    if os.environ.get(SERIAL_REDUCE_ENV, "1") == "0":
        return None
    return arrival_counters(_counters, device, n, _MIN_COUNTERS)


def _check(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype | None = None) -> None:
    if tuple(t.shape) != tuple(shape) or (dtype is not None and t.dtype != dtype):
        raise ValueError(f"{name}: expected {tuple(shape)} {dtype or ''}, got {tuple(t.shape)} "
                         f"{t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


def fused_moe_w4a16(
    hidden_states: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    routed_scaling_factor: float = 1.0,
    out: torch.Tensor | None = None,
    config: MoeConfig | None = None,
    _upto: int = 4,
) -> torch.Tensor:
    """MoE forward with int4 group-32 symmetric experts; CUDA-graph safe (no host sync).

    Parameters
    ----------
    hidden_states : torch.Tensor
        ``[M, H]`` bf16 (row stride may exceed H).
    w13_packed : torch.Tensor
        ``[E, H // 8, 2 I]`` int32; gate columns ``[0, I)``, up columns ``[I, 2I)``.
    w13_scale : torch.Tensor
        ``[E, H // 32, 2 I]`` bf16.
    w2_packed : torch.Tensor
        ``[E, I // 8, H]`` int32.
    w2_scale : torch.Tensor
        ``[E, I // 32, H]`` bf16.
    topk_weights : torch.Tensor
        ``[M, topk]`` float32 (or bf16) routing weights.
    topk_ids : torch.Tensor
        ``[M, topk]`` int32 / int64 expert ids. Ids outside ``[0, E)`` (SGLang writes -1 for the
        padding tokens of a CUDA graph) contribute nothing; a token with no valid slot gets zeros.
    routed_scaling_factor : float
        Multiplies the top-k sum (as SGLang's ``moe_sum_reduce`` does).
    out : torch.Tensor, optional
        ``[M, H]`` output buffer (may alias ``hidden_states``: it is read before ``out`` is written).
    config : MoeConfig, optional
        Overrides the tuned table (``moe_w4a16_configs.json``).
    _upto : int
        Benchmark-only: launch the first ``_upto`` of the four kernels (align, gate-up, down,
        combine) and return ``out`` unwritten below 4, for per-kernel times by differences.

    Returns
    -------
    torch.Tensor
        ``[M, H]`` bf16.
    """
    m, hidden = hidden_states.shape
    num_experts = w13_packed.shape[0]
    inter = w2_packed.shape[1] * PACK_FACTOR
    topk = topk_ids.shape[1] if topk_ids.dim() == 2 else -1
    if hidden_states.dtype != torch.bfloat16 or hidden_states.stride(1) != 1:
        raise ValueError(f"hidden_states: expected bf16 with unit column stride, got "
                         f"{hidden_states.dtype} strides {hidden_states.stride()}")
    if hidden % 128 or inter % 128:
        raise ValueError(f"hidden {hidden} and intermediate {inter} must be multiples of 128")
    _check("w13_packed", w13_packed, (num_experts, hidden // 8, 2 * inter), torch.int32)
    _check("w13_scale", w13_scale, (num_experts, hidden // GROUP_SIZE, 2 * inter), torch.bfloat16)
    _check("w2_packed", w2_packed, (num_experts, inter // 8, hidden), torch.int32)
    _check("w2_scale", w2_scale, (num_experts, inter // GROUP_SIZE, hidden), torch.bfloat16)
    _check("topk_ids", topk_ids, (m, topk))
    _check("topk_weights", topk_weights, (m, topk))
    if out is None:
        out = torch.empty(m, hidden, dtype=hidden_states.dtype, device=hidden_states.device)
    elif tuple(out.shape) != (m, hidden) or out.stride(1) != 1 or out.dtype != torch.bfloat16:
        raise ValueError(f"out: expected [{m}, {hidden}] bf16, got {tuple(out.shape)} {out.dtype}")
    if m == 0:
        return out

    cfg = config or select_config(m)
    gu, dn = _fitted(cfg, hidden, inter)
    bm = cfg.block_m
    portable_path = portable(hidden_states.device)
    t = m * topk
    sorted_ids, block_expert, xp = moe_align(topk_ids, num_experts, bm, hidden_states, gu.block_k)
    if _upto < 2:
        return out
    max_padded = sorted_ids.numel()
    h = torch.empty(max_padded, inter, dtype=torch.bfloat16, device=hidden_states.device)
    y = torch.empty(t, hidden, dtype=torch.bfloat16, device=hidden_states.device)
    n_blocks = max_padded // bm

    num_n = inter // gu.block_n
    # Rows of a split's partial slice: every padded row, or under a live split only the rows of
    # calls that split at all (fewer than split_target / num_n used blocks; see _live_split).
    part_rows = max_padded if not gu.split_target else min(
        max_padded, triton.cdiv(gu.split_target, num_n) * bm)
    part = h if gu.split_k == 1 else torch.empty(
        gu.split_k, part_rows, 2 * inter, dtype=torch.float32, device=hidden_states.device)
    tiles = n_blocks * num_n
    counters = _tile_counters(hidden_states.device, tiles) if gu.split_k > 1 else None
    programs = tiles * gu.split_k if not gu.split_target else live_grid(
        tiles, hidden // gu.block_k, gu.split_k, gu.split_target)
    _gate_up_kernel[(programs,)](
        xp, w13_packed, w13_scale, sorted_ids, block_expert, h, part,
        sorted_ids if counters is None else counters, t, part_rows, K=hidden,
        I=inter, TOPK=topk, BLOCK_M=bm, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k,
        DOWN_BLOCK_K=dn.block_k, PORTABLE=portable_path, SPLIT_DQ=bool(gu.split_dq),
        SPLIT_K=gu.split_k, HALF_M=cfg.narrow_gate_up, SERIAL=counters is not None,
        SPLIT_TARGET=gu.split_target,
        NUM_EXPERTS=num_experts if gu.split_target else 0,
        num_warps=gu.num_warps, num_stages=gu.num_stages)
    if gu.split_k > 1 and counters is None:
        block_c = min(inter, 128)
        _gate_up_reduce_kernel[(n_blocks, inter // block_c)](
            part, sorted_ids, block_expert, h, t, part_rows, I=inter, SPLIT_K=gu.split_k,
            BLOCK_M=bm, BLOCK_C=block_c, DOWN_BLOCK_K=dn.block_k,
            SPLIT_TARGET=gu.split_target, NUM_N=num_n, KS=hidden // gu.block_k)
    if _upto < 3:
        return out
    if dn.n_per_cta:
        ranges = n_blocks * (hidden // dn.n_per_cta)
        steps = dn.n_per_cta // dn.block_n  # a live range splits into a divisor of its steps
        _down_loop_kernel[(ranges if not dn.split_target else live_grid(
                ranges, steps, steps, dn.split_target),)](
            h, w2_packed, w2_scale, sorted_ids, block_expert, topk_weights, y, t, N=hidden,
            I=inter, BLOCK_M=bm, BLOCK_N=dn.block_n, N_PER_CTA=dn.n_per_cta,
            PORTABLE=portable_path, HALF_M=cfg.narrow_down,
            NUM_EXPERTS=num_experts if dn.split_target else 0,
            SPLIT_TARGET=dn.split_target, num_warps=dn.num_warps, num_stages=dn.num_stages)
    else:
        _down_kernel[(n_blocks * (hidden // dn.block_n),)](
            h, w2_packed, w2_scale, sorted_ids, block_expert, topk_weights, y, t, N=hidden,
            I=inter, BLOCK_M=bm, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, PORTABLE=portable_path,
            HALF_M=cfg.narrow_down, num_warps=dn.num_warps, num_stages=dn.num_stages)
    if _upto < 4:
        return out
    return combine(y, topk_ids, out, routed_scaling_factor, num_experts)
