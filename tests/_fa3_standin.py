"""FA3's prefix call (``sglang_ddtree.mha_prefix.load_fa3``'s contract) in fp32 torch, for CPU
tests: a non-causal paged decode over pages of ``k_cache.shape[1]`` tokens returning the
normalised output and the natural-log LSE [b, hq, s]; a row with no keys gets FlashAttention's
+inf LSE and a zero output."""
import torch


def torch_fa3(q, k_cache, v_cache, page_table, cache_seqlens, softmax_scale):
    b, s, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(b, s, hq, v_cache.shape[-1])
    lse = torch.full((b, hq, s), float("inf"))
    for i in range(b):
        length = int(cache_seqlens[i])
        if not length:
            continue
        pages = page_table[i, :-(-length // page)].long()
        k = k_cache[pages].reshape(-1, hkv, d)[:length].float().repeat_interleave(hq // hkv, 1)
        v = v_cache[pages].reshape(-1, hkv, v_cache.shape[-1])[:length].float()
        v = v.repeat_interleave(hq // hkv, 1)
        sc = torch.einsum("shd,lhd->hsl", q[i].float(), k) * softmax_scale
        lse[i] = torch.logsumexp(sc, dim=-1)
        out[i] = torch.einsum("hsl,lhd->shd", torch.softmax(sc, -1), v)
    return out.to(q.dtype), lse
