#!/usr/bin/env python
"""Benchmark the DFlash drafter's block attention on one GPU: ours vs SGLang's triton and flashinfer.

Every DDTREE (and DFLASH) step runs the drafter once: ``block`` query tokens a request attend the
drafter's whole prefix KV and every block token (DFlash drafter layers are bidirectional). With
``--speculative-draft-attention-backend triton`` SGLang runs that as ``extend_attention_fwd``
with ``is_causal=False`` and no custom mask, one program per (request, q head, 64-row block)
walking the prefix serially; ``SGLANG_DDTREE_DRAFT_ATTENTION=triton`` runs our tree-attention
kernel with an all-ones block mask instead (``draft_attention.install_draft``), which splits long
prefixes. The session-23 Kimi rank at 32k prompt tokens spent 14.3 ms of a step in the draft
stage against 0.97 ms at 512 (``bench_results/cost_curves_kimi_l61_rankvocab_32k_*``).

Shapes (one layer, bf16): ``kimi`` = the Kimi K2.6 TP8-rank emulation's drafter (8 q heads,
1 KV head, d 128; ``bench_assets/model-configs/kimi-k2.6-*-dflash-draft``); ``qwen3-8b`` = a
Qwen3-8B DFlash drafter layer (32 q heads, 8 KV heads, d 128). Prefix slots scattered over pages
of 16 tokens; CUDA-graph replays, L2 flushed before each (``bench_tree_verify.time_graph``).

Baselines (``--baselines``, default both): SGLang's triton extend kernel, and FlashInfer's paged
prefill as SGLang's flashinfer backend runs the drafter (``fa2``, pages of one token,
``causal=False``; ``--speculative-draft-attention-backend flashinfer``).

Columns: ``ours_us``, ``sglang_triton_us`` (``not available`` without SGLang's kernel),
``speedup`` = sglang / ours, ``rel_diff`` (max |sglang - ours| / max |ours|, same inputs),
``flashinfer_us``, ``speedup_vs_flashinfer``, ``rel_diff_flashinfer`` likewise,
``kv_GBps`` / ``frac_copy_bw`` (prefix + block K/V bytes over our time, against the measured
copy bandwidth); with ``--splits`` (and ``--reduce-chunks``) ``sweep``: our kernel at those fixed
split counts (x the reduce's splits per step), each row's time and difference from the served
plan's output. Writes JSON (command, versions, GPU, date, results) to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tree_verify import (_import_ours, copy_bandwidth_gbps,  # noqa: E402
                               load_sglang_extend, parse_ints, reduce_chunk, rel_diff,
                               time_graph)

from sglang_ddtree.doctor import DRAFT_SHAPE, MHA_SHAPE  # noqa: E402
from sglang_ddtree.provenance import checkout_digest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# q heads, kv heads, head dim: the doctor's drafter rows and its Qwen3-8B layer
SHAPES = {name: (s["num_q_heads"], s["num_kv_heads"], s["head_dim"])
          for name, s in (("kimi", DRAFT_SHAPE), ("qwen3-8b", MHA_SHAPE))}


class DraftPoint:
    """Inputs of one point: ``bs`` requests of ``ctx`` prefix tokens and a ``block``-token
    block whose K/V sit at ``layout.out_cache_loc`` (written, as the drafter's forward does
    before it attends)."""

    def __init__(self, ref, shape, bs, block, ctx, gen, device):
        hq, hkv, d = SHAPES[shape]
        self.shape, self.bs, self.n, self.ctx, self.hq, self.hkv, self.d = (
            shape, bs, block, ctx, hq, hkv, d)
        self.layout = ref.random_paged_layout([ctx] * bs, block, 16, gen).to(device)
        slots = self.layout.num_slots
        # the caches are drawn where they live (gigabytes at batch 32 x 64k keys)
        dgen = torch.Generator(device).manual_seed(int(torch.randint(1 << 30, (1,),
                                                                     generator=gen)))

        def randn(*shape):
            return torch.randn(shape, generator=dgen, device=device, dtype=torch.bfloat16)

        self.k_cache, self.v_cache = randn(slots, hkv, d), randn(slots, hkv, d)
        self.q = randn(bs * block, hq, d)
        self.mask = torch.ones(block, block, dtype=torch.bool, device=device).expand(
            bs, block, block)
        self.sm_scale = d ** -0.5
        self.kv_bytes = bs * (ctx + block) * 2 * hkv * d * 2


def ours_fn(ta, p, max_context=0, validate=False, num_kv_splits=None):
    """(fn, out, splits): our kernel planned as install_draft plans it (for the server's longest
    context, ``max_context``), all-ones block mask; ``num_kv_splits`` fixes the split count."""
    attn = ta.TreeAttention.plan(max_batch_size=p.bs, num_tree_tokens=p.n, num_q_heads=p.hq,
                                 num_kv_heads=p.hkv, head_dim=p.d,
                                 max_context_len=max(max_context, p.ctx + p.n),
                                 device=p.q.device, sm_scale=p.sm_scale,
                                 num_kv_splits=num_kv_splits, ordered_mask=False)
    out = torch.empty_like(p.q)

    def fn():
        attn.run(p.q, p.k_cache, p.v_cache, p.layout.out_cache_loc, p.mask, out=out,
                 validate=validate, **p.layout.table_kwargs())

    return fn, out, attn.num_splits(p.bs)


def sglang_fn(extend, p):
    """(fn, out): SGLang's extend kernel as its triton backend runs the DFlash drafter (block
    K/V passed as the extend part, prefix through kv_indices, is_causal False, no mask)."""
    lay, n, bs = p.layout, p.n, p.bs
    loc = lay.out_cache_loc
    k_ext, v_ext = p.k_cache[loc].contiguous(), p.v_cache[loc].contiguous()
    dev = p.q.device
    qo_indptr = torch.arange(0, (bs + 1) * n, n, dtype=torch.int32, device=dev)
    kv_indptr = lay.kv_indptr.to(torch.int32)
    kv_indices = lay.kv_indices.to(torch.int64)
    mask_indptr = torch.zeros(bs + 1, dtype=torch.int64, device=dev)
    out = torch.empty_like(p.q)

    def fn():
        extend(p.q, k_ext, v_ext, out, p.k_cache, p.v_cache, qo_indptr, kv_indptr, kv_indices,
               None, False, mask_indptr, n, 1.0, 1.0, sm_scale=p.sm_scale)

    return fn, out


def flashinfer_fn(p, workspace):
    """(fn, out): FlashInfer's paged prefill as SGLang's flashinfer backend runs the DFlash
    drafter: the ``fa2`` backend (SGLang's prefill choice on Hopper), pages of one token (each
    request's prefix slots, then its block's), ``causal=False`` for the bidirectional layers.
    Planned once per point, outside the timing (SGLang plans once per step for all layers)."""
    import flashinfer

    lay, n, bs, ctx = p.layout, p.n, p.bs, p.ctx
    dev = p.q.device
    width = ctx + n
    indices = torch.cat([lay.kv_indices.view(bs, ctx).to(torch.int32),
                         lay.out_cache_loc.view(bs, n).to(torch.int32)], 1).reshape(-1)
    kv_indptr = torch.arange(0, (bs + 1) * width, width, dtype=torch.int32, device=dev)
    qo_indptr = torch.arange(0, (bs + 1) * n, n, dtype=torch.int32, device=dev)
    last_page_len = torch.ones(bs, dtype=torch.int32, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
    wrapper.plan(qo_indptr, kv_indptr, indices, last_page_len, p.hq, p.hkv, p.d, 1,
                 causal=False, sm_scale=p.sm_scale, q_data_type=p.q.dtype,
                 kv_data_type=p.k_cache.dtype)
    slots = p.k_cache.shape[0]
    k4, v4 = p.k_cache.view(slots, 1, p.hkv, p.d), p.v_cache.view(slots, 1, p.hkv, p.d)
    out = torch.empty_like(p.q)

    def fn():
        wrapper.run(p.q, (k4, v4), out=out)

    return fn, out


def time_baseline(r, make, iters, flush, ours_out, ours_us, keys):
    """Time one baseline (``make()`` gives its (fn, out)) into row ``r`` under ``keys``: (its
    microseconds, its timing mode, ours' speedup over it, its max difference from ours); an
    error is recorded in the first key instead."""
    us_key, mode_key, speed_key, diff_key = keys
    try:
        fn, out = make()
        t, mode = time_graph(fn, iters, flush)
        r.update({us_key: round(t, 2), mode_key: mode, speed_key: round(t / ours_us, 2),
                  diff_key: round(rel_diff(out, ours_out), 5)})
    except Exception as exc:  # noqa: BLE001 - recorded per point
        r[us_key] = f"error: {type(exc).__name__}: {exc}"[:200]


def sweep_splits(ta, p, splits, chunks, max_context, iters, flush, ours_out):
    """Our kernel at fixed split counts x reduce chunk sizes (the reduce kernel's CHUNK_S,
    normally ``_reduce_chunk(v_head_dim, splits)``): a list of {splits, chunk, us, rel_diff}
    rows, the difference against the served plan's output."""
    rows = []
    for s in splits:
        for c in chunks or [ta._reduce_chunk(p.d, s)]:
            with reduce_chunk(ta, c):
                fn, out, _ = ours_fn(ta, p, max_context, num_kv_splits=s)
                us, _ = time_graph(fn, iters, flush)
            rows.append(dict(splits=s, chunk=c, us=round(us, 2),
                             rel_diff=round(rel_diff(out, ours_out), 5)))
    return rows


def load_flashinfer():
    """(workspace, version) or (None, why not)."""
    try:
        import flashinfer

        workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        return workspace, getattr(flashinfer, "__version__", "unknown")
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON
        return None, f"not available: {type(exc).__name__}: {exc}"[:200]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench_results" / "draft_attention_h200.json"))
    ap.add_argument("--shapes", default="kimi,qwen3-8b")
    ap.add_argument("--batch-sizes", type=parse_ints, default=[1, 8, 32])
    ap.add_argument("--blocks", type=parse_ints, default=[8, 16])
    ap.add_argument("--contexts", type=parse_ints, default=[2048, 16384, 32768, 65536])
    ap.add_argument("--plan-context", type=int, default=0,
                    help="plan our kernel for contexts up to this many tokens (a server plans "
                         "for its --context-length) instead of each point's own")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--baselines", default="triton,flashinfer",
                    help="SGLang's drafter backends to time beside ours (comma list of triton, "
                         "flashinfer; empty: ours only)")
    ap.add_argument("--no-baselines", action="store_true", help="time our kernel only")
    ap.add_argument("--splits", type=parse_ints, default=[],
                    help="also time our kernel at these fixed prefix split counts (a sweep "
                         "beside the served plan; rows in each point's 'sweep')")
    ap.add_argument("--reduce-chunks", type=parse_ints, default=[],
                    help="with --splits: the reduce kernel's splits per step to try (default: "
                         "the served one)")
    args = ap.parse_args(argv)
    baselines = [] if args.no_baselines else [b for b in args.baselines.split(",") if b]
    unknown = sorted(set(baselines) - {"triton", "flashinfer"})
    if unknown:
        ap.error(f"--baselines: unknown {unknown} (triton, flashinfer)")
    if not torch.cuda.is_available():
        print("bench_draft_attention needs a CUDA GPU")
        return 2
    ref, ta, _ = _import_ours()
    extend, extend_src = ((None, "skipped") if "triton" not in baselines
                          else load_sglang_extend(None))
    fi_ws, fi_src = ((None, "skipped") if "flashinfer" not in baselines
                     else load_flashinfer())
    copy_bw = copy_bandwidth_gbps()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    gen = torch.Generator().manual_seed(0)
    results = []
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print(f"sglang triton extend: {extend_src}; flashinfer: {fi_src}; "
          f"copy bandwidth {copy_bw:.0f} GB/s")

    def dump(complete):
        meta = dict(command=" ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
                    date=started, complete=complete, gpu=torch.cuda.get_device_name(),
                    torch=torch.__version__, triton=__import__("triton").__version__,
                    source_digest=checkout_digest(__file__), python=platform.python_version(),
                    copy_bandwidth_GBps=round(copy_bw, 1), sglang_triton=extend_src,
                    flashinfer=fi_src,
                    iters=args.iters, shapes={k: dict(q_heads=v[0], kv_heads=v[1], head_dim=v[2])
                                              for k, v in SHAPES.items()},
                    plan_context=args.plan_context or "each point's own context",
                    splits_swept=args.splits, reduce_chunks_swept=args.reduce_chunks,
                    timing="median of CUDA-graph replays, L2 flushed (256 MB write) before each")
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".tmp", "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
        os.replace(args.out + ".tmp", args.out)

    for shape in args.shapes.split(","):
        for ctx in args.contexts:
            for bs in args.batch_sizes:
                for block in args.blocks:
                    p = DraftPoint(ref, shape, bs, block, ctx, gen, "cuda")
                    fn, out, splits = ours_fn(ta, p, args.plan_context)
                    us, _ = time_graph(fn, args.iters, flush)
                    r = dict(shape=shape, batch=bs, block=block, context=ctx,
                             ours_us=round(us, 2), num_splits=splits,
                             kv_GBps=round(p.kv_bytes / us / 1e3, 1))
                    r["frac_copy_bw"] = round(r["kv_GBps"] / copy_bw, 3)
                    if fi_ws is not None:
                        time_baseline(r, lambda: flashinfer_fn(p, fi_ws), max(3, args.iters // 2),
                                      flush, out, us, ("flashinfer_us", "flashinfer_timing",
                                                       "speedup_vs_flashinfer",
                                                       "rel_diff_flashinfer"))
                    elif "flashinfer" in baselines:
                        r["flashinfer_us"] = "not available"
                    if extend is not None:
                        time_baseline(r, lambda: sglang_fn(extend, p), max(3, args.iters // 4),
                                      flush, out, us, ("sglang_triton_us", "sglang_timing",
                                                       "speedup", "rel_diff"))
                    elif "triton" in baselines:
                        r["sglang_triton_us"] = "not available"
                    if args.splits:
                        r["sweep"] = sweep_splits(ta, p, args.splits, args.reduce_chunks,
                                                  args.plan_context, args.iters, flush, out)
                    results.append(r)
                    dump(complete=False)
                    print(" ".join(f"{k}={v}" for k, v in r.items()), flush=True)
                    del p
                    torch.cuda.empty_cache()
    dump(complete=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
