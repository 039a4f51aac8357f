"""Fused W4A16 MoE (int4 weights, group 32, symmetric; bf16 activations) for verify-sized batches.

A tree verify sends batch x (budget + 1) tokens through every MoE layer: tens to a few thousand
tokens, a regime bound by reading expert weights. ``fused_moe_w4a16`` reads each touched
expert's packed weights once per step, dequantizes them in registers and fuses the rest around
two GEMMs. This module holds the wrapper and the combine; the launches live beside it:
``moe_align.py`` (step 1), ``moe_gemm.py`` (steps 2 and 3, from the pieces in
``moe_tiles.py``) and ``moe_config.py`` (the config table).

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
two-width kernel cost 5-6 % where 32 experts hold 16 rows each). ``MoeConfig.wide_halves``
(session 53, no band yet) runs a full block's gate-up as two tiles of half the columns, so the
two-width gate-up kernel needs no more registers or shared memory than its narrow tile.

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
    _CONFIG_PATH, _REMOVED, _REMOVED_GEMM, DEVICES, GemmConfig, MoeConfig, _config_table,
    _fit, _fitted, _split_candidates, check_config_table, cuda_device_name, device_overrides,
    gemm_config, live_grid, live_split, select_config, table_json,
)
from .moe_align import (  # noqa: F401  (step 1; names re-exported for tests and scripts)
    ALIGN_ENV, ALIGN_WARPS, ALIGN_WARPS_ENV, PACK_FACTOR, PROLOGUE_ENV, _align_count_kernel,
    _align_place_kernel, _align_small_kernel, _env_ints, _prologue_kernel, max_padded_rows,
    moe_align,
)
from .moe_gemm import (  # steps 2 and 3
    _down_kernel, _down_loop_kernel, _gate_up_kernel, _gate_up_reduce_kernel,
)
from .moe_pdl import PDL_ENV, Pdl, _pdl_wait, parse_pdl, pdl_mode  # noqa: F401
from .moe_tiles import (  # noqa: F401  (names re-exported for tests)
    _DEQUANT_PTX, _DEQUANT_PTX_HI, _DEQUANT_PTX_LO, GROUP_SIZE, _live_split,
)


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
    PDL: tl.constexpr = 0,  # moe_pdl's mode (no early release: the next launch is SGLang's)
    TOPK_PAD: tl.constexpr = 8,  # (EARLY) next power of 2 of TOPK
    EARLY: tl.constexpr = False,  # moe_pdl's "c": the expert ids read before the wait
):
    m = tl.program_id(0).to(tl.int64)
    if EARLY:  # the router's output, written before the MoE's first launch: which slots
        # have a y row, as bits of one integer
        slots = tl.arange(0, TOPK_PAD)
        ids = tl.load(topk_ids_ptr + m * TOPK + slots, mask=slots < TOPK, other=-1)
        valid = tl.sum(tl.where((ids >= 0) & (ids < NUM_EXPERTS), 1 << slots, 0), axis=0)
    _pdl_wait(PDL)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = offs < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(TOPK):  # fixed order: deterministic sum
        if EARLY:
            live = ok & (((valid >> k) & 1) != 0)
        else:
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
            num_experts: int, shape: tuple[int, int] | None = None,
            pdl: Pdl | None = None) -> torch.Tensor:
    """``out[m] = scale * sum_k y[m * topk + k]`` over the slots with a valid expert id, in slot
    order (fp32), one launch (``_combine_kernel``); ``shape`` = (block_n, num_warps). Any
    shape gives the same bits. ``pdl``: ``moe_pdl``'s choice (the caller checks the device)."""
    m, topk = topk_ids.shape
    hidden = y.shape[1]
    if shape is None:
        env = os.environ.get(COMBINE_ENV)
        shape = _env_ints(COMBINE_ENV, env, 2, "block_n:num_warps, e.g. 512:4") if env else \
            COMBINE_DEFAULT
    block_n, warps = shape
    block_n = min(block_n, triton.next_power_of_2(hidden))
    opts = (pdl or Pdl()).combine()
    if topk >= 32:  # (EARLY keeps the valid slots as bits of one int32, clear of its sign)
        opts.pop("EARLY", None)
    _combine_kernel[(m, triton.cdiv(hidden, block_n))](
        y, topk_ids, out, float(scale), out.stride(0), N=hidden, TOPK=topk,
        NUM_EXPERTS=num_experts, BLOCK_N=block_n, TOPK_PAD=triton.next_power_of_2(topk),
        num_warps=warps, **opts)
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


def _reg_limit(cfg) -> dict:
    """The launch option for GemmConfig.max_regs (ptxas's per-thread register limit; none
    where 0). Triton's interpreter drops it with the other compile options."""
    return {"maxnreg": cfg.max_regs} if cfg.max_regs else {}


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
    pdl: Pdl | str | None = None,
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
    pdl : Pdl or str, optional
        Programmatic dependent launch (``moe_pdl``: a Pdl or a spec such as ``"0"``, ``"1"``,
        ``"1:gdec"``); default ``SGLANG_DDTREE_MOE_PDL``, else ``1:gdec`` on an sm_90+ GPU and
        plain launches elsewhere. Asked for where it cannot run (the interpreter, before
        sm_90): ValueError. The same outputs bit for bit.
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

    cfg = config or select_config(m, device_name=cuda_device_name(hidden_states.device))
    gu, dn = _fitted(cfg, hidden, inter)
    bm = cfg.block_m
    portable_path = portable(hidden_states.device)
    pdl = pdl_mode(hidden_states.device, portable_path, pdl)
    t = m * topk
    sorted_ids, block_expert, xp = moe_align(topk_ids, num_experts, bm, hidden_states, gu.block_k,
                                             pdl=pdl)
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
    wide = 2 if cfg.wide_halves else 1  # MoeConfig.wide_halves: 2 programs a column tile
    counters = _tile_counters(hidden_states.device, wide * tiles) if gu.split_k > 1 else None
    programs = wide * (tiles * gu.split_k if not gu.split_target else live_grid(
        tiles, hidden // gu.block_k, gu.split_k, gu.split_target))
    _gate_up_kernel[(programs,)](
        xp, w13_packed, w13_scale, sorted_ids, block_expert, h, part,
        sorted_ids if counters is None else counters, t, part_rows, K=hidden,
        I=inter, TOPK=topk, BLOCK_M=bm, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k,
        DOWN_BLOCK_K=dn.block_k, PORTABLE=portable_path, SPLIT_DQ=bool(gu.split_dq),
        SPLIT_K=gu.split_k, HALF_M=cfg.narrow_gate_up, SERIAL=counters is not None,
        SPLIT_TARGET=gu.split_target,
        NUM_EXPERTS=num_experts if gu.split_target else 0, PAR_ACC=bool(gu.par_acc),
        SCALE_ONCE=bool(gu.scale_once), WIDE_HALVES=bool(cfg.wide_halves),
        num_warps=gu.num_warps, num_stages=gu.num_stages, **_reg_limit(gu),
        **pdl.launch("g"), **({"EARLY_ROWS": True} if cfg.early_rows else {}))
    if gu.split_k > 1 and counters is None:
        block_c = min(inter, 128)
        _gate_up_reduce_kernel[(n_blocks, inter // block_c)](
            part, sorted_ids, block_expert, h, t, part_rows, I=inter, SPLIT_K=gu.split_k,
            BLOCK_M=bm, BLOCK_C=block_c, DOWN_BLOCK_K=dn.block_k,
            SPLIT_TARGET=gu.split_target, NUM_N=num_n, KS=hidden // gu.block_k,
            **pdl.launch("r"))
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
            SPLIT_TARGET=dn.split_target, PAR_ACC=bool(dn.par_acc),
            SCALE_ONCE=bool(dn.scale_once), num_warps=dn.num_warps, num_stages=dn.num_stages,
            **_reg_limit(dn), **pdl.down_loop())
    else:
        _down_kernel[(n_blocks * (hidden // dn.block_n),)](
            h, w2_packed, w2_scale, sorted_ids, block_expert, topk_weights, y, t, N=hidden,
            I=inter, BLOCK_M=bm, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, PORTABLE=portable_path,
            HALF_M=cfg.narrow_down, num_warps=dn.num_warps, num_stages=dn.num_stages,
            **_reg_limit(dn), **pdl.launch("d"))
    if _upto < 4:
        return out
    return combine(y, topk_ids, out, routed_scaling_factor, num_experts, pdl=pdl)
