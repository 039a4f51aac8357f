"""The grouped int4 layout of the fused MoE's gate-up weights (experimental, opt-in).

SGLang's compressed-tensors packing puts 8 consecutive input rows in one int32 (nibble ``j`` of
word ``r`` is row ``8 r + j``), so each nibble plane the gate-up dots spans every scale group of
its K tile, and each weight must be offset and scaled on its own before the MMA (16 SASS
instructions a word on the H200's M = 8 band, where the gate-up issues about as many
instructions as the SMs can).

The grouped layout re-packs each 256-row K tile so that nibble ``j`` of word ``r`` is input row
``32 j + r`` of the tile: plane ``j`` is then scale group ``j``, and a plane's dot runs on the raw
``128 + n`` values (an ``lop3``, no offset, no scale); the -136 offset is one more dot against the
group's activation sum and the scale multiplies the plane's fp32 dot (``moe_tiles._mma8_grouped``).
Scales keep SGLang's layout. The repack runs once per weight tensor (``repack_grouped``); the
activations stay in natural order (``moe_align(grouped=True)`` adds each group's sum).
"""
from __future__ import annotations

import torch

TILE = 256  # input rows per re-packed K tile (8 groups of 32)


def unpack_sglang(packed: torch.Tensor) -> torch.Tensor:
    """``[E, K / 8, N]`` int32 in SGLang's packing -> ``[E, K, N]`` int32 nibbles (0..15)."""
    e, kw, n = packed.shape
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    q = (packed.unsqueeze(2) >> shifts.view(1, 1, 8, 1)) & 15  # [E, K/8, 8, N]: row 8 r + j
    return q.reshape(e, kw * 8, n)


def _pack(q: torch.Tensor) -> torch.Tensor:
    """``[..., 8, N]`` nibbles -> ``[..., N]`` int32, nibble j from index j (two's complement)."""
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    w = (q.to(torch.int64) << shifts.view(*([1] * (q.dim() - 2)), 8, 1)).sum(-2)
    return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)


def repack_grouped(packed: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    """SGLang's ``[E, K / 8, N]`` int32 packing -> the grouped layout (same shape): inside each
    256-row K tile, nibble ``j`` of word ``r`` holds input row ``32 j + r``. K must be a
    multiple of 256. ``chunk`` experts at a time (an int32 copy of their nibbles lives at once)."""
    e, kw, n = packed.shape
    k = kw * 8
    if k % TILE:
        raise ValueError(f"repack_grouped: K = {k} is not a multiple of {TILE}")
    out = torch.empty_like(packed)
    for e0 in range(0, e, chunk):
        q = unpack_sglang(packed[e0:e0 + chunk])  # [c, K, N]: row k
        c = q.shape[0]
        # row 256 t + 32 j + r -> word 32 t + r, nibble j
        q = q.view(c, k // TILE, 8, 32, n).permute(0, 1, 3, 2, 4)  # [c, t, r, j, N]
        out[e0:e0 + chunk] = _pack(q).reshape(c, kw, n)
    return out


def unpack_grouped(packed: torch.Tensor) -> torch.Tensor:
    """Inverse view of ``repack_grouped``: ``[E, K / 8, N]`` grouped -> ``[E, K, N]`` nibbles
    by input row (tests and references)."""
    e, kw, n = packed.shape
    k = kw * 8
    q = unpack_sglang(packed)  # [E, K, N]: index 8 w + j = (word w, nibble j)
    q = q.view(e, k // TILE, 32, 8, n).permute(0, 1, 3, 2, 4)  # [E, t, j, r, N]
    return q.reshape(e, k, n)
