"""Pure-PyTorch fp32 references for tree-verify attention, and random test-case builders.

The references loop over requests and materialise each request's keys explicitly (prefix slots
then tree slots), so they share no indexing code with the kernels. The builders make SGLang-like
paged KV layouts: token-granular slots, pages of ``page_size`` contiguous slots scattered over the
pool, the tree tokens' slots right after the prefix (as SGLang allocates ``out_cache_loc``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def _prefix_slots(b: int, req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices):
    if kv_indptr is not None:
        lo, hi = int(kv_indptr[b]), int(kv_indptr[b + 1])
        return kv_indices[lo:hi].long()
    return req_to_token[int(req_pool_indices[b]), : int(seq_lens[b])].long()


def _dequant(cache: torch.Tensor, scale: float) -> torch.Tensor:
    if cache.dtype == torch.uint8:
        cache = cache.view(torch.float8_e4m3fn)
    return cache.float() * scale


def tree_attention_reference(q, k_cache, v_cache, out_cache_loc, tree_mask, *,
                             req_to_token=None, req_pool_indices=None, seq_lens=None,
                             kv_indptr=None, kv_indices=None, sm_scale: Optional[float] = None,
                             logit_cap: float = 0.0, k_scale: float = 1.0,
                             v_scale: float = 1.0) -> torch.Tensor:
    """fp32 tree-verify attention (MHA / GQA and, with shared K/V, absorbed MLA).

    Parameters
    ----------
    q : [bs * N, Hq, Dk]
    k_cache : [num_slots, Hkv, Dk]; v_cache : [num_slots, Hkv, Dv] (may be a view of k_cache)
    out_cache_loc : [bs * N] tree-token slots
    tree_mask : [bs, N, N] bool ancestor-or-self mask
    req_to_token, req_pool_indices, seq_lens / kv_indptr, kv_indices : prefix slots, as the kernel

    Returns
    -------
    out : [bs * N, Hq, Dv] float32
    """
    bs, n, _ = tree_mask.shape
    hq, dk = q.shape[1], q.shape[2]
    hkv = k_cache.shape[1]
    g = hq // hkv
    scale = dk ** -0.5 if sm_scale is None else sm_scale
    kf = _dequant(k_cache, k_scale)
    vf = _dequant(v_cache, v_scale)
    out = torch.empty(q.shape[0], hq, v_cache.shape[2], dtype=torch.float32, device=q.device)
    for b in range(bs):
        prefix = _prefix_slots(b, req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices)
        tree = out_cache_loc[b * n:(b + 1) * n].long()
        slots = torch.cat([prefix, tree])
        k = kf[slots].repeat_interleave(g, dim=1)  # [L + N, Hq, Dk]
        v = vf[slots].repeat_interleave(g, dim=1)  # [L + N, Hq, Dv]
        qb = q[b * n:(b + 1) * n].float()           # [N, Hq, Dk]
        s = torch.einsum("ihd,jhd->hij", qb, k) * scale
        if logit_cap > 0:
            s = logit_cap * torch.tanh(s / logit_cap)
        allowed = torch.cat([torch.ones(n, prefix.numel(), dtype=torch.bool, device=q.device),
                             tree_mask[b].bool()], dim=1)  # [N, L + N]
        s = s.masked_fill(~allowed[None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[b * n:(b + 1) * n] = torch.einsum("hij,jhd->ihd", p, v)
    return out


def prefix_attention_reference(q, k_cache, v_cache, num_tree_tokens: int, *,
                               req_to_token=None, req_pool_indices=None, seq_lens=None,
                               kv_indptr=None, kv_indices=None,
                               sm_scale: Optional[float] = None):
    """fp32 attention of every tree row over its request's prefix alone, no mask (what a
    non-causal multi-token decode kernel such as FlashMLA's returns for the prefix pages).

    Returns
    -------
    out : [bs * N, Hq, Dv] float32, normalised (zeros for an empty prefix)
    lse : [bs, Hq, N] float32, natural-log log-sum-exp of the scaled scores (-inf if empty)
    """
    n = num_tree_tokens
    bs = q.shape[0] // n
    hq, dk = q.shape[1], q.shape[2]
    g = hq // k_cache.shape[1]
    scale = dk ** -0.5 if sm_scale is None else sm_scale
    kf, vf = _dequant(k_cache, 1.0), _dequant(v_cache, 1.0)
    out = torch.zeros(q.shape[0], hq, v_cache.shape[2], dtype=torch.float32, device=q.device)
    lse = torch.full((bs, hq, n), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(bs):
        prefix = _prefix_slots(b, req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices)
        if prefix.numel() == 0:
            continue
        k = kf[prefix].repeat_interleave(g, dim=1)
        v = vf[prefix].repeat_interleave(g, dim=1)
        s = torch.einsum("ihd,jhd->hij", q[b * n:(b + 1) * n].float(), k) * scale
        lse[b] = torch.logsumexp(s, dim=-1)
        out[b * n:(b + 1) * n] = torch.einsum("hij,jhd->ihd", torch.softmax(s, dim=-1), v)
    return out, lse


def mla_tree_attention_reference(q, kv_cache, out_cache_loc, tree_mask, *, kv_lora_rank: int,
                                 sm_scale: float, kv_scale: float = 1.0, **kv) -> torch.Tensor:
    """fp32 absorbed-MLA tree attention: keys are whole latent rows, values their first
    ``kv_lora_rank`` dims, one latent head shared by all query heads.

    q : [bs * N, H, kv_lora_rank + rope]; kv_cache : [num_slots, 1, kv_lora_rank + rope].
    Returns [bs * N, H, kv_lora_rank] float32.
    """
    return tree_attention_reference(q, kv_cache, kv_cache[..., :kv_lora_rank], out_cache_loc,
                                    tree_mask, sm_scale=sm_scale, k_scale=kv_scale,
                                    v_scale=kv_scale, **kv)


# ---------------------------------------------------------------------------------------------
# random cases
# ---------------------------------------------------------------------------------------------

def random_tree_mask(bs: int, n: int, generator: torch.Generator,
                     n_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[bs, N, N] bool ancestor-or-self masks of random parent-before-child trees.

    Node 0 is the root; node i < n_valid[b] gets a random parent in [0, i); nodes past n_valid
    are padding (diagonal only), as in the tree contract.
    """
    if n_valid is None:
        n_valid = torch.randint(1, n + 1, (bs,), generator=generator)
    mask = torch.zeros(bs, n, n, dtype=torch.bool)
    for b in range(bs):
        for i in range(n):
            mask[b, i, i] = True
            if 0 < i < int(n_valid[b]):
                parent = int(torch.randint(0, i, (1,), generator=generator))
                mask[b, i] |= mask[b, parent]
    return mask


@dataclass
class PagedLayout:
    """Slot layout of a batch in a paged KV pool (all int tensors on CPU; move as needed)."""

    req_to_token: torch.Tensor      # [pool_rows, max_ctx] int32
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor          # [bs] int64 prefix lengths
    out_cache_loc: torch.Tensor     # [bs * N] int64 tree-token slots
    kv_indptr: torch.Tensor         # [bs + 1] int32
    kv_indices: torch.Tensor        # [sum(seq_lens)] int64
    num_slots: int

    def to(self, device) -> "PagedLayout":
        return PagedLayout(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                              for k, v in self.__dict__.items()})

    def table_kwargs(self) -> dict:
        return dict(req_to_token=self.req_to_token, req_pool_indices=self.req_pool_indices,
                    seq_lens=self.seq_lens)

    def indptr_kwargs(self) -> dict:
        return dict(kv_indptr=self.kv_indptr, kv_indices=self.kv_indices)


def random_paged_layout(seq_lens, n: int, page_size: int, generator: torch.Generator,
                        max_ctx: Optional[int] = None, spare_pages: int = 3) -> PagedLayout:
    """Scatter each request's ``seq_lens[b] + n`` tokens over random pages of a shared pool.

    Slot 0..page_size-1 (page 0) is never used, like SGLang's reserved padding slot, so a kernel
    reading slot 0 by mistake sees a poisoned row if the caller poisons it.
    """
    seq_lens = torch.as_tensor(seq_lens, dtype=torch.int64)
    bs = seq_lens.numel()
    need = [(int(l) + n + page_size - 1) // page_size for l in seq_lens]
    num_pages = 1 + sum(need) + spare_pages
    perm = torch.randperm(num_pages - 1, generator=generator) + 1
    max_ctx = max_ctx or int(seq_lens.max()) + n
    pool_rows = bs + 2
    req_to_token = torch.zeros(pool_rows, max_ctx, dtype=torch.int32)
    req_pool_indices = torch.randperm(pool_rows, generator=generator)[:bs]
    out_cache_loc = torch.empty(bs * n, dtype=torch.int64)
    used = 0
    for b in range(bs):
        pages = perm[used:used + need[b]]
        used += need[b]
        pos = torch.arange(int(seq_lens[b]) + n)
        slots = pages[pos // page_size] * page_size + pos % page_size
        req_to_token[req_pool_indices[b], : slots.numel()] = slots.int()
        out_cache_loc[b * n:(b + 1) * n] = slots[int(seq_lens[b]):]
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(seq_lens, 0)
    kv_indices = torch.cat([req_to_token[req_pool_indices[b], : int(seq_lens[b])].long()
                            for b in range(bs)]) if bs else torch.empty(0, dtype=torch.int64)
    return PagedLayout(req_to_token, req_pool_indices, seq_lens, out_cache_loc, kv_indptr,
                       kv_indices, num_pages * page_size)
