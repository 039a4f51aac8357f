"""Pure-PyTorch oracle for the fused W4A16 MoE (``moe_w4a16.py``).

It dequantizes each touched expert's int4 weights to fp32 and runs the whole MoE in fp32:
``out[m] = scale * sum_k w[m, k] * (silu(x[m] @ G_e) * (x[m] @ U_e)) @ D_e`` with ``e = ids[m, k]``,
``[G_e | U_e] = W13_e`` (gate columns first, then up columns).

Weight layout (the one SGLang 0.5.17's compressed-tensors WNA16 MoE method loads; see
``sglang_ddtree/moe_hook.py``): a weight ``W`` of logical shape ``[E, K, N]`` (input dim K, output
dim N) is stored as ``packed[E, K // 8, N]`` int32 where bits ``4j .. 4j+3`` of ``packed[e, r, n]``
hold ``q + 8`` for ``q = Q[e, 8 r + j, n]`` in ``[-8, 7]`` (compressed-tensors ``pack_to_int32``:
offset to unsigned, little-endian nibbles along the input dim), and ``scale[E, K // 32, N]``
(bf16) so that ``W[e, k, n] = Q[e, k, n] * scale[e, k // 32, n]``.

No SGLang or Triton import here: this module is the oracle for tests and benchmarks.
"""
from __future__ import annotations

import torch

PACK_FACTOR = 8  # int4 values per int32
GROUP_SIZE = 32  # input-dim elements per scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack signed int4 values along dim 1 into int32 (test helper; inverse of ``unpack_int4``).

    Parameters
    ----------
    q : torch.Tensor
        ``[E, K, N]`` integer tensor with values in ``[-8, 7]``; ``K % 8 == 0``.

    Returns
    -------
    torch.Tensor
        ``[E, K // 8, N]`` int32, nibble ``j`` of row ``r`` holding ``q[:, 8 r + j, :] + 8``.
    """
    if q.dim() != 3 or q.shape[1] % PACK_FACTOR:
        raise ValueError(f"q: expected [E, K, N] with K % 8 == 0, got {tuple(q.shape)}")
    e, k, n = q.shape
    u = (q.to(torch.int64) + 8).view(e, k // PACK_FACTOR, PACK_FACTOR, n)
    shifts = (4 * torch.arange(PACK_FACTOR, device=q.device, dtype=torch.int64)).view(1, 1, -1, 1)
    packed = (u << shifts).sum(dim=2)  # < 2**32, fits int64
    # Reinterpret the unsigned 32-bit pattern as int32 (values >= 2**31 wrap negative).
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack ``[E, K // 8, N]`` int32 into signed int4 values ``[E, K, N]`` (int8, in [-8, 7])."""
    if packed.dim() != 3 or packed.dtype != torch.int32:
        raise ValueError(
            f"packed: expected [E, K//8, N] int32, got {tuple(packed.shape)} {packed.dtype}"
        )
    e, kp, n = packed.shape
    shifts = (4 * torch.arange(PACK_FACTOR, device=packed.device, dtype=torch.int32)).view(1, 1, -1, 1)
    nib = (packed.unsqueeze(2) >> shifts) & 0xF  # arithmetic shift; the mask drops sign bits
    return (nib - 8).to(torch.int8).reshape(e, kp * PACK_FACTOR, n)


def dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantize to fp32: ``W[e, k, n] = Q[e, k, n] * scale[e, k // 32, n]``.

    Parameters
    ----------
    packed : torch.Tensor
        ``[E, K // 8, N]`` int32.
    scale : torch.Tensor
        ``[E, K // 32, N]`` (any float dtype).

    Returns
    -------
    torch.Tensor
        ``[E, K, N]`` float32.
    """
    q = unpack_int4(packed).to(torch.float32)
    e, k, n = q.shape
    if tuple(scale.shape) != (e, k // GROUP_SIZE, n):
        raise ValueError(f"scale: expected {(e, k // GROUP_SIZE, n)}, got {tuple(scale.shape)}")
    s = scale.to(torch.float32).repeat_interleave(GROUP_SIZE, dim=1)
    return q * s


def moe_w4a16_reference(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    routed_scaling_factor: float = 1.0,
) -> torch.Tensor:
    """fp32 MoE forward over the int4 experts (SiLU-and-multiply gating, weighted top-k sum).

    Parameters
    ----------
    x : torch.Tensor
        ``[M, H]`` activations (any float dtype).
    w13_packed, w13_scale : torch.Tensor
        ``[E, H // 8, 2 I]`` int32 and ``[E, H // 32, 2 I]``; columns ``[0, I)`` gate, ``[I, 2I)`` up.
    w2_packed, w2_scale : torch.Tensor
        ``[E, I // 8, H]`` int32 and ``[E, I // 32, H]``.
    topk_weights : torch.Tensor
        ``[M, topk]`` routing weights.
    topk_ids : torch.Tensor
        ``[M, topk]`` expert ids; ids outside ``[0, E)`` (e.g. -1 for padding) contribute nothing.
    routed_scaling_factor : float
        Multiplies the summed output (SGLang applies it in its final top-k sum).

    Returns
    -------
    torch.Tensor
        ``[M, H]`` float32.
    """
    m, h = x.shape
    inter = w2_packed.shape[1] * PACK_FACTOR
    xf = x.to(torch.float32)
    out = torch.zeros(m, h, dtype=torch.float32, device=x.device)
    ids = topk_ids.to(torch.int64)
    wts = topk_weights.to(torch.float32)
    # Loop over touched experts only: dequantizing all 384 Kimi experts at once would need ~9 GB.
    num_experts = w13_packed.shape[0]
    for e in torch.unique(ids).tolist():
        if not 0 <= e < num_experts:  # -1 marks padding tokens in SGLang: no contribution
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w13 = dequantize(w13_packed[e : e + 1], w13_scale[e : e + 1])[0]  # [H, 2I]
        w2 = dequantize(w2_packed[e : e + 1], w2_scale[e : e + 1])[0]  # [I, H]
        gu = xf[tok] @ w13
        act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        out.index_add_(0, tok, (act @ w2) * wts[tok, slot].unsqueeze(1))
    return out * routed_scaling_factor


def make_random_moe(
    num_experts: int,
    hidden: int,
    inter: int,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Random packed experts in the SGLang-loaded layout (test and benchmark helper).

    Scales are chosen so that ``x @ W13`` and the down projection stay O(1) for unit-variance ``x``.

    Returns
    -------
    dict
        ``w13_packed [E, H//8, 2I] int32``, ``w13_scale [E, H//32, 2I] dtype``,
        ``w2_packed [E, I//8, H] int32``, ``w2_scale [E, I//32, H] dtype``.
    """
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)  # deterministic per device type

    def one(k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Draw packed words directly (every bit pattern is a valid set of 8 nibbles): cheap even for
        # Kimi's 384 x 7168 x 512 shapes, where materializing int8 values would take gigabytes.
        words = torch.randint(-(2**31), 2**31, (num_experts, k // PACK_FACTOR, n), generator=g,
                              dtype=torch.int64, device=device).to(torch.int32)
        base = 1.0 / (4.6 * k**0.5)  # E[q^2] = 21.5 for uniform q in [-8, 7]
        scale = base * (0.5 + torch.rand(num_experts, k // GROUP_SIZE, n, generator=g,
                                         device=device))
        return words, scale.to(dtype)

    w13_packed, w13_scale = one(hidden, 2 * inter)
    w2_packed, w2_scale = one(inter, hidden)
    return {"w13_packed": w13_packed, "w13_scale": w13_scale, "w2_packed": w2_packed,
            "w2_scale": w2_scale}
