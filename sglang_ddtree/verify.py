"""Verify-forward inputs for a DDTree step: tokens, positions, KV slots and the tree mask.

Terms (root, node, depth, budget, accepted path) are defined in :mod:`sglang_ddtree.tree`.

The target verifies all N tokens in one TARGET_VERIFY forward: node i sits at position
``prefix + depth(i)`` and attends to the whole prefix and its ancestors. SGLang's tree-capable
backends (triton, flashinfer) read that as a FULL_MASK custom mask: per request an
``[N, prefix + N]`` row-major bool block (prefix columns all True, then the ancestor mask),
blocks concatenated over the batch. :func:`write_full_mask` writes it on the GPU with no host
sync, into a preallocated buffer, given device-side seq_lens.
"""

from __future__ import annotations

import torch

from .tree import full_mask_layout, full_mask_offsets

try:  # Triton is present wherever SGLang is; the CPU reference keeps tests independent of it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def full_mask_numel_bound(num_tokens: int, seq_lens_sum_bound: int, bs: int) -> int:
    """Host-side upper bound of the FULL_MASK length for ``bs`` requests of N tokens."""
    return num_tokens * seq_lens_sum_bound + num_tokens * num_tokens * bs


if triton is not None:

    @triton.jit
    def _full_mask_kernel(
        anc_ptr,  # [bs, N, N] bool (as uint8/int8)
        seq_lens_ptr,  # [bs] int64
        offsets_ptr,  # [bs] int64: start of request b's block in out
        out_ptr,  # [>= total] bool (as uint8/int8)
        N: tl.constexpr,
        BLOCK_COLS: tl.constexpr,
    ):
        b = tl.program_id(0)
        row = tl.program_id(1)
        s = tl.load(seq_lens_ptr + b)
        row_len = s + N
        row_start = tl.load(offsets_ptr + b) + row * row_len
        # prefix columns: all True; loop bound is data-dependent, the grid is not
        c0 = s * 0
        while c0 < s:
            cols = c0 + tl.arange(0, BLOCK_COLS)
            tl.store(out_ptr + row_start + cols, tl.full([BLOCK_COLS], 1, tl.int8), mask=cols < s)
            c0 += BLOCK_COLS
        # tree columns: the ancestor row
        for c0 in range(0, N, BLOCK_COLS):
            cols = c0 + tl.arange(0, BLOCK_COLS)
            m = cols < N
            anc = tl.load(anc_ptr + (b * N + row) * N + cols, mask=m, other=0)
            tl.store(out_ptr + row_start + s + cols, anc, mask=m)


def write_full_mask(
    ancestor_mask: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor
) -> None:
    """Write the FULL_MASK layout into ``out`` (bool, long enough) on the GPU; graph-capturable.

    Parameters
    ----------
    ancestor_mask : torch.Tensor
        [bs, N, N] bool, the tree's ancestor-or-self mask.
    seq_lens : torch.Tensor
        [bs] integer prefix lengths on the same device.
    out : torch.Tensor
        1-D bool buffer of at least ``sum(N * (seq_lens + N))`` elements.
    """
    bs, n, n2 = ancestor_mask.shape
    if n != n2 or seq_lens.shape != (bs,):
        raise ValueError(
            f"write_full_mask: ancestor_mask {tuple(ancestor_mask.shape)} must be [bs, N, N] and "
            f"seq_lens {tuple(seq_lens.shape)} must be [bs]"
        )
    if out.dtype != torch.bool or out.dim() != 1:
        raise ValueError(f"write_full_mask: out must be 1-D bool, got {out.dtype} {tuple(out.shape)}")
    if bs == 0:
        return
    if triton is None or not out.is_cuda:  # CPU: the torch-op layout (also the tests' oracle)
        full_mask_layout(ancestor_mask, seq_lens, out, full_mask_offsets(seq_lens, n))
        return
    _launch_full_mask(ancestor_mask, seq_lens, out)


def _launch_full_mask(ancestor_mask, seq_lens, out) -> None:
    bs, n, _ = ancestor_mask.shape
    lens = seq_lens.to(torch.int64)
    offsets = full_mask_offsets(lens, n)
    _full_mask_kernel[(bs, n)](
        ancestor_mask.view(torch.int8),
        lens,
        offsets,
        out.view(torch.int8),
        N=n,
        BLOCK_COLS=512,
    )


def write_verify_layout(tree, seq_lens: torch.Tensor, full_mask=None, positions=None):
    """The verify layout of ``tree`` in ops (what the fused tree kernel writes in its launch):
    the FULL_MASK into ``full_mask`` if given, and the positions, into ``positions`` if given;
    returns the positions."""
    if full_mask is not None:
        write_full_mask(tree.ancestor_mask, seq_lens, full_mask)
    pos = tree_positions(tree.depths, seq_lens)
    if positions is None:
        return pos
    positions.copy_(pos)
    return positions


def tree_positions(depths: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """[bs, N] int64 positions: prefix length + node depth."""
    return seq_lens.to(torch.int64)[:, None] + depths


def gather_slots(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, width: int
) -> torch.Tensor:
    """[bs, width] int64 KV slots req_to_token[req, prefix : prefix + width] (reserved ahead)."""
    cols = seq_lens.to(torch.int64)[:, None] + torch.arange(
        width, device=seq_lens.device, dtype=torch.int64
    )
    return req_to_token[req_pool_indices.to(torch.int64)[:, None], cols].to(torch.int64)
