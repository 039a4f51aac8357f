"""The fused W4A16 MoE's first launch: (token, slot) pairs grouped by expert into blocks, and
the activations copied into the plane-major order the GEMMs read (``moe_w4a16``, step 1).

``moe_align`` groups the ``T = M * topk`` pairs into blocks of ``BLOCK_M`` rows, padding each
expert's rows with the sentinel ``T``; pairs keep flat order inside an expert, sizes are
static (no host sync; CUDA-graph safe) and the results deterministic. Three groupings give the
same outputs bit for bit:

* ``_align_small_kernel`` (up to a thousand pairs): one program, a histogram and a sort.
* ``_prologue_kernel``: one program per expert, each histogramming all T pairs (work that
  grows as E x T).
* ``_align_count_kernel`` + ``_align_place_kernel`` (from 2,048 pairs): per-chunk
  histograms, then each chunk's pairs placed by a sort.

The same launch copies ``x`` into plane-major order: inside each ``BLOCK_K`` tile, column
``j * KP + r`` holds input column ``8 r + j`` (``KP = BLOCK_K / 8``), so that nibble plane ``j``
of a packed weight tile meets a contiguous activation slice.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .moe_pdl import Pdl, _pdl_release, _pdl_wait

PACK_FACTOR = 8  # int4 values per int32 word
_PACK = tl.constexpr(PACK_FACTOR)  # (kernels may only read constexpr globals)


def _env_ints(name: str, value: str, n: int, form: str) -> tuple[int, ...]:
    """``n`` positive ints from env variable ``name`` (``a:b``), or a ValueError naming it."""
    try:
        ints = tuple(int(v) for v in value.split(":"))
    except ValueError:
        ints = ()
    if len(ints) != n or min(ints) < 1:
        raise ValueError(f"{name}: expected {form}, got {value!r}")
    return ints



@triton.jit
def _plane_major_cols(c, BLOCK_K: tl.constexpr):
    """Stored column of logical column ``c``: inside each BLOCK_K tile, 8 r + j -> j * KP + r."""
    KP: tl.constexpr = BLOCK_K // _PACK
    within = c % BLOCK_K
    return c - within + (within % _PACK) * KP + within // _PACK


@triton.jit
def _plane_major_src(o, BLOCK_K: tl.constexpr):
    """Inverse of _plane_major_cols: logical column stored at column ``o``."""
    KP: tl.constexpr = BLOCK_K // _PACK
    within = o % BLOCK_K
    return o - within + (within % KP) * _PACK + within // KP


@triton.jit
def _copy_chunk(x_ptr, xp_ptr, m, stride_xm, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns k0 .. k0 + 1023 of row m of xp (plane-major) from x: strided reads (served by
    L1), coalesced writes."""
    o = k0 + tl.arange(0, 1024)
    v = tl.load(x_ptr + m * stride_xm + _plane_major_src(o, BLOCK_K), mask=o < K)
    tl.store(xp_ptr + m * K + o, v, mask=o < K)


@triton.jit
def _copy_part(x_ptr, xp_ptr, q, stride_xm, K: tl.constexpr, BLOCK_K: tl.constexpr,
               COPY_PROGS: tl.constexpr):
    """Copy program ``q``'s part of xp: row ``q // COPY_PROGS``, its ``q % COPY_PROGS``-th run
    of ceil(K / 1024 / COPY_PROGS) 1,024-column chunks."""
    CHUNKS: tl.constexpr = (K + 1024 * COPY_PROGS - 1) // (1024 * COPY_PROGS)
    m = (q // COPY_PROGS).to(tl.int64)
    for c in range(CHUNKS):
        _copy_chunk(x_ptr, xp_ptr, m, stride_xm, ((q % COPY_PROGS) * CHUNKS + c) * 1024, K,
                    BLOCK_K)


@triton.jit
def _prologue_kernel(
    topk_ids_ptr,  # [T] int32/int64: expert of pair t = token * topk + slot
    sorted_ids_ptr,  # [max_padded] int32 out: pair ids grouped by expert, padded with T
    block_expert_ptr,  # [max_blocks + 1] int32 out: expert of each BLOCK_M block, -1 past the
    # used ones; entry max_blocks: the number of used blocks
    x_ptr,  # [M, K] bf16, row stride stride_xm (read by programs >= NUM_EXPERTS only)
    xp_ptr,  # [M, K] bf16 out: x in plane-major order for BLOCK_K tiles
    T,
    max_blocks,
    stride_xm,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,  # next power of two >= NUM_EXPERTS
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NUM_T_BLOCKS: tl.constexpr,  # cdiv(T, BLOCK_T); constexpr loop bounds also suit the interpreter
    BLOCK_B: tl.constexpr,  # NUM_EXPERTS * BLOCK_B >= max_blocks
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COPY_FIRST: tl.constexpr = False,  # x's copy in COPY_PROGS programs per row, before the experts
    COPY_PROGS: tl.constexpr = 1,  # programs per row of x under COPY_FIRST (1,024-column chunks)
    PDL: tl.constexpr = 0,  # moe_pdl's mode
):
    _pdl_wait(PDL)
    _pdl_release(PDL)
    pid = tl.program_id(0)
    if COPY_FIRST:
        # The copy first, each row split over COPY_PROGS programs of ceil(K / 1024 / COPY_PROGS)
        # chunks: the grid's first programs start first, and no program walks a whole row.
        n_copy = tl.num_programs(0) - NUM_EXPERTS
        if pid < n_copy:
            _copy_part(x_ptr, xp_ptr, pid, stride_xm, K, BLOCK_K, COPY_PROGS)
            return
        e = pid - n_copy
    else:
        if pid >= NUM_EXPERTS:
            # Programs past the experts copy one row of x each (one launch instead of two).
            m = (pid - NUM_EXPERTS).to(tl.int64)
            for k0 in range(0, K, 1024):
                _copy_chunk(x_ptr, xp_ptr, m, stride_xm, k0, K, BLOCK_K)
            return
        e = pid
    # One program per expert. Each recomputes the (cheap) histogram of all T ids so that the
    # expert's output offset needs no second launch and no grid-wide barrier.
    bins = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for i in range(NUM_T_BLOCKS):
        offs = i * BLOCK_T + tl.arange(0, BLOCK_T)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < T, other=-1).to(tl.int32)
        counts += tl.histogram(ids, E_PAD, mask=(ids >= 0) & (ids < NUM_EXPERTS))
    padded = tl.where(bins < NUM_EXPERTS, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, 0)
    start = tl.sum(tl.where(bins == e, ends - padded, 0))
    n_pad = tl.sum(tl.where(bins == e, padded, 0))
    total = tl.sum(padded)

    # This expert's pairs in flat order: rank = number of earlier pairs routed to e.
    run = 0
    for i in range(NUM_T_BLOCKS):
        offs = i * BLOCK_T + tl.arange(0, BLOCK_T)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < T, other=-1).to(tl.int32)
        hit = (ids == e).to(tl.int32)
        rank = run + tl.cumsum(hit, 0) - 1
        tl.store(sorted_ids_ptr + start + rank, offs, mask=hit != 0)
        run += tl.sum(hit)
    pad = run + tl.arange(0, BLOCK_M)  # fewer than BLOCK_M padding slots per expert
    tl.store(sorted_ids_ptr + start + pad, T, mask=pad < n_pad)

    _label_blocks(block_expert_ptr, e, bins, ends, padded, total, max_blocks, NUM_EXPERTS,
                  BLOCK_M, BLOCK_B)


@triton.jit
def _label_blocks(block_expert_ptr, e, bins, ends, padded, total, max_blocks,
                  NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    """block_expert's labels from the padded per-expert row counts (``padded``, their inclusive
    cumsum ``ends`` and ``total``; one entry per bin of ``bins``), written by expert ``e``'s
    program: see moe_align."""
    # Expert e's program labels blocks e * BLOCK_B + [0, BLOCK_B): the expert of block j is the
    # number of experts whose padded range ends at or before row j * BLOCK_M; -1 past the last
    # block.
    j = e * BLOCK_B + tl.arange(0, BLOCK_B)
    ends_live = tl.where(bins < NUM_EXPERTS, ends, total + 1)
    owner = tl.sum((ends_live[None, :] <= j[:, None] * BLOCK_M).to(tl.int32), axis=1)
    owner = tl.where(j * BLOCK_M < total, owner, -1)
    tl.store(block_expert_ptr + j, owner, mask=j < max_blocks)
    if e == 0:  # the number of used blocks, past the labels (the gate-up's live split reads it)
        tl.store(block_expert_ptr + max_blocks, total // BLOCK_M)


@triton.jit
def _align_count_kernel(
    topk_ids_ptr,  # [T] int32/int64
    counts_ptr,  # [NUM_CH, E_PAD] int32 out: each chunk's per-expert pair counts
    x_ptr,  # [M, K] bf16 (read by the copy programs only)
    xp_ptr,  # [M, K] bf16 out: plane-major copy (see _prologue_kernel)
    T,
    stride_xm,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    CH: tl.constexpr,  # pairs per chunk
    NUM_CH: tl.constexpr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COPY_PROGS: tl.constexpr = 1,  # programs per row of x (1,024-column chunks each)
    PDL: tl.constexpr = 0,  # moe_pdl's mode
):
    """First launch of the two-pass grouping (large calls): one program per chunk of CH pairs
    writes that chunk's expert histogram; the programs after them copy x (plane-major)."""
    _pdl_wait(PDL)
    _pdl_release(PDL)
    pid = tl.program_id(0)
    if pid < NUM_CH:
        offs = pid * CH + tl.arange(0, CH)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < T, other=-1).to(tl.int32)
        hist = tl.histogram(ids, E_PAD, mask=(ids >= 0) & (ids < NUM_EXPERTS))
        tl.store(counts_ptr + pid * E_PAD + tl.arange(0, E_PAD), hist)
        return
    _copy_part(x_ptr, xp_ptr, pid - NUM_CH, stride_xm, K, BLOCK_K, COPY_PROGS)


@triton.jit
def _align_place_kernel(
    topk_ids_ptr,  # [T] int32/int64
    counts_ptr,  # [NUM_CH, E_PAD] int32: _align_count_kernel's histograms
    base_ptr,  # [NUM_CH, E_PAD] int32 scratch (each chunk program's row)
    sorted_ids_ptr,  # [max_padded] int32 out (as _prologue_kernel's)
    block_expert_ptr,  # out (as _prologue_kernel's)
    T,
    max_blocks,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CH: tl.constexpr,
    NUM_CH: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PDL: tl.constexpr = 0,  # moe_pdl's mode
):
    """Second launch of the two-pass grouping: the same sorted_ids and block_expert as
    _prologue_kernel, with O(T + (NUM_CH + E) * NUM_CH * E) work instead of O(E * T).

    Every program sums the chunk histograms (the expert offsets). Chunk program c places its
    pairs: sorting the keys ``expert * CH + local index`` lists them by expert and, inside an
    expert, in flat order; the pair at sorted position p with expert e goes to row
    ``start[e] + (pairs of e in earlier chunks) + p - (pairs of the chunk with experts < e)``,
    the row _prologue_kernel gives it. Expert programs (after the chunks) write their padding
    and the block labels."""
    _pdl_wait(PDL)
    _pdl_release(PDL)
    pid = tl.program_id(0)
    bins = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    prefix = tl.zeros([E_PAD], dtype=tl.int32)  # pairs of each expert in chunks before pid
    mine = tl.zeros([E_PAD], dtype=tl.int32)  # chunk pid's histogram
    for c in range(NUM_CH):
        row = tl.load(counts_ptr + c * E_PAD + bins)
        counts += row
        prefix += tl.where(c < pid, row, 0)
        mine = tl.where(c == pid, row, mine)
    padded = tl.where(bins < NUM_EXPERTS, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, 0)
    total = tl.sum(padded)
    if pid < NUM_CH:
        base = ends - padded + prefix - (tl.cumsum(mine, 0) - mine)
        tl.store(base_ptr + pid * E_PAD + bins, base)
        local = tl.arange(0, CH)
        offs = pid * CH + local
        ids = tl.load(topk_ids_ptr + offs, mask=offs < T, other=-1).to(tl.int32)
        live = (ids >= 0) & (ids < NUM_EXPERTS)
        key = tl.sort(tl.where(live, ids * CH + local, E_PAD * CH))
        ok = key < E_PAD * CH
        tl.debug_barrier()  # base's stores before the gather below (same program)
        b = tl.load(base_ptr + pid * E_PAD + key // CH, mask=ok, other=0)
        tl.store(sorted_ids_ptr + b + local, pid * CH + key % CH, mask=ok)
    else:
        e = pid - NUM_CH
        n_e = tl.sum(tl.where(bins == e, counts, 0))
        start = tl.sum(tl.where(bins == e, ends - padded, 0))
        n_pad = tl.sum(tl.where(bins == e, padded, 0))
        pad = n_e + tl.arange(0, BLOCK_M)  # fewer than BLOCK_M padding slots per expert
        tl.store(sorted_ids_ptr + start + pad, T, mask=pad < n_pad)
        _label_blocks(block_expert_ptr, e, bins, ends, padded, total, max_blocks, NUM_EXPERTS,
                      BLOCK_M, BLOCK_B)


@triton.jit
def _running_max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _align_small_kernel(
    topk_ids_ptr,  # [T] int32/int64
    sorted_ids_ptr,  # [max_padded] int32 out (as _prologue_kernel's)
    block_expert_ptr,  # [max_blocks + 1] int32 out (as _prologue_kernel's)
    x_ptr,  # [M, K] bf16 (read by the copy programs only)
    xp_ptr,  # [M, K] bf16 out: plane-major copy (see _prologue_kernel)
    T,
    max_blocks,
    stride_xm,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,  # next power of two >= NUM_EXPERTS
    BLOCK_M: tl.constexpr,
    T_PAD: tl.constexpr,  # next power of two >= T
    B_PAD: tl.constexpr,  # next power of two >= max_blocks
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COPY_PROGS: tl.constexpr = 1,  # programs per row of x (1,024-column chunks each)
    PDL: tl.constexpr = 0,  # moe_pdl's mode
):
    """The grouping of a call of up to a thousand pairs in one program (no per-expert
    programs): the same sorted_ids and block labels as _prologue_kernel. Programs 1.. copy x
    (plane-major), COPY_PROGS per row.

    One histogram gives each expert's padded row range; sorting the keys ``expert * T_PAD +
    pair`` lists the pairs by expert, in flat order inside one, so the pair at sorted position
    p goes to row ``start[e] + p - (pairs on experts below e)``. Each expert's first pair
    writes its padding and labels its first block; a running max along the blocks labels the
    rest (experts ascend with their rows)."""
    _pdl_wait(PDL)
    _pdl_release(PDL)
    pid = tl.program_id(0)
    if pid > 0:
        _copy_part(x_ptr, xp_ptr, pid - 1, stride_xm, K, BLOCK_K, COPY_PROGS)
        return
    i = tl.arange(0, T_PAD)
    ids = tl.load(topk_ids_ptr + i, mask=i < T, other=-1).to(tl.int32)
    live = (ids >= 0) & (ids < NUM_EXPERTS)
    count = tl.histogram(ids, E_PAD, mask=live)
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # 0 for the bins past the experts
    starts = tl.cumsum(padded, 0) - padded
    below = tl.cumsum(count, 0) - count  # pairs on lower experts
    total = tl.sum(padded)
    key = tl.sort(tl.where(live, ids * T_PAD + i, NUM_EXPERTS * T_PAD))  # left-out pairs last
    e = key // T_PAD
    ok = e < NUM_EXPERTS
    e = tl.minimum(e, NUM_EXPERTS - 1)  # in range for the gathers (masked below)
    within = tl.arange(0, T_PAD) - tl.gather(below, e, 0)
    start = tl.gather(starts, e, 0)
    tl.store(sorted_ids_ptr + start + within, key % T_PAD, mask=ok)
    lead = ok & (within == 0)
    end = start + tl.gather(count, e, 0)  # the expert's padding: rows end .. its padded end
    pad_end = start + tl.gather(padded, e, 0)
    for q in tl.static_range(BLOCK_M - 1):  # fewer than BLOCK_M slots
        tl.store(sorted_ids_ptr + end + q, T, mask=lead & (end + q < pad_end))
    b = tl.arange(0, B_PAD)
    tl.store(block_expert_ptr + b, -1, mask=b < max_blocks)
    tl.debug_barrier()  # the -1s before the first blocks' labels (other threads' stores)
    tl.store(block_expert_ptr + start // BLOCK_M, e, mask=lead)
    tl.debug_barrier()
    owner = tl.load(block_expert_ptr + b, mask=b < max_blocks, other=-1)
    tl.debug_barrier()  # every load before the stores below
    owner = tl.associative_scan(owner, 0, _running_max)
    tl.store(block_expert_ptr + b, tl.where(b * BLOCK_M < total, owner, -1), mask=b < max_blocks)
    tl.store(block_expert_ptr + max_blocks, total // BLOCK_M)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static upper bound on padded rows: each non-empty expert adds < BLOCK_M padding rows."""
    bound = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


PROLOGUE_ENV = "SGLANG_DDTREE_MOE_PROLOGUE"  # rows | chunks (default: by grouping); see moe_align
# one | two | auto (default): the grouping in one launch (_prologue_kernel, every expert's
# program histograms all T pairs) or in two (_align_count_kernel + _align_place_kernel, each
# pair read by one chunk program); auto takes two from ALIGN_TWO_PASS_MIN_PAIRS pairs.
ALIGN_ENV = "SGLANG_DDTREE_MOE_ALIGN"
ALIGN_TWO_PASS_MIN_PAIRS = 2048
# small: one program groups the pairs (_align_small_kernel: a histogram and a sort), up to
# ALIGN_SMALL_MAX_PAIRS pairs; auto takes it up to ALIGN_SMALL_AUTO_PAIRS, M = 16 at top-8:
# whole MoE calls 1.0-1.6 us faster there than with the one-launch grouping, slower from
# M = 32 on random routing and from 64 on 8 shared experts (H200, session 48,
# bench_results/fused_moe_small_ab_*_h200_s48b.json)
ALIGN_SMALL_MAX_PAIRS = 1024
ALIGN_SMALL_AUTO_PAIRS = 128
# warps per program of the grouping launches (SGLANG_DDTREE_MOE_ALIGN_WARPS overrides, per call)
ALIGN_WARPS_ENV = "SGLANG_DDTREE_MOE_ALIGN_WARPS"
ALIGN_WARPS = 4
_ALIGN_CHUNK = 1024  # pairs per chunk program of the two-pass grouping


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              x: torch.Tensor | None = None, block_k: int = 128, copy: str | None = None,
              method: str | None = None, warps: int | None = None, pdl: Pdl | None = None):
    """Group (token, slot) pairs by expert in blocks of ``block_m`` rows (one launch, or two
    for large calls: ``method``).

    Parameters
    ----------
    topk_ids : torch.Tensor
        ``[M, topk]`` int32 or int64 expert ids; pairs with ids outside ``[0, num_experts)`` are
        left out (SGLang marks CUDA-graph padding tokens with -1).
    num_experts, block_m : int
    x : torch.Tensor, optional
        ``[M, K]`` bf16 activations to copy into plane-major order for ``block_k`` tiles in the
        same launch.
    copy : str, optional
        How that copy is laid out over programs (default: ``SGLANG_DDTREE_MOE_PROLOGUE``, else
        ``rows`` with the one-launch grouping and ``chunks`` with the two-pass and one-program
        ones, the faster on the H200, sessions 39 and 59). ``rows``: one program per row of x,
        walking the row in 1,024-column chunks. ``chunks``: one program per chunk. Same output
        (``bench_fused_moe.py --prologue`` times both).
    method : str, optional
        ``one``: one launch whose expert programs each histogram all T pairs (O(E T) work,
        which grows to tens of microseconds at thousands of tokens); ``two``: a histogram
        launch over chunks of 1,024 pairs (with x's copy), then a launch that places each
        chunk's pairs by sorting them; ``small``: one program groups all pairs (a histogram
        and a sort, no per-expert programs) for calls of up to ``ALIGN_SMALL_MAX_PAIRS``
        pairs, ``auto``'s choice for larger ones; ``auto`` (default: ``SGLANG_DDTREE_MOE_ALIGN``, else
        auto) takes ``small`` up to ``ALIGN_SMALL_AUTO_PAIRS`` pairs and ``two`` from
        ``ALIGN_TWO_PASS_MIN_PAIRS``. Same outputs bit for bit.
    warps : int, optional
        Warps per program of the launches (default ``SGLANG_DDTREE_MOE_ALIGN_WARPS``, else
        ``ALIGN_WARPS``); the same outputs at any count.
    pdl : Pdl, optional
        ``moe_pdl``'s choice for the launches (default: plain; the caller checks the device).

    Returns
    -------
    sorted_ids : torch.Tensor
        ``[max_padded] int32``: pair ids ``token * topk + slot`` grouped by expert (ascending pair id
        inside an expert), padding slots hold ``T = M * topk``; entries past the last used block
        are unspecified.
    block_expert : torch.Tensor
        ``[max_padded // block_m + 1] int32``: expert of each block, ``-1`` for unused blocks;
        the last entry holds the number of used blocks.
    xp : torch.Tensor or None
        ``[M, K]`` plane-major copy of ``x`` (contiguous).
    """
    t = topk_ids.numel()
    max_padded = max_padded_rows(t, num_experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    max_blocks = max_padded // block_m
    block_expert = torch.empty(max_blocks + 1, dtype=torch.int32, device=dev)
    xp = None if x is None else torch.empty(x.shape, dtype=x.dtype, device=dev)
    rows = 0 if x is None else x.shape[0]
    # One T block for small calls (a 1024-wide histogram of 64 ids costs ~3 us), 1024 at most.
    block_t = min(1024, max(16, triton.next_power_of_2(max(t, 1))))
    method = method or os.environ.get(ALIGN_ENV) or "auto"
    if method not in ("one", "two", "small", "auto"):
        raise ValueError(f"{ALIGN_ENV} / method: one, two, small or auto, got {method!r}")
    small = t <= {"small": ALIGN_SMALL_MAX_PAIRS, "auto": ALIGN_SMALL_AUTO_PAIRS}.get(method, -1)
    two_pass = method == "two" or (method in ("auto", "small") and not small
                                   and t >= ALIGN_TWO_PASS_MIN_PAIRS)
    # rows beside the one-launch grouping, chunks beside the two-pass one: the faster of the
    # two at every M timed on the H200 (bench_results/fused_moe_prologue_h200_s39.json);
    # chunks beside the one-program grouping too: whole calls 0.8-1.5 us faster at M 1-16 on
    # the H200 and 0.8-1.2 on an H100, random routing and 8 shared experts (session 59,
    # bench_results/fused_moe_pdl_*_s59{a,b}.json)
    copy = copy or os.environ.get(PROLOGUE_ENV) or ("chunks" if two_pass or small else "rows")
    if copy not in ("rows", "chunks"):
        raise ValueError(f"{PROLOGUE_ENV} / copy: rows or chunks, got {copy!r}")
    k = 0 if x is None else x.shape[1]
    per_row = triton.cdiv(k, 1024) if copy == "chunks" else 1
    if not warps:
        env = os.environ.get(ALIGN_WARPS_ENV)
        warps = _env_ints(ALIGN_WARPS_ENV, env, 1, "a warp count, e.g. 4")[0] if env else \
            ALIGN_WARPS
    launch = (pdl or Pdl()).launch("a")
    if small:
        _align_small_kernel[(1 + rows * per_row,)](
            topk_ids.reshape(-1), sorted_ids, block_expert, sorted_ids if x is None else x,
            sorted_ids if x is None else xp, t, max_blocks, 0 if x is None else x.stride(0),
            NUM_EXPERTS=num_experts, E_PAD=triton.next_power_of_2(num_experts), BLOCK_M=block_m,
            T_PAD=max(16, triton.next_power_of_2(max(t, 1))),
            B_PAD=max(16, triton.next_power_of_2(max_blocks)), K=k, BLOCK_K=block_k,
            COPY_PROGS=max(per_row, 1), num_warps=warps, **launch)
        return sorted_ids, block_expert, xp
    if two_pass:
        num_ch = triton.cdiv(max(t, 1), _ALIGN_CHUNK)
        e_pad = triton.next_power_of_2(num_experts)
        scratch = torch.empty(2, num_ch, e_pad, dtype=torch.int32, device=dev)
        _align_count_kernel[(num_ch + rows * per_row,)](
            topk_ids.reshape(-1), scratch[0], sorted_ids if x is None else x,
            sorted_ids if x is None else xp, t, 0 if x is None else x.stride(0),
            NUM_EXPERTS=num_experts, E_PAD=e_pad, CH=_ALIGN_CHUNK, NUM_CH=num_ch, K=k,
            BLOCK_K=block_k, COPY_PROGS=max(per_row, 1), num_warps=warps, **launch)
        _align_place_kernel[(num_ch + num_experts,)](
            topk_ids.reshape(-1), scratch[0], scratch[1], sorted_ids, block_expert, t,
            max_blocks, NUM_EXPERTS=num_experts, E_PAD=e_pad, BLOCK_M=block_m,
            CH=_ALIGN_CHUNK, NUM_CH=num_ch,
            BLOCK_B=max(16, triton.next_power_of_2(triton.cdiv(max_blocks, num_experts))),
            num_warps=warps, **launch)
        return sorted_ids, block_expert, xp
    _prologue_kernel[(num_experts + rows * per_row,)](
        topk_ids.reshape(-1), sorted_ids, block_expert, sorted_ids if x is None else x,
        sorted_ids if x is None else xp, t, max_blocks, 0 if x is None else x.stride(0),
        NUM_EXPERTS=num_experts, E_PAD=triton.next_power_of_2(num_experts), BLOCK_M=block_m,
        BLOCK_T=block_t, NUM_T_BLOCKS=triton.cdiv(t, block_t),
        BLOCK_B=max(16, triton.next_power_of_2(triton.cdiv(max_blocks, num_experts))),
        K=k, BLOCK_K=block_k, COPY_FIRST=copy == "chunks", COPY_PROGS=max(per_row, 1),
        num_warps=warps, **launch,
    )
    return sorted_ids, block_expert, xp
