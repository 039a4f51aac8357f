#!/usr/bin/env python
"""Benchmark tree-verify attention on one GPU: ours vs SGLang's triton extend kernel vs fa3.

Grid (issue 4): batch 1, 8, 32 x budget 8, 16, 32, 64 x context 2k, 16k, 64k, for
- MHA with Qwen3-8B shapes per layer (32 q heads, 8 KV heads, head dim 128, bf16), and
- absorbed MLA with Kimi K2.6 TP8-rank shapes (8 heads, latent 512 + rope 64, bf16 cache).

Every point uses one random tree per request (N = budget + 1 nodes, ancestor mask), random prefix
slots scattered over pages of 16 tokens, and times one layer's attention as a replayed CUDA graph
(median of ``--iters`` replays, L2 flushed before each with a 256 MB write, CUDA events).

Columns
- ``ours_us``: :class:`TreeAttention` / :class:`TreeAttentionMLA` ``run()``.
- ``sglang_triton_us``: SGLang's ``extend_attention_fwd`` with the same tree as a FULL_MASK custom
  mask (what SGLang's triton backend runs in TARGET_VERIFY); ``not available`` when SGLang's kernel
  cannot be imported (``--sglang-src DIR`` loads it from a directory holding
  extend_attention.py, decode_attention.py, prefill_attention.py and score_mod.py of SGLang).
- ``fa3_us``: sgl_kernel's FA3 as SGLang's fa3 backend verifies a tree (topk > 1): one pass over
  the prefix, one pass per query over its sorted ancestor slots, merge_state_v2; ``not available``
  without sgl_kernel or off Hopper. Its metadata build is not timed.
- ``kv_GBps`` = kv_bytes / ours_us, kv_bytes = sum over requests of (prefix + N) x bytes per token
  (MHA: 2 x kv_heads x 128 x 2 B; MLA: 576 x 2 B); ``frac_copy_bw`` = kv_GBps / copy bandwidth,
  the copy bandwidth being (bytes read + bytes written) / time of a 2 GiB device-to-device copy.
- ``TFLOPs`` = 2 x bs x N x q_heads x prefix x (Dqk + Dv) / ours_us (prefix work only): MLA and
  large MHA budgets are compute-bound (arithmetic intensity above the card's ~200 FLOP/B).
- ``*_rel_diff``: max |other - ours| / max |ours| on the same inputs (same semantics check).

Writes JSON (command, versions, GPU, date, results) to ``--out`` and prints a table.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import sys
import time
import types
from dataclasses import replace
from pathlib import Path

import torch

from sglang_ddtree.provenance import checkout_digest

ROOT = Path(__file__).resolve().parents[1]


def _import_ours(kernels_dir=None):
    """(reference, tree_attention, tree_attention_mla): the installed package's, this checkout's,
    or with ``kernels_dir`` those of another checkout's ``triton_kernels/`` (an A/B of kernel
    versions on one machine), imported under a private package name."""
    names = ("reference", "tree_attention", "tree_attention_mla")
    if kernels_dir:
        sys.path.insert(0, str(ROOT))
        from tests.triton_kernels import load_copy

        mods = load_copy("tv_variant", names, interpret=os.environ.get("TRITON_INTERPRET") == "1",
                         kernel_dir=kernels_dir)
        return tuple(mods[m] for m in names)
    try:
        from sglang_ddtree.triton_kernels import reference, tree_attention, tree_attention_mla
    except ImportError:  # running from a checkout without the package installed
        sys.path.insert(0, str(ROOT))
        from tests.triton_kernels import load_kernels
        k = load_kernels(interpret=False)
        reference, tree_attention, tree_attention_mla = k.reference, k.tree_attention, \
            k.tree_attention_mla
    return reference, tree_attention, tree_attention_mla


def load_sglang_extend(src_dir):
    """SGLang's extend_attention_fwd, or (None, reason)."""
    for mod in ("sglang.kernels.ops.attention.extend_attention",
                "sglang.srt.layers.attention.triton_ops.extend_attention"):
        try:
            return importlib.import_module(mod).extend_attention_fwd, mod
        except Exception as exc:  # noqa: BLE001 - reported in the JSON
            reason = f"{mod}: {type(exc).__name__}: {exc}"
    if not src_dir:
        return None, reason
    # Minimal namespace so SGLang's own kernel files import without the rest of SGLang.
    src = str(Path(src_dir).resolve())
    for name in list(sys.modules):
        if name == "sglang" or name.startswith("sglang."):
            del sys.modules[name]
    for name in ("sglang", "sglang.srt", "sglang.kernels", "sglang.kernels.ops",
                 "sglang.kernels.ops.attention"):
        m = types.ModuleType(name)
        m.__path__ = [src] if name.endswith("attention") else []
        sys.modules[name] = m
    utils = types.ModuleType("sglang.srt.utils")
    utils.is_cuda = lambda: torch.version.cuda is not None
    utils.is_hip = lambda: torch.version.hip is not None
    utils.is_gfx95_supported = lambda: False
    sys.modules["sglang.srt.utils"] = utils
    try:
        mod = importlib.import_module("sglang.kernels.ops.attention.extend_attention")
        return mod.extend_attention_fwd, f"files in {src}"
    except Exception as exc:  # noqa: BLE001
        return None, f"{src}: {type(exc).__name__}: {exc}"


def load_fa3():
    try:
        from sgl_kernel import merge_state_v2
        from sgl_kernel.flash_attn import flash_attn_with_kvcache
    except Exception as exc:  # noqa: BLE001
        return None, f"sgl_kernel: {type(exc).__name__}: {exc}"
    if torch.cuda.get_device_capability()[0] != 9:
        return None, "fa3 runs on sm90 only"
    return (flash_attn_with_kvcache, merge_state_v2), "sgl_kernel"


def copy_bandwidth_gbps(nbytes=2 << 30, iters=10):
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        b.copy_(a)
    e.record()
    torch.cuda.synchronize()
    sec = s.elapsed_time(e) / 1e3 / iters
    return 2 * nbytes / sec / 1e9


def time_graph(fn, iters, flush):
    """Median microseconds of a replayed CUDA graph of fn (eager if capture fails)."""
    fn()
    torch.cuda.synchronize()
    mode = "graph"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except Exception:  # noqa: BLE001 - some baselines are not capturable: time them eagerly
        torch.cuda.synchronize()
        run, mode = fn, "eager"
    times = []
    for _ in range(iters):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        run()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    times.sort()
    if KERNEL_TIMES["on"]:
        KERNEL_TIMES["last"] = kernel_times(run, flush)
    return times[len(times) // 2], mode


# --kernel-times: the kernels of the last timed graph, from the PyTorch profiler (CUPTI)
KERNEL_TIMES = {"on": False, "last": None}


def kernel_times(run, flush, reps=5):
    """Per-kernel device times of ``run`` (a graph replay) and the span from its first kernel's
    start to its last kernel's end, medians over ``reps`` profiled replays, each after an L2
    flush that has finished before the profiler starts (so only ``run``'s kernels are seen).
    The span leaves out the graph's launch; the events' time includes it."""
    from torch.profiler import ProfilerActivity, profile

    per_rep = []
    for _ in range(reps):
        flush.zero_()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        per_rep.append([(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                        if e.device_type == torch.autograd.DeviceType.CUDA])
    return summarize_kernel_times(per_rep)


def summarize_kernel_times(per_rep):
    """``per_rep``: one list of (start_us, end_us, name) device events per replay. The i-th
    kernel of each replay (by start) is taken as the same kernel; medians over the replays of
    each one's time and of the gap before it, and of the first-start-to-last-end span."""
    per_rep = [sorted(ks, key=lambda t: t[0]) for ks in per_rep]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    n = min(len(ks) for ks in per_rep)
    kernels = [dict(name=per_rep[0][i][2][:90],
                    us=round(med([ks[i][1] - ks[i][0] for ks in per_rep]), 2),
                    gap_before_us=round(med([ks[i][0] - ks[i - 1][1] for ks in per_rep]), 2)
                    if i else 0.0) for i in range(n)]
    spans = [ks[-1][1] - ks[0][0] for ks in per_rep if ks]
    return dict(kernels=kernels, span_us=round(med(spans), 2) if spans else None,
                sum_us=round(sum(k["us"] for k in kernels), 2))


def rel_diff(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


class Point:
    """Inputs of one grid point, on the GPU."""

    def __init__(self, ref, kind, bs, budget, ctx, caches, gen):
        self.kind, self.bs, self.n, self.ctx = kind, bs, budget + 1, ctx
        lens = [ctx] * bs
        self.layout = ref.random_paged_layout(lens, self.n, 16, gen).to("cuda")
        self.mask = ref.random_tree_mask(bs, self.n, gen, n_valid=torch.full((bs,), self.n))
        self.mask = self.mask.cuda()
        self.k_cache, self.v_cache = caches
        hq, dq = (32, 128) if kind == "mha" else (8, 576)
        self.q = torch.randn(bs * self.n, hq, dq, device="cuda", dtype=torch.bfloat16)
        self.sm_scale = 128 ** -0.5 if kind == "mha" else 192 ** -0.5
        tok_bytes = 2 * 8 * 128 * 2 if kind == "mha" else 576 * 2
        self.kv_bytes = bs * (ctx + self.n) * tok_bytes
        # useful matmul work: every query row against every prefix key, QK^T and PV
        self.flops = 2 * bs * self.n * hq * ctx * ((128 + 128) if kind == "mha" else (576 + 512))


@contextlib.contextmanager
def reduce_chunk(ta, chunk):
    """Launches inside run the split reduce with ``chunk`` splits a step (its CHUNK_S) instead of
    the served rule, ``tree_attention_plan._reduce_chunk``, which ``ta.TreeAttention.run`` reads
    from its module per launch; the rule is back afterwards."""
    served = ta._reduce_chunk
    ta._reduce_chunk = lambda v_head_dim, num_splits=1: chunk
    try:
        yield
    finally:
        ta._reduce_chunk = served


def plan_ours(ta, mla, p, config, plan_context=0, num_kv_splits=None, merge_config=None):
    """Our kernel planned for point ``p`` as a server plans it: for contexts up to
    max(plan_context, p.ctx) (its longest context: more splits, most of them empty on a short
    prefix); ``num_kv_splits`` fixes the split count instead of the rule's; ``merge_config``
    replaces the tile of the launch that merges a prefix part from FlashMLA / FA3 (left out
    when None: checkouts before session 35 have no such argument)."""
    max_ctx = max(plan_context, p.ctx)
    extra = {} if merge_config is None else dict(merge_config=merge_config)
    if p.kind == "mha":
        return ta.TreeAttention.plan(max_batch_size=p.bs, num_tree_tokens=p.n, num_q_heads=32,
                                     num_kv_heads=8, head_dim=128, max_context_len=max_ctx,
                                     device="cuda", config=config, num_kv_splits=num_kv_splits,
                                     **extra)
    return mla.TreeAttentionMLA.plan(max_batch_size=p.bs, num_tree_tokens=p.n, num_heads=8,
                                     max_context_len=max_ctx, device="cuda",
                                     sm_scale=p.sm_scale, config=config,
                                     num_kv_splits=num_kv_splits, **extra)


def merge_tile(attn, bs):
    """The merging launch's tile of a plan, as text (None before session 35's merge tile)."""
    fn = getattr(attn, "merge_config_for", None)
    if fn is None:
        return None
    c = fn(bs)
    return f"{c.block_m},{c.block_n},{c.num_warps},{c.num_stages},{c.dv_split}"


def bench_ours(ta, mla, p, iters, flush, config, plan_context=0, min_split_keys=None,
               num_kv_splits=None):
    """Our kernel at point ``p`` (planned by ``plan_ours``). ``min_split_keys`` replaces the
    config's fewest prefix keys per split (``KernelConfig.min_split_keys``, the served knob:
    it sets the kernel's minimum chunk and caps the split count at the planned context over
    it) in the config the plan would launch at this batch size."""
    attn = plan_ours(ta, mla, p, config, plan_context, num_kv_splits)
    if min_split_keys is not None:
        cfg = replace(attn.config_for(p.bs), min_split_keys=min_split_keys)
        attn = plan_ours(ta, mla, p, cfg, plan_context, num_kv_splits)
    if p.kind == "mha":
        out = torch.empty(p.q.shape[0], 32, 128, device="cuda", dtype=torch.bfloat16)
        fn = lambda: attn.run(p.q, p.k_cache, p.v_cache, p.layout.out_cache_loc, p.mask,  # noqa
                              out=out, validate=False, **p.layout.table_kwargs())
    else:
        out = torch.empty(p.q.shape[0], 8, 512, device="cuda", dtype=torch.bfloat16)
        fn = lambda: attn.run(p.q, p.k_cache, p.layout.out_cache_loc, p.mask, out=out,  # noqa
                              validate=False, **p.layout.table_kwargs())
    us, _ = time_graph(fn, iters, flush)
    return us, out.clone(), attn.num_splits(p.bs)


def bench_flashmla_prefix(ref, mla, p, iters, flush, gen, config, plan_context=0,
                          merge_config=None):
    """MLA point ``p`` with the prefix on FlashMLA (``SGLANG_DDTREE_MLA_PREFIX=flashmla``):
    the same queries and cache, laid out in pages of 64 tokens (FlashMLA's page); page table,
    lengths and metadata prepared before the timed graph, as the verify backend does before a
    replay. Returns (us, output, the merging launch's tile, our kernel alone on the same
    layout)."""
    from sglang_ddtree.mla_prefix import PAGE, FlashMLAPrefix

    lay = ref.random_paged_layout([p.ctx] * p.bs, p.n, PAGE, gen).to("cuda")
    assert lay.num_slots <= p.k_cache.shape[0]
    kv = p.k_cache[: lay.num_slots // PAGE * PAGE]
    attn = plan_ours(None, mla, p, config, plan_context, merge_config=merge_config)
    prefix = FlashMLAPrefix(num_tree_tokens=p.n, num_heads=8, device="cuda",
                            context_width=lay.req_to_token.shape[1])
    prefix.init_graph_buffers(p.bs)
    prefix.prepare(lay.req_to_token, lay.req_pool_indices, lay.seq_lens, static=True)
    out = torch.empty(p.q.shape[0], 8, 512, device="cuda", dtype=torch.bfloat16)

    def fn():
        p_out, p_lse = prefix.run(p.q, kv, p.sm_scale)
        attn.run(p.q, kv, lay.out_cache_loc, p.mask, out=out, validate=False,
                 prefix_out=p_out, prefix_lse=p_lse, **lay.table_kwargs())

    us, _ = time_graph(fn, iters, flush)
    alone = attn.run(p.q, kv, lay.out_cache_loc, p.mask, **lay.table_kwargs())
    return us, out.clone(), merge_tile(attn, p.bs), alone


def bench_fa3_prefix(ta, p, iters, flush, config, plan_context=0, merge_config=None):
    """MHA point ``p`` with the prefix on FA3 (``SGLANG_DDTREE_MHA_PREFIX=fa3``): FA3's paged
    decode over the prefix (pages of one token, as SGLang's fa3 backend keeps them), then our
    kernel over the tree keys merging the two, page table and lengths prepared before the
    timed graph as the verify backend does before a replay."""
    from sglang_ddtree.mha_prefix import FA3Prefix

    lay = p.layout
    attn = plan_ours(ta, None, p, config, plan_context, merge_config=merge_config)
    prefix = FA3Prefix(num_tree_tokens=p.n, page_size=1, device="cuda",
                       context_width=lay.req_to_token.shape[1],
                       table_dtype=lay.req_to_token.dtype)
    prefix.init_graph_buffers(p.bs)
    rows = torch.arange(p.bs, device="cuda")
    table = lay.req_to_token.index_select(0, lay.req_pool_indices).contiguous()
    prefix.prepare(table, rows, lay.seq_lens, static=True)
    out = torch.empty(p.q.shape[0], 32, 128, device="cuda", dtype=torch.bfloat16)

    def fn():
        p_out, p_lse = prefix.run(p.q, p.k_cache, p.v_cache, p.sm_scale)
        attn.run(p.q, p.k_cache, p.v_cache, lay.out_cache_loc, p.mask, out=out, validate=False,
                 prefix_out=p_out, prefix_lse=p_lse, **lay.table_kwargs())

    us, _ = time_graph(fn, iters, flush)
    return us, out.clone(), merge_tile(attn, p.bs)


def record_timed(r, key, t, out, ours, args):
    """A timed path's common fields at point row ``r``: its time, its kernels (--kernel-times)
    and its output's difference from our kernel alone's."""
    r[f"{key}_us"] = round(t, 2)
    if args.kernel_times:
        r[f"{key}_kernels"] = KERNEL_TIMES["last"]
    r[f"{key}_rel_diff"] = round(rel_diff(out, ours), 5)


def time_prefix_path(r, key, us, args, ta, run):
    """Record one prefix path (``key``: ``fa3_prefix`` or ``flashmla_prefix``) at point row
    ``r``: ``run(merge_config)`` -> (us, output, merging tile, our kernel alone's output on the
    same layout); ``us`` our kernel alone's time. Its time, tile, kernels (--kernel-times),
    difference from ours, speedup and, with --merge-sweep, the other merge tiles' times; an
    error is recorded in place of the time."""
    try:
        t, o, tile, ours = run(None)
        record_timed(r, key, t, o, ours, args)
        r[f"{key}_merge_tile"] = tile
        r[f"speedup_{key}"] = round(us / t, 2)
        if args.merge_sweep:
            r[f"{key}_merge_us"] = merge_sweep(args.merge_sweep, ta, o, lambda c: run(c)[:2])
    except Exception as exc:  # noqa: BLE001 - recorded per point
        r[f"{key}_us"] = f"error: {type(exc).__name__}: {exc}"[:200]


def merge_sweep(spec, ta, base_out, run):
    """Microseconds of a prefix path (``run(merge_config) -> (us, out)``) with each tile of
    ``spec`` (';'-separated block_m,block_n,num_warps,num_stages[,dv_split]) on the merging
    launch, outputs checked against the default tile's ``base_out``."""
    res = {}
    for cfg_s in spec.split(";"):
        try:
            t, o = run(ta.KernelConfig(*parse_ints(cfg_s)))
            diff = rel_diff(o, base_out)
            res[cfg_s] = round(t, 2) if diff < 2e-2 else f"wrong output: rel diff {diff:.3g}"
        except Exception as exc:  # noqa: BLE001 - recorded per config
            res[cfg_s] = f"error: {type(exc).__name__}: {exc}"[:200]
    return res


def bench_sglang(extend, p, iters, flush):
    n, bs, lay = p.n, p.bs, p.layout
    loc = lay.out_cache_loc
    if p.kind == "mha":
        k_buf, v_buf = p.k_cache, p.v_cache
        hq, dv = 32, 128
    else:
        k_buf, v_buf = p.k_cache, p.k_cache[..., :512]
        hq, dv = 8, 512
    k_ext, v_ext = k_buf[loc].contiguous(), v_buf[loc].contiguous()
    qo_indptr = torch.arange(0, (bs + 1) * n, n, dtype=torch.int32, device="cuda")
    kv_indptr = lay.kv_indptr.to(torch.int32)
    kv_indices = lay.kv_indices.to(torch.int64)
    rows = [torch.cat([torch.ones(n, int(lay.seq_lens[b]), dtype=torch.bool, device="cuda"),
                       p.mask[b]], 1).flatten() for b in range(bs)]
    custom_mask = torch.cat(rows)
    mask_indptr = torch.zeros(bs + 1, dtype=torch.int64, device="cuda")
    mask_indptr[1:] = torch.cumsum(n * (lay.seq_lens + n), 0)
    out = torch.empty(bs * n, hq, dv, device="cuda", dtype=torch.bfloat16)
    fn = lambda: extend(p.q, k_ext, v_ext, out, k_buf, v_buf, qo_indptr, kv_indptr,  # noqa
                        kv_indices, custom_mask, True, mask_indptr, n, 1.0, 1.0,
                        sm_scale=p.sm_scale)
    us, mode = time_graph(fn, iters, flush)
    return us, out.clone(), mode


def bench_fa3(fa3, p, iters, flush):
    attn_kv, merge = fa3
    n, bs, lay = p.n, p.bs, p.layout
    page_table = lay.req_to_token[lay.req_pool_indices].to(torch.int32)
    cache_seqlens = lay.seq_lens.to(torch.int32)
    cu_q = torch.arange(0, (bs + 1) * n, n, dtype=torch.int32, device="cuda")
    # expand pass: every query alone, over its ancestors' slots sorted first (as SGLang builds)
    col = torch.arange(n, device="cuda").expand(bs * n, n)
    m = p.mask.reshape(bs * n, n)
    order = torch.sort(torch.where(m, col, col + n), dim=1).indices
    loc_rows = lay.out_cache_loc.view(bs, n).repeat_interleave(n, 0)
    exp_table = torch.gather(loc_rows, 1, order).to(torch.int32)
    exp_lens = m.sum(1).to(torch.int32)
    cu_exp = torch.arange(0, bs * n + 1, dtype=torch.int32, device="cuda")
    if p.kind == "mha":
        kc = p.k_cache.view(-1, 1, 8, 128)
        vc = p.v_cache.view(-1, 1, 8, 128)
        q, qv, extra = p.q, None, {}
    else:
        kc = p.k_cache[..., 512:].view(-1, 1, 1, 64)
        vc = p.k_cache[..., :512].view(-1, 1, 1, 512)
        q, qv = p.q[..., 512:].contiguous(), p.q[..., :512].contiguous()
        extra = {"qv": qv}

    def fn():
        o, lse, *_ = attn_kv(q=q, k_cache=kc, v_cache=vc, page_table=page_table,
                             cache_seqlens=cache_seqlens, cu_seqlens_q=cu_q, max_seqlen_q=n,
                             softmax_scale=p.sm_scale, causal=False, return_softmax_lse=True,
                             **extra)
        o2, lse2, *_ = attn_kv(q=q, k_cache=kc, v_cache=vc, page_table=exp_table,
                               cache_seqlens=exp_lens, cu_seqlens_q=cu_exp, max_seqlen_q=1,
                               softmax_scale=p.sm_scale, causal=False,
                               return_softmax_lse=True, **extra)
        return merge(o, lse.T.contiguous(), o2, lse2.T.contiguous())[0]

    out = fn()
    us, mode = time_graph(fn, iters, flush)
    return us, out, mode


def parse_ints(s):
    return [int(x) for x in s.split(",") if x]


# H200 SXM dense BF16 tensor-core peak from NVIDIA's datasheet (989 TFLOP/s), not a measurement:
# the compute roof of the roofline below. The memory roof is the measured copy bandwidth.
H200_BF16_PEAK_TFLOPS = 989.0


def roofline(r: dict, copy_gbps: float, peak_tflops: float = H200_BF16_PEAK_TFLOPS) -> dict:
    """The time a point cannot beat: max(KV bytes / copy bandwidth, prefix FLOPs / peak), and
    our kernel's share of it. ``r`` is one result row (kv_bytes, ours_us, TFLOPs)."""
    flops = r["TFLOPs"] * 1e6 * r["ours_us"]  # TFLOP/s x us = MFLOP; x 1e6 -> FLOP
    mem_us = r["kv_bytes"] / (copy_gbps * 1e3)
    compute_us = flops / (peak_tflops * 1e6)
    roof = max(mem_us, compute_us)
    return {"flop_per_byte": round(flops / r["kv_bytes"], 1),
            "bound": "memory" if mem_us >= compute_us else "compute",
            "roofline_us": round(roof, 2), "frac_of_roofline": round(roof / r["ours_us"], 3),
            # the best fraction of copy bandwidth any kernel can reach at this point
            "max_frac_copy_bw": round(mem_us / roof, 3)}


def roofline_table(data: dict, peak_tflops: float = H200_BF16_PEAK_TFLOPS) -> str:
    """Markdown: every point of a results JSON against its roofline (no GPU needed)."""
    bw = data["meta"]["copy_bandwidth_GBps"]
    rows = ["| kind | batch | budget | context | ours us | FLOP/B | bound | roofline us | "
            "ours / roofline | % copy bw reached | % copy bw reachable |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["results"]:
        f = roofline(r, bw, peak_tflops)
        rows.append(f"| {r['kind']} | {r['batch']} | {r['budget']} | {r['context']} | "
                    f"{r['ours_us']} | {f['flop_per_byte']:.0f} | {f['bound']} | "
                    f"{f['roofline_us']} | {100 * f['frac_of_roofline']:.0f} % | "
                    f"{100 * r['frac_copy_bw']:.0f} % | {100 * f['max_frac_copy_bw']:.0f} % |")
    return (f"Roofline: memory roof {bw:.0f} GB/s (measured copy), compute roof {peak_tflops:.0f} "
            f"TFLOP/s (datasheet BF16 dense peak, not measured).\n\n" + "\n".join(rows))


def ab_summary(variants: dict) -> list:
    """Same-call A/B of kernel variants (``{tag: [results JSON, ...]}``, one JSON a round, the
    rounds alternating): per point, each variant's fastest round, its rounds, its split count,
    and each other variant's time over the first's. The points all variants timed, in the
    first variant's order."""
    tags = list(variants)
    key = ("kind", "batch", "budget", "context")
    times = {}
    order = []
    for tag, datas in variants.items():
        for data in datas:
            for r in data["results"]:
                if not isinstance(r.get("ours_us"), (int, float)):
                    continue
                k = tuple(r[f] for f in key)
                if tag == tags[0] and k not in order:
                    order.append(k)
                t = times.setdefault(k, {}).setdefault(tag, {"us": [], "splits": None})
                t["us"].append(r["ours_us"])
                t["splits"] = r.get("num_splits")
    rows = []
    for k in order:
        if set(times[k]) != set(tags):
            continue
        row = dict(zip(key, k))
        for tag in tags:
            row[f"{tag}_us"] = min(times[k][tag]["us"])
            row[f"{tag}_rounds"] = times[k][tag]["us"]
            row[f"{tag}_splits"] = times[k][tag]["splits"]
        for tag in tags[1:]:
            row[f"{tag}_over_{tags[0]}"] = round(row[f"{tag}_us"] / row[f"{tags[0]}_us"], 3)
        rows.append(row)
    return rows


def parse_ab(specs: list) -> dict:
    """``TAG=A.json[,B.json...]`` items (``--ab``) -> {tag: [loaded JSON, ...]}."""
    out = {}
    for spec in specs:
        tag, sep, paths = spec.partition("=")
        if not sep or not tag or not paths:
            raise SystemExit(f"--ab {spec!r}: expected TAG=RESULTS.json[,RESULTS.json...]")
        out[tag] = [json.load(open(p)) for p in paths.split(",")]
    if len(out) < 2:
        raise SystemExit("--ab: name at least two variants")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench_results" / "tree_verify_h200.json"))
    ap.add_argument("--kinds", default="mha,mla")
    ap.add_argument("--batch-sizes", type=parse_ints, default=[1, 8, 32])
    ap.add_argument("--budgets", type=parse_ints, default=[8, 16, 32, 64])
    ap.add_argument("--contexts", type=parse_ints, default=[2048, 16384, 65536])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sglang-src", default=None, help="dir with SGLang's attention kernel files")
    ap.add_argument("--no-baselines", action="store_true", help="time our kernel only")
    ap.add_argument("--no-sglang-triton", action="store_true",
                    help="skip SGLang's triton extend baseline (up to 50 ms a point at 64k keys), "
                         "keep fa3")
    ap.add_argument("--mla-prefix", action="store_true",
                    help="also time MLA points with the prefix on FlashMLA "
                         "(SGLANG_DDTREE_MLA_PREFIX=flashmla; Hopper; pages of 64)")
    ap.add_argument("--mha-prefix", action="store_true",
                    help="also time MHA points with the prefix on FA3 "
                         "(SGLANG_DDTREE_MHA_PREFIX=fa3; Hopper), under 'fa3_prefix_us'")
    ap.add_argument("--config", default=None,
                    help="override our tile config: block_m,block_n,num_warps,num_stages")
    ap.add_argument("--sweep", default=None,
                    help="tile configs to time at every point besides the default, ';'-separated "
                         "block_m,block_n,num_warps,num_stages[,dv_split[,dk_chunk"
                         "[,min_split_keys[,tail_m]]]] (KernelConfig's order; e.g. "
                         "'64,64,8,2;64,32,4,2,2,64;64,64,4,3,1,0,256,16'; screen them first with "
                         "scripts/tree_verify_static.py); "
                         "each point records them under 'sweep_us' (outputs checked against the "
                         "default config's) and their split counts under 'sweep_splits'")
    ap.add_argument("--splits", type=parse_ints, default=[],
                    help="also time every point with these fixed split counts (num_kv_splits; "
                         "the served tile of each batch size), under 'splits_us' (outputs "
                         "checked against the default's)")
    ap.add_argument("--min-split-keys", type=parse_ints, default=[],
                    help="also time every point with these fewest-keys-per-split values "
                         "(KernelConfig.min_split_keys of the tile served at that batch size: "
                         "the kernel's minimum chunk and the split cap), under "
                         "'min_split_keys_us' (outputs checked against the default's; before "
                         "session 19 this moved the minimum chunk only)")
    ap.add_argument("--reduce-chunks", type=parse_ints, default=[],
                    help="also time every point's served plan with the split reduce summing "
                         "this many splits a step (the reduce kernel's CHUNK_S; served: "
                         "tree_attention_plan._reduce_chunk), under 'reduce_chunk_us' (outputs "
                         "checked against the default's)")
    ap.add_argument("--kernels-dir", default=None,
                    help="time the kernels of another checkout's triton_kernels/ directory "
                         "(reference.py, tree_attention.py, tree_attention_mla.py, an "
                         "__init__.py, from session 21 on tree_attention_plan.py and from "
                         "session 30 on _device.py) instead of this one's")
    ap.add_argument("--plan-context", type=int, default=0,
                    help="plan our kernel for contexts up to this many tokens (as a server "
                         "does for its --context-length) instead of each point's own context")
    ap.add_argument("--merge-sweep", default=None,
                    help="with --mla-prefix / --mha-prefix: also time the prefix path with "
                         "each of these tiles on the launch that attends the tree keys and "
                         "merges (';'-separated block_m,block_n,num_warps,num_stages"
                         "[,dv_split]), under '<prefix>_merge_us' (outputs checked against the "
                         "default tile's)")
    ap.add_argument("--kernel-times", action="store_true",
                    help="also record each timed graph's kernels (PyTorch profiler: device "
                         "time each, gaps, first-start-to-last-end span) under '<name>_kernels'")
    ap.add_argument("--roofline-of", default=None, metavar="JSON",
                    help="print a results JSON against its roofline and exit (no GPU needed)")
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_PEAK_TFLOPS)
    ap.add_argument("--ab", action="append", default=[], metavar="TAG=JSON[,JSON...]",
                    help="summarise a same-call A/B (gpu_session.sh tvspec) from its results "
                         "JSONs, one per round, into --out and exit (no GPU needed); the first "
                         "variant is the base of the ratios")
    args = ap.parse_args(argv)
    if args.ab:
        variants = parse_ab(args.ab)
        rows = ab_summary(variants)
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "variants": {
                t: [d.get("meta", {}) for d in ds] for t, ds in variants.items()},
                "summary": rows}, f, indent=1)
        tags = list(variants)
        for r in rows:
            print(f"{r['kind']} bs {r['batch']} budget {r['budget']} ctx {r['context']}: "
                  + " ".join(f"{t} {r[f'{t}_us']}" for t in tags) + " | "
                  + " ".join(f"{t}/{tags[0]} {r[f'{t}_over_{tags[0]}']}" for t in tags[1:]))
        return 0
    if args.roofline_of:
        print(roofline_table(json.load(open(args.roofline_of)), args.peak_tflops))
        return 0
    if not torch.cuda.is_available():
        print("bench_tree_verify needs a CUDA GPU")
        return 2

    KERNEL_TIMES["on"] = args.kernel_times
    ref, ta, mla = _import_ours(args.kernels_dir)
    config = ta.KernelConfig(*parse_ints(args.config)) if args.config else None
    extend, extend_src = (None, "skipped") if args.no_baselines or args.no_sglang_triton else \
        load_sglang_extend(args.sglang_src)
    fa3, fa3_src = (None, "skipped") if args.no_baselines else load_fa3()
    print(f"sglang triton extend: {'available' if extend else 'not available'} ({extend_src})")
    print(f"fa3: {'available' if fa3 else 'not available'} ({fa3_src})")
    copy_bw = copy_bandwidth_gbps()
    print(f"device copy bandwidth (read + write): {copy_bw:.0f} GB/s")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    gen = torch.Generator().manual_seed(0)
    kinds = args.kinds.split(",")
    # (+ 64 a request and 5 pages: room for the 64-token pages of --mla-prefix layouts)
    max_tokens = max(args.batch_sizes) * (max(args.contexts) + max(args.budgets) + 1 + 96) + 320
    results = []
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")

    def dump(complete):
        # after every point too: a call's time limit keeps the points that ran
        meta = dict(command=" ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
                    date=started, complete=complete, gpu=torch.cuda.get_device_name(),
                    torch=torch.__version__, triton=__import__("triton").__version__,
                    source_digest=checkout_digest(__file__),
                    python=platform.python_version(), copy_bandwidth_GBps=round(copy_bw, 1),
                    sglang_triton=extend_src, fa3=fa3_src, iters=args.iters,
                    mla_prefix="flashmla" if args.mla_prefix else None,
                    mha_prefix="fa3" if args.mha_prefix else None,
                    peak_tflops_datasheet=args.peak_tflops, sweep=args.sweep,
                    min_split_keys=args.min_split_keys, splits=args.splits,
                    timing="median of CUDA-graph replays, L2 flushed (256 MB write) before each",
                    shapes=dict(mha="Qwen3-8B layer: 32 q heads, 8 kv heads, d 128, bf16",
                                mla="Kimi K2.6 TP8 rank: 8 heads, latent 512 + rope 64, bf16"),
                    config=args.config or "default",
                    plan_context=args.plan_context or "each point's own context",
                    kernels_dir=args.kernels_dir or "this checkout")
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".tmp", "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
        os.replace(args.out + ".tmp", args.out)

    for kind in kinds:
        if kind == "mha":
            caches = (torch.randn(max_tokens, 8, 128, device="cuda", dtype=torch.bfloat16),
                      torch.randn(max_tokens, 8, 128, device="cuda", dtype=torch.bfloat16))
        else:
            caches = (torch.randn(max_tokens, 1, 576, device="cuda", dtype=torch.bfloat16),
                      None)
        for ctx in args.contexts:
            for bs in args.batch_sizes:
                for budget in args.budgets:
                    p = Point(ref, kind, bs, budget, ctx, caches, gen)
                    assert p.layout.num_slots <= max_tokens
                    r = dict(kind=kind, batch=bs, budget=budget, context=ctx,
                             kv_bytes=p.kv_bytes)
                    us, ours, splits = bench_ours(ta, mla, p, args.iters, flush, config,
                                                  args.plan_context)
                    if args.kernel_times:
                        r["ours_kernels"] = KERNEL_TIMES["last"]
                    r.update(ours_us=round(us, 2), num_splits=splits,
                             kv_GBps=round(p.kv_bytes / us / 1e3, 1),
                             TFLOPs=round(p.flops / us / 1e6, 1))
                    r["frac_copy_bw"] = round(r["kv_GBps"] / copy_bw, 3)
                    r.update(roofline(r, copy_bw, args.peak_tflops))
                    if args.sweep:
                        r["sweep_us"], r["sweep_splits"] = {}, {}
                        for cfg_s in args.sweep.split(";"):
                            try:
                                cfg = ta.KernelConfig(*parse_ints(cfg_s))
                                t, o, r["sweep_splits"][cfg_s] = bench_ours(
                                    ta, mla, p, args.iters, flush, cfg, args.plan_context)
                                diff = rel_diff(o, ours)
                                r["sweep_us"][cfg_s] = (round(t, 2) if diff < 2e-2 else
                                                        f"wrong output: rel diff {diff:.3g}")
                            except Exception as exc:  # noqa: BLE001 - recorded per config
                                r["sweep_us"][cfg_s] = f"error: {type(exc).__name__}: {exc}"[:200]
                    # the served tile with another split minimum, or a fixed split count
                    for key, values, kw in (("min_split_keys_us", args.min_split_keys,
                                             "min_split_keys"),
                                            ("splits_us", args.splits, "num_kv_splits")):
                        if values:
                            r[key] = {}
                        for v in values:
                            t, o, _ = bench_ours(ta, mla, p, args.iters, flush, config,
                                                 args.plan_context, **{kw: v})
                            diff = rel_diff(o, ours)
                            r[key][v] = (round(t, 2) if diff < 2e-2 else
                                         f"wrong output: rel diff {diff:.3g}")
                    if args.reduce_chunks:
                        r["reduce_chunk_us"] = {}
                    for c in args.reduce_chunks:
                        with reduce_chunk(ta, c):
                            t, o, _ = bench_ours(ta, mla, p, args.iters, flush, config,
                                                 args.plan_context)
                        diff = rel_diff(o, ours)
                        r["reduce_chunk_us"][c] = (round(t, 2) if diff < 2e-2 else
                                                   f"wrong output: rel diff {diff:.3g}")
                    if args.mha_prefix and kind == "mha":
                        time_prefix_path(r, "fa3_prefix", us, args, ta, lambda c: (
                            *bench_fa3_prefix(ta, p, args.iters, flush, config,
                                              args.plan_context, merge_config=c), ours))
                    if args.mla_prefix and kind == "mla":
                        # the paged layout from a seed of the point's own, so the merge sweep
                        # runs on the default's
                        lay_seed = 1000 + len(results)
                        time_prefix_path(r, "flashmla_prefix", us, args, ta, lambda c: (
                            bench_flashmla_prefix(ref, mla, p, args.iters, flush,
                                                  torch.Generator().manual_seed(lay_seed),
                                                  config, args.plan_context, merge_config=c)))
                    for name, avail, fn in (("sglang_triton", extend, bench_sglang),
                                            ("fa3", fa3, bench_fa3)):
                        if not avail:
                            r[f"{name}_us"] = "not available"
                            continue
                        try:
                            t, o, mode = fn(avail, p, max(3, args.iters // 4), flush)
                            record_timed(r, name, t, o, ours, args)
                            r[f"{name}_timing"] = mode
                            r[f"speedup_vs_{name}"] = round(t / us, 2)
                        except Exception as exc:  # noqa: BLE001 - recorded per point
                            r[f"{name}_us"] = f"error: {type(exc).__name__}: {exc}"[:200]
                    results.append(r)
                    dump(complete=False)
                    print(_row(r), flush=True)
                    del p
                    torch.cuda.empty_cache()
        del caches
        torch.cuda.empty_cache()

    dump(complete=True)
    print(f"wrote {args.out}")
    return 0


def _fmt(v):
    return f"{v:9.1f}" if isinstance(v, (int, float)) else f"{str(v)[:9]:>9s}"


def _row(r):
    return (f"{r['kind']:3s} ctx {r['context']:6d} bs {r['batch']:2d} budget {r['budget']:3d} "
            f"splits {r['num_splits']:2d} | ours {r['ours_us']:9.1f} us "
            f"{r['kv_GBps']:7.0f} GB/s ({100 * r['frac_copy_bw']:4.0f}% copy) {r['TFLOPs']:5.0f} TF/s | "
            f"sglang {_fmt(r['sglang_triton_us'])} | fa3 {_fmt(r['fa3_us'])}"
            + "".join(f" | {key} {r[key]}" for key in ("sweep_us", "min_split_keys_us",
                                                        "reduce_chunk_us", "splits_us",
                                                        "flashmla_prefix_us", "fa3_prefix_us")
                    if key in r))


if __name__ == "__main__":
    raise SystemExit(main())
