"""The fused W4A16 MoE's down GEMM as column tiles that walk the call's expert blocks, with the
top-k sum in the same launch (``GemmConfig.col_parts``; ``moe_w4a16`` steps 3 and 4 as one).

The looped down (``_down_loop_kernel``) gives a program one expert block and a range of output
columns. At M = 8 on random routing that is about 61 blocks x 28 ranges: 1,700 short programs,
each a start-up (its block's expert, rows and activations) and a few column steps, and the
top-k sum is a launch of its own (``_combine_kernel``). Here a program holds one ``BLOCK_N``
column tile and walks the used blocks, every ``COL_PARTS``-th from its part's first, so each
program streams one [BLOCK_N, I] weight tile after another whatever the routing; and a column
tile has only ``COL_PARTS`` programs, so the last of them to finish sums the tile's top-k rows
itself (a counter per column tile, as the gate-up's serial split-K): ``y`` is written and read
back through the L2, the slots summed in order in fp32, as ``_combine_kernel`` does.

The same bits as the looped down of the same tile options followed by the combine launch: a
pair's ``y`` comes from the same step (``_down_step``: dequant, eight plane dots, routing
weight, one bf16 rounding), and the sum is the combine's, term for term.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .moe_align import _PACK
from .moe_gemm import _down_step
from .moe_tiles import _GROUP


@triton.jit
def _down_cols_kernel(
    h_ptr,  # [max_padded, I] bf16, plane-major for one BLOCK_K = I tile
    w_ptr,  # [E, I // 8, N] int32
    s_ptr,  # [E, I // 32, N] bf16
    sorted_ids_ptr,  # [max_padded] int32
    block_expert_ptr,  # [max_blocks + 1] int32; entry max_blocks: the used blocks
    topk_w_ptr,  # [T] fp32/bf16 routing weight of pair t
    topk_ids_ptr,  # [T] int32/int64: slots with ids outside [0, E) have no y row
    y_ptr,  # [T, N] bf16 out (and, under SUM, read back), row = pair id
    out_ptr,  # [M, N] bf16 out under SUM, row stride stride_om
    cnt_ptr,  # SUM and COL_PARTS > 1: [>= N // BLOCK_N] int32, zero between launches
    scale,  # routed_scaling_factor
    T,
    M,
    max_blocks,
    stride_om,
    N: tl.constexpr,
    I: tl.constexpr,
    TOPK: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COL_PARTS: tl.constexpr,  # programs per column tile; part p takes blocks p, p + COL_PARTS, ..
    STEPS: tl.constexpr,  # power of two >= cdiv(max_blocks, COL_PARTS): a part's most blocks
    TOK_TILE: tl.constexpr,  # tokens per step of the top-k sum (a power of two)
    PORTABLE: tl.constexpr,
    SUM: tl.constexpr,  # the top-k sum into out here (else the combine launch follows)
    PAR_ACC: tl.constexpr = False,  # planes 0-3 / 4-7 in two accumulators (GemmConfig.par_acc)
    SCALE_ONCE: tl.constexpr = False,  # one scale load per group (GemmConfig.scale_once)
):
    NUM_C: tl.constexpr = N // BLOCK_N
    KP: tl.constexpr = I // _PACK
    pid = tl.program_id(0)
    # part-major: the first programs to start are every column tile of part 0, so the
    # programs in flight together read the same few experts' rows end to end
    part = pid // NUM_C
    col = pid % NUM_C
    used = tl.load(block_expert_ptr + max_blocks)
    offs_n = col * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, KP)
    if SCALE_ONCE:  # [BLOCK_N, KP / 4]: one scale per group (_scale_tile)
        s_cols = tl.arange(0, KP // 4)[None, :] * N + offs_n[:, None]
    else:
        s_cols = (offs_r[None, :] // 4) * N + offs_n[:, None]
    w_cols = offs_r[None, :] * N + offs_n[:, None]
    # Every block of this part's expert, pair ids and routing weights, loaded at once and held
    # in registers: a block's weight tile address is then no load of the loop (as a load of
    # the block itself it would be an indirect load the pipeliner puts a stage behind it, one
    # buffer a tile, and each block would wait an L2 round trip for its ids).
    step = tl.arange(0, STEPS)
    blk = part + step * COL_PARTS
    on = blk < used
    experts = tl.load(block_expert_ptr + blk, mask=on, other=0)
    pairs = tl.load(sorted_ids_ptr + blk[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :],
                    mask=on[:, None], other=T)
    weights = tl.load(topk_w_ptr + pairs, mask=pairs < T, other=0.0).to(tl.float32)
    n_steps = tl.maximum(used - part + COL_PARTS - 1, 0) // COL_PARTS
    if PORTABLE:
        # the interpreter cannot range() over a loaded bound: a while loop
        i = 0
        while i < n_steps:
            _down_cols_block(h_ptr, w_ptr, s_ptr, y_ptr, T, part + i * COL_PARTS, i, step,
                             experts, pairs, weights, w_cols, s_cols, offs_n, offs_r, N, I,
                             BLOCK_M, BLOCK_N, KP, PORTABLE, PAR_ACC, SCALE_ONCE)
            i += 1
    else:
        for i in range(0, n_steps):
            _down_cols_block(h_ptr, w_ptr, s_ptr, y_ptr, T, part + i * COL_PARTS, i, step,
                             experts, pairs, weights, w_cols, s_cols, offs_n, offs_r, N, I,
                             BLOCK_M, BLOCK_N, KP, PORTABLE, PAR_ACC, SCALE_ONCE)
    if SUM:
        # The column tile's programs count themselves in; the last to arrive sums every token's
        # slots (its own rows and the others') in slot order and re-arms the counter. The
        # barrier puts every thread's y stores before the counter's release; the acquire and
        # the L2-only loads (.cg) let the last program see the other programs' rows.
        tl.debug_barrier()
        last = True
        if COL_PARTS > 1:
            last = tl.atomic_add(cnt_ptr + col, 1, sem="acq_rel", scope="gpu") == COL_PARTS - 1
        if last:
            if PORTABLE:  # (the interpreter's range() takes no runtime bound either)
                m0 = 0
                while m0 < M:
                    _topk_sum(y_ptr, topk_ids_ptr, out_ptr, scale, m0, M, stride_om, offs_n, N,
                              TOPK, NUM_EXPERTS, TOK_TILE)
                    m0 += TOK_TILE
            else:
                for m0 in range(0, M, TOK_TILE):
                    _topk_sum(y_ptr, topk_ids_ptr, out_ptr, scale, m0, M, stride_om, offs_n, N,
                              TOPK, NUM_EXPERTS, TOK_TILE)
            if COL_PARTS > 1:
                tl.atomic_xchg(cnt_ptr + col, 0, sem="relaxed", scope="gpu")


@triton.jit
def _down_cols_block(h_ptr, w_ptr, s_ptr, y_ptr, T, b, i, step, experts, pairs, weights, w_cols,
                     s_cols, offs_n, offs_r, N: tl.constexpr, I: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KP: tl.constexpr,
                     PORTABLE: tl.constexpr, PAR_ACC: tl.constexpr, SCALE_ONCE: tl.constexpr):
    """Block ``b`` (the part's ``i``-th: its expert, pair ids and routing weights picked out of
    the registers) times the [BLOCK_N, I] weight tile of its expert at this program's columns,
    times the routing weights, into y by pair id (``_down_loop_rows``' step for one block).
    The activation planes need no row mask: a padding row's ``h`` only ever reaches its own
    output column, which is not stored."""
    here = step == i
    e64 = tl.sum(tl.where(here, experts, 0), axis=0).to(tl.int64)
    rows = tl.sum(tl.where(here[:, None], pairs, 0), axis=0)
    wt = tl.sum(tl.where(here[:, None], weights, 0.0), axis=0)
    offs_m = b * BLOCK_M + tl.arange(0, BLOCK_M)
    h_ptrs = h_ptr + offs_m[None, :].to(tl.int64) * I + offs_r[:, None]  # [KP, BM], plane 0
    a0 = tl.load(h_ptrs + 0 * KP)
    a1 = tl.load(h_ptrs + 1 * KP)
    a2 = tl.load(h_ptrs + 2 * KP)
    a3 = tl.load(h_ptrs + 3 * KP)
    a4 = tl.load(h_ptrs + 4 * KP)
    a5 = tl.load(h_ptrs + 5 * KP)
    a6 = tl.load(h_ptrs + 6 * KP)
    a7 = tl.load(h_ptrs + 7 * KP)
    y_ptrs = y_ptr + rows[None, :].to(tl.int64) * N + offs_n[:, None]
    _down_step(w_ptr + e64 * (KP * N) + w_cols, s_ptr + e64 * (I // _GROUP * N) + s_cols, y_ptrs,
               a0, a1, a2, a3, a4, a5, a6, a7, wt, (rows < T)[None, :], BLOCK_M, BLOCK_N,
               PORTABLE, PAR_ACC, SCALE_ONCE)


@triton.jit
def _topk_sum(y_ptr, topk_ids_ptr, out_ptr, scale, m0, M, stride_om, offs_n, N: tl.constexpr,
              TOPK: tl.constexpr, NUM_EXPERTS: tl.constexpr, TOK_TILE: tl.constexpr):
    """out[m, offs_n] = scale * sum_k y[m * TOPK + k, offs_n] over the slots with a valid expert
    id, slot order, fp32 (``_combine_kernel``'s arithmetic), for tokens m0 .. m0 + TOK_TILE - 1
    at once: the TOPK loads are independent, so a tile waits for one L2 round trip, not TOPK."""
    tok = m0 + tl.arange(0, TOK_TILE)
    tok_ok = tok < M
    acc = tl.zeros([TOK_TILE, offs_n.shape[0]], dtype=tl.float32)
    for k in tl.static_range(TOPK):  # fixed order: deterministic, the combine's bits
        pair = tok.to(tl.int64) * TOPK + k
        e = tl.load(topk_ids_ptr + pair, mask=tok_ok, other=-1)
        live = tok_ok & (e >= 0) & (e < NUM_EXPERTS)
        acc += tl.load(y_ptr + pair[:, None] * N + offs_n[None, :], mask=live[:, None],
                       other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + tok[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             (acc * scale).to(out_ptr.dtype.element_ty), mask=tok_ok[:, None])
