"""The accepted path's KV relocation for every layer and path column in one Triton launch.

``commit.kv_moves`` gives, per request, B-1 (dst, src) slot pairs that must be applied column by
column (see its ordering note). SGLang's ``move_kv_cache`` moves one column per call: for an MHA
pool that is one Triton launch per column, for an MLA pool a gather and a scatter per layer per
column -- 61 layers x 15 columns x 2 = 1830 kernels per step for a Kimi-K2-shaped model, even
inside a CUDA graph. Here one program per (request, layer buffer) walks the columns in order and
copies each slot row with plain loads and stores, so one launch does the whole relocation.

Only pools whose layout is known are taken: SGLang's ``MHATokenToKVPool`` (per-layer K and V
buffers ``[slots, heads, dim]``) and ``MLATokenToKVPool`` (per-layer latent buffers
``[slots, 1, kv_lora_rank + rope]``), contiguous, without scale buffers. Anything else keeps
SGLang's ``move_kv_cache`` per column (``path_kv_mover`` returns None).
"""

from __future__ import annotations

from typing import List, Optional

import torch
import triton
import triton.language as tl

_POOL_BUFFERS = {
    "MHATokenToKVPool": ("k_buffer", "v_buffer"),
    "MLATokenToKVPool": ("kv_buffer",),
}
_SCALE_ATTRS = ("k_scale_buffer", "v_scale_buffer", "kv_scale_buffer")
_WORDS = ((4, tl.int32, torch.int32), (2, tl.int16, torch.int16), (1, tl.int8, torch.int8))


@triton.jit
def _move_path_kv_kernel(
    table_ptr,  # [L] int64: data pointer of each layer buffer
    row_words_ptr,  # [L] int64: words per slot row of each buffer
    dst_ptr,  # [bs, C] int64 destination slots, column j = path position j + 1
    src_ptr,  # [bs, C] int64 source slots (== dst past the accepted length: no-op)
    stride_b,  # row stride of dst / src (elements)
    NUM_COLS: tl.constexpr,  # B - 1 path columns (the drafter block is fixed per server)
    MAX_ROW: tl.constexpr,  # the longest row in words (loop bound; shorter rows are masked)
    WORD: tl.constexpr,  # tl.int32 / tl.int16 / tl.int8: the copy unit
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    layer = tl.program_id(1)
    base = tl.load(table_ptr + layer).to(tl.pointer_type(WORD))
    row = tl.load(row_words_ptr + layer)
    offs = tl.arange(0, BLOCK)
    for j in range(NUM_COLS):
        d = tl.load(dst_ptr + b * stride_b + j)
        s = tl.load(src_ptr + b * stride_b + j)
        if d != s:
            for start in range(0, MAX_ROW, BLOCK):
                m = start + offs < row
                v = tl.load(base + s * row + start + offs, mask=m)
                tl.store(base + d * row + start + offs, v, mask=m)
        # column j must be read before a later column overwrites its source slot: the same
        # thread touches the same word offset in every column, and the barrier orders warps
        tl.debug_barrier()


class PathKVMover:
    """One launch per step over a fixed set of per-layer slot-row buffers."""

    def __init__(self, buffers: List[torch.Tensor]):
        if not buffers:
            raise ValueError("PathKVMover: no buffers")
        device = buffers[0].device
        row_bytes = [b[0].numel() * b.element_size() for b in buffers]
        for size, tl_word, _ in _WORDS:
            if all(r % size == 0 and b.data_ptr() % size == 0 for r, b in zip(row_bytes, buffers)):
                self.word, self.word_bytes = tl_word, size
                break
        self.table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64,
                                  device=device)
        self.row_words = torch.tensor([r // self.word_bytes for r in row_bytes],
                                      dtype=torch.int64, device=device)
        self.max_row = max(r // self.word_bytes for r in row_bytes)
        self.block = min(1024, triton.next_power_of_2(self.max_row))
        self.buffers = buffers  # keep the storage the table points at alive

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Apply the [bs, C] (dst, src) slot columns of ``commit.kv_moves``, in column order."""
        bs, cols = dst.shape
        if bs == 0 or cols == 0:
            return
        dst = dst.to(torch.int64).contiguous()
        src = src.to(torch.int64).contiguous()
        grid = (bs, self.table.numel())
        _move_path_kv_kernel[grid](self.table, self.row_words, dst, src, dst.stride(0),
                                   NUM_COLS=cols, MAX_ROW=self.max_row, WORD=self.word,
                                   BLOCK=self.block)


def _buffers_of(pool) -> Optional[List[torch.Tensor]]:
    names = _POOL_BUFFERS.get(type(pool).__name__)
    if names is None:
        return None
    if any(getattr(pool, a, None) is not None for a in _SCALE_ATTRS):
        return None
    # one slot = one contiguous row only in the token-major layout ([slots, heads, dim]);
    # 0.5.17's use_hnd and 0.5.23's kv_cache_layout "hnd" / "vectorized_5d" index pages
    if getattr(pool, "use_hnd", False) or getattr(pool, "kv_cache_layout", "nhd") != "nhd":
        return None
    bufs = []
    for name in names:
        layer_bufs = getattr(pool, name, None)
        if not isinstance(layer_bufs, (list, tuple)) or not layer_bufs:
            return None
        for t in layer_bufs:
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or not t.is_contiguous():
                return None
            bufs.append(t)
    return bufs


def path_kv_mover(pool) -> Optional[PathKVMover]:
    """The pool's one-launch mover (built once, cached on the pool), or None if its layout is
    not one this kernel knows (then SGLang's ``move_kv_cache`` runs per column)."""
    cached = getattr(pool, "_ddtree_path_kv_mover", False)
    if cached is not False:
        return cached
    bufs = _buffers_of(pool)
    mover = PathKVMover(bufs) if bufs is not None else None
    try:
        pool._ddtree_path_kv_mover = mover
    except AttributeError:  # a pool with __slots__: rebuild each time (cheap, but say so)
        pass
    return mover
