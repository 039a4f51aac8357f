"""The step's inputs before the drafter runs, in one launch.

Each decode step needs, per request: the KV slots of positions prefix .. prefix + W - 1 (the
verify tree's, reserved ahead by SGLang; the drafter block uses the first B), the drafter
block's token ids ``[root, MASK x (B - 1)]`` and its positions ``prefix + 0 .. B - 1``, and the
prefix lengths themselves as int64 (a snapshot the accept/commit graph reads in place, so that a
step copies neither the slots nor the lengths into it). As torch ops that is about ten small
kernels and as many host calls per step (index arithmetic, a gather, a fill, a copy);
:class:`StepPrep` writes all four in one Triton launch into per-batch-size buffers.
:func:`prepare_step_reference` is the same in torch ops (the CPU path and the tests' oracle).
"""

from __future__ import annotations

import logging
from typing import Dict, Optional, Tuple

import torch

from .verify import gather_slots

try:  # Triton is present wherever SGLang is
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

logger = logging.getLogger(__name__)


def prepare_step_reference(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                           prefix: torch.Tensor, bonus: torch.Tensor, width: int, block: int,
                           mask_token_id: int) -> Tuple[torch.Tensor, ...]:
    """(slots [bs, width] int64, block_ids [bs, block] int64, positions [bs, block] int64,
    prefix [bs] int64).

    slots[b, j] = req_to_token[req_pool_indices[b], prefix[b] + j]; block_ids = [bonus[b],
    mask_token_id, ...]; positions[b, j] = prefix[b] + j; the last is a copy of prefix.
    """
    bs = prefix.shape[0]
    dev = prefix.device
    slots = gather_slots(req_to_token, req_pool_indices, prefix, width)
    block_ids = torch.full((bs, block), int(mask_token_id), dtype=torch.int64, device=dev)
    block_ids[:, 0].copy_(bonus)
    positions = prefix.to(torch.int64)[:, None] + torch.arange(block, device=dev,
                                                               dtype=torch.int64)
    return slots, block_ids, positions, prefix.to(torch.int64, copy=True)


if triton is not None:

    @triton.jit
    def _step_prep_kernel(req_to_token_ptr, r2t_stride, rpi_ptr, prefix_ptr, bonus_ptr,
                          slots_ptr, block_ids_ptr, positions_ptr, prefix_out_ptr, mask_token_id,
                          W: tl.constexpr, B: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        p = tl.load(prefix_ptr + b).to(tl.int64)
        r = tl.load(rpi_ptr + b).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        in_w = offs < W
        loc = tl.load(req_to_token_ptr + r * r2t_stride + p + offs, mask=in_w, other=0)
        tl.store(slots_ptr + b * W + offs, loc.to(tl.int64), mask=in_w)
        in_b = offs < B
        root = tl.load(bonus_ptr + b).to(tl.int64)
        ids = tl.where(offs == 0, root, tl.zeros([BLOCK], tl.int64) + mask_token_id)
        tl.store(block_ids_ptr + b * B + offs, ids, mask=in_b)
        tl.store(positions_ptr + b * B + offs, p + offs, mask=in_b)
        tl.store(prefix_out_ptr + b, p)


class StepPrep:
    """:func:`prepare_step_reference` as one Triton launch per step on CUDA, into buffers kept
    per batch size (no allocation per step; the step reads them before the next one writes).
    ``use_kernel=False`` (or a CPU device, or no Triton) runs the torch ops."""

    def __init__(self, width: int, block: int, mask_token_id: int, device,
                 use_kernel: bool = True):
        self.width, self.block, self.mask_token_id = int(width), int(block), int(mask_token_id)
        self.device = torch.device(device)
        self.use_kernel = bool(use_kernel) and triton is not None and self.device.type == "cuda"
        self._bufs: Dict[int, Tuple[torch.Tensor, ...]] = {}

    def __call__(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                 prefix: torch.Tensor, bonus: torch.Tensor):
        if not self.use_kernel:
            return prepare_step_reference(req_to_token, req_pool_indices, prefix, bonus,
                                          self.width, self.block, self.mask_token_id)
        bs = prefix.shape[0]
        bufs = self.buffers(bs)
        if bs == 0:
            return bufs
        slots, block_ids, positions, prefix_out = bufs
        _step_prep_kernel[(bs,)](
            req_to_token, req_to_token.stride(0), req_pool_indices, prefix, bonus,
            slots, block_ids, positions, prefix_out, self.mask_token_id,
            W=self.width, B=self.block,
            BLOCK=triton.next_power_of_2(max(self.width, self.block)))
        return bufs

    def buffers(self, bs: int) -> Optional[Tuple[torch.Tensor, ...]]:
        """The (slots, block_ids, positions, prefix) buffers every step at batch size ``bs``
        writes (allocated zeroed on first use), or None where the torch ops serve (fresh
        tensors each step). The worker's start-up capture hands the slots and prefix buffers to
        the accept/commit graph, which then reads them in place."""
        if not self.use_kernel:
            return None
        bufs = self._bufs.get(bs)
        if bufs is None:
            i64 = dict(dtype=torch.int64, device=self.device)
            bufs = self._bufs[bs] = (torch.zeros(bs, self.width, **i64),
                                     torch.zeros(bs, self.block, **i64),
                                     torch.zeros(bs, self.block, **i64),
                                     torch.zeros(bs, **i64))
        return bufs

    def self_check(self, req_to_token: torch.Tensor) -> bool:
        """Compare the kernel with the torch ops once on this pool's ``req_to_token`` (random
        requests and lengths, read only); on a difference or an error log it and use the ops
        from now on. Synchronizes: call at start-up only. Returns whether the kernel serves."""
        if not self.use_kernel:
            return False
        rows, cols = req_to_token.shape
        if cols <= self.width:
            return True  # nothing to draw from; the step shapes are checked by SGLang
        g = torch.Generator(device="cpu").manual_seed(0)
        try:
            for bs in (1, 5):
                rpi = torch.randint(0, rows, (bs,), generator=g).to(self.device)
                prefix = torch.randint(0, cols - self.width, (bs,), generator=g).to(self.device)
                bonus = torch.randint(0, 1000, (bs,), generator=g).to(self.device)
                got = self(req_to_token, rpi, prefix, bonus)
                want = prepare_step_reference(req_to_token, rpi, prefix, bonus, self.width,
                                              self.block, self.mask_token_id)
                if not all(torch.equal(a, b) for a, b in zip(got, want)):
                    raise RuntimeError(f"differs from the torch ops (bs={bs})")
        except Exception as e:  # noqa: BLE001 -- logged, then the torch ops serve
            logger.error("sglang_ddtree: the step-prep kernel failed its start-up check (%s: %s);"
                         " using torch ops", type(e).__name__, e)
            self.use_kernel = False
            return False
        logger.info("sglang_ddtree: step-prep kernel passed the start-up check")
        return True
