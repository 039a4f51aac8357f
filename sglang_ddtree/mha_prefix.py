"""MHA / GQA tree verify with the prefix part on FlashAttention 3 (``SGLANG_DDTREE_MHA_PREFIX``:
``auto``, the default since session 34, or ``fa3``).

A tree verify's attention splits in two: every tree row attends its request's whole prefix with
no mask, and the tree tokens (at most budget + 1 keys) under the ancestor mask. The first part is
a non-causal multi-token decode over the paged KV cache, which FA3's warp-specialized sm_90
kernel (``sgl_kernel.flash_attn``, the kernel of SGLang's fa3 backend) runs at the memory floor
where our Triton kernel does not: on the H200, Qwen3-8B shapes, batch 8 x 65,536 keys x budget
16, fa3's whole tree verify took 598 us against our kernel's 970
(``bench_results/tree_verify_tail_mha_h200_s34.json``); Nsight Compute put FA3's prefix pass at
81 % of DRAM peak and ours at 46 %. This module runs that part on FA3 and hands its output and
log-sum-exp to our tree kernel, which attends only the tree keys and merges the two
(``TreeAttention.run(prefix_out=, prefix_lse=)``), in one launch instead of SGLang fa3
backend's expand pass and merge kernel.

Requirements, checked at start-up (:func:`problems`): an MHA / GQA target whose head dims FA3
has (q / k and v dims equal, at most 256), a bf16 or fp16 KV cache, no logit cap, a Hopper GPU
(FA3 is built for sm_90a), and FA3 importable. Named explicitly (``fa3``), anything else is
refused at start-up with the reason (never a silent fallback); under ``auto`` our kernel attends
the whole tree verify instead and the start-up log says why. Any page size: FA3 reads a page
table of the cache's pages.

CUDA graphs: FA3 takes the page table and prefix lengths as device tensors. At page size 1 the
page table is the verify backend's own snapshot of the batch's ``req_to_token`` rows (no copy);
at larger pages a static buffer of the pages' first slots / page size is filled outside the
graph (``prepare``). The kernel's split count is its host heuristic on static shapes, as in
SGLang's own fa3 decode graphs.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from . import prefix_kernel

MAX_HEAD_DIM = 256  # FA3's largest head dim


def load_fa3() -> Callable:
    """The prefix call on FA3: ``attend(q [b, s, hq, d], k_cache [pages, page, hkv, d],
    v_cache, page_table [b, pages] int32, cache_seqlens [b] int32, softmax_scale) -> (out
    [b, s, hq, d], lse [b, hq, s] fp32, natural log)``. Raises ImportError naming why FA3 is
    not usable."""
    from sgl_kernel.flash_attn import flash_attn_with_kvcache

    def attend(q, k_cache, v_cache, page_table, cache_seqlens, softmax_scale):
        out, lse, *_ = flash_attn_with_kvcache(
            q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table,
            cache_seqlens=cache_seqlens, softmax_scale=softmax_scale, causal=False,
            return_softmax_lse=True)
        return out, lse

    return attend


def machine_problems(device: torch.device) -> list:
    """Why FA3 cannot run on ``device`` (empty: it can): CUDA, a Hopper GPU, FA3 importable."""
    return prefix_kernel.machine_problems(device, "FA3", "sm_90a: H100 / H200",
                                          lambda cap: cap[0] == 9, load_fa3)


def problems(model_runner, layer_keys, device: torch.device, kernel: bool = True) -> list:
    """Why the FA3 prefix cannot serve this target (empty: it can). ``kernel=False`` leaves out
    the machine check, for a stand-in with the same contract (tests)."""
    out = []
    for key in layer_keys:
        if key.qk_dim != key.v_dim or key.qk_dim > MAX_HEAD_DIM:
            out.append(f"heads of {key.qk_dim} q / k dims and {key.v_dim} v dims (FA3 here: "
                       f"equal, at most {MAX_HEAD_DIM})")
        if key.logit_cap:
            out.append(f"a logit cap ({key.logit_cap}; the prefix merge takes none)")
    kv_dtype = getattr(model_runner, "kv_cache_dtype", torch.bfloat16)
    if kv_dtype not in (torch.bfloat16, torch.float16):
        out.append(f"a {kv_dtype} KV cache (serve with a bf16 or fp16 KV cache)")
    return out + (machine_problems(device) if kernel else [])


class FA3Prefix:
    """The prefix part of one MHA verify batch on FA3, for trees of ``num_tree_tokens`` rows per
    request over pages of ``page_size`` tokens.

    ``prepare`` (outside any graph) points at the batch's page table and prefix lengths; ``run``
    (inside the graph, per layer) returns ``(out [bs * N, Hq, Dv], lse [bs, Hq, N])``.
    ``fns`` replaces FA3's call (tests): a 1-tuple ``(attend,)`` with :func:`load_fa3`'s
    contract.
    """

    def __init__(self, *, num_tree_tokens: int, page_size: int, context_width: int, device,
                 table_dtype: torch.dtype = torch.int32, fns: Optional[Tuple[Callable]] = None):
        self.n = int(num_tree_tokens)
        self.page = int(page_size)
        # a graph batch's page table: the verify backend's req_to_token snapshot itself where
        # it is one (pages of one token, int32 slots as SGLang keeps them), else a buffer
        self._own_table = self.page > 1 or table_dtype != torch.int32
        self.pages = -(-int(context_width) // self.page)  # page columns of a req_to_token row
        self.device = torch.device(device)
        self._attend = fns[0] if fns is not None else load_fa3()
        self._max_bs = 0
        self.page_table = self.seq_lens = None
        self._batch = None  # (page_table, seq_lens) the next run reads

    def init_graph_buffers(self, max_bs: int) -> None:
        """Static buffers for graph batches of up to ``max_bs`` requests (allocates)."""
        if max_bs <= self._max_bs:
            return
        if self._own_table:
            self.page_table = torch.zeros((max_bs, self.pages), dtype=torch.int32,
                                          device=self.device)
        self.seq_lens = torch.ones((max_bs,), dtype=torch.int32, device=self.device)
        self._max_bs = max_bs

    def prepare(self, table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                static: bool) -> None:
        """Page table and prefix lengths of a batch. ``table[rows[b]]`` holds request b's token
        slots; ``seq_lens`` its prefix lengths. ``static``: into buffers a captured ``run``
        reads; at pages of one token with int32 slots ``table`` must then be a static snapshot
        whose first rows are the batch's (``rows`` = 0..bs-1, the verify backend's), read in
        place."""
        bs = int(rows.shape[0])
        if static:
            if bs > self._max_bs:
                raise RuntimeError(f"FA3 prefix: graph batch {bs} but buffers for "
                                   f"{self._max_bs} (init_graph_buffers not called)")
            if not self._own_table:  # the snapshot itself
                pages = table[:bs]
            else:  # each page's first slot, gathered for the batch's rows only
                first = table[:, ::self.page].index_select(0, rows)
                self.page_table[:bs, :first.shape[1]].copy_(first // self.page)
                pages = self.page_table[:bs]
            self.seq_lens[:bs].copy_(seq_lens)
            self._batch = (pages, self.seq_lens[:bs])
        else:
            first = table[:, ::self.page].index_select(0, rows)
            self._batch = ((first // self.page).to(torch.int32).contiguous(),
                           seq_lens.to(torch.int32))

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            sm_scale: float):
        """``q [bs * N, Hq, D]``, ``k_cache / v_cache [slots, Hkv, D]`` (the layer's pool
        buffers). Returns the prefix-only ``(out [bs * N, Hq, Dv], lse [bs, Hq, N] fp32)``, lse in
        natural log."""
        bs = q.shape[0] // self.n
        pages, lens = self._batch
        hq, d = q.shape[1], q.shape[2]
        whole = k_cache.shape[0] // self.page * self.page  # whole pages (a view either way)
        out, lse = self._attend(
            q.view(bs, self.n, hq, d),
            k_cache[:whole].view(-1, self.page, k_cache.shape[-2], k_cache.shape[-1]),
            v_cache[:whole].view(-1, self.page, v_cache.shape[-2], v_cache.shape[-1]),
            pages[:bs], lens[:bs], sm_scale)
        return out.view(bs * self.n, hq, -1), lse
