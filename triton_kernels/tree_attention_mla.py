"""Tree-verify attention for absorbed MLA (DeepSeek / Kimi K2.x) over SGLang's paged latent cache.

In absorbed form every query head attends to one shared latent KV row per token:
``kv_cache[slot, 0, :] = [c_kv (kv_lora_rank) | k_rope (rope_dim)]``, e.g. 512 + 64. The query is
``[q_nope @ W_UK (kv_lora_rank) | q_rope (rope_dim)]``; the logit is the dot product over all
``kv_lora_rank + rope_dim`` dims; the value is the ``c_kv`` part, so the output has
``kv_lora_rank`` dims per head (the caller applies ``W_UV`` afterwards).

The kernel is the one of :mod:`.tree_attention` with ``SHARED_KV`` (the value tile is the key tile
already loaded, so each latent row is read once) and one KV head whose group is all query heads:
a program's rows are ``(tree token, head)`` pairs, so one latent tile serves every head and tree
token of the block. fp8 (e4m3) latent caches are upcast in registers; ``kv_scale`` multiplies both
the logits and the output.

:meth:`TreeAttentionMLA.plan` allocates (NOT graph-safe); :meth:`TreeAttentionMLA.run` is
launch-only and CUDA-graph safe.
"""
from __future__ import annotations

from typing import Optional

import torch

from .tree_attention import TreeAttention, _check
from .tree_attention_plan import KernelConfig


class TreeAttentionMLA(TreeAttention):
    """Absorbed-MLA tree-verify attention; see the module docstring."""

    @classmethod
    def plan(cls, *, max_batch_size: int, num_tree_tokens: int, num_heads: int,
             max_context_len: int, device, sm_scale: float, kv_lora_rank: int = 512,
             rope_dim: int = 64, logit_cap: float = 0.0, num_kv_splits: Optional[int] = None,
             config: Optional[KernelConfig] = None,
             merge_config: Optional[KernelConfig] = None) -> "TreeAttentionMLA":
        """Size and allocate everything for MLA tree verify (not graph-safe).

        Parameters
        ----------
        max_batch_size : int
            Largest batch ``run`` will see.
        num_tree_tokens : int
            N = budget + 1.
        num_heads : int
            Query heads on this rank (any count, e.g. 8 for Kimi K2.6 on TP8, 16, 128).
        max_context_len : int
            Longest prefix; bounds the split count.
        sm_scale : float
            The model's softmax scale (DeepSeek: ``qk_head_dim ** -0.5`` times the YaRN mscale
            squared), not ``(kv_lora_rank + rope_dim) ** -0.5``; so it has no default.
        kv_lora_rank, rope_dim : int
            Latent and rope dims of a cache row (512 + 64 for DeepSeek V3 / Kimi K2).
        num_kv_splits : int, optional
            Fixed prefix split count (1 disables split-K); default picks per batch size.
        merge_config : KernelConfig, optional
            Tile of the launches that merge a prefix part from another kernel (FlashMLA's);
            default: the plan's merge tile (``TreeAttention.merge_config_for``).
        """
        _check(kv_lora_rank & (kv_lora_rank - 1) == 0 and kv_lora_rank >= 16, "kv_lora_rank",
               "a power of two >= 16", kv_lora_rank)
        return cls(max_batch_size=max_batch_size, num_tree_tokens=num_tree_tokens,
                   num_q_heads=num_heads, num_kv_heads=1, head_dim=kv_lora_rank,
                   v_head_dim=kv_lora_rank, rope_dim=rope_dim, max_context_len=max_context_len,
                   device=device, sm_scale=sm_scale, logit_cap=logit_cap,
                   num_kv_splits=num_kv_splits, config=config, shared_kv=True,
                   merge_config=merge_config)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, out_cache_loc: torch.Tensor,
            tree_mask: torch.Tensor, *, req_to_token: Optional[torch.Tensor] = None,
            req_pool_indices: Optional[torch.Tensor] = None,
            seq_lens: Optional[torch.Tensor] = None, kv_indptr: Optional[torch.Tensor] = None,
            kv_indices: Optional[torch.Tensor] = None, kv_scale: float = 1.0,
            out: Optional[torch.Tensor] = None, validate: bool = True,
            prefix_out: Optional[torch.Tensor] = None,
            prefix_lse: Optional[torch.Tensor] = None,
            q_pe: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Absorbed-MLA tree attention for one layer. CUDA-graph safe.

        Parameters
        ----------
        q : [bs * N, H, kv_lora_rank + rope_dim] bf16/fp16
            Absorbed queries, request-major in node order; with ``q_pe`` given, only the
            first ``kv_lora_rank`` dims (``q_nope W_UK``), any token / head strides.
        kv_cache : [num_slots, 1, kv_lora_rank + rope_dim] bf16/fp16, fp8 e4m3/e5m2 or uint8
            The layer's latent cache (uint8 is read as e4m3, as SGLang stores fp8).
        out_cache_loc : [bs * N] int32/int64
            Slots of the tree tokens' latent rows (already written).
        tree_mask : [bs, N, N] bool/uint8
            Ancestor-or-self mask.
        req_to_token, req_pool_indices, seq_lens / kv_indptr, kv_indices
            Prefix slots, as :meth:`TreeAttention.run`.
        kv_scale : float
            Dequantisation scale of an fp8 cache (1.0 otherwise).
        out : [bs * N, H, kv_lora_rank], optional
            Written in place.
        prefix_out, prefix_lse : optional
            The prefix part from another kernel (FlashMLA), as :meth:`TreeAttention.run`.
        q_pe : [bs * N, H, rope_dim], optional
            The queries' rope part as a tensor of its own (SGLang's split MLA convention):
            the kernel reads both parts where they lie, so no ``[q | q_pe]`` copy is made.

        Returns
        -------
        out : [bs * N, H, kv_lora_rank], dtype of ``q``.
        """
        if validate:
            self._validate(q, kv_cache, kv_cache, out_cache_loc, tree_mask, req_to_token,
                           req_pool_indices, seq_lens, kv_indptr, kv_indices, out, q_pe)
            self._validate_prefix(q, prefix_out, prefix_lse)
        return self._launch(q, kv_cache, kv_cache, out_cache_loc, tree_mask, req_to_token,
                            req_pool_indices, seq_lens, kv_indptr, kv_indices, kv_scale,
                            kv_scale, out, prefix_out, prefix_lse, q_pe)


def tree_attention_mla(q, kv_cache, out_cache_loc, tree_mask, *, sm_scale: float,
                       kv_lora_rank: int = 512, num_kv_splits=None, config=None,
                       **kv) -> torch.Tensor:
    """One-shot MLA tree attention (plans then runs; allocates, so NOT graph-safe)."""
    n = tree_mask.shape[-1]
    bs = q.shape[0] // n
    max_ctx = int(kv["kv_indptr"].diff().max()) if kv.get("kv_indptr") is not None else \
        int(kv["seq_lens"].max())
    attn = TreeAttentionMLA.plan(
        max_batch_size=bs, num_tree_tokens=n, num_heads=q.shape[1],
        max_context_len=max(max_ctx, 1), device=q.device, sm_scale=sm_scale,
        kv_lora_rank=kv_lora_rank, rope_dim=q.shape[2] - kv_lora_rank,
        num_kv_splits=num_kv_splits, config=config)
    return attn.run(q, kv_cache, out_cache_loc, tree_mask, **kv)
