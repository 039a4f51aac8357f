"""Dense bf16 GEMM for verify-sized token counts: ``y = x @ W^T``, ``x [M, K]`` with M <= 64,
``W [N, K]`` (an ``nn.Linear`` weight), fp32 accumulation, bf16 out (or fp32, as the MoE
router's GEMM returns).

Why. A tree verify sends batch x (budget + 1) tokens through every dense projection of the
target. On the Kimi K2.6 TP8 rank SGLang's dsv3 kernels (the q / kv down-projection, the router)
serve only up to 16 tokens and cuBLAS above; in session 30's profile
(``bench_results/profile_step_kimi_l8_int4_*_h200_s30.json``) the GEMMs of a layer, the
lm_head left out, took about 11 us more at 33 tokens than at 1. Every one of these GEMMs reads
weights that dwarf its activations: the time to beat is the weight read.

How. Each program streams one ``[BLOCK_N, K / SPLIT_K]`` slice of ``W`` (contiguous along K,
so every load is whole rows) against the few token rows, with the operands swapped as in
:mod:`.moe_w4a16`: ``acc^T [BLOCK_N, BLOCK_M] = W_tile @ x^T``, the weight tile on the MMA's M
side (64 rows per warpgroup) and the tokens on its N side (16-64). ``SPLIT_K`` programs share a
column tile so that a thin matrix still fills the GPU (:func:`plan_split`); they write fp32
partials, and the tile's last program to arrive (an arrival counter per column tile, re-armed by
that program) adds them in split order and stores ``y``: one launch, and the sum does not
depend on which program finishes last, so every call is bitwise reproducible.

:func:`skinny_gemm` is launch-only and CUDA-graph safe once :func:`counters_for` has allocated
the device's counter buffer outside capture (the wrapper does so on first use; a call captured
before that, or needing more counters, raises instead of falling back). The ``PORTABLE`` path
(``TRITON_INTERPRET=1``, CPU, pre-Ampere) dots in fp32.

Programmatic dependent launch (``pdl``, sm_90+, off by default; :func:`pdl_mode`). SGLang's own
small-batch GEMMs for DeepSeek / Kimi (the dsv3 router and fused-A kernels, up to 16 tokens)
launch with PDL: their programs start while the kernel before them drains and wait for its
writes on the GPU. cuBLAS, which serves a verify's 17-32-row calls, does not. Mode ``1``: every
program waits (``griddepcontrol.wait``) before it reads anything; the launch after this one
starts at this one's programs' exit, as after a plain launch. Session 68 (H100,
``bench_results/skinny_pdl_h100_s68.json``, ``skinny_pdl_router_h100_s68.json``: chained calls
in a CUDA graph, the same bits): 0.25-0.35 us less a call at every shape and row count timed
(the router at 32 rows 7.73 against 7.96 us, cuBLAS 8.01). A mode that also loaded each
program's first weight tile before the wait was 0.4-1.5 us slower a call (the peeled step's
tiles took a pipeline stage's shared memory) and was removed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._device import (BLOCK_RESERVE, arrival_counters, num_sms, parse_switch, pdl_switch,
                      portable)
from .moe_pdl import _pdl_wait

MAX_M = 64  # token rows one launch takes (the MMA's N side)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,  # [M, K] bf16, row stride stride_xm
    w_ptr,  # [N, K] bf16, contiguous
    y_ptr,  # [M, N] bf16 or fp32 out, row stride stride_ym
    part_ptr,  # SPLIT_K > 1: [SPLIT_K, BLOCK_M, N] fp32 partial sums (rows < M written)
    cnt_ptr,  # SPLIT_K > 1: [N // BLOCK_N] int32 arrival counters, zero between launches
    M,
    stride_xm,
    stride_ym,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PORTABLE: tl.constexpr,
    PDL: tl.constexpr = 0,  # 1: wait for the launch before (griddepcontrol.wait) first
):
    tl.static_assert(K % (SPLIT_K * BLOCK_K) == 0)
    tl.static_assert(N % BLOCK_N == 0)
    K_SPLIT: tl.constexpr = K // SPLIT_K
    pid = tl.program_id(0)
    pid_k = pid % SPLIT_K  # a column tile's splits are neighbours: they start together
    pid_n = pid // SPLIT_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]  # [BLOCK_K, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    _pdl_wait(PDL)
    for _ in range(K_SPLIT // BLOCK_K):
        w = tl.load(w_ptrs)
        xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        if PORTABLE:
            acc += tl.dot(w.to(tl.float32), xt.to(tl.float32))
        else:
            acc = tl.dot(w, xt, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y_ptrs = y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[None, :])
    else:
        p_ptrs = part_ptr + (pid_k * BLOCK_M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
        tl.store(p_ptrs, acc, mask=m_ok[None, :])
        # The barrier puts every thread's partial stores before the counter's release; the
        # acquire and the L2-only loads (.cg) let the last program see the others' partials.
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tot = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for k in tl.static_range(SPLIT_K):  # split order: the sum is the same whoever is last
                q_ptrs = (part_ptr + (k * BLOCK_M + offs_m[None, :]).to(tl.int64) * N
                          + offs_n[:, None])
                tot += tl.load(q_ptrs, mask=m_ok[None, :], other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, tot.to(y_ptr.dtype.element_ty), mask=m_ok[None, :])
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")


@dataclass(frozen=True)
class SkinnyConfig:
    """Tiles of one launch (``block_m`` follows M: 16, 32 or 64)."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 0  # 0: launch_stages's for the launch's block_m


# shared memory one program may take for two to fit on an SM (sm_90: 228 KB an SM);
# plan_split counts two programs per SM
_SMEM_TWO_PER_SM = 233472 // 2 - BLOCK_RESERVE
_MAX_STAGES = 4


def block_m_for(m: int) -> int:
    """The launch's row tile (the MMA's N side) for ``m`` token rows: 16, 32 or 64."""
    return max(16, triton.next_power_of_2(m))


def launch_stages(cfg: SkinnyConfig, block_m: int) -> int:
    """Pipeline stages of a launch: ``cfg.num_stages``, or where that is 0 the most (up to 4)
    whose x and W tiles leave room for two programs per SM. Triton stages both operands in
    shared memory where the row strides are multiples of 16 (K and N always are here): at
    64 x 64 x 128 tiles 4 stages took 131,072 bytes, one program per SM, 3 take 98,304 (sm_90
    compile, tests/triton_kernels/test_skinny_gemm_compile.py)."""
    if cfg.num_stages:
        return cfg.num_stages
    per_stage = (block_m + cfg.block_n) * cfg.block_k * 2
    return max(1, min(_MAX_STAGES, _SMEM_TWO_PER_SM // per_stage))


def plan_split(n_tiles: int, k_steps: int, target_programs: int, max_split: int = 16) -> int:
    """The K split of a ``n_tiles``-column-tile GEMM of ``k_steps`` K steps: the smallest
    divisor ``s <= max_split`` of ``k_steps`` giving at least ``target_programs`` programs
    (``n_tiles * s``), else the largest divisor up to ``max_split``. Each split adds one fp32
    partial of the call's rows to write and read back, so no more splits than fill the GPU."""
    divisors = [s for s in range(1, min(k_steps, max_split) + 1) if k_steps % s == 0]
    return next((s for s in divisors if n_tiles * s >= target_programs), divisors[-1])


BLOCK_N, BLOCK_K = 64, 128  # default_config's tiles: N and K must be multiples


def default_config(n: int, k: int, sms: int) -> SkinnyConfig:
    """64-column tiles of 128 K rows, split so that about two programs per SM run."""
    block_n, block_k = BLOCK_N, BLOCK_K
    if n % block_n or k % block_k:
        raise ValueError(f"skinny_gemm: N {n} must be a multiple of {block_n} and K {k} of "
                         f"{block_k}")
    return SkinnyConfig(block_n, block_k, plan_split(n // block_n, k // block_k, 2 * sms))


_counters: dict = {}
_MIN_COUNTERS = 1 << 12


def counters_for(device: torch.device, n: int) -> torch.Tensor:
    """The device's arrival counters (at least ``n``, zero between launches; one launch at a
    time: calls that may overlap on two streams pass their own, see :func:`skinny_gemm`).
    Allocating inside CUDA-graph capture would zero them only at replays, so that raises:
    call once outside capture (``skinny_gemm`` does on its first eager call)."""
    buf = arrival_counters(_counters, device, n, _MIN_COUNTERS)
    if buf is None:
        raise RuntimeError(f"skinny_gemm: {n} arrival counters needed inside CUDA-graph "
                           "capture but fewer allocated; run one eager call of the largest "
                           "shape first")
    return buf


def _sms(device: torch.device) -> int:
    return num_sms(device, 2)


PDL_ENV = "SGLANG_DDTREE_SKINNY_PDL"
_PDL_ONE = " (each program waits for the launch before it first)"  # what mode 1 does


def parse_pdl(value) -> int:
    """A PDL mode as given (``0`` / ``1``; _device.parse_switch); ValueError otherwise."""
    return parse_switch(PDL_ENV, value, _PDL_ONE)


def pdl_mode(device: torch.device, mode=None) -> int:
    """A launch's PDL mode (module docstring): ``mode`` if given, else ``SGLANG_DDTREE_SKINNY_PDL``
    (read per call), else 0. Raises ValueError for another value, or for mode 1 where the
    device cannot run it (the portable path, a GPU before sm_90; _device.pdl_switch)."""
    return pdl_switch(PDL_ENV, device, mode, _PDL_ONE)


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                config: SkinnyConfig | None = None,
                counters: torch.Tensor | None = None, pdl=None) -> torch.Tensor:
    """``x @ w.T`` for ``x [M, K]`` bf16 (M <= 64, unit column stride) and ``w [N, K]`` bf16
    contiguous; CUDA-graph safe after one eager call of the shape (see the module docstring).

    ``counters``: int32 arrival counters of this call site (at least ``N // block_n``, zero
    between launches), for calls that may run at the same time as another split launch on a
    second stream (the device's shared buffer is for one launch at a time).

    ``pdl``: the launch's PDL mode (:func:`pdl_mode`; None: the environment's, else 0).

    Returns ``[M, N]`` bf16, or ``out`` if given: ``[M, N]`` bf16 or fp32 (the fp32 sums
    stored unrounded), unit column stride."""
    m, k = x.shape
    n = w.shape[0]
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise ValueError(f"skinny_gemm: bf16 x and w expected, got {x.dtype} and {w.dtype}")
    if tuple(w.shape) != (n, k) or not w.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"skinny_gemm: x [M, K] with unit column stride and w [N, K] "
                         f"contiguous expected, got x {tuple(x.shape)} strides {x.stride()}, "
                         f"w {tuple(w.shape)} strides {w.stride()}")
    if not 1 <= m <= MAX_M:
        raise ValueError(f"skinny_gemm: 1 <= M <= {MAX_M} rows, got {m}")
    cfg = config or default_config(n, k, _sms(x.device))
    if n % cfg.block_n or k % (cfg.block_k * cfg.split_k):
        raise ValueError(f"skinny_gemm: {cfg} does not tile N {n} / K {k}")
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    elif (tuple(out.shape) != (m, n) or out.dtype not in (torch.bfloat16, torch.float32)
          or out.stride(1) != 1):
        raise ValueError(f"skinny_gemm: out [{m}, {n}] bf16 or fp32 expected, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    block_m = block_m_for(m)
    n_tiles = n // cfg.block_n
    if cfg.split_k > 1:
        part = torch.empty(cfg.split_k * block_m * n, dtype=torch.float32, device=x.device)
        cnt = counters if counters is not None else counters_for(x.device, n_tiles)
        if cnt.dtype != torch.int32 or cnt.numel() < n_tiles:
            raise ValueError(f"skinny_gemm: {n_tiles} int32 counters needed, got "
                             f"{cnt.numel()} {cnt.dtype}")
    else:
        part = cnt = out  # unused
    opts = {"PDL": 1, "launch_pdl": True} if pdl_mode(x.device, pdl) else {}
    _skinny_gemm_kernel[(n_tiles * cfg.split_k,)](
        x, w, out, part, cnt, m, x.stride(0), out.stride(0), N=n, K=k, BLOCK_M=block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        PORTABLE=portable(x.device), num_warps=cfg.num_warps,
        num_stages=launch_stages(cfg, block_m), **opts)
    return out


def skinny_gemm_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 ``x @ w.T`` (the oracle of the tests)."""
    return x.float() @ w.float().t()
