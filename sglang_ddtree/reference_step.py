"""Pure-PyTorch model of a whole DDTree decode step, free of SGLang: the project's oracle.

Words (node, depth, budget, accepted path, bonus token) are defined in :mod:`sglang_ddtree.tree`.
This module strings the package's own step functions together exactly as the SGLang worker does
(``worker.py``), around a tiny causal transformer whose KV cache is laid out like SGLang's
token-granular pool:

- ``KVPool``: per layer a K and a V buffer ``[num_slots, heads, head_dim]``; slot 0 is the dummy
  slot (SGLang's padding slot); ``move_kv_cache(dst, src)`` copies rows in all layers. Buffers
  start as NaN, so attending to a slot nobody wrote shows up as NaN in the logits.
- ``Runtime``: ``req_to_token [max_reqs, max_ctx]`` maps a request's token positions to slots;
  slots come from a shuffled free list (physical slots are scattered, as in a long-running
  server) and are reserved ahead of the length: ``seq_len + max(N, block)`` for a DDTree step.

One step (``ddtree_generate``), per batch of requests with prefix lengths ``seq_lens``:

1. draft: the drafter gives per-depth top-K log-probs for depths 1..B-1 (``topk_logprobs``);
2. tree: ``build_tree`` (checked against ``build_tree_reference`` when ``checks``);
3. verify: the N = budget + 1 tree tokens at positions ``prefix + depth``, KV written at
   ``slots[:, :N]``, attention over the prefix slots plus the tree under the FULL_MASK layout
   (``verify.write_full_mask``; checked against ``tree.full_mask_layout`` and the ancestor mask);
4. accept: target argmax (greedy) or one sample per node (``sample_per_node``), ``accept_walk``;
5. commit: ``commit_from_path``, ``kv_moves`` + ``move_accepted_kv`` (accepted KV contiguous),
   the accepted nodes' target hidden states (``path_hidden``) appended to the drafter's context.

``ar_generate`` is plain autoregressive decoding of the same target with the same pool; greedy
DDTree output must equal it token for token, and the KV left in the pool must match. Both take
``constrain``, a constrained decoder's mask (a grammar): AR masks each step's logits with the
tokens generated so far, DDTree every tree node's with the tokens so far and the node's path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, List, Optional, Sequence

import torch

from .accept import accept_walk, accept_walk_reference
from .commit import commit_from_path, kv_moves, move_accepted_kv, path_hidden
from .draft_head import topk_logprobs
from .sampling import sample_per_node
from .tree import build_tree, build_tree_reference, full_mask_layout, full_mask_offsets
from .verify import full_mask_numel_bound, gather_slots, tree_positions, write_full_mask

# ----------------------------------------------------------------------------------------------
# Tiny causal transformer (pre-norm, RoPE, multi-head attention, SwiGLU MLP).


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 64
    hidden: int = 32
    heads: int = 2
    head_dim: int = 16
    layers: int = 2
    ffn: int = 64
    rope_theta: float = 10000.0
    logit_scale: float = 1.0  # multiplies the logits: > 1 sharpens the target's distributions
    dtype: torch.dtype = torch.float64


class TinyTransformer:
    """Weights in a dict of plain tensors; see ``forward`` for the paged-attention forward."""

    def __init__(self, cfg: TinyConfig, weights: dict):
        self.cfg, self.w = cfg, weights

    @classmethod
    def random(cls, cfg: TinyConfig, seed: int) -> "TinyTransformer":
        g = torch.Generator().manual_seed(seed)
        h, qd = cfg.hidden, cfg.heads * cfg.head_dim

        def lin(i, o):
            return torch.randn(i, o, generator=g, dtype=cfg.dtype) / math.sqrt(i)

        w = {"embed": torch.randn(cfg.vocab, h, generator=g, dtype=cfg.dtype),
             "norm": torch.ones(h, dtype=cfg.dtype), "lm_head": lin(h, cfg.vocab) * 2.0}
        for l in range(cfg.layers):
            w.update({f"{l}.attn_norm": torch.ones(h, dtype=cfg.dtype), f"{l}.wq": lin(h, qd),
                      f"{l}.wk": lin(h, qd), f"{l}.wv": lin(h, qd), f"{l}.wo": lin(qd, h),
                      f"{l}.mlp_norm": torch.ones(h, dtype=cfg.dtype), f"{l}.w1": lin(h, cfg.ffn),
                      f"{l}.w3": lin(h, cfg.ffn), f"{l}.w2": lin(cfg.ffn, h)})
        return cls(cfg, w)

    def noisy_copy(self, sigma: float, seed: int) -> "TinyTransformer":
        """Same architecture, every weight W + sigma * std(W) * N(0, 1) (norms: sigma * N(0, 1))."""
        g = torch.Generator().manual_seed(seed)
        out = {}
        for name, t in self.w.items():
            scale = sigma if "norm" in name else sigma * float(t.std())
            out[name] = t + scale * torch.randn(t.shape, generator=g, dtype=t.dtype)
        return TinyTransformer(self.cfg, out)

    # --- pieces ---------------------------------------------------------------------------
    @staticmethod
    def _rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    def _rope(self, x, positions):
        """x [..., heads, head_dim], positions [...] int64 (rotate-half RoPE)."""
        half = self.cfg.head_dim // 2
        inv = self.cfg.rope_theta ** (-torch.arange(half, dtype=x.dtype) / half)
        ang = positions.to(x.dtype)[..., None, None] * inv  # [..., 1, half]
        cos, sin = ang.cos(), ang.sin()
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def kv_from_hidden(self, layer: int, h: torch.Tensor, positions: torch.Tensor):
        """K, V [..., heads, head_dim] of layer ``layer`` from its input hidden h [..., hidden]."""
        c, w = self.cfg, self.w
        x = self._rms(h, w[f"{layer}.attn_norm"])
        k = (x @ w[f"{layer}.wk"]).unflatten(-1, (c.heads, c.head_dim))
        v = (x @ w[f"{layer}.wv"]).unflatten(-1, (c.heads, c.head_dim))
        return self._rope(k, positions), v

    def forward(self, pool: "KVPool", input_ids, positions, q_valid, out_slots, key_slots,
                key_valid, mask):
        """Paged forward: write the new tokens' K/V into ``pool``, then attend from the pool.

        Parameters
        ----------
        input_ids, positions, out_slots : [bs, n] int64; q_valid : [bs, n] bool (padding rows
            write nothing and their outputs are garbage).
        key_slots : [bs, L] int64 pool slots of the key columns; key_valid : [bs, L] bool.
        mask : [bs, n, L] bool, query i may attend key column c.

        Returns
        -------
        logits [bs, n, vocab], hidden_in [bs, n, layers, hidden]: each layer's input (the
        residual stream), which the drafter's context is built from.
        """
        c, w = self.cfg, self.w
        h = w["embed"][input_ids]
        hidden_in = []
        mask = mask & key_valid[:, None, :]
        any_key = mask.any(-1)[:, None, :, None]  # [bs, 1, n, 1]
        for l in range(c.layers):
            hidden_in.append(h)
            x = self._rms(h, w[f"{l}.attn_norm"])
            q = self._rope((x @ w[f"{l}.wq"]).unflatten(-1, (c.heads, c.head_dim)), positions)
            k, v = self.kv_from_hidden(l, h, positions)
            pool.k[l][out_slots[q_valid]] = k[q_valid]
            pool.v[l][out_slots[q_valid]] = v[q_valid]
            # padding key columns point at unwritten (NaN) slots: zero them (where, not a
            # product: 0 * NaN is NaN). A NaN in a valid column is a real bug and shows up.
            kv_ok = key_valid[:, :, None, None]
            kk = torch.where(kv_ok, pool.k[l][key_slots], 0.0)  # [bs, L, heads, dim]
            vv = torch.where(kv_ok, pool.v[l][key_slots], 0.0)
            s = torch.einsum("bnhd,blhd->bhnl", q, kk) / math.sqrt(c.head_dim)
            p = torch.softmax(s.masked_fill(~mask[:, None], float("-inf")), -1)
            p = torch.where(any_key, p, 0.0)  # padding rows see no key: 0, not NaN
            o = torch.einsum("bhnl,blhd->bnhd", p, vv).flatten(-2)
            h = h + o @ w[f"{l}.wo"]
            x = self._rms(h, w[f"{l}.mlp_norm"])
            h = h + (torch.nn.functional.silu(x @ w[f"{l}.w1"]) * (x @ w[f"{l}.w3"])) @ w[f"{l}.w2"]
        logits = self._rms(h, w["norm"]) @ w["lm_head"] * c.logit_scale
        return logits, torch.stack(hidden_in, -2)

    def forward_dense(self, ids: torch.Tensor):
        """No cache: causal forward over one sequence ids [T]. Returns (logits [T, V],
        hidden_in [T, layers, hidden], K list, V list of [T, heads, dim]): an independent check
        of the paged path and of the KV a pool should hold."""
        t = ids.shape[0]
        pool = KVPool(t + 1, self.cfg)
        slots = torch.arange(1, t + 1)[None]
        causal = torch.ones(t, t, dtype=torch.bool).tril()[None]
        logits, hid = self.forward(pool, ids[None], torch.arange(t)[None],
                                   torch.ones(1, t, dtype=torch.bool), slots, slots,
                                   torch.ones(1, t, dtype=torch.bool), causal)
        return logits[0], hid[0], [k[1:] for k in pool.k], [v[1:] for v in pool.v]


class KVPool:
    """SGLang-like token-granular KV pool: per layer K and V ``[num_slots, heads, head_dim]``."""

    def __init__(self, num_slots: int, cfg: TinyConfig, move_order: Optional[str] = None):
        shape = (num_slots, cfg.heads, cfg.head_dim)
        self.k = [torch.full(shape, float("nan"), dtype=cfg.dtype) for _ in range(cfg.layers)]
        self.v = [torch.full(shape, float("nan"), dtype=cfg.dtype) for _ in range(cfg.layers)]
        if move_order not in (None, "forward", "reverse"):
            raise ValueError(f"KVPool.move_order: expected None|forward|reverse, got "
                             f"{move_order!r}")
        self.move_order = move_order

    def move_kv_cache(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy slots src -> dst [n] in every layer.

        ``move_order`` None: advanced indexing, which reads every source before writing (SGLang's
        native move). "forward" / "reverse": one pair at a time, in place, in that order: two
        legal schedules of SGLang's Triton move kernel (one program per pair, no ordering
        between programs). Only pairs that never read a slot another pair writes are safe under
        every schedule, which is why ``move_accepted_kv`` calls this once per path column.
        """
        if self.move_order is None:
            for buf in self.k + self.v:
                buf[dst] = buf[src]
            return
        pairs = list(zip(dst.tolist(), src.tolist()))
        for d, s in pairs if self.move_order == "forward" else reversed(pairs):
            for buf in self.k + self.v:
                buf[d] = buf[s]


# ----------------------------------------------------------------------------------------------
# Requests, slots and attention layouts.


class Runtime:
    """Pools and per-request state for one generate call (requests 0..R-1 own req_to_token rows
    0..R-1). State tensors are [R]: ``seq_lens`` (tokens with KV), ``allocated`` (positions with
    a slot), ``bonus`` (the next root token)."""

    def __init__(self, cfg: TinyConfig, num_reqs: int, max_ctx: int, seed: int,
                 move_order: Optional[str] = None):
        num_slots = 1 + num_reqs * max_ctx
        self.pool = KVPool(num_slots, cfg, move_order)
        self.req_to_token = torch.full((num_reqs, max_ctx), -1, dtype=torch.int64)
        g = torch.Generator().manual_seed(seed)
        self.free = 1 + torch.randperm(num_slots - 1, generator=g)  # slot 0: the dummy slot
        self.seq_lens = torch.zeros(num_reqs, dtype=torch.int64)
        self.allocated = torch.zeros(num_reqs, dtype=torch.int64)
        self.bonus = torch.zeros(num_reqs, dtype=torch.int64)

    def reserve(self, reqs: torch.Tensor, upto: torch.Tensor) -> None:
        """Give requests ``reqs`` [r] slots for positions < ``upto`` [r] (no-op where present)."""
        start = self.allocated[reqs]
        need = (upto - start).clamp(min=0)
        total = int(need.sum())
        if total > self.free.numel():
            raise RuntimeError(f"Runtime.reserve: need {total} slots, {self.free.numel()} free")
        if upto.max() > self.req_to_token.shape[1]:
            raise RuntimeError(f"Runtime.reserve: position {int(upto.max())} past max_ctx "
                               f"{self.req_to_token.shape[1]}")
        rows = reqs.repeat_interleave(need)
        first = need.cumsum(0) - need  # where each request's run starts in the flat list
        cols = (start - first).repeat_interleave(need) + torch.arange(total)
        self.req_to_token[rows, cols] = self.free[:total]
        self.free = self.free[total:]
        self.allocated[reqs] = torch.maximum(start, upto)


def key_layout(req_to_token, reqs, prefix_lens, out_slots, new_valid=None):
    """Key columns of request b: its prefix slots from req_to_token, then its new tokens' slots
    (SGLang's extend/verify layout). new_valid [bs, n] bool marks real (not padding) new tokens.
    Returns key_slots [bs, L] int64, key_valid [bs, L] bool, L = max(prefix) + n."""
    n = out_slots.shape[1]
    cols = torch.arange(int(prefix_lens.max()) + n)[None, :]
    pre = cols < prefix_lens[:, None]
    new = cols - prefix_lens[:, None]
    valid = pre | (new < n)
    if new_valid is not None:
        valid &= pre | new_valid.gather(1, new.clamp(0, n - 1))
    table = req_to_token[reqs][:, : cols.shape[1]]
    from_table = table.gather(1, cols.clamp(max=table.shape[1] - 1).expand(len(reqs), -1))
    from_out = out_slots.gather(1, new.clamp(0, n - 1))
    slots = torch.where(pre, from_table, torch.where(valid, from_out, 0))
    return slots, valid


def causal_mask(prefix_lens, n, width):
    """[bs, n, width] bool: query i (position prefix + i) sees columns c <= prefix + i."""
    c = torch.arange(width)[None, None, :]
    i = torch.arange(n)[None, :, None]
    return c <= prefix_lens[:, None, None] + i


def mask_from_ancestors(ancestor_mask, prefix_lens, width):
    """[bs, N, width] bool: the whole prefix, then the tree's ancestor-or-self mask."""
    bs, n, _ = ancestor_mask.shape
    c = torch.arange(width)[None, None, :] - prefix_lens[:, None, None]
    tree = ancestor_mask.gather(2, c.clamp(0, n - 1).expand(bs, n, width))
    return (c < 0) | ((c < n) & tree)


def mask_from_full_mask(flat, prefix_lens, n, width):
    """Read SGLang's FULL_MASK flat layout back as [bs, n, width] bool (row i of request b is
    ``flat[offset_b + i * (prefix_b + n) : ... + prefix_b + n]``, columns past it False)."""
    off = full_mask_offsets(prefix_lens, n)
    row_len = prefix_lens + n
    c = torch.arange(width)[None, None, :]
    i = torch.arange(n)[None, :, None]
    idx = off[:, None, None] + i * row_len[:, None, None] + c
    inside = c < row_len[:, None, None]
    return inside & flat[torch.where(inside, idx, 0)]


def _pick(logits, mode, sampler, generator):
    """[bs, n] int64 tokens from logits [bs, n, V]."""
    bs, n, v = logits.shape
    if mode == "greedy":
        return logits.argmax(-1)
    if sampler is not None:
        return sampler(logits, generator)
    info = SimpleNamespace(  # temperature 1, no top-k/top-p/min-p: the plain distribution
        temperatures=torch.ones(bs, 1), top_ks=torch.full((bs,), v), top_ps=torch.ones(bs),
        min_ps=torch.zeros(bs), need_top_k_sampling=False, need_top_p_sampling=False,
        need_min_p_sampling=False)
    return sample_per_node(logits.reshape(bs * n, v), info, n, generator=generator).view(bs, n)


# ----------------------------------------------------------------------------------------------
# Drafter: autoregressive chain whose context K/V come from the target's hidden states.


class ChainDrafter:
    """Per-depth top-K proposals from a drafter model with the target's shape.

    Its context K/V at committed positions are its own K/V projections of the *target's* layer
    inputs (DFlash's "append target hidden" step, ``append_context``); the block is then drafted
    as a greedy chain root, c1, .., c_{D-1} whose K/V go to the block's reserved slots (as
    DFlash's block forward does); depth d's distribution is the drafter's at chain step d - 1.
    A ``noisy_copy`` of the target accepts a lot; an unrelated random model accepts ~nothing.
    """

    def __init__(self, model: TinyTransformer):
        self.model = model

    def reset(self, num_slots: int) -> None:
        self.pool = KVPool(num_slots, self.model.cfg)

    def append_context(self, hidden_in, positions, slots, counts) -> None:
        """hidden_in [bs, W, layers, hidden], positions/slots [bs, W]: rows j < counts[b]."""
        keep = torch.arange(slots.shape[1])[None, :] < counts[:, None]
        for l in range(self.model.cfg.layers):
            k, v = self.model.kv_from_hidden(l, hidden_in[:, :, l], positions)
            self.pool.k[l][slots[keep]] = k[keep]
            self.pool.v[l][slots[keep]] = v[keep]

    def propose(self, rt: Runtime, reqs, prefix_lens, root, block_slots, k: int):
        """[bs, D, K] fp32 log-probs (sorted desc) and int64 ids, D = block_slots.shape[1] - 1."""
        tok, logps, ids = root, [], []
        ones = torch.ones(len(reqs), 1, dtype=torch.bool)
        for t in range(block_slots.shape[1] - 1):
            pre = prefix_lens + t  # chain tokens so far sit in the block's reserved slots
            out = block_slots[:, t:t + 1]
            ks, kv = key_layout(rt.req_to_token, reqs, pre, out)
            logits, _ = self.model.forward(self.pool, tok[:, None], pre[:, None], ones, out, ks,
                                           kv, torch.ones(len(reqs), 1, ks.shape[1], dtype=bool))
            lp, ix = topk_logprobs(logits[:, 0], k)
            logps.append(lp)
            ids.append(ix)
            tok = ix[:, 0]
        return torch.stack(logps, 1), torch.stack(ids, 1)


# ----------------------------------------------------------------------------------------------
# Generation loops.


@dataclass
class GenResult:
    outputs: List[List[int]]  # per request, exactly max_new_tokens tokens
    rt: Runtime  # pools and req_to_token after the run (request r owns req_to_token row r)
    accept_lens: List[torch.Tensor] = field(default_factory=list)  # per step, [active] int64
    off_chain: int = 0  # accepted nodes that are not rank 0 of their parent's children


def _prefill(target, rt, prompts, mode, sampler, generator, drafter, constrain=None):
    """Extend forward over all prompts (different lengths, padded); first token from the last
    position; prompt hidden states go to the drafter's context."""
    r = len(prompts)
    lens = torch.tensor([len(p) for p in prompts])
    reqs = torch.arange(r)
    rt.reserve(reqs, lens)
    n = int(lens.max())
    ids = torch.zeros(r, n, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    q_valid = torch.arange(n)[None, :] < lens[:, None]
    out_slots = torch.where(q_valid, rt.req_to_token[:, :n], 0)
    zero = torch.zeros(r, dtype=torch.int64)
    ks, kv = key_layout(rt.req_to_token, reqs, zero, out_slots, q_valid)
    mask = causal_mask(zero, n, ks.shape[1]) & q_valid[:, :, None]
    pos = torch.arange(n).expand(r, n)
    logits, hid = target.forward(rt.pool, ids, pos, q_valid, out_slots, ks, kv, mask)
    last = (lens - 1)[:, None, None]
    first_logits = logits.gather(1, last.expand(r, 1, logits.shape[-1]))
    if constrain is not None:  # nothing generated yet
        constrain([[] for _ in range(r)], first_logits.view(r, -1))
    first = _pick(first_logits, mode, sampler, generator)[:, 0]
    if drafter is not None:
        drafter.append_context(hid, pos, out_slots, lens)
    rt.seq_lens[:], rt.bonus[:] = lens, first
    return [[int(t)] for t in first]


def _setup(target, prompts, max_new_tokens, width, seed, move_order=None):
    if max_new_tokens < 1 or not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError(f"generate: expected non-empty prompts and max_new_tokens >= 1, got "
                         f"{[len(p) for p in prompts]} prompts, max_new_tokens={max_new_tokens}")
    # a request still short of max_new_tokens has seq_len <= prompt + max_new_tokens - 2 and
    # reserves up to seq_len + width
    max_ctx = max(len(p) for p in prompts) + max_new_tokens + width
    return Runtime(target.cfg, len(prompts), max_ctx, seed, move_order)


def ar_generate(target: TinyTransformer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                mode: str = "greedy", generator: Optional[torch.Generator] = None,
                sampler: Optional[Callable] = None, slot_seed: int = 0,
                constrain: Optional[Callable] = None) -> GenResult:
    """Plain autoregressive decoding (one token per request per forward) with the same pool.

    constrain(histories, logits [rows, V]): a constrained decoder's mask (a grammar), applied in
    place to each row's logits before the pick; histories[i] is the row's generated tokens so
    far (the prompt excluded), the row's logits predict the token after them."""
    rt = _setup(target, prompts, max_new_tokens, 1, slot_seed)
    outs = _prefill(target, rt, prompts, mode, sampler, generator, None, constrain)
    for _ in range(max_new_tokens - 1):
        reqs = torch.arange(len(prompts))
        rt.reserve(reqs, rt.seq_lens + 1)
        out = gather_slots(rt.req_to_token, reqs, rt.seq_lens, 1)
        ks, kv = key_layout(rt.req_to_token, reqs, rt.seq_lens, out)
        logits, _ = target.forward(rt.pool, rt.bonus[:, None], rt.seq_lens[:, None],
                                   torch.ones_like(out, dtype=torch.bool), out, ks, kv,
                                   causal_mask(rt.seq_lens, 1, ks.shape[1]))
        if constrain is not None:
            constrain(outs, logits.view(len(outs), -1))
        nxt = _pick(logits, mode, sampler, generator)[:, 0]
        rt.seq_lens += 1
        rt.bonus = nxt
        for b, t in enumerate(nxt.tolist()):
            outs[b].append(t)
    return GenResult(outputs=outs, rt=rt)


def ddtree_generate(target: TinyTransformer, drafter: ChainDrafter,
                    prompts: Sequence[Sequence[int]], max_new_tokens: int, budget: int,
                    block_size: int, mode: str = "greedy",
                    generator: Optional[torch.Generator] = None, sampler: Optional[Callable] = None,
                    topk: Optional[int] = None, checks: bool = True, slot_seed: int = 0,
                    kv_move_order: Optional[str] = None,
                    constrain: Optional[Callable] = None) -> GenResult:
    """DDTree decoding with the package's step functions (see the module docstring).

    mode: "greedy" (target argmax per node) or "sampled" (temperature 1, ``sample_per_node``, or
    ``sampler(logits [bs, N, V], generator) -> [bs, N]`` if given). checks: also run the CPU
    oracles (tree, accept walk, both FULL_MASK writers, ancestor mask) and assert agreement.
    slot_seed shuffles the free slot list; kv_move_order: the target pool's ``move_order``.
    constrain: as for :func:`ar_generate`, applied to every tree node's logits with the node's
    history (the request's tokens so far, then the node's path), as the worker masks each node
    with a grammar's bitmask. Requests leave the batch once they have max_new_tokens tokens
    (extra ones are cut).
    """
    if mode not in ("greedy", "sampled") or block_size < 2:
        raise ValueError(f"ddtree_generate: expected mode greedy|sampled and block_size >= 2, "
                         f"got {mode!r}, {block_size}")
    n, vocab = budget + 1, target.cfg.vocab
    width = max(n, block_size)  # reserved ahead per step: verify (N) and draft (B) tokens
    k = min(budget, vocab) if topk is None else min(topk, budget, vocab)
    rt = _setup(target, prompts, max_new_tokens, width, slot_seed, kv_move_order)
    drafter.reset(rt.pool.k[0].shape[0])
    res = GenResult(outputs=_prefill(target, rt, prompts, mode, sampler, generator, drafter,
                                     constrain), rt=rt)
    while True:
        reqs = torch.tensor([b for b, o in enumerate(res.outputs) if len(o) < max_new_tokens],
                            dtype=torch.int64)
        if len(reqs) == 0:
            break
        bs, prefix, root = len(reqs), rt.seq_lens[reqs], rt.bonus[reqs]
        rt.reserve(reqs, prefix + width)
        slots = gather_slots(rt.req_to_token, reqs, prefix, width)  # [bs, width]

        # 1) draft  2) tree
        topk_logp, topk_ids = drafter.propose(rt, reqs, prefix, root, slots[:, :block_size], k)
        tree = build_tree(root, topk_logp, topk_ids, budget)
        if checks:
            ref = build_tree_reference(root, topk_logp, topk_ids, budget)
            for name, t in tree.tensors().items():
                assert torch.equal(t, getattr(ref, name)), f"build_tree differs in {name}"

        # 3) verify: N tokens, prefix + tree columns under the FULL_MASK layout
        positions = tree_positions(tree.depths, prefix)
        flat = torch.zeros(full_mask_numel_bound(n, int(prefix.sum()), bs), dtype=torch.bool)
        write_full_mask(tree.ancestor_mask, prefix, flat)
        out = slots[:, :n]
        ks, kv = key_layout(rt.req_to_token, reqs, prefix, out)
        mask = mask_from_full_mask(flat, prefix, n, ks.shape[1])
        if checks:
            other = torch.zeros_like(flat)
            full_mask_layout(tree.ancestor_mask, prefix, other, full_mask_offsets(prefix, n))
            assert torch.equal(flat, other), "write_full_mask != tree.full_mask_layout"
            assert torch.equal(mask, mask_from_ancestors(tree.ancestor_mask, prefix,
                                                         ks.shape[1])), "FULL_MASK != ancestors"
        logits, hid = target.forward(rt.pool, tree.tokens, positions,
                                     torch.ones_like(out, dtype=torch.bool), out, ks, kv, mask)

        # 4) accept
        if constrain is not None:
            constrain(_node_histories(tree, [res.outputs[b] for b in reqs.tolist()]),
                      logits.view(bs * n, -1))
        predicted = _pick(logits, mode, sampler, generator)
        accept_len, nodes, bonus = accept_walk(tree, predicted)
        if checks:
            ref_walk = accept_walk_reference(tree, predicted)
            assert all(torch.equal(a, b) for a, b in zip((accept_len, nodes, bonus), ref_walk))
        step = commit_from_path(tree, nodes, accept_len, bonus, prefix)

        # 5) commit: accepted KV to contiguous slots, drafter context from the path's hidden
        dst, src = kv_moves(slots, step.path_nodes, accept_len)
        move_accepted_kv(rt.pool, dst, src)
        rows = path_hidden(hid.flatten(2).reshape(bs * n, -1), step.path_nodes, n)
        blk = step.path_nodes.shape[1]
        drafter.append_context(rows.view(bs, blk, *hid.shape[2:]),
                               prefix[:, None] + torch.arange(blk), slots[:, :blk],
                               step.commit_lens.to(torch.int64))
        rt.seq_lens[reqs], rt.bonus[reqs] = step.new_seq_lens, step.bonus
        res.accept_lens.append(accept_len.clone())
        res.off_chain += _count_off_chain(tree, nodes)
        for i, b in enumerate(reqs.tolist()):
            res.outputs[b].extend(step.out_tokens[i, : int(step.commit_lens[i])].tolist())
    res.outputs = [o[:max_new_tokens] for o in res.outputs]
    return res


def _node_histories(tree, outputs) -> List[List[int]]:
    """Row b * N + i: request b's tokens so far (ending with the root) then node i's path."""
    bs, n = tree.tokens.shape
    rows = []
    for b in range(bs):
        for i in range(n):
            path, node = [], i
            while node > 0:
                path.append(int(tree.tokens[b, node]))
                node = int(tree.parents[b, node])
            rows.append(list(outputs[b]) + path[::-1])
    return rows


def _count_off_chain(tree, nodes) -> int:
    """Accepted nodes whose parent has an earlier (better-ranked) child: the tree paid off."""
    par = tree.parents.gather(1, nodes[:, 1:].clamp(min=0))
    first = tree.retrive_next_token.gather(1, par.clamp(min=0))
    return int(((nodes[:, 1:] >= 0) & (first != nodes[:, 1:])).sum())
