"""MLA's absorbed per-head projections for verify-sized token counts:
``out[h, t, :] = a[h, t, :] @ w[h]`` for ``a [H, T, K]``, ``w [H, K, N]`` (``torch.bmm``'s
arguments), fp32 accumulation, bf16 out.

Why. SGLang's DeepSeek-family absorbed attention runs two such products a layer, as
``torch.bmm`` (cuBLAS): ``q_nope W_UK`` before the attention (``w_kc`` [H, 128, 512]) and
``o W_UV`` after it (``w_vc`` [H, 512, 128]). Each reads only H x 128 x 512 bf16 weights (1 MB
on a Kimi K2.6 TP8 rank, H = 8), so its time is launch and latency, and cuBLAS picks split-K
tiles with a second reduce kernel at verify-sized T: session 32's profile of the 8-layer Kimi
rank (``bench_results/profile_step_kimi_l8_int4_ar_b31_b32_h200_s32.json``, H200) had the two
at 9.6 + 5.8 us (+ 2.2 us of split-K reduce) a layer in a budget-31 verify against 6.4 + 4.5 us
in an AR decode step.

How. One program per (head, ``BLOCK_N`` output columns, ``BLOCK_T`` token rows) walks K in
``BLOCK_K`` steps with no split (K is 128 or 512 here), so one launch and no partials. SGLang
stores both weights K-contiguous (``w.stride(1) == 1``: its loader keeps ``w_kc`` and ``w_vc``
as transposed views of row-major ``[H, N, K]`` data), so every weight load reads whole
128-byte runs along K; ``a`` and ``out`` take any token / head strides with a unit last stride
(the model passes ``q_nope.transpose(0, 1)`` and writes into a transposed ``out=`` view).
``SWAP`` puts the weight tile on the MMA's M side (``acc^T [BLOCK_N, BLOCK_T] = w^T a^T``), as
:mod:`.skinny_gemm` does for wide weights and few tokens.

:func:`absorb_bmm` is launch-only and CUDA-graph safe. The ``PORTABLE`` path
(``TRITON_INTERPRET=1``, CPU, pre-Ampere) dots in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._device import portable

MAX_BLOCK_T = 64  # token rows one program takes; more rows -> more programs along T


@triton.jit
def _absorb_bmm_kernel(
    a_ptr,  # [H, T, K] bf16, strides (stride_ah, stride_at, 1)
    w_ptr,  # [H, K, N] bf16, strides (stride_wh, 1, stride_wn)
    o_ptr,  # [H, T, N] bf16 out, strides (stride_oh, stride_ot, 1)
    T,
    stride_ah,
    stride_at,
    stride_wh,
    stride_wn,
    stride_oh,
    stride_ot,
    K: tl.constexpr,
    N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP: tl.constexpr,
    PORTABLE: tl.constexpr,
):
    tl.static_assert(K % BLOCK_K == 0)
    tl.static_assert(N % BLOCK_N == 0)
    N_TILES: tl.constexpr = N // BLOCK_N
    pid = tl.program_id(0)  # a head's column tiles are neighbours: they read one weight
    h = pid // N_TILES
    offs_n = (pid % N_TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    t_ok = offs_t < T
    a_base = a_ptr + h.to(tl.int64) * stride_ah
    w_base = w_ptr + h.to(tl.int64) * stride_wh
    if SWAP:
        # acc^T [BLOCK_N, BLOCK_T] = w^T [BLOCK_N, BLOCK_K] @ a^T [BLOCK_K, BLOCK_T]
        w_ptrs = w_base + offs_n[:, None] * stride_wn + offs_k[None, :]
        a_ptrs = a_base + offs_t[None, :].to(tl.int64) * stride_at + offs_k[:, None]
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        for _ in range(K // BLOCK_K):
            wt = tl.load(w_ptrs)
            at = tl.load(a_ptrs, mask=t_ok[None, :], other=0.0)
            if PORTABLE:
                acc += tl.dot(wt.to(tl.float32), at.to(tl.float32))
            else:
                acc = tl.dot(wt, at, acc)
            w_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
        o_ptrs = (o_ptr + h.to(tl.int64) * stride_oh + offs_t[None, :].to(tl.int64) * stride_ot
                  + offs_n[:, None])
        tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=t_ok[None, :])
    else:
        # acc [BLOCK_T, BLOCK_N] = a [BLOCK_T, BLOCK_K] @ w [BLOCK_K, BLOCK_N]
        a_ptrs = a_base + offs_t[:, None].to(tl.int64) * stride_at + offs_k[None, :]
        w_ptrs = w_base + offs_k[:, None] + offs_n[None, :] * stride_wn
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for _ in range(K // BLOCK_K):
            at = tl.load(a_ptrs, mask=t_ok[:, None], other=0.0)
            wt = tl.load(w_ptrs)
            if PORTABLE:
                acc += tl.dot(at.to(tl.float32), wt.to(tl.float32))
            else:
                acc = tl.dot(at, wt, acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        o_ptrs = (o_ptr + h.to(tl.int64) * stride_oh + offs_t[:, None].to(tl.int64) * stride_ot
                  + offs_n[None, :])
        tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=t_ok[:, None])


@dataclass(frozen=True)
class AbsorbConfig:
    """Tiles of one launch (``block_t`` follows T: 16, 32 or 64, see :func:`block_t_for`)."""

    block_n: int = 64
    block_k: int = 64
    swap: bool = True
    num_warps: int = 4
    num_stages: int = 2


def block_t_for(t: int) -> int:
    """A program's token rows for ``t`` tokens: 16, 32 or 64 (the MMA needs 16)."""
    return min(MAX_BLOCK_T, max(16, triton.next_power_of_2(t)))


def default_config(k: int, n: int) -> AbsorbConfig:
    """The served tiles: 64 columns of a head per program (64 programs at H = 8 for ``w_kc``'s
    N = 512), 16 for ``w_vc``'s N = 128 (again 64 programs), K in 64-row steps."""
    return AbsorbConfig(block_n=64 if n >= 512 else 16, block_k=64)


def check_shapes(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> str | None:
    """Why :func:`absorb_bmm` does not take these operands (None: it does)."""
    if a.dim() != 3 or w.dim() != 3:
        return f"a [H, T, K] and w [H, K, N] expected, got {tuple(a.shape)} and {tuple(w.shape)}"
    h, t, k = a.shape
    n = w.shape[2]
    if tuple(w.shape[:2]) != (h, k):
        return f"w [{h}, {k}, N] expected, got {tuple(w.shape)}"
    if a.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return f"bf16 a and w expected, got {a.dtype} and {w.dtype}"
    if a.device != w.device:
        return f"a on {a.device}, w on {w.device}"
    if a.stride(2) != 1 or w.stride(1) != 1:
        return (f"unit K strides expected (a's last, w's middle), got a {a.stride()} and "
                f"w {w.stride()}")
    cfg = default_config(k, n)
    if k % cfg.block_k or n % cfg.block_n or t < 1:
        return f"K {k} a multiple of {cfg.block_k}, N {n} of {cfg.block_n} and T >= 1 expected"
    if out is not None and (tuple(out.shape) != (h, t, n) or out.dtype != torch.bfloat16
                            or out.stride(2) != 1 or out.device != a.device):
        return (f"out [{h}, {t}, {n}] bf16 with a unit last stride expected, got "
                f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    return None


def absorb_bmm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
               config: AbsorbConfig | None = None) -> torch.Tensor:
    """``torch.bmm(a, w)`` for bf16 ``a [H, T, K]`` (unit last stride) and ``w [H, K, N]``
    (unit K stride: ``w.stride(1) == 1``); CUDA-graph safe.

    Returns ``[H, T, N]`` bf16: ``out`` if given (any head / token strides, unit last stride),
    else a new tensor laid out ``[T, H, N]`` (returned as its ``[H, T, N]`` transpose, so that
    the model's ``.transpose(0, 1)`` gives a contiguous ``[T, H, N]``)."""
    problem = check_shapes(a, w, out)
    if problem is not None:
        raise ValueError(f"absorb_bmm: {problem}")
    h, t, k = a.shape
    n = w.shape[2]
    cfg = config or default_config(k, n)
    if k % cfg.block_k or n % cfg.block_n:
        raise ValueError(f"absorb_bmm: {cfg} does not tile K {k} / N {n}")
    if out is None:
        out = torch.empty(t, h, n, dtype=torch.bfloat16, device=a.device).transpose(0, 1)
    block_t = block_t_for(t)
    grid = (h * (n // cfg.block_n), triton.cdiv(t, block_t))
    _absorb_bmm_kernel[grid](
        a, w, out, t, a.stride(0), a.stride(1), w.stride(0), w.stride(2), out.stride(0),
        out.stride(1), K=k, N=n, BLOCK_T=block_t, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SWAP=cfg.swap, PORTABLE=portable(a.device), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out


def absorb_bmm_reference(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 ``a @ w`` per head (the oracle of the tests)."""
    return torch.bmm(a.float(), w.float())
