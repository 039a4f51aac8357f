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
    return _dot2(acc, acc2, w, w2, tl.load(a_ptrs, mask=a_mask, other=0.0), TWO, PORTABLE)


@triton.jit
def _planes4(acc, acc2, p0, p1, p2, p3, q0, q1, q2, q3, a_ptrs, a_mask, KP: tl.constexpr,
             TWO: tl.constexpr, PORTABLE: tl.constexpr, NATURAL: tl.constexpr = False):
    """Four consecutive nibble planes (weights p / q, activations from ``a_ptrs``), in order;
    with NATURAL the activations in natural order (_x_planes4; ``a_mask`` unused)."""
    if NATURAL:
        a0, a1, a2, a3 = _x_planes4(a_ptrs)
        acc, acc2 = _dots4(acc, acc2, p0, p1, p2, p3, q0, q1, q2, q3, a0, a1, a2, a3, TWO,
                           PORTABLE)
    else:
        acc, acc2 = _plane(acc, acc2, p0, q0, a_ptrs + 0 * KP, a_mask, TWO, PORTABLE)
        acc, acc2 = _plane(acc, acc2, p1, q1, a_ptrs + 1 * KP, a_mask, TWO, PORTABLE)
        acc, acc2 = _plane(acc, acc2, p2, q2, a_ptrs + 2 * KP, a_mask, TWO, PORTABLE)
        acc, acc2 = _plane(acc, acc2, p3, q3, a_ptrs + 3 * KP, a_mask, TWO, PORTABLE)
    return acc, acc2


@triton.jit
def _mma8(acc, acc2, acc_b, acc2_b, w, s, w2, s2, a_ptrs, a_mask, KP: tl.constexpr,
          TWO: tl.constexpr, PORTABLE: tl.constexpr, SPLIT_DQ: tl.constexpr = False,
          PAR_ACC: tl.constexpr = False, NATURAL: tl.constexpr = False):
    """acc[BN, BM] += W_tile^T @ A_tile over one K tile of 8 * KP input rows (acc2 with W2).

    ``w``/``s``: [BN, KP] packed words and their scales; ``a_ptrs``: [KP, BM] pointers to the
    plane-major activation tile, plane j at ``a_ptrs + j * KP`` (input column ``8 r + j``, the
    rows nibble j of word r holds). With ``TWO`` (gate and up) a second weight tile shares the
    activation loads. With ``PAR_ACC`` planes 4-7 add into ``acc_b`` / ``acc2_b`` instead, so
    each chain of dependent MMAs on one accumulator is half as long (the caller sums the pairs
    after its K loop: another fp32 summation order); otherwise those two pass through.
    With ``NATURAL`` the activations are in natural order (self-routed gate-up): ``a_ptrs``
    is [KP, BM, 4], planes 0-3 (_x_planes4), and ``a_ptrs + 4`` planes 4-7; the same planes,
    products and accumulators, so the same sums.
    Returns ``acc, acc2, acc_b, acc2_b``.
    """
    HALF2: tl.constexpr = 4 if NATURAL else 4 * KP  # where planes 4-7 start
    if SPLIT_DQ:
        # Halves: planes 0-3 of both tiles, their dots, then 4-7 (fewer planes live at once).
        p0, p1, p2, p3 = _dequant4(w, s, False, PORTABLE)
        q0, q1, q2, q3 = p0, p1, p2, p3
        if TWO:
            q0, q1, q2, q3 = _dequant4(w2, s2, False, PORTABLE)
        acc, acc2 = _planes4(acc, acc2, p0, p1, p2, p3, q0, q1, q2, q3, a_ptrs, a_mask, KP, TWO,
                             PORTABLE, NATURAL)
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
                             PORTABLE, NATURAL)
    if PAR_ACC:
        acc_b, acc2_b = _planes4(acc_b, acc2_b, p4, p5, p6, p7, q4, q5, q6, q7, a_ptrs + HALF2,
                                 a_mask, KP, TWO, PORTABLE, NATURAL)
    else:
        acc, acc2 = _planes4(acc, acc2, p4, p5, p6, p7, q4, q5, q6, q7, a_ptrs + HALF2, a_mask,
                             KP, TWO, PORTABLE, NATURAL)
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
    return _split_for(tl.load(block_expert_ptr + max_blocks), NUM_N, KS, SPLIT_K, SPLIT_TARGET)


@triton.jit
def _split_for(used_blocks, NUM_N: tl.constexpr, KS: tl.constexpr, SPLIT_K: tl.constexpr,
               SPLIT_TARGET: tl.constexpr):
    """_live_split's choice for ``used_blocks`` used blocks, however they were counted."""
    live = used_blocks * NUM_N
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


# --------------------------------------------------------------------------------------------
# Self-routed blocks (MoeConfig.self_route): the GEMMs group a small call's pairs themselves,
# with no grouping launch. Each program reads the call's T expert ids (T <= T_PAD, a power of
# two) and finds its block in registers.
#
# The blocks are moe_align's: an expert's pairs in flat order, cut into runs of BLOCK_M. A
# block is named by its first pair, its leader: pair i leads when it is the 0th, BLOCK_M-th,
# ... pair of its expert. Program u takes the u-th leader in flat order (moe_align orders the
# blocks by expert instead), so a block holds the same pairs in the same rows as moe_align's
# and every tile computes the same sums bit for bit.
# --------------------------------------------------------------------------------------------
@triton.jit
def _self_ids(ids_ptr, T, T_PAD: tl.constexpr, NUM_EXPERTS: tl.constexpr):
    """Pair indices ``0 .. T_PAD - 1`` and their expert ids, -1 where left out (past T, or an
    id outside ``[0, NUM_EXPERTS)``: SGLang's CUDA-graph padding writes -1)."""
    i = tl.arange(0, T_PAD)
    ids = tl.load(ids_ptr + i, mask=i < T, other=-1).to(tl.int32)
    return i, tl.where((ids >= 0) & (ids < NUM_EXPERTS), ids, -1)


@triton.jit
def _self_leaders(ids_ptr, T, T_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                  NUM_EXPERTS: tl.constexpr):
    """The call's blocks: per pair its index, id, rank (earlier pairs of its expert), whether
    it leads a block and the leader's index among the leaders; and the used blocks' count.
    The ranks come from comparing every pair with every earlier one (T_PAD <= 128 as served,
    SELF_ROUTE_MAX_PAIRS), the one step that grows as T squared: 16 columns at a time, so
    that it needs no more registers than the GEMM after it (a whole [T_PAD, T_PAD] at once
    took 168 a thread on sm_90 at T_PAD 128 with 4 warps, the down's tile 80)."""
    i, ids = _self_ids(ids_ptr, T, T_PAD, NUM_EXPERTS)
    rank = tl.zeros([T_PAD], dtype=tl.int32)
    for c in tl.static_range(0, T_PAD, 16):
        j, ids_j = _self_ids(ids_ptr + c, T - c, 16, NUM_EXPERTS)
        before = (ids[:, None] == ids_j[None, :]) & (c + j[None, :] < i[:, None])
        rank += tl.sum(before.to(tl.int32), axis=1)
    lead = ((ids >= 0) & (rank % BLOCK_M == 0)).to(tl.int32)
    return i, ids, rank, lead, tl.cumsum(lead, 0) - lead, tl.sum(lead)


@triton.jit
def _self_pick(i, ids, rank, lead, order, used, u, BLOCK_M: tl.constexpr):
    """Block ``u`` of _self_leaders' blocks: its leader pair, its expert (-1 past the used
    blocks) and its real rows (at most BLOCK_M)."""
    mine = (lead != 0) & (order == u)
    e = tl.sum(tl.where(mine, ids, 0))
    n_e = tl.sum(((ids == e) & (ids >= 0)).to(tl.int32))
    rows = tl.minimum(n_e - tl.sum(tl.where(mine, rank, 0)), BLOCK_M)
    return tl.sum(tl.where(mine, i, 0)), tl.where(u < used, e, -1), rows


@triton.jit
def _self_rows(ids_ptr, b, T, BM: tl.constexpr, T_PAD: tl.constexpr):
    """Like _rows_at for the block led by pair ``b`` (a leader, so its id is a valid expert):
    its first BM rows, the pairs of its expert ranked ``rank(b) .. rank(b) + BM - 1``. A row
    past the block's real ones points at row T (the scratch row of ``h`` and the partial sums
    under self-routing) and holds the sentinel T, as padding does under moe_align."""
    i = tl.arange(0, T_PAD)
    e = tl.load(ids_ptr + b).to(tl.int32)
    hit = (tl.load(ids_ptr + i, mask=i < T, other=-1).to(tl.int32) == e).to(tl.int32)
    rank = tl.cumsum(hit, 0) - hit  # earlier pairs of e
    rank_b = tl.sum(tl.where(i == b, rank, 0))
    sel = (hit[None, :] != 0) & (rank[None, :] == rank_b + tl.arange(0, BM)[:, None])
    row_ok = tl.sum(sel.to(tl.int32), axis=1) > 0
    rows = tl.where(row_ok, tl.sum(tl.where(sel, i[None, :], 0), axis=1), T)
    return rows, rows, row_ok


@triton.jit
def _rows_for(src_ptr, row0, T, BM: tl.constexpr, SELF_ROUTE: tl.constexpr = 0):
    """A block's rows: ``_rows_at`` (``src_ptr`` moe_align's sorted ids, ``row0`` the block's
    first padded position) or, with SELF_ROUTE = T_PAD > 0, ``_self_rows`` (``src_ptr`` the
    flat expert ids, ``row0`` the block's leader pair)."""
    if SELF_ROUTE > 0:
        return _self_rows(src_ptr, row0, T, BM, SELF_ROUTE)
    else:
        return _rows_at(src_ptr, row0, T, BM)


@triton.jit
def _level_of(rows, BLOCK_M: tl.constexpr):
    """_narrow_level from a block's count of real rows."""
    level = tl.where(rows > BLOCK_M // 2, 0, 1)
    if BLOCK_M >= 64:
        level = tl.where((level == 1) & (rows <= BLOCK_M // 4), 2, level)
    return level


@triton.jit
def _x_planes4(x_ptrs):
    """Four nibble planes of a K tile of activations in their natural order: ``x_ptrs`` is
    [KP, BM, 4], input columns ``8 r + 4 h + j`` (8 contiguous bytes at ``[r, m, :]``; ``h`` 0
    for planes 0-3, 1 for 4-7), loaded at once and split in registers. Plane ``4 h + j`` is
    [KP, BM], what moe_align's plane-major copy holds as one contiguous slice."""
    kp: tl.constexpr = x_ptrs.shape[0]
    bm: tl.constexpr = x_ptrs.shape[1]
    x = tl.reshape(tl.load(x_ptrs), [kp, bm, 2, 2])
    c0, c1 = tl.split(x)  # bit 0 of j
    a0, a2 = tl.split(c0)  # bit 1
    a1, a3 = tl.split(c1)
    return a0, a1, a2, a3


@triton.jit
def _dots4(acc, acc2, p0, p1, p2, p3, q0, q1, q2, q3, a0, a1, a2, a3, TWO: tl.constexpr,
           PORTABLE: tl.constexpr):
    """_planes4 with the four activation planes in hand (the same dots in the same order)."""
    acc, acc2 = _dot2(acc, acc2, p0, q0, a0, TWO, PORTABLE)
    acc, acc2 = _dot2(acc, acc2, p1, q1, a1, TWO, PORTABLE)
    acc, acc2 = _dot2(acc, acc2, p2, q2, a2, TWO, PORTABLE)
    return _dot2(acc, acc2, p3, q3, a3, TWO, PORTABLE)


@triton.jit
def _dot2(acc, acc2, w, w2, a, TWO: tl.constexpr, PORTABLE: tl.constexpr):
    """One plane's dot, and the second tile's (``TWO``), as _plane makes them."""
    acc = _dot(w, a, acc, PORTABLE)
    if TWO:
        acc2 = _dot(w2, a, acc2, PORTABLE)
    return acc, acc2
