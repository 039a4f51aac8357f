"""Pieces both fused-MoE GEMMs (``moe_gemm.py``) are built from: the nibble-plane dequant
of a packed int4 tile (inline PTX on the GPU, fp32 in the portable path), the plane dots, an
expert block's rows, and the live choices read from the grouping's used-block count. The
layout they assume is described in ``moe_w4a16``'s docstring."""
from __future__ import annotations

import triton
import triton.language as tl

from .moe_align import _PACK

GROUP_SIZE = 32  # input rows per scale
# The same number as a Triton global (kernels may only read constexpr globals).
_GROUP = tl.constexpr(GROUP_SIZE)


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
    half, 2 the first quarter (BLOCK_M >= 32: 16 rows of 64, 8 of 32; a 16-row block narrows to
    8 at most). An expert's real rows come before its padding (moe_align), so
    a half or quarter holds them all when the row just past it is padding. Fewer rows, narrower
    MMAs; more rows in one tile, each weight tile dequantized once for all of them."""
    row0 = pid_m * BLOCK_M
    level = tl.where(tl.load(sorted_ids_ptr + row0 + BLOCK_M // 2) < T, 0, 1)
    if BLOCK_M >= 32:
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
def _planes4(acc, acc2, p0, p1, p2, p3, q0, q1, q2, q3, a_ptrs, a_mask, KP: tl.constexpr,
             TWO: tl.constexpr, PORTABLE: tl.constexpr):
    """Four consecutive nibble planes (weights p / q, activations from ``a_ptrs``), in order."""
    acc, acc2 = _plane(acc, acc2, p0, q0, a_ptrs + 0 * KP, a_mask, TWO, PORTABLE)
    acc, acc2 = _plane(acc, acc2, p1, q1, a_ptrs + 1 * KP, a_mask, TWO, PORTABLE)
    acc, acc2 = _plane(acc, acc2, p2, q2, a_ptrs + 2 * KP, a_mask, TWO, PORTABLE)
    return _plane(acc, acc2, p3, q3, a_ptrs + 3 * KP, a_mask, TWO, PORTABLE)


@triton.jit
def _mma8(acc, acc2, acc_b, acc2_b, w, s, w2, s2, a_ptrs, a_mask, KP: tl.constexpr,
          TWO: tl.constexpr, PORTABLE: tl.constexpr, SPLIT_DQ: tl.constexpr = False,
          PAR_ACC: tl.constexpr = False):
    """acc[BN, BM] += W_tile^T @ A_tile over one K tile of 8 * KP input rows (acc2 with W2).

    ``w``/``s``: [BN, KP] packed words and their scales; ``a_ptrs``: [KP, BM] pointers to the
    plane-major activation tile, plane j at ``a_ptrs + j * KP`` (input column ``8 r + j``, the
    rows nibble j of word r holds). With ``TWO`` (gate and up) a second weight tile shares the
    activation loads. With ``PAR_ACC`` planes 4-7 add into ``acc_b`` / ``acc2_b`` instead, so
    each chain of dependent MMAs on one accumulator is half as long (the caller sums the pairs
    after its K loop: another fp32 summation order); otherwise those two pass through.
    Returns ``acc, acc2, acc_b, acc2_b``.
    """
    if SPLIT_DQ:
        # Halves: planes 0-3 of both tiles, their dots, then 4-7 (fewer planes live at once).
        p0, p1, p2, p3 = _dequant4(w, s, False, PORTABLE)
        q0, q1, q2, q3 = p0, p1, p2, p3
        if TWO:
            q0, q1, q2, q3 = _dequant4(w2, s2, False, PORTABLE)
        acc, acc2 = _planes4(acc, acc2, p0, p1, p2, p3, q0, q1, q2, q3, a_ptrs, a_mask, KP, TWO,
                             PORTABLE)
        p4, p5, p6, p7 = _dequant4(w, s, True, PORTABLE)
        q4, q5, q6, q7 = p4, p5, p6, p7
        if TWO:
            q4, q5, q6, q7 = _dequant4(w2, s2, True, PORTABLE)
    else:
        p0, p1, p2, p3, p4, p5, p6, p7 = _dequant8(w, s, PORTABLE)
        q0, q1, q2, q3, q4, q5, q6, q7 = p0, p1, p2, p3, p4, p5, p6, p7
        if TWO:
            q0, q1, q2, q3, q4, q5, q6, q7 = _dequant8(w2, s2, PORTABLE)
        acc, acc2 = _planes4(acc, acc2, p0, p1, p2, p3, q0, q1, q2, q3, a_ptrs, a_mask, KP, TWO,
                             PORTABLE)
    if PAR_ACC:
        acc_b, acc2_b = _planes4(acc_b, acc2_b, p4, p5, p6, p7, q4, q5, q6, q7, a_ptrs + 4 * KP,
                                 a_mask, KP, TWO, PORTABLE)
    else:
        acc, acc2 = _planes4(acc, acc2, p4, p5, p6, p7, q4, q5, q6, q7, a_ptrs + 4 * KP, a_mask,
                             KP, TWO, PORTABLE)
    return acc, acc2, acc_b, acc2_b


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
