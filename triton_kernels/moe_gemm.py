"""The fused W4A16 MoE's two GEMMs (``moe_w4a16``, steps 2 and 3): the gate-up with SiLU-and-
multiply in its epilogue (split-K partials summed by the tile's last program or by a reduce
launch) and the down times the routing weight (one tile per program, or a column loop)."""
from __future__ import annotations

import triton
import triton.language as tl

from .moe_align import _PACK, _plane_major_cols
from .moe_pdl import _pdl_release, _pdl_wait
from .moe_tiles import (
    _GROUP, _block_rows, _dequant8, _dot, _live_split, _max_blocks, _mma8, _narrow_level,
    _rows_at,
)


# --------------------------------------------------------------------------------------------
# 2. gate-up GEMM + SiLU-and-multiply
# --------------------------------------------------------------------------------------------
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
    PAR_ACC: tl.constexpr = False,  # two accumulators per tile (planes 0-3 / 4-7): _mma8
    SCALE_ONCE: tl.constexpr = False,  # one scale load per group, broadcast (_scale_tile)
    WIDE_HALVES: tl.constexpr = False,  # HALF_M: a full block's tile as two of BLOCK_N / 2
    PDL: tl.constexpr = 0,  # moe_pdl's mode (2: the next launch after the K loop)
    EARLY_ROWS: tl.constexpr = False,  # (not HALF_M) MoeConfig.early_rows
):
    NUM_N: tl.constexpr = I // BLOCK_N
    # EARLY_ROWS: the block's expert and its row ids are loaded together, and under a live split
    # for every split the call may take, before its used-block count is known: one dependent
    # load before the K loop's first instead of three (count, expert, rows).
    SPEC: tl.constexpr = EARLY_ROWS and not HALF_M
    # WIDE_HALVES (MoeConfig.wide_halves, HALF_M with BLOCK_M 16 / 32): each block has 2 NUM_N
    # programs (per K split). A full block's tile is two programs of BLOCK_N / 2 columns (its
    # half-width tiles); a block that narrows runs its NUM_N [BLOCK_N, BLOCK_M / 2] tiles on the
    # first NUM_N, the rest leave at once. Both tiles hold the same number of accumulators, so
    # the kernel keeps the narrow tile's registers and shared memory (a full-width full block,
    # as plain HALF_M runs it, needs about 1.3x both on sm_90), while an expert with more than
    # BLOCK_M / 2 rows of a call still dequantizes each weight tile once for all of them.
    NQ: tl.constexpr = 2 * NUM_N if WIDE_HALVES else NUM_N  # programs per block (and split)
    _pdl_wait(PDL)
    pid = tl.program_id(0)
    if SPLIT_TARGET > 0:
        # The used tiles' programs first, n_split per tile (the used blocks lead block_expert),
        # whatever the split: the grid (live_grid) holds the most any call can need, and
        # programs past this call's leave at once. max_blocks as moe_align sized it.
        # (the split from the used blocks' NUM_N tiles, as without WIDE_HALVES)
        if SPEC:
            n_split, live, e, rows_pre = _live_split_rows(
                block_expert_ptr, sorted_ids_ptr, pid, T, _max_blocks(T, NUM_EXPERTS, BLOCK_M),
                NQ, NUM_N, K // BLOCK_K, SPLIT_K, SPLIT_TARGET, BLOCK_M)
        else:
            n_split, live = _live_split(block_expert_ptr, _max_blocks(T, NUM_EXPERTS, BLOCK_M),
                                        NUM_N, K // BLOCK_K, SPLIT_K, SPLIT_TARGET)
        if pid >= live * (NQ // NUM_N) * n_split:
            return
        pid_k = pid % n_split
        pid_mn = pid // n_split
    else:
        pid_k = pid % SPLIT_K
        pid_mn = pid // SPLIT_K
        n_split = SPLIT_K
    pid_m = pid_mn // NQ
    pid_n = pid_mn % NQ  # WIDE_HALVES: a half-width tile's index (full blocks) or past NUM_N
    if SPEC:
        level = 0
        if SPLIT_TARGET == 0:
            e = tl.load(block_expert_ptr + pid_m)
            rows_pre = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    else:
        e, level = _grouped_block(block_expert_ptr, sorted_ids_ptr, pid_m, T, BLOCK_M, HALF_M)
        rows_pre = 0
    if e < 0:
        return
    row0 = pid_m * BLOCK_M
    if HALF_M:
        if level == 0:
            _gate_up_rows(xp_ptr, w_ptr, s_ptr, sorted_ids_ptr, h_ptr, part_ptr, T, part_rows,
                          e, row0, pid_n, pid_k, K, I, TOPK, BLOCK_M,
                          BLOCK_N // 2 if WIDE_HALVES else BLOCK_N, BLOCK_K, DOWN_BLOCK_K,
                          PORTABLE, SPLIT_DQ, SPLIT_K, cnt_ptr, pid_mn, SERIAL, n_split,
                          PAR_ACC, SCALE_ONCE, PDL)
        elif WIDE_HALVES:
            if pid_n < NUM_N:
                _gate_up_rows(xp_ptr, w_ptr, s_ptr, sorted_ids_ptr, h_ptr, part_ptr, T,
                              part_rows, e, row0, pid_n, pid_k, K, I, TOPK, BLOCK_M // 2,
                              BLOCK_N, BLOCK_K, DOWN_BLOCK_K, PORTABLE, SPLIT_DQ, SPLIT_K,
                              cnt_ptr, pid_mn, SERIAL, n_split, PAR_ACC, SCALE_ONCE, PDL)
        elif BLOCK_M >= 32:  # a half, or a quarter (16 rows of 64, 8 of 32)
            if level == 1:
                _gate_up_rows(xp_ptr, w_ptr, s_ptr, sorted_ids_ptr, h_ptr, part_ptr, T, part_rows,
                              e, row0, pid_n, pid_k, K, I, TOPK, BLOCK_M // 2, BLOCK_N, BLOCK_K,
                              DOWN_BLOCK_K, PORTABLE, SPLIT_DQ, SPLIT_K, cnt_ptr, pid_mn, SERIAL,
                              n_split, PAR_ACC, SCALE_ONCE, PDL)
            else:
                _gate_up_rows(xp_ptr, w_ptr, s_ptr, sorted_ids_ptr, h_ptr, part_ptr, T, part_rows,
                              e, row0, pid_n, pid_k, K, I, TOPK, BLOCK_M // 4, BLOCK_N, BLOCK_K,
                              DOWN_BLOCK_K, PORTABLE, SPLIT_DQ, SPLIT_K, cnt_ptr, pid_mn, SERIAL,
                              n_split, PAR_ACC, SCALE_ONCE, PDL)
        else:
            _gate_up_rows(xp_ptr, w_ptr, s_ptr, sorted_ids_ptr, h_ptr, part_ptr, T, part_rows,
                          e, row0, pid_n, pid_k, K, I, TOPK, BLOCK_M // 2, BLOCK_N, BLOCK_K,
                          DOWN_BLOCK_K, PORTABLE, SPLIT_DQ, SPLIT_K, cnt_ptr, pid_mn, SERIAL,
                          n_split, PAR_ACC, SCALE_ONCE, PDL)
    else:
        _gate_up_rows(xp_ptr, w_ptr, s_ptr, sorted_ids_ptr, h_ptr, part_ptr, T, part_rows, e,
                      row0, pid_n, pid_k, K, I, TOPK, BLOCK_M, BLOCK_N, BLOCK_K, DOWN_BLOCK_K,
                      PORTABLE, SPLIT_DQ, SPLIT_K, cnt_ptr, pid_mn, SERIAL, n_split, PAR_ACC,
                      SCALE_ONCE, PDL, rows_pre, SPEC)


@triton.jit
def _live_split_rows(block_expert_ptr, sorted_ids_ptr, pid, T, max_blocks, NQ: tl.constexpr,
                     NUM_N: tl.constexpr, KS: tl.constexpr, SPLIT_K: tl.constexpr,
                     SPLIT_TARGET: tl.constexpr, BLOCK_M: tl.constexpr):
    """_live_split, and the expert and row ids of the block program ``pid`` works on, all
    from one round of loads: the block under each candidate split (SPLIT_K and its divisors
    below it that divide the KS steps) is loaded beside the used-block count, then the split's
    is kept. Returns (split, used tiles, expert (-1: unused), row ids)."""
    live = tl.load(block_expert_ptr + max_blocks) * NUM_N
    offs = tl.arange(0, BLOCK_M)
    pm = (pid // SPLIT_K) // NQ
    ok = pm < max_blocks
    e = tl.load(block_expert_ptr + pm, mask=ok, other=-1)
    rows = tl.load(sorted_ids_ptr + pm * BLOCK_M + offs, mask=ok, other=T)
    s = tl.full([], SPLIT_K, tl.int32)
    for c in tl.static_range(SPLIT_K - 1, 0, -1):  # descending: the last match is the smallest
        if KS % c == 0:
            pm_c = (pid // c) // NQ
            ok_c = pm_c < max_blocks
            e_c = tl.load(block_expert_ptr + pm_c, mask=ok_c, other=-1)
            rows_c = tl.load(sorted_ids_ptr + pm_c * BLOCK_M + offs, mask=ok_c, other=T)
            take = live * c >= SPLIT_TARGET
            s = tl.where(take, c, s)
            e = tl.where(take, e_c, e)
            rows = tl.where(take, rows_c, rows)
    return s, live, e, rows


@triton.jit
def _grouped_block(block_expert_ptr, sorted_ids_ptr, pid_m, T, BLOCK_M: tl.constexpr,
                   HALF_M: tl.constexpr):
    """moe_align's block ``pid_m``: its expert (-1: unused) and HALF_M level (0: all rows),
    the level's ids loaded beside the expert, not after it (in bounds for unused blocks too)."""
    e = tl.load(block_expert_ptr + pid_m)
    level = 0  # all BLOCK_M rows
    if HALF_M:
        level = _narrow_level(sorted_ids_ptr, pid_m, T, BLOCK_M)
    return e, level


@triton.jit
def _gate_up_rows(xp_ptr, w_ptr, s_ptr, sorted_ids_ptr, h_ptr, part_ptr, T, part_rows, e, row0,
                  pid_n, pid_k, K: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr,
                  BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOWN_BLOCK_K: tl.constexpr, PORTABLE: tl.constexpr, SPLIT_DQ: tl.constexpr,
                  SPLIT_K: tl.constexpr, cnt_ptr, tile, SERIAL: tl.constexpr, n_split,
                  PAR_ACC: tl.constexpr = False, SCALE_ONCE: tl.constexpr = False,
                  PDL: tl.constexpr = 0, rows_pre=0, ROWS_PRE: tl.constexpr = False):
    """The gate-up tile of padded rows ``row0 .. row0 + BM - 1`` (expert ``e``), output columns
    ``pid_n``'s (``BLOCK_N`` wide, of gate and of up), K range ``pid_k``'s of ``n_split``
    (``SPLIT_K`` itself, or this call's live split, at most ``SPLIT_K``); ``tile`` indexes its
    counter under ``SERIAL``; ROWS_PRE: ``rows_pre`` holds the rows' pair ids, loaded."""
    KP: tl.constexpr = BLOCK_K // _PACK
    N2: tl.constexpr = 2 * I
    K_STEPS = K // BLOCK_K // n_split
    if ROWS_PRE:
        offs_m = row0 + tl.arange(0, BM)
        rows = rows_pre
        row_ok = rows < T
    else:
        offs_m, rows, row_ok = _rows_at(sorted_ids_ptr, row0, T, BM)
    tok = tl.where(row_ok, rows // TOPK, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, KP)
    e64 = e.to(tl.int64)
    # [BLOCK_N, KP] views of the packed gate tile and its scales (4 packed rows share a scale;
    # SCALE_ONCE: a [BLOCK_N, KP / 4] view, one per group, broadcast in registers).
    k0 = pid_k * (K_STEPS * BLOCK_K)  # first input row of this program's K range
    w_ptrs = (w_ptr + e64 * (K // _PACK * N2) + (k0 // _PACK + offs_r[None, :]) * N2
              + offs_n[:, None])
    if SCALE_ONCE:
        offs_g = tl.arange(0, KP // 4)
        s_ptrs = (s_ptr + e64 * (K // _GROUP * N2) + (k0 // _GROUP + offs_g[None, :]) * N2
                  + offs_n[:, None])
    else:
        s_ptrs = (s_ptr + e64 * (K // _GROUP * N2) + (k0 // _GROUP + offs_r[None, :] // 4) * N2
                  + offs_n[:, None])
    x_ptrs = xp_ptr + tok[None, :] * K + k0 + offs_r[:, None]  # [KP, BM], plane 0
    x_mask = row_ok[None, :]
    acc_g = tl.zeros([BLOCK_N, BM], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BM], dtype=tl.float32)
    # PAR_ACC: planes 4-7's sums apart from 0-3's (half-length MMA chains), added after the
    # loop; otherwise these two are carried through unchanged
    acc_gb = acc_g
    acc_ub = acc_u
    if PAR_ACC:
        acc_gb = tl.zeros([BLOCK_N, BM], dtype=tl.float32)
        acc_ub = tl.zeros([BLOCK_N, BM], dtype=tl.float32)
    if PORTABLE:
        # the interpreter cannot range() over a loaded bound (a live split): a while loop
        i = 0
        while i < K_STEPS:
            acc_g, acc_u, acc_gb, acc_ub = _gate_up_step(
                acc_g, acc_u, acc_gb, acc_ub, w_ptrs, s_ptrs, x_ptrs, x_mask, I, BLOCK_N, KP,
                PORTABLE, SPLIT_DQ, PAR_ACC, SCALE_ONCE)
            x_ptrs += BLOCK_K
            w_ptrs += KP * N2
            s_ptrs += (BLOCK_K // _GROUP) * N2
            i += 1
    else:
        for _ in range(0, K_STEPS):
            acc_g, acc_u, acc_gb, acc_ub = _gate_up_step(
                acc_g, acc_u, acc_gb, acc_ub, w_ptrs, s_ptrs, x_ptrs, x_mask, I, BLOCK_N, KP,
                PORTABLE, SPLIT_DQ, PAR_ACC, SCALE_ONCE)
            x_ptrs += BLOCK_K
            w_ptrs += KP * N2
            s_ptrs += (BLOCK_K // _GROUP) * N2
    _pdl_release(PDL)  # the K loop's loads are done: the next launch may start
    if PAR_ACC:
        acc_g += acc_gb
        acc_u += acc_ub
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
def _scale_tile(s_ptrs, BN: tl.constexpr, KP: tl.constexpr, SCALE_ONCE: tl.constexpr):
    """A K step's [BN, KP] scales (one per packed word): loaded as such, or (SCALE_ONCE) as
    [BN, KP / 4], one per group of 32 input rows, each repeated over its 4 words in registers."""
    s = tl.load(s_ptrs)
    if SCALE_ONCE:
        s = tl.reshape(tl.broadcast_to(s[:, :, None], [BN, KP // 4, 4]), [BN, KP])
    return s


@triton.jit
def _gate_up_step(acc_g, acc_u, acc_gb, acc_ub, w_ptrs, s_ptrs, x_ptrs, x_mask, I: tl.constexpr,
                  BN: tl.constexpr, KP: tl.constexpr, PORTABLE: tl.constexpr,
                  SPLIT_DQ: tl.constexpr, PAR_ACC: tl.constexpr, SCALE_ONCE: tl.constexpr):
    """One K step of _gate_up_rows: the gate and up tiles and their scales (in that order),
    their planes' dots into two accumulators (``acc_gb`` / ``acc_ub`` only under PAR_ACC)."""
    w = tl.load(w_ptrs)
    s = _scale_tile(s_ptrs, BN, KP, SCALE_ONCE)
    w2 = tl.load(w_ptrs + I)
    s2 = _scale_tile(s_ptrs + I, BN, KP, SCALE_ONCE)
    return _mma8(acc_g, acc_u, acc_gb, acc_ub, w, s, w2, s2, x_ptrs, x_mask, KP, True, PORTABLE,
                 SPLIT_DQ, PAR_ACC)


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
    PDL: tl.constexpr = 0,  # moe_pdl's mode
):
    """Split-K gate-up epilogue: sum the partials in fixed order, then SiLU(gate) * up -> h."""
    _pdl_wait(PDL)
    _pdl_release(PDL)
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
    PDL: tl.constexpr = 0,  # moe_pdl's mode
):
    NUM_N: tl.constexpr = N // BLOCK_N
    _pdl_wait(PDL)
    _pdl_release(PDL)
    pid = tl.program_id(0)
    pid_m = pid // NUM_N
    pid_n = pid % NUM_N
    e, level = _grouped_block(block_expert_ptr, sorted_ids_ptr, pid_m, T, BLOCK_M, HALF_M)
    if e < 0:
        return
    _down_blocks(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, level,
                 pid_m * BLOCK_M, pid_n, 0, N, I, BLOCK_M, BLOCK_N, BLOCK_K, 0, PORTABLE, HALF_M)


@triton.jit
def _down_blocks(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, level, row0,
                 pid_nc, tiles, N: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, N_PER_CTA: tl.constexpr,
                 PORTABLE: tl.constexpr, HALF_M: tl.constexpr, PAR_ACC: tl.constexpr = False,
                 SCALE_ONCE: tl.constexpr = False, EARLY: tl.constexpr = False,
                 PDL: tl.constexpr = 0):
    """Both down kernels' work for one expert block, at the width ``level`` picks under HALF_M
    (_narrow_level): the looped kernel's (N_PER_CTA > 0, ``pid_nc`` its column range of
    ``tiles`` BLOCK_N steps) or the per-tile one's (``pid_nc`` its column tile). EARLY (the
    looped kernel): the PDL wait is _down_loop_rows', after its loads that need no gate-up."""
    if HALF_M:
        if level == 0:
            _down_width(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, row0,
                        pid_nc, tiles, N, I, BLOCK_M, BLOCK_N, BLOCK_K, N_PER_CTA, PORTABLE,
                        PAR_ACC, SCALE_ONCE, EARLY, PDL)
        elif BLOCK_M >= 32:  # a half, or a quarter (16 rows of 64, 8 of 32)
            if level == 1:
                _down_width(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, row0,
                            pid_nc, tiles, N, I, BLOCK_M // 2, BLOCK_N, BLOCK_K, N_PER_CTA,
                            PORTABLE, PAR_ACC, SCALE_ONCE, EARLY, PDL)
            else:
                _down_width(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, row0,
                            pid_nc, tiles, N, I, BLOCK_M // 4, BLOCK_N, BLOCK_K, N_PER_CTA,
                            PORTABLE, PAR_ACC, SCALE_ONCE, EARLY, PDL)
        else:
            _down_width(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, row0,
                        pid_nc, tiles, N, I, BLOCK_M // 2, BLOCK_N, BLOCK_K, N_PER_CTA, PORTABLE,
                        PAR_ACC, SCALE_ONCE, EARLY, PDL)
    else:
        _down_width(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, row0, pid_nc,
                    tiles, N, I, BLOCK_M, BLOCK_N, BLOCK_K, N_PER_CTA, PORTABLE, PAR_ACC,
                    SCALE_ONCE, EARLY, PDL)


@triton.jit
def _down_width(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, row0, pid_nc,
                tiles, N: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, N_PER_CTA: tl.constexpr, PORTABLE: tl.constexpr,
                PAR_ACC: tl.constexpr = False, SCALE_ONCE: tl.constexpr = False,
                EARLY: tl.constexpr = False, PDL: tl.constexpr = 0):
    if N_PER_CTA > 0:
        _down_loop_rows(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, row0,
                        pid_nc, tiles, N, I, BM, BLOCK_N, PORTABLE, PAR_ACC, SCALE_ONCE, EARLY,
                        PDL)
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
        acc, _, _, _ = _mma8(acc, acc, acc, acc, w, tl.load(s_ptrs), w, w, h_ptrs,
                             row_ok[None, :], KP, False, PORTABLE)
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
    PAR_ACC: tl.constexpr = False,  # planes 0-3 / 4-7 in two accumulators (GemmConfig.par_acc)
    SCALE_ONCE: tl.constexpr = False,  # one scale load per group (GemmConfig.scale_once)
    PDL: tl.constexpr = 0,  # moe_pdl's mode
    EARLY: tl.constexpr = False,  # moe_pdl's "e": the grouping's outputs read before the wait
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
    # EARLY: the grouping's outputs (the block's expert and rows) and the routing weights are
    # read before the wait (in _down_loop_rows), and every program still waits before it
    # returns. The grouping has completed by then: this launch starts only once every program
    # of the gate-up (or reduce) has released it or ended, each after its own wait.
    if not EARLY:
        _pdl_wait(PDL)
        _pdl_release(PDL)
    pid = tl.program_id(0)
    if SPLIT_TARGET > 0:
        parts, live = _live_split(block_expert_ptr, _max_blocks(T, NUM_EXPERTS, BLOCK_M), NUM_S,
                                  TILES, TILES, SPLIT_TARGET)
        if pid >= live * parts:
            if EARLY:
                _pdl_wait(PDL)
            return
        pid_m = pid // (NUM_S * parts)
        pid_s = pid % (NUM_S * parts)
        tiles = TILES // parts
    else:
        pid_m = pid // NUM_S
        pid_s = pid % NUM_S
        tiles = TILES
    e, level = _grouped_block(block_expert_ptr, sorted_ids_ptr, pid_m, T, BLOCK_M, HALF_M)
    if e < 0:
        if EARLY:
            _pdl_wait(PDL)
        return
    _down_blocks(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, level,
                 pid_m * BLOCK_M, pid_s, tiles, N, I, BLOCK_M, BLOCK_N, I, N_PER_CTA,
                 PORTABLE, HALF_M, PAR_ACC, SCALE_ONCE, EARLY, PDL)


@triton.jit
def _down_loop_rows(h_ptr, w_ptr, s_ptr, sorted_ids_ptr, topk_w_ptr, y_ptr, T, e, row0, pid_s,
                    tiles, N: tl.constexpr, I: tl.constexpr, BM: tl.constexpr,
                    BLOCK_N: tl.constexpr, PORTABLE: tl.constexpr, PAR_ACC: tl.constexpr = False,
                    SCALE_ONCE: tl.constexpr = False, EARLY: tl.constexpr = False,
                    PDL: tl.constexpr = 0):
    """_down_loop_kernel's work for padded rows ``row0 .. row0 + BM - 1`` (expert ``e``):
    column range ``pid_s`` of ``tiles`` BLOCK_N steps (a constant unless the range is live).
    EARLY: the row ids and routing weights are loaded, then the PDL wait (and release), then
    the activations (the gate-up's output) and the weights."""
    KP: tl.constexpr = I // _PACK
    offs_m, rows, row_ok = _rows_at(sorted_ids_ptr, row0, T, BM)
    offs_r = tl.arange(0, KP)
    if EARLY:  # the routing weights and pointers, then the wait (the activations after it)
        wt = tl.load(topk_w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        w_ptrs, s_ptrs, y_ptrs = _down_loop_ptrs(w_ptr, s_ptr, y_ptr, e, rows, pid_s, tiles, N, I,
                                                 BLOCK_N, SCALE_ONCE)
        _pdl_wait(PDL)
        _pdl_release(PDL)
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
    if not EARLY:
        wt = tl.load(topk_w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        w_ptrs, s_ptrs, y_ptrs = _down_loop_ptrs(w_ptr, s_ptr, y_ptr, e, rows, pid_s, tiles, N, I,
                                                 BLOCK_N, SCALE_ONCE)
    if PORTABLE:
        # the interpreter cannot range() over a loaded bound (a live range): a while loop
        i = 0
        while i < tiles:
            _down_step(w_ptrs, s_ptrs, y_ptrs, a0, a1, a2, a3, a4, a5, a6, a7, wt, a_mask, BM,
                       BLOCK_N, PORTABLE, PAR_ACC, SCALE_ONCE)
            w_ptrs += BLOCK_N
            s_ptrs += BLOCK_N
            y_ptrs += BLOCK_N
            i += 1
    else:
        for _ in range(tiles):
            _down_step(w_ptrs, s_ptrs, y_ptrs, a0, a1, a2, a3, a4, a5, a6, a7, wt, a_mask, BM,
                       BLOCK_N, PORTABLE, PAR_ACC, SCALE_ONCE)
            w_ptrs += BLOCK_N
            s_ptrs += BLOCK_N
            y_ptrs += BLOCK_N


@triton.jit
def _down_loop_ptrs(w_ptr, s_ptr, y_ptr, e, rows, pid_s, tiles, N: tl.constexpr, I: tl.constexpr,
                    BLOCK_N: tl.constexpr, SCALE_ONCE: tl.constexpr):
    """_down_loop_rows' weight, scale and y pointers of its first column step."""
    KP: tl.constexpr = I // _PACK
    offs_r = tl.arange(0, KP)
    e64 = e.to(tl.int64)
    offs_n = pid_s * (tiles * BLOCK_N) + tl.arange(0, BLOCK_N)
    w_ptrs = w_ptr + e64 * (KP * N) + offs_r[None, :] * N + offs_n[:, None]
    if SCALE_ONCE:  # [BLOCK_N, KP / 4]: one scale per group (_scale_tile)
        s_ptrs = (s_ptr + e64 * (I // _GROUP * N) + tl.arange(0, KP // 4)[None, :] * N
                  + offs_n[:, None])
    else:
        s_ptrs = s_ptr + e64 * (I // _GROUP * N) + (offs_r[None, :] // 4) * N + offs_n[:, None]
    y_ptrs = y_ptr + rows[None, :].to(tl.int64) * N + offs_n[:, None]
    return w_ptrs, s_ptrs, y_ptrs


@triton.jit
def _down_step(w_ptrs, s_ptrs, y_ptrs, a0, a1, a2, a3, a4, a5, a6, a7, wt, a_mask,
               BM: tl.constexpr, BLOCK_N: tl.constexpr, PORTABLE: tl.constexpr,
               PAR_ACC: tl.constexpr = False, SCALE_ONCE: tl.constexpr = False):
    """One BLOCK_N step of _down_loop_rows: dequantize the [BLOCK_N, I] weight tile, its eight
    nibble-plane dots with the block's activation planes, the routing weights, y's store
    (PAR_ACC: planes 4-7 in a second accumulator, half the dependent MMA chain; SCALE_ONCE:
    ``s_ptrs`` is the [BLOCK_N, KP / 4] group view)."""
    KP: tl.constexpr = a0.shape[0]
    p0, p1, p2, p3, p4, p5, p6, p7 = _dequant8(tl.load(w_ptrs),
                                               _scale_tile(s_ptrs, BLOCK_N, KP, SCALE_ONCE),
                                               PORTABLE)
    acc = tl.zeros([BLOCK_N, BM], dtype=tl.float32)
    acc = _dot(p0, a0, acc, PORTABLE)
    acc = _dot(p1, a1, acc, PORTABLE)
    acc = _dot(p2, a2, acc, PORTABLE)
    acc = _dot(p3, a3, acc, PORTABLE)
    if PAR_ACC:
        acc_b = tl.zeros([BLOCK_N, BM], dtype=tl.float32)
        acc_b = _dot(p4, a4, acc_b, PORTABLE)
        acc_b = _dot(p5, a5, acc_b, PORTABLE)
        acc_b = _dot(p6, a6, acc_b, PORTABLE)
        acc_b = _dot(p7, a7, acc_b, PORTABLE)
        acc += acc_b
    else:
        acc = _dot(p4, a4, acc, PORTABLE)
        acc = _dot(p5, a5, acc, PORTABLE)
        acc = _dot(p6, a6, acc, PORTABLE)
        acc = _dot(p7, a7, acc, PORTABLE)
    tl.store(y_ptrs, (acc * wt[None, :]).to(y_ptrs.dtype.element_ty), mask=a_mask)
