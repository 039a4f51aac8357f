"""DDTREE's target verify forward on our Triton tree-attention kernels, behind the user's backend.

``--speculative-ddtree-verify-backend triton`` wraps the *target* model runner's attention backend
in :class:`TreeVerifyBackend` at worker init (``DDTreeWorker.init_attention_backends``: after
SGLang built the target's backends, before it captures the target's verify CUDA graphs). The
wrapper passes every call through to the user's backend, so prefill and decode run exactly as
configured, except for ``ForwardMode.TARGET_VERIFY`` batches:

- metadata: ``init_forward_metadata`` (eager) and ``init_forward_metadata_out_graph`` (graph
  capture and replay prep, outside the graph) record where the kernels read the prefix slots,
  prefix lengths and the tree's ancestor mask; ``init_forward_metadata_in_graph`` records nothing.
- ``forward`` / ``forward_extend``: write the new K/V (MHA) or latent row (MLA) at
  ``out_cache_loc`` as SGLang's triton backend does (``token_to_kv_pool.set_kv_buffer``), then run
  :class:`TreeAttention` / :class:`TreeAttentionMLA` on the layer's cache.

The worker hands the tree over on the verify input: :func:`attach_tree_mask` stores the [bs, N, N]
ancestor-or-self mask (``DraftTree.ancestor_mask``) on the ``DFlashVerifyInput`` it builds.

CUDA graphs. ``init_cuda_graph_state(max_bs, ...)`` allocates static buffers once: a [max_bs,
row width] copy of the batch's ``req_to_token`` rows, [max_bs] prefix lengths and a [max_bs, N, N]
mask. Replay prep (outside the graph) refreshes them; the captured kernels read only them, the
runner's static ``out_cache_loc`` and the layer's cache. So the graph reads no scheduler-shared
buffer during replay (SGLang publishes the WAR read-done event for a DFLASH-family verify replay
*before* it runs). Rows the runner pads a batch with get an all-false mask: the kernels give them
finite output (zeros with an empty prefix), and their K/V go to the runner's zeroed slots
(slot 0, SGLang's padding sink).

MLA call conventions (DeepSeek-V2 family, absorbed path, ``attn_mqa``): for backends in SGLang's
``FORWARD_ABSORB_CORE_ATTENTION_BACKENDS`` (fa3, flashinfer, cutlass_mla, trtllm_mla) the model
passes ``q = q_nope W_UK [T, H, rank]``, ``k = v = k_nope [T, 1, rank]`` and ``q_rope`` /
``k_rope`` ([T, H, rope] / [T, 1, rope]); trtllm_mla with an fp8 KV cache also passes
``cos_sin_cache`` / ``is_neox`` (rope not applied yet: the backend fuses it) and
``llama_4_scaling``. Other backends (triton, flashmla) get ``q = [q_nope W_UK | q_pe] [T, H,
rank + rope]``, ``k = [k_nope | k_pe] [T, 1, rank + rope]``, ``v = k_nope``, unless
:mod:`.mla_split` (on by default) has the model hand the verify the split parts. Either way the
cache row is ``[k_nope | k_pe]`` and the kernel's query is ``[q_nope W_UK | q_pe]``; split parts
are neither copied together (the kernel reads ``q_pe`` apart) nor written as one row (the
pool's ``set_mla_kv_buffer``), except under a scaled fp8 cache, Llama-4 scaling or a FlashMLA
prefix, which take the whole row.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from . import config as cfg

logger = logging.getLogger(__name__)

TREE_MASK_ATTR = "ddtree_tree_mask"
# keyword arguments the model may pass to the backend in TARGET_VERIFY that this backend handles
_MLA_KWARGS = ("q_rope", "k_rope", "cos_sin_cache", "is_neox", "llama_4_scaling")


def attach_tree_mask(spec_info, tree_mask: torch.Tensor) -> None:
    """Hand the step's tree to the verify backend: ``tree_mask`` [bs, N, N] bool/uint8,
    ``tree_mask[b, i, j]`` iff tree node j is node i or one of its ancestors."""
    setattr(spec_info, TREE_MASK_ATTR, tree_mask)


def _tree_mask_of(spec_info) -> Optional[torch.Tensor]:
    """The attached mask; None for a dummy verify input (CUDA-graph capture, warm-up runs);
    raises for a real verify input without one (a caller that forgot :func:`attach_tree_mask`)."""
    mask = getattr(spec_info, TREE_MASK_ATTR, None) if spec_info is not None else None
    draft = getattr(spec_info, "draft_token", None)
    if mask is None and draft is not None and draft.numel() > 0:
        raise RuntimeError(
            "DDTREE triton verify backend: the TARGET_VERIFY batch carries draft tokens but no "
            "tree mask; the worker must call verify_backend.attach_tree_mask on its verify input."
        )
    return mask


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
               is_neox: bool) -> torch.Tensor:
    """Rotary embedding as SGLang's ``RotaryEmbedding`` applies it, in fp32.

    Parameters
    ----------
    x : [T, H, R] rope part of queries or keys (any float dtype)
    positions : [T] int token positions
    cos_sin_cache : [max_pos, R] rows ``[cos (R/2) | sin (R/2)]``
    is_neox : bool
        True: rotate the two halves of ``x``; False (GPT-J, DeepSeek): rotate even/odd pairs.

    Returns
    -------
    [T, H, R] float32
    """
    if cos_sin_cache.shape[-1] != x.shape[-1]:
        raise ValueError(f"apply_rope: cos_sin_cache last dim {cos_sin_cache.shape[-1]} != rope "
                         f"dim {x.shape[-1]} (partial rotary is not supported here)")
    cs = cos_sin_cache.index_select(0, positions.long()).float()  # [T, R]
    cos, sin = (c[:, None, :] for c in cs.chunk(2, dim=-1))   # [T, 1, R/2] each
    xf = x.float()
    if is_neox:
        x1, x2 = xf.chunk(2, dim=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    # (x1 + i x2) * (cos + i sin)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


class LayerKey(NamedTuple):
    """What a kernel plan depends on, per attention layer."""

    q_heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    scaling: float
    logit_cap: float


def layer_key(layer) -> LayerKey:
    return LayerKey(int(layer.tp_q_head_num), int(layer.tp_k_head_num), int(layer.qk_head_dim),
                    int(layer.v_head_dim), float(layer.scaling), float(layer.logit_cap or 0.0))


def attn_type_of(layer) -> str:
    return getattr(getattr(layer, "attn_type", None), "value", "decoder")


def unsupported_reason(layer, attn_types=("decoder",)) -> Optional[str]:
    """Why our kernels cannot run this layer's verify attention (None: they can)."""
    if getattr(layer, "is_cross_attention", False):
        return "cross-attention"
    attn_type = attn_type_of(layer)
    if attn_type not in attn_types:
        return f"attention type {attn_type}"
    if (getattr(layer, "sliding_window_size", -1) or -1) > -1:
        return f"sliding window {layer.sliding_window_size}"
    if (layer.logit_cap or 0.0) > 0 and getattr(layer, "logit_capping_method", "tanh") != "tanh":
        return f"logit capping method {layer.logit_capping_method}"
    if (getattr(layer, "xai_temperature_len", -1) or -1) > 0:
        return "xai temperature scaling"
    return None


def _device_of(model_runner) -> torch.device:
    """The runner's device (SGLang keeps a string there)."""
    dev = model_runner.device
    return torch.device(dev) if isinstance(dev, str) else dev


@dataclass
class VerifyMeta:
    """Where the kernels read one verify batch (all [bs]-leading, on the device)."""

    table: torch.Tensor     # [rows, W] int32 prefix slots per row (req_to_token or a snapshot)
    rows: torch.Tensor      # [bs] int64 row of each request in ``table``
    seq_lens: torch.Tensor  # [bs] int prefix lengths (tokens before the tree)
    mask: torch.Tensor      # [bs, N, N] bool/uint8 ancestor-or-self mask


class TreeVerifyBackend:
    """The target runner's attention backend with TARGET_VERIFY on our Triton kernels.

    Every attribute and method not defined here is the wrapped backend's (reads and writes go
    through to it), so SGLang code that inspects the backend sees the user's backend.
    """

    # our graph path pads by request, not by token: keep SGLang's ragged verify graphs off
    supports_ragged_verify_graph = False
    _OWN = frozenset({"_inner", "_runner", "_sgl", "_n", "_is_mla", "_plans", "_kernels",
                      "_meta", "_graph", "_plan_bs", "_prefix", "_prefix_min_bs", "_block_mask",
                      "_name"})

    def __init__(self, inner, model_runner, *, num_tree_tokens: int, is_mla: bool, layers,
                 sgl, kernels=None, prefix=None, prefix_fns=None, block_mask=None):
        """``block_mask`` ([N, N] bool): one mask for every request and step instead of the
        tree the worker attaches (the drafter's block: ``draft_attention.install_draft``).
        ``prefix``: ``(kernel, B)``, the prefix of verify batches of B requests and more on
        ``"flashmla"`` (MLA) or ``"fa3"`` (MHA), the tree keys on ours (:func:`choose_prefix`);
        None: our kernel alone. ``prefix_fns`` stands in for that kernel's functions (tests)."""
        if kernels is None:
            from .triton_kernels import tree_attention, tree_attention_mla

            kernels = (tree_attention.TreeAttention, tree_attention_mla.TreeAttentionMLA)
        own = {"_inner": inner, "_runner": model_runner, "_sgl": sgl,
               "_n": int(num_tree_tokens), "_is_mla": bool(is_mla), "_plans": {},
               "_kernels": kernels, "_meta": None, "_graph": None, "_plan_bs": 0,
               "_prefix": None, "_prefix_min_bs": 1, "_block_mask": None,
               "_name": ("DDTREE triton verify backend" if block_mask is None else
                         f"DDTREE drafter attention ({cfg.ENV_DRAFT_ATTENTION})")}
        for name, value in own.items():
            object.__setattr__(self, name, value)
        if block_mask is not None:
            if tuple(block_mask.shape) != (self._n, self._n):
                raise ValueError(f"block mask shape {tuple(block_mask.shape)}, expected "
                                 f"({self._n}, {self._n})")
            self._block_mask = block_mask.to(device=_device_of(model_runner),
                                             dtype=torch.uint8).contiguous()
        keys = tuple(dict.fromkeys(layer_key(m) for m in layers))  # distinct, in layer order
        self._plan(keys, int(model_runner.req_to_token_pool.size))
        if prefix is not None:
            self._prefix_min_bs = prefix[1]
            width = int(model_runner.req_to_token_pool.req_to_token.shape[1])
            if prefix[0] == "flashmla":
                from .mla_prefix import FlashMLAPrefix

                heads = {key.q_heads for key in keys}
                if len(heads) != 1:
                    raise cfg.DDTreeConfigError(
                        f"DDTREE: {cfg.ENV_MLA_PREFIX}=flashmla: layers with different head "
                        f"counts {sorted(heads)}; set {cfg.ENV_MLA_PREFIX}=triton.")
                self._prefix = FlashMLAPrefix(
                    num_tree_tokens=self._n, num_heads=heads.pop(), v_dim=keys[0].v_dim,
                    context_width=width, device=_device_of(model_runner), fns=prefix_fns)
            else:
                from .mha_prefix import FA3Prefix

                self._prefix = FA3Prefix(
                    num_tree_tokens=self._n,
                    page_size=int(getattr(model_runner, "page_size", 1) or 1),
                    context_width=width,
                    table_dtype=model_runner.req_to_token_pool.req_to_token.dtype,
                    device=_device_of(model_runner), fns=prefix_fns)

    def _prefix_serves(self, bs: int) -> bool:
        """Whether another kernel attends the prefix of a verify batch of ``bs`` requests
        (padded, as a graph runs it): FlashMLA under SGLANG_DDTREE_MLA_PREFIX=flashmla, FA3 under
        SGLANG_DDTREE_MHA_PREFIX=fa3, or from batch B with ``:B``. Each batch size is its own
        graph, so the choice is static within one."""
        return self._prefix is not None and bs >= self._prefix_min_bs

    # --- delegation -------------------------------------------------------------------------
    def __getattr__(self, name):
        if name in TreeVerifyBackend._OWN:  # not set yet (e.g. copy/pickle protocol)
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        if name in TreeVerifyBackend._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)

    def __repr__(self):
        return f"TreeVerifyBackend(N={self._n}, mla={self._is_mla}, inner={self._inner!r})"

    @property
    def wrapped_backend(self):
        return self._inner

    @property
    def takes_split_mla(self) -> bool:
        """Whether verify batches may hand this backend an MLA target's query and latent
        parts split (:mod:`.mla_split`): it then copies neither."""
        return self._is_mla and self._block_mask is None

    def glue_target_verify_metadata(self) -> str:
        """SGLang 0.5.23: our verify prep copies with host-chosen shapes; never glue-captured."""
        return "DDTREE's triton tree-verify prep snapshots req_to_token rows on the host side"

    def get_fused_kv_write_buffers(self, layer, forward_batch):
        """SGLang 0.5.23: a model may write K/V itself through these; in TARGET_VERIFY the
        wrapped backend's metadata is stale (we prepared ours), so it saves through us."""
        if forward_batch.forward_mode.is_target_verify():
            return None
        return self._inner.get_fused_kv_write_buffers(layer, forward_batch)

    # --- planning ---------------------------------------------------------------------------
    def _ordered_mask(self) -> bool:
        """Whether no row's mask admits a later token: a tree (ancestors precede) or a causal
        block; a bidirectional block mask is not (the kernel then reads every tree key)."""
        return self._block_mask is None or not bool(self._block_mask.triu(1).any())

    def _plan(self, keys, max_bs: int) -> None:
        """One kernel plan per distinct layer shape, for up to ``max_bs`` requests (allocates:
        never inside a graph)."""
        tree_attention_cls, mla_cls = self._kernels
        mr = self._runner
        width = int(mr.req_to_token_pool.req_to_token.shape[1])
        device = _device_of(mr)
        ordered = self._ordered_mask()
        plans = {}
        for key in keys:
            if self._is_mla:
                plans[key] = mla_cls.plan(
                    max_batch_size=max_bs, num_tree_tokens=self._n, num_heads=key.q_heads,
                    max_context_len=width, device=device, sm_scale=key.scaling,
                    kv_lora_rank=key.v_dim, rope_dim=key.qk_dim - key.v_dim,
                    logit_cap=key.logit_cap)
            else:
                plans[key] = tree_attention_cls.plan(
                    max_batch_size=max_bs, num_tree_tokens=self._n, num_q_heads=key.q_heads,
                    num_kv_heads=key.kv_heads, head_dim=key.qk_dim, v_head_dim=key.v_dim,
                    max_context_len=width, device=device, sm_scale=key.scaling,
                    logit_cap=key.logit_cap, ordered_mask=ordered)
        self._plans = plans
        self._plan_bs = max_bs

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args, **kwargs):
        self._inner.init_cuda_graph_state(max_bs, max_num_tokens, *args, **kwargs)
        if max_bs > self._plan_bs:
            self._plan(tuple(self._plans), max_bs)
        if self._prefix is not None:
            self._prefix.init_graph_buffers(max_bs)
        if self._graph is not None and self._graph["mask"].shape[0] >= max_bs:
            return
        mr = self._runner
        req_to_token = mr.req_to_token_pool.req_to_token
        dev = req_to_token.device
        self._graph = {
            "table": torch.zeros((max_bs, req_to_token.shape[1]), dtype=req_to_token.dtype,
                                 device=dev),
            "rows": torch.arange(max_bs, dtype=torch.int64, device=dev),
            "seq_lens": torch.zeros((max_bs,), dtype=torch.int64, device=dev),
            "mask": torch.zeros((max_bs, self._n, self._n), dtype=torch.uint8, device=dev),
        }
        if self._block_mask is not None:  # the same for every row, padded ones too: set once
            self._graph["mask"].copy_(self._block_mask.expand(max_bs, self._n, self._n))

    # --- metadata ---------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch):
        if not forward_batch.forward_mode.is_target_verify():
            return self._inner.init_forward_metadata(forward_batch)
        mr = self._runner
        bs = int(forward_batch.req_pool_indices.shape[0])
        if self._block_mask is not None:  # a view: every request attends the same block mask
            mask = self._block_mask.expand(bs, self._n, self._n)
        else:
            mask = _tree_mask_of(forward_batch.spec_info)
        if mask is None:  # a dummy verify input: no tree, every row attends its prefix only
            mask = torch.zeros((bs, self._n, self._n), dtype=torch.uint8,
                               device=forward_batch.seq_lens.device)
        self._check_mask(mask, bs, exact=True)
        # eager: no WAR read-done event is published, the kernels may read the live table
        self._meta = VerifyMeta(table=mr.req_to_token_pool.req_to_token,
                                rows=forward_batch.req_pool_indices,
                                seq_lens=forward_batch.seq_lens, mask=mask)
        if self._prefix_serves(bs):
            self._prefix.prepare(self._meta.table, self._meta.rows, self._meta.seq_lens,
                                 static=False)

    def init_forward_metadata_out_graph(self, forward_batch, *args, **kwargs):
        if not forward_batch.forward_mode.is_target_verify():
            return self._inner.init_forward_metadata_out_graph(forward_batch, *args, **kwargs)
        g = self._graph
        bs = int(forward_batch.req_pool_indices.shape[0])
        if g is None or bs > g["mask"].shape[0]:
            raise RuntimeError(
                f"{self._name}: graph metadata for batch {bs} but the graph "
                f"buffers hold {0 if g is None else g['mask'].shape[0]} requests "
                "(init_cuda_graph_state not called with this max batch size)."
            )
        # snapshot what the captured kernels read: req_to_token rows of this batch (padded rows
        # point at row 0, any valid row), prefix lengths and the tree
        torch.index_select(self._runner.req_to_token_pool.req_to_token, 0,
                           forward_batch.req_pool_indices, out=g["table"][:bs])
        g["seq_lens"][:bs].copy_(forward_batch.seq_lens)
        if self._block_mask is None:  # (a block mask sits in g["mask"] since its allocation)
            mask = _tree_mask_of(forward_batch.spec_info)
            real = 0
            if mask is not None:
                real = int(mask.shape[0])
                self._check_mask(mask, bs)
                g["mask"][:real].copy_(mask)
            g["mask"][real:bs].zero_()
        self._meta = VerifyMeta(table=g["table"], rows=g["rows"][:bs],
                                seq_lens=g["seq_lens"][:bs], mask=g["mask"][:bs])
        if self._prefix_serves(bs):  # FlashMLA's page table and metadata, before replay
            self._prefix.prepare(g["table"], g["rows"][:bs], g["seq_lens"][:bs], static=True)

    def init_forward_metadata_in_graph(self, forward_batch, *args, **kwargs):
        if forward_batch.forward_mode.is_target_verify():
            return None  # everything was prepared outside the graph
        return self._inner.init_forward_metadata_in_graph(forward_batch, *args, **kwargs)

    def _check_mask(self, mask: torch.Tensor, bs: int, exact: bool = False) -> None:
        """Eager batches carry one mask row per request; graph batches may be padded."""
        n = self._n
        rows_ok = mask.shape[0] == bs if exact else mask.shape[0] <= bs
        if mask.dim() != 3 or mask.shape[1:] != (n, n) or not rows_ok:
            raise ValueError(f"{self._name}: tree mask shape: expected "
                             f"[{'' if exact else '<= '}{bs}, {n}, {n}], got "
                             f"{tuple(mask.shape)}")

    # --- forward ----------------------------------------------------------------------------
    def forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        if not forward_batch.forward_mode.is_target_verify():
            return self._inner.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self._verify(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       **kwargs):
        if not forward_batch.forward_mode.is_target_verify():
            return self._inner.forward_extend(q, k, v, layer, forward_batch, save_kv_cache,
                                              **kwargs)
        return self._verify(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def _verify(self, q, k, v, layer, forward_batch, save_kv_cache, kwargs):
        allowed = _MLA_KWARGS if self._is_mla else ()
        extra = [name for name, val in kwargs.items() if val is not None and name not in allowed]
        if extra:
            raise NotImplementedError(
                f"{self._name}: layer {layer.layer_id} passes {extra} to the "
                "attention backend, which the tree-verify kernels do not implement; use "
                + ("--speculative-ddtree-verify-backend native." if self._block_mask is None
                   else f"{cfg.ENV_DRAFT_ATTENTION}=native.")
            )
        plan = self._plans.get(layer_key(layer))
        if plan is None:
            raise RuntimeError(f"{self._name}: no kernel plan for layer "
                               f"{layer.layer_id} with shape {layer_key(layer)}; planned: "
                               f"{list(self._plans)}")
        meta = self._meta
        n = self._n
        if meta is None or q.shape[0] != meta.seq_lens.shape[0] * n:
            raise RuntimeError(
                f"{self._name}: verify metadata for "
                f"{None if meta is None else meta.seq_lens.shape[0]} requests x {n} tree "
                f"tokens, but layer {layer.layer_id} got {q.shape[0]} query tokens.")
        if self._is_mla:
            return self._verify_mla(plan, q, k, layer, forward_batch, save_kv_cache, kwargs,
                                    meta)
        return self._verify_mha(plan, q, k, v, layer, forward_batch, save_kv_cache, meta)

    def _verify_mha(self, plan, q, k, v, layer, forward_batch, save_kv_cache, meta):
        pool = self._runner.token_to_kv_pool
        hq, dqk, dv = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
        if save_kv_cache and k is not None:
            # the triton backend's save: scaled caches divide in place, so copies are stored
            loc = self._sgl.kv_write_loc(forward_batch)
            if layer.k_scale is None:
                pool.set_kv_buffer(layer, loc, k, v)
            else:
                pool.set_kv_buffer(layer, loc, k.clone(), v.clone(), layer.k_scale,
                                   layer.v_scale)
        scaled = layer.k_scale is not None and layer.v_scale is not None
        tokens = q.shape[0]
        out = torch.empty((tokens, hq, dv), dtype=q.dtype, device=q.device)
        q3 = q.view(tokens, hq, dqk)
        k_cache = pool.get_key_buffer(layer.layer_id)
        v_cache = pool.get_value_buffer(layer.layer_id)
        prefix_out = prefix_lse = None
        if self._prefix_serves(tokens // self._n):  # the prefix on FA3, the tree keys below
            prefix_out, prefix_lse = self._prefix.run(q3, k_cache, v_cache, layer.scaling)
        plan.run(q3, k_cache, v_cache, forward_batch.out_cache_loc, meta.mask,
                 req_to_token=meta.table, req_pool_indices=meta.rows, seq_lens=meta.seq_lens,
                 k_scale=layer.k_scale_float if scaled else 1.0,
                 v_scale=layer.v_scale_float if scaled else 1.0, out=out,
                 prefix_out=prefix_out, prefix_lse=prefix_lse)
        # same layout as the triton backend returns: q's shape when dims agree, else [T, H*Dv]
        return out.view(q.shape) if dv == dqk else out.view(tokens, hq * dv)

    def _verify_mla(self, plan, q, k, layer, forward_batch, save_kv_cache, kwargs, meta):
        pool = self._runner.token_to_kv_pool
        heads, rank = layer.tp_q_head_num, layer.v_head_dim
        rope = layer.qk_head_dim - rank
        tokens = q.shape[0]
        q_rope, k_rope = kwargs.get("q_rope"), kwargs.get("k_rope")
        scaling = kwargs.get("llama_4_scaling")
        prefix = self._prefix_serves(tokens // self._n)  # the prefix on FlashMLA
        q_pe = None
        if q_rope is not None:  # split convention: q_nope W_UK / k_nope plus rope parts
            q_pe = q_rope.reshape(tokens, heads, rope)
            k_pe = None if k_rope is None else k_rope.reshape(-1, 1, rope)
            cos_sin_cache = kwargs.get("cos_sin_cache")
            if cos_sin_cache is not None:  # the backend was to apply rope (trtllm_mla fp8)
                is_neox = bool(kwargs.get("is_neox") or False)
                q_pe = apply_rope(q_pe, forward_batch.positions, cos_sin_cache, is_neox)
                if k_pe is not None:
                    k_pe = apply_rope(k_pe, forward_batch.positions, cos_sin_cache, is_neox)
            q_full = q.reshape(tokens, heads, rank)
            q_pe = q_pe.to(q.dtype)
            if scaling is not None or prefix:  # these take the whole query row
                q_full, q_pe = torch.cat([q_full, q_pe], dim=-1), None
            latent = None
            if k is not None and k_pe is not None:
                k_nope = k.reshape(-1, 1, rank)
                k_pe = k_pe.to(k_nope.dtype)
                latent = (k_nope, k_pe)
        else:  # concatenated convention
            q_full = q.reshape(tokens, heads, rank + rope)
            latent = None if k is None else k.reshape(-1, 1, rank + rope)
        if scaling is not None:
            q_full = (q_full * scaling).to(q_full.dtype)
        if save_kv_cache and latent is not None:
            loc = self._sgl.kv_write_loc(forward_batch)
            if isinstance(latent, tuple) and layer.k_scale is None \
                    and hasattr(pool, "set_mla_kv_buffer"):
                pool.set_mla_kv_buffer(layer, loc, *latent)  # both parts, no [k | k_pe] copy
            else:
                if isinstance(latent, tuple):
                    latent = torch.cat(latent, dim=-1)
                if layer.k_scale is not None:
                    latent = latent / layer.k_scale
                pool.set_kv_buffer(layer, loc, latent, latent[..., :rank])
        out = torch.empty((tokens, heads, rank), dtype=q_full.dtype, device=q_full.device)
        kv_cache = pool.get_key_buffer(layer.layer_id)
        prefix_out = prefix_lse = None
        if prefix:  # the prefix on FlashMLA, the tree keys below
            prefix_out, prefix_lse = self._prefix.run(q_full, kv_cache, layer.scaling)
        plan.run(q_full, kv_cache, forward_batch.out_cache_loc,
                 meta.mask, req_to_token=meta.table, req_pool_indices=meta.rows,
                 seq_lens=meta.seq_lens,
                 kv_scale=layer.k_scale_float if layer.k_scale is not None else 1.0, out=out,
                 prefix_out=prefix_out, prefix_lse=prefix_lse, q_pe=q_pe)
        return out.view(tokens, heads * rank)


# --- installing on the target runner ---------------------------------------------------------

def verify_layers(model, is_mla: bool, radix_attention_cls, model_config=None) -> list:
    """The attention layers the target's TARGET_VERIFY forward runs through our kernels.

    MLA models have two RadixAttention modules per layer (``attn_mqa``: one latent KV head of
    ``kv_lora_rank + rope`` dims, used by the absorbed verify path; ``attn_mha``: the prefill
    path); only the former verifies.
    """
    layers = [m for m in model.modules() if isinstance(m, radix_attention_cls)]
    if is_mla:
        rank = getattr(model_config, "kv_lora_rank", None)
        rope = getattr(model_config, "qk_rope_head_dim", None)
        layers = [m for m in layers if m.tp_k_head_num == 1
                  and (rank is None or (m.v_head_dim == rank and m.qk_head_dim == rank + rope))]
    return layers


def blockers(model_runner, sgl, is_mla: bool) -> list:
    """Reasons the triton verify backend cannot wrap this runner (empty: it can)."""
    out = []
    backend = model_runner.attn_backend
    if type(backend).__name__ == "TboAttnBackend":
        out.append("two-batch overlap (--enable-two-batch-overlap)")
    if getattr(model_runner, "decode_attn_backend_group", None):
        out.append("PD multiplexing (--enable-pdmux)")
    if sgl.dcp_enabled():
        out.append("decode context parallelism (--dcp-size > 1)")
    pool = model_runner.token_to_kv_pool
    want = "MLATokenToKVPool" if is_mla else "MHATokenToKVPool"
    if type(pool).__name__ != want:
        out.append(f"KV pool {type(pool).__name__} (the kernels read SGLang's plain {want}: "
                   "no sliding-window / hybrid, FP4 / MXFP8 or page-major pools)")
    elif getattr(pool, "use_hnd", False):
        out.append("HND KV cache layout (SGLANG_USE_HND_KVCACHE)")
    elif getattr(pool, "is_quantized_kv_cache", False):
        out.append("a quantized (scale-block) KV cache")
    elif getattr(pool, "dtype", None) == torch.float8_e4m3fn:
        cap = _capability(_device_of(model_runner))
        if cap is not None and cap < (8, 9):
            # the kernels' compile would fail at the first verify launch (graph capture)
            out.append(f"an fp8 e4m3 KV cache on compute capability {cap[0]}.{cap[1]} (Triton "
                       "decodes e4m3 from sm_89 on; --kv-cache-dtype fp8_e5m2 or auto serve "
                       "here)")
    return out


def _capability(device: torch.device):
    """(major, minor) of a CUDA device; None for others."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def install(model_runner, num_tree_tokens: int, sgl, kernels=None,
            prefix_fns=None) -> TreeVerifyBackend:
    """Wrap ``model_runner.attn_backend`` (the target's) in :class:`TreeVerifyBackend`.

    Call after SGLang built the target's attention backends and before it captures the target's
    CUDA graphs (the graph runners take ``model_runner.attn_backend`` when they are built).
    Raises :class:`~sglang_ddtree.config.DDTreeConfigError` naming what blocks it.
    """
    wrapper = wrap(model_runner.attn_backend, model_runner, num_tree_tokens, sgl, kernels,
                   prefix_fns)
    model_runner.attn_backend = wrapper
    return wrapper


def choose_prefix(model_runner, is_mla: bool, layers, kernel: bool = True):
    """Who attends the prefix of this target's verify: ``(kernel, B)`` for FlashMLA (MLA,
    ``SGLANG_DDTREE_MLA_PREFIX``) or FA3 (MHA, ``SGLANG_DDTREE_MHA_PREFIX``) from verify batches
    of B requests, or None for our kernel alone. Named explicitly, a kernel that cannot serve
    the target stops start-up with the reason; ``auto`` (the default) takes it where it can
    serve (all batch sizes) and says at start-up why not otherwise. ``kernel=False``: a
    stand-in replaces the kernel, so the machine is not checked (tests)."""
    from . import mha_prefix, mla_prefix

    keys = {layer_key(m) for m in layers}
    device = _device_of(model_runner)
    # (env, kernel, setting, smallest batch, its module, what the target is to the other one)
    mla = (cfg.ENV_MLA_PREFIX, "flashmla", cfg.read_mla_prefix(),
           cfg.read_mla_prefix_min_batch(), mla_prefix, "a non-MLA target")
    mha = (cfg.ENV_MHA_PREFIX, "fa3", cfg.read_mha_prefix(), cfg.read_mha_prefix_min_batch(),
           mha_prefix, f"an MLA target ({cfg.ENV_MLA_PREFIX} is MLA's)")
    (env, name, setting, min_bs, module, _), other = (mla, mha) if is_mla else (mha, mla)
    other_env, other_name, other_setting, _, _, this_target = other
    if other_setting == other_name:  # the other arch's kernel named for this target
        raise cfg.DDTreeConfigError(f"DDTREE: {other_env}={other_name} cannot serve this "
                                    f"target: {this_target}. Unset it.")
    if setting == "triton":
        return None
    why = sorted(set(module.problems(model_runner, keys, device, kernel=kernel)))
    if not why:
        return name, min_bs
    if setting == name:
        raise cfg.DDTreeConfigError(
            f"DDTREE: {env}={name} cannot serve this target: {'; '.join(why)}. Set {env}=triton "
            "to verify on DDTREE's Triton kernels alone.")
    logger.info("DDTREE: %s=auto: the verify's prefix stays on DDTREE's Triton kernel (%s "
                "cannot serve: %s)", env, "FlashMLA" if is_mla else "FA3", "; ".join(why))
    return None


def wrap(inner, model_runner, num_tree_tokens: int, sgl, kernels=None,
         prefix_fns=None) -> TreeVerifyBackend:
    """:class:`TreeVerifyBackend` around the target attention backend ``inner`` for trees of
    ``num_tree_tokens``; ``model_runner.attn_backend`` is left as it is (``--speculative-ddtree-
    budget auto`` wraps each width's own backend before its verify graphs are captured).
    ``prefix_fns`` stands in for FlashMLA's functions under ``SGLANG_DDTREE_MLA_PREFIX=flashmla``
    and for FA3's ``(attend,)`` under ``SGLANG_DDTREE_MHA_PREFIX=fa3`` (tests)."""
    is_mla = sgl.is_mla(model_runner.model_config)
    problems = blockers(model_runner, sgl, is_mla)
    layers = verify_layers(model_runner.model, is_mla, sgl.RadixAttention,
                           model_runner.model_config)
    if not layers:
        problems.append("no attention layer the tree-verify kernels recognise")
    problems += sorted({f"layer {m.layer_id}: {why}" for m in layers
                        if (why := unsupported_reason(m)) is not None})
    if problems:
        raise cfg.DDTreeConfigError(
            "DDTREE: --speculative-ddtree-verify-backend triton cannot serve this target: "
            f"{'; '.join(problems)}. Use --speculative-ddtree-verify-backend native with a "
            "tree-capable --attention-backend (triton, or flashinfer for MHA)."
        )
    prefix = choose_prefix(model_runner, is_mla, layers, kernel=prefix_fns is None)
    if is_mla and cfg.mla_split_enabled():
        from . import mla_split

        mla_split.install(sgl)
    wrapper = TreeVerifyBackend(inner, model_runner,
                                num_tree_tokens=num_tree_tokens, is_mla=is_mla, layers=layers,
                                sgl=sgl, kernels=kernels, prefix=prefix,
                                prefix_fns=prefix_fns)
    logger.info("DDTREE verify backend: triton (%s, N=%d, %d kernel plan(s)%s) behind %s",
                "MLA" if is_mla else "MHA", num_tree_tokens, len(wrapper._plans),
                "" if wrapper._prefix is None else
                ", prefix on " + ("FlashMLA" if is_mla else "FA3")
                + (f" from batch {wrapper._prefix_min_bs}" if wrapper._prefix_min_bs > 1 else ""),
                type(wrapper.wrapped_backend).__name__)
    return wrapper
