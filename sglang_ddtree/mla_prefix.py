"""MLA tree verify with the prefix part on FlashMLA (``SGLANG_DDTREE_MLA_PREFIX``: ``auto``, the
default since session 34, or ``flashmla``).

A tree verify's attention splits in two: every tree row attends its request's whole prefix with
no mask, and the tree tokens (at most budget + 1 keys) under the ancestor mask. The first part is
exactly a non-causal multi-token decode, which FlashMLA's dense sm_90 kernel does over paged
latent rows (up to 660 TFLOP/s on an H800 by its authors' count; our Triton kernel reaches
60-200 TFLOP/s at MLA points on the H200, ``bench_results/tree_verify_h200.json``). This module runs that
part on FlashMLA (``sgl_kernel.flash_mla``, shipped with SGLang 0.5.17) and hands its output and
log-sum-exp to our tree kernel, which attends only the tree keys and merges the two
(``TreeAttention.run(prefix_out=, prefix_lse=)``).

Requirements, checked at start-up (:func:`problems`): an MLA target with 576-dim latent rows
(512 + 64) and 512-dim values, KV pages of 64 tokens (``--page-size 64``, FlashMLA's page), a bf16
KV cache, no logit cap, a Hopper GPU (FlashMLA's dense decode kernel is sm_90a), and FlashMLA
importable. Named explicitly (``flashmla``), anything else is refused at start-up with the reason
(never a silent fallback); under ``auto`` our kernel attends the whole tree verify instead and the
start-up log says why.

CUDA graphs: the page table, prefix lengths and FlashMLA's tile-scheduler metadata of a verify
batch are computed outside the graph (``prepare``, before replay) into buffers sized at
``init_cuda_graph_state`` (FlashMLA's metadata has a shape that depends on the GPU and the rows
per request, not on the batch), as SGLang's own flashmla backend does for its decode graphs.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from . import prefix_kernel

PAGE = 64                 # FlashMLA's page_block_size
LATENT_DIM, V_DIM = 576, 512  # the only head dims FlashMLA's dense decode kernel has


def load_flashmla() -> Tuple[Callable, Callable]:
    """(get_mla_metadata, flash_mla_with_kvcache) from sgl_kernel; raises ImportError naming
    why they are not usable."""
    from sgl_kernel import flash_mla

    err = getattr(flash_mla, "_flashmla_import_error", None)
    if err is not None:
        raise ImportError(f"sgl_kernel.flash_mla could not load its extension: {err}")
    return flash_mla.get_mla_metadata, flash_mla.flash_mla_with_kvcache


def machine_problems(device: torch.device) -> list:
    """Why FlashMLA's kernel cannot run on ``device`` (empty: it can): CUDA, a Hopper GPU
    (its dense decode kernel is sm_90a), and FlashMLA importable."""
    return prefix_kernel.machine_problems(
        device, "FlashMLA", "sm_90a (its dense decode kernel): H100 / H200",
        lambda cap: tuple(cap) == (9, 0), load_flashmla)


def problems(model_runner, layer_keys, device: torch.device, kernel: bool = True) -> list:
    """Why the FlashMLA prefix cannot serve this target (empty: it can). ``kernel=False``
    leaves out what only FlashMLA's own kernel needs (its dims, the machine), for a stand-in
    with the same contract (tests)."""
    out = []
    if len({key.q_heads for key in layer_keys}) > 1:
        out.append(f"layers with different head counts {sorted({k.q_heads for k in layer_keys})}")
    for key in layer_keys:
        if kernel and (key.qk_dim, key.v_dim) != (LATENT_DIM, V_DIM):
            out.append(f"latent rows of {key.qk_dim} dims with {key.v_dim}-dim values "
                       f"(FlashMLA's kernel has {LATENT_DIM} / {V_DIM})")
        if key.logit_cap:
            out.append(f"a logit cap ({key.logit_cap}; FlashMLA has none)")
    page = int(getattr(model_runner, "page_size", 1) or 1)
    if page != PAGE:
        out.append(f"KV pages of {page} tokens (serve with --page-size {PAGE}: FlashMLA's page)")
    kv_dtype = getattr(model_runner, "kv_cache_dtype", torch.bfloat16)
    if kv_dtype != torch.bfloat16:
        out.append(f"a {kv_dtype} KV cache (FlashMLA's fp8 path needs fp8 queries; serve with a "
                   "bf16 KV cache)")
    return out + (machine_problems(device) if kernel else [])


class FlashMLAPrefix:
    """The prefix part of one verify batch on FlashMLA, for trees of ``num_tree_tokens`` rows
    per request and ``num_heads`` query heads (one latent KV head).

    ``prepare`` (outside any graph) fills the page table, prefix lengths and scheduler metadata
    of a batch; ``run`` (inside the graph) returns ``(out [bs * N, H, 512], lse [bs, H, N])``.
    ``fns`` replaces FlashMLA's two functions (tests).
    """

    def __init__(self, *, num_tree_tokens: int, num_heads: int, context_width: int,
                 device, v_dim: int = V_DIM, fns: Optional[Tuple[Callable, Callable]] = None):
        self.n = int(num_tree_tokens)
        self.heads = int(num_heads)
        self.v_dim = int(v_dim)
        self.pages = -(-int(context_width) // PAGE)  # page columns of a req_to_token row
        self.device = torch.device(device)
        self._get_metadata, self._attend = fns if fns is not None else load_flashmla()
        self._max_bs = 0
        self.block_table = self.seq_lens = self.sched = self.splits = None
        self._eager = None  # (block_table, seq_lens, sched, splits) of an eager batch

    # --- buffers ---------------------------------------------------------------------------
    def init_graph_buffers(self, max_bs: int) -> None:
        """Static buffers for graph batches of up to ``max_bs`` requests (allocates)."""
        if max_bs <= self._max_bs:
            return
        self.block_table = torch.zeros((max_bs, self.pages), dtype=torch.int32,
                                       device=self.device)
        self.seq_lens = torch.ones((max_bs,), dtype=torch.int32, device=self.device)
        sched, splits = self._metadata(self.seq_lens)
        self.sched = torch.zeros_like(sched)
        self.splits = torch.zeros((max_bs + 1,), dtype=splits.dtype, device=self.device)
        self._max_bs = max_bs

    def _metadata(self, seq_lens: torch.Tensor):
        return self._get_metadata(seq_lens, self.n * self.heads, 1)

    # --- per batch (outside graphs) ----------------------------------------------------------
    def prepare(self, table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                static: bool) -> None:
        """Page table, prefix lengths and metadata of a batch. ``table[rows[b]]`` holds request
        b's token slots (pages of 64 contiguous slots); ``seq_lens`` its prefix lengths.
        ``static``: into the graph buffers (a captured ``run`` reads them)."""
        bs = int(rows.shape[0])
        # slot of each page's first token: only those columns are gathered (a row is as wide
        # as the longest context, 64x the page count)
        first_slots = table[:, ::PAGE].index_select(0, rows)
        if static:
            if bs > self._max_bs:
                raise RuntimeError(f"FlashMLA prefix: graph batch {bs} but buffers for "
                                   f"{self._max_bs} (init_graph_buffers not called)")
            self.block_table[:bs, :first_slots.shape[1]].copy_(first_slots // PAGE)
            self.seq_lens[:bs].copy_(seq_lens)
            sched, splits = self._metadata(self.seq_lens[:bs])
            self.sched.copy_(sched)
            self.splits[:bs + 1].copy_(splits)
            self._eager = None
        else:
            lens = seq_lens.to(torch.int32)
            self._eager = ((first_slots // PAGE).to(torch.int32).contiguous(), lens,
                           *self._metadata(lens))

    # --- per layer (graph-safe) --------------------------------------------------------------
    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, sm_scale: float):
        """``q [bs * N, H, 576]`` (absorbed, rope applied), ``kv_cache [slots, 1, 576]`` (the
        layer's latent pool rows). Returns the prefix-only ``(out [bs * N, H, 512], lse
        [bs, H, N] fp32)``, lse in natural log. FlashMLA packs each request's N x H query rows
        against its one latent head, so every page row it loads serves all of them."""
        bs = q.shape[0] // self.n
        if self._eager is not None:
            block_table, lens, sched, splits = self._eager
        else:
            block_table, lens = self.block_table[:bs], self.seq_lens[:bs]
            sched, splits = self.sched, self.splits[:bs + 1]
        d = q.shape[-1]
        out, lse = self._attend(
            q.contiguous().view(bs, self.n, self.heads, d),  # FlashMLA views q itself
            kv_cache.view(-1, PAGE, 1, d), block_table,
            lens, self.v_dim, sched, splits, softmax_scale=sm_scale, causal=False)
        return out.view(bs * self.n, self.heads, -1), lse
