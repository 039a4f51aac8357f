"""Benchmark the fused W4A16 MoE kernel against SGLang 0.5.17's paths for the same format.

Shapes: Kimi K2 per TP8 rank (hidden 7168, expert FFN 2048 / 8 = 256, 384 experts, top-8, int4
group 32 symmetric). Routing: uniform random top-8 per token (the worst case for distinct experts).

Timing: ``--layers`` distinct weight sets (each ~1.2 GB, so together several times the 50 MB L2)
run back to back inside one CUDA graph, each with its own routing; a call's time is the graph's
time divided by the layer count. This is how a decode/verify step sees MoE layers: no weight reuse
across consecutive calls.

Baselines (each used when importable, named in the JSON):
* ``sglang_marlin``: ``fused_marlin_moe`` on Marlin-repacked weights, what SGLang 0.5.17 runs for
  compressed-tensors WNA16 MoE on CUDA by default (``CompressedTensorsWNA16MoE``).
* ``sglang_triton``: ``fused_experts(..., use_int4_w4a16=True)``, what it runs with
  ``--moe-runner-backend triton`` (``CompressedTensorsWNA16TritonMoE``; no tuned config ships for
  these shapes, so SGLang's default config is used), in place on a copy of x (its time includes
  the copy).

Bytes moved per call = touched experts x (packed w13 + w2 + their scales) + x read + out written.
Bandwidth is compared with a measured device-to-device copy (bytes read + written).

Run: ``python scripts/bench_fused_moe.py`` (add ``--check`` to compare with the fp32 reference).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import importlib
import importlib.util
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from sglang_ddtree.provenance import checkout_digest

REPO = Path(__file__).resolve().parents[1]


def _load_repo_kernels():
    """Import triton_kernels/ from this checkout under a private name: no install needed, never a
    stale installed copy, and no clash with sglang-kernel's top-level ``triton_kernels``."""
    name = "_ddtree_bench_kernels"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, REPO / "triton_kernels" / "__init__.py",
            submodule_search_locations=[str(REPO / "triton_kernels")])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[name] = pkg
        spec.loader.exec_module(pkg)
    return (importlib.import_module(f"{name}.moe_w4a16"),
            importlib.import_module(f"{name}.moe_reference"))


mw, _ref = _load_repo_kernels()
make_random_moe, moe_w4a16_reference = _ref.make_random_moe, _ref.moe_w4a16_reference

DEFAULT_MS = [8, 16, 32, 64, 128, 256, 512, 1024, 2048]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * iters / (time.perf_counter() - t0) / 1e9


def graph_time_us(fn, iters: int, device: torch.device = torch.device("cuda")) -> float:
    """Mean time of ``fn`` in microseconds: CUDA-graph replays on a GPU, eager calls elsewhere."""
    if device.type != "cuda":  # CPU smoke runs of this script (Triton interpreter)
        fn()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e6 / iters
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile + allocate outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def profiler_time_us(fn, iters: int) -> float:
    """GPU time of ``fn`` in microseconds: the sum of its kernels' durations from the CUDA
    profiler over ``iters`` eager calls (launch gaps left out). For paths whose CUDA-graph timing
    does not complete (session 9: SGLang's Marlin MoE made no progress in graph timing)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    # kernel (and memset/memcpy) events only: op-level events also carry their kernels' time
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time_total for e in kernels) / iters  # us


def run_ours(layers, xs, tws, tis, n=None, **kw):
    """Our kernel on the first ``n`` weight sets (default all), each with its own inputs;
    ``kw`` goes to ``fused_moe_w4a16``. Returns the last output."""
    for i, lw in enumerate(layers[:n]):
        out = mw.fused_moe_w4a16(xs[i], lw["w13_packed"], lw["w13_scale"], lw["w2_packed"],
                                 lw["w2_scale"], tws[i], tis[i], **kw)
    return out


def parse_variants(specs) -> dict:
    """``--ours-variants`` specs ``NAME:VAR=VALUE[,VAR=VALUE...]`` -> {"ours_NAME": {VAR: VALUE}}."""
    out = {}
    for spec in specs or ():
        name, sep, assigns = spec.partition(":")
        env = dict(a.split("=", 1) for a in assigns.split(",") if "=" in a)
        if not sep or not name or not env:
            raise SystemExit(f"--ours-variants: NAME:VAR=VALUE[,VAR=VALUE], got {spec!r}")
        out[f"ours_{name}"] = env
    return out


def with_env(env: dict, fn):
    """``fn`` called with ``env`` set in os.environ (the kernel reads its switches per call,
    so a CUDA graph captured this way keeps the variant's launches)."""
    def call():
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return call


def compare_with_sglang(row: dict) -> None:
    """Name the fastest SGLang path of a row and our speed-up over it (when both ran)."""
    base = {k: v for k, v in row["us"].items() if not k.startswith("ours") and v}
    if base and row["us"].get("ours"):
        row["best_sglang"] = min(base, key=base.get)
        row["speedup_vs_best_sglang"] = base[row["best_sglang"]] / row["us"]["ours"]


def expert_bytes(hidden: int, inter: int) -> int:
    """Packed weights + bf16 scales of one expert (gate-up and down)."""
    w = hidden // 8 * 2 * inter * 4 + inter // 8 * hidden * 4
    s = hidden // 32 * 2 * inter * 2 + inter // 32 * hidden * 2
    return w + s


class _Skip(Exception):
    """A baseline left out on purpose."""


def sglang_baselines(layers, args, wanted=("sglang_marlin", "sglang_triton")):
    """Build SGLang callables; returns {name: (prepared_layers, fn(x, layer, tw, ti, logits))}.

    Only the ``wanted`` ones are set up (the Triton path publishes SGLang's server args first,
    ``ensure_runtime_context``, which a Marlin-only run does not need). SGLang 0.5.17 compiles the
    Marlin MoE kernel with nvcc at its first call (``load_jit``, minutes; see ``gpu_session.sh
    jitbg``): a first Marlin row can sit in that build for longer than a short step allows.
    """
    out, errors = {}, {}
    if "sglang_marlin" not in wanted:
        errors["sglang_marlin"] = "not requested (--baselines)"
    try:
        if "sglang_marlin" not in wanted:
            raise _Skip
        # Through the scheme module: importing gptq_kernels first hits a circular import.
        from sglang.srt.layers.quantization.compressed_tensors.schemes import (
            compressed_tensors_wNa16_moe as wna16)
        from sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe import fused_marlin_moe

        gptq_marlin_moe_repack = wna16.gptq_marlin_moe_repack
        marlin_moe_permute_scales = wna16.marlin_moe_permute_scales
        marlin_make_workspace = wna16.marlin_make_workspace

        dev = layers[0]["w13_packed"].device
        e = args.experts
        empty = torch.empty((e, 0), dtype=torch.int32, device=dev)
        workspace = marlin_make_workspace(dev, 4)
        prepared = []
        for lw in layers:  # the same repack as CompressedTensorsWNA16MoE.process_weights_after_loading
            prepared.append(dict(
                w1=gptq_marlin_moe_repack(lw["w13_packed"], empty, args.hidden, 2 * args.inter, 4),
                w2=gptq_marlin_moe_repack(lw["w2_packed"], empty, args.inter, args.hidden, 4),
                s1=marlin_moe_permute_scales(lw["w13_scale"], args.hidden, 2 * args.inter, 32),
                s2=marlin_moe_permute_scales(lw["w2_scale"], args.inter, args.hidden, 32)))

        def marlin(x, lw, tw, ti, logits):
            return fused_marlin_moe(
                x, lw["w1"], lw["w2"], lw["s1"], lw["s2"], logits, tw, ti, g_idx1=empty,
                g_idx2=empty, sort_indices1=empty, sort_indices2=empty, num_bits=4, is_k_full=True,
                workspace=workspace, routed_scaling_factor=args.routed_scaling)

        out["sglang_marlin"] = (prepared, marlin)
    except _Skip:
        pass
    except Exception as exc:  # report, never hide: the JSON records why a baseline is missing
        errors["sglang_marlin"] = repr(exc)
    if "sglang_triton" not in wanted:
        errors["sglang_triton"] = "not requested (--baselines)"
        return out, errors
    try:
        from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
        from sglang.srt.layers.moe.moe_runner.triton_utils import fused_experts
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        from sglang_ddtree.compat._common import ensure_runtime_context

        # its kernels read SGLang's published config (any local model config will do)
        ensure_runtime_context(str(REPO / "tests" / "gpu" / "models" / "mla-moe-target"))
        cfg = MoeRunnerConfig(
            num_experts=args.experts, num_local_experts=args.experts, hidden_size=args.hidden,
            intermediate_size_per_partition=args.inter, top_k=args.topk,
            params_dtype=torch.bfloat16, activation="silu", inplace=True,
            routed_scaling_factor=args.routed_scaling)
        prepared = []
        for lw in layers:  # CompressedTensorsWNA16TritonMoE.process_weights_after_loading
            prepared.append(dict(
                w1=lw["w13_packed"].transpose(1, 2).contiguous().view(torch.uint8),
                w2=lw["w2_packed"].transpose(1, 2).contiguous().view(torch.uint8),
                s1=lw["w13_scale"].transpose(1, 2).contiguous(),
                s2=lw["w2_scale"].transpose(1, 2).contiguous()))

        def triton_int4(x, lw, tw, ti, logits):
            # In place on a copy of x (the copy is in its time: 1-2 us): 0.5.17's out-of-place
            # path asks for the tensor-parallel group, which this process does not have
            # (session 39: "tensor model parallel group is not initialized").
            return fused_experts(x.clone(), lw["w1"], lw["w2"],
                                 StandardTopKOutput(tw, ti, logits), cfg, use_int4_w4a16=True,
                                 w1_scale=lw["s1"], w2_scale=lw["s2"], block_shape=[0, 32])

        out["sglang_triton"] = (prepared, triton_int4)
    except Exception as exc:
        errors["sglang_triton"] = repr(exc)
    return out, errors


# Tuning candidates per block_m: (block_n, block_k, num_warps, num_stages) for gate-up and down.
# Picked from sm_90 ahead-of-time compiles of these kernels (Triton 3.6): no register spills, shared
# memory within 227 KB. block_n 32 with 2 warps runs mma.sync with no duplicated dequant (the fewest
# SASS instructions per weight byte, ~180 warp-instructions per KB); block_n 64 / 128 with 4 / 8
# warps runs wgmma (~190-220 per KB at small block_m, better MMA use at large block_m).
_GU = {"v2": (32, 256, 2, 3), "v2s4": (32, 256, 2, 4), "w64": (64, 256, 4, 3), "w64k128": (64, 128, 4, 4),
       "w64s2": (64, 256, 4, 2), "w128": (128, 128, 8, 3)}
_GU.update({"v2k512": (32, 512, 2, 3), "v2k512s2": (32, 512, 2, 2),
            # split dequant (nibbles 0-3, then 4-7): 168 -> 128 registers, more programs per SM
            "v2d": (32, 256, 2, 3, 0, 1), "v2ds2": (32, 256, 2, 2, 0, 1),
            "v2dk128": (32, 128, 2, 4, 0, 1), "w64d": (64, 256, 4, 3, 0, 1),
            "w64ds2": (64, 256, 4, 2, 0, 1),
            # K split over 2 / 4 programs per tile (+ a reduce kernel): more loads in flight
            # when few experts are touched
            "v2dk2": (32, 256, 2, 3, 0, 1, 2), "v2dk4": (32, 256, 2, 3, 0, 1, 4),
            "v2ds2k4": (32, 256, 2, 2, 0, 1, 4), "w64dk2": (64, 256, 4, 3, 0, 1, 2),
            # M = 8's winner (v2dk128) with its K split (timed in session 15: did not win)
            "v2dk128k2": (32, 128, 2, 4, 0, 1, 2), "v2dk128k4": (32, 128, 2, 4, 0, 1, 4),
            # session 14: deeper pipelines and one-warp 16-column tiles for M <= 16 (timed in
            # session 15: none won at M = 8-128)
            # (sm_90 AOT: 51 / 36 / 43 KB shared, 95 / 87 / 143 registers, no spills)
            "v2dk128s6": (32, 128, 2, 6, 0, 1), "n16dk128s6": (16, 128, 1, 6, 0, 1),
            "n16d": (16, 256, 1, 4, 0, 1),
            # session 17: decode-sized calls (M = 1-4 tokens: 8-32 experts, 64-256 tiles of 32
            # columns) leave most SMs idle without a deeper K split (K = 7168: 56 steps of 128,
            # 28 of 256)
            "v2dk128k8": (32, 128, 2, 4, 0, 1, 8), "v2dk7": (32, 256, 2, 3, 0, 1, 7),
            "w64dk4": (64, 256, 4, 3, 0, 1, 4), "w64dk7": (64, 256, 4, 3, 0, 1, 7),
            # M = 1 took the deepest split offered (8 of 56 steps): deeper ones
            "v2dk128k14": (32, 128, 2, 4, 0, 1, 14), "n16dk128k14": (16, 128, 1, 4, 0, 1, 14)})
_DN = {"v2": (32, 256, 2, 2), "w64": (64, 128, 4, 3), "w128": (128, 128, 4, 2),
       "w128k256": (128, 256, 4, 2), "w64k256": (64, 256, 4, 2), "w128w8": (128, 128, 8, 3)}
# The down GEMM as one column loop per program (_down_loop_kernel; block_k = intermediate 256):
# (block_n, 256, num_warps, num_stages, n_per_cta).
_DL = {"l32": (32, 256, 2, 3, 512), "l32b": (32, 256, 2, 4, 896), "l64": (64, 256, 4, 3, 512),
       "l64b": (64, 256, 4, 3, 1024), "l128": (128, 256, 4, 2, 1792),
       "l128b": (128, 256, 4, 3, 1024), "l64w8": (64, 256, 8, 3, 1024)}
_LOOPS = [_DL[k] for k in ("l32", "l32b", "l64", "l64b", "l128", "l128b")]
CANDIDATES = {
    16: ([_GU[k] for k in ("v2", "v2s4", "w64", "w64k128", "w64s2", "v2k512", "v2k512s2", "v2d",
                           "v2ds2", "v2dk128", "w64d", "w64ds2", "v2dk2", "v2dk4", "v2ds2k4",
                           "w64dk2", "v2dk128k2", "v2dk128k4", "v2dk128s6", "n16dk128s6",
                           "n16d", "v2dk128k8", "v2dk7", "w64dk4", "w64dk7", "v2dk128k14",
                           "n16dk128k14")],
         [_DN[k] for k in ("v2", "w64", "w128", "w128k256", "w64k256")] + _LOOPS),
    32: ([_GU[k] for k in ("v2", "w64", "w64k128", "w64s2", "w128", "v2d", "w64d", "w64ds2")],
         list(_DN.values()) + _LOOPS),
    64: ([_GU[k] for k in ("w64", "w64k128", "w64s2", "w128")],
         [_DN[k] for k in ("v2", "w64", "w128", "w64k256", "w128w8")]
         + [_DL[k] for k in ("l64b", "l128", "l128b", "l64w8")]),
    128: ([_GU[k] for k in ("w64k128", "w128")],
          [_DN[k] for k in ("w64", "w64k256", "w128w8")] + [_DL[k] for k in ("l128", "l128b")]),
}


# 8-row expert blocks (MMA n = 8; session 45): the 16-row blocks' candidates
CANDIDATES[8] = CANDIDATES[16]


def block_m_candidates(m: int) -> list[int]:
    """Tokens per expert average M * topk / experts (M / 48 for Kimi): small M, small MMA N side."""
    if m <= 64:
        return [16]
    if m <= 256:
        return [16, 32]
    if m <= 1024:
        return [16, 32, 64]
    return [32, 64, 128]


def tune(args, layers, make_inputs, dev) -> dict:
    """Greedy per-M search: per block_m, best gate-up tiles (down fixed), then best down tiles."""
    def gemm(c):
        return mw.GemmConfig(*c)

    bands, log = [], []
    for m in args.ms:
        xs, tws, tis, _ = make_inputs(m)

        def timed(cfg):
            try:
                return graph_time_us(lambda: run_ours(layers, xs, tws, tis, config=cfg),
                                     args.iters, dev) / len(layers)
            except Exception as exc:  # e.g. out of shared memory for a tile: skip the candidate
                log.append({"m": m, "config": repr(cfg), "error": repr(exc)[:300]})
                return float("inf")

        best = (float("inf"), None)
        gate_up_us = {}  # every gate-up candidate's time (down fixed): what the winner beat
        for bm in block_m_candidates(m):
            gus, dns = CANDIDATES[bm]
            for c in gus:
                gate_up_us[f"{bm}:{','.join(map(str, c))}"] = timed(
                    mw.MoeConfig(bm, gemm(c), gemm(dns[0])))
            gu = min(gus, key=lambda c: gate_up_us[f"{bm}:{','.join(map(str, c))}"])
            for dn in dns:
                cfg = mw.MoeConfig(bm, gemm(gu), gemm(dn))
                best = min(best, (timed(cfg), cfg), key=lambda b: b[0])
        us, cfg = best
        print(f"tuned M={m}: {us:.1f} us {cfg}", flush=True)
        bands.append({"max_m": m, "block_m": cfg.block_m, "gate_up": gemm_json(cfg.gate_up),
                      "down": gemm_json(cfg.down), "us": round(us, 2),
                      "gate_up_candidates_us": {k: round(v, 2) for k, v in gate_up_us.items()}})
    return {"bands": bands, "errors": log}


def _band_of(m: int) -> int:
    """max_m of the table band that serves ``m`` (the largest band for bigger ``m``)."""
    table = mw._config_table(os.environ.get("SGLANG_DDTREE_MOE_CONFIG", mw._CONFIG_PATH))
    return next((max_m for max_m, _ in table if m <= max_m), table[-1][0])


def gate_up_grid(args, layers, make_inputs, dev, grid, save=None) -> dict:
    """Whole-call times of gate-up candidates against the table, per M and routing.

    A band's table entry serves every M up to its max_m under any routing, while the best K
    split depends on how many experts a call touches (few experts: few row blocks, too few
    programs without a split). So each candidate is timed at several M and routings, and
    ``summary`` gives, per table band, its worst ratio to the table on random routing and on
    the concentrated ones (below 1: faster). Block_m and the down config stay the table's;
    half_m is the grid's flag's (0 without it, whatever the band has), which a pick from the
    grid writes into the table.
    """
    routings = args.routings.split(",")
    out = run_header(dev, {
        "grid_block_m": args.grid_block_m, "grid_half_m": int(args.grid_half_m),
        "grid_wide_halves": int(args.grid_wide_halves),
        "note": "us per whole call (align + gate-up + down + combine), mean of CUDA-graph "
                f"replays over {len(layers)} weight sets; down from the table, block_m "
                + (f"{args.grid_block_m} for the candidates (the table's for its own row)"
                   if args.grid_block_m else "from the table"),
        "rows": [], "summary": {}})
    for m in args.ms:
        table = mw.select_config(m)
        for routing in routings:
            xs, tws, tis, _ = make_inputs(m, routing)
            touched = sum(int(torch.unique(ti).numel()) for ti in tis) / len(tis)
            ref = run_ours(layers, xs, tws, tis, n=1).float().clone()

            def timed(cfg):
                try:
                    o = run_ours(layers, xs, tws, tis, n=1, config=cfg).float()
                    err = float((o - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
                    us = graph_time_us(lambda: run_ours(layers, xs, tws, tis, config=cfg),
                                       args.iters, dev) / len(layers)
                    return {"us": round(us, 2), "rel_diff_vs_table": err}
                except Exception as exc:  # a tile that does not fit: recorded, not fatal
                    return {"us": None, "error": repr(exc)[:300]}

            row = {"m": m, "band": _band_of(m), "routing": routing, "touched_experts": touched,
                   "table": dataclasses.asdict(table), "table_us": timed(table)["us"],
                   "candidates": {}}
            for c in grid:
                cfg = mw.MoeConfig(args.grid_block_m or table.block_m, mw.GemmConfig(*c),
                                   table.down, half_m=int(args.grid_half_m),
                                   wide_halves=int(args.grid_wide_halves))
                row["candidates"][",".join(map(str, c))] = timed(cfg)
            out["rows"].append(row)
            if save is not None:  # after every row: a run cut by its time limit keeps its rows
                out["summary"] = grid_summary(out["rows"])
                save(out)
            best = sorted((v["us"], k) for k, v in row["candidates"].items() if v["us"])[:3]
            print(f"M={m} {routing} touched {touched:.1f} table {row['table_us']} | "
                  + "; ".join(f"{u} {k}" for u, k in best), flush=True)
    out["summary"] = grid_summary(out["rows"])
    return out


def _worst_ratios(rows: list) -> dict:
    """{band: {candidate: [{"random": r, "concentrated": r}, rows timed]}}: each candidate's
    worst ratio of its time to the table's per routing kind over the band's rows (rows
    without a table time, and failed candidates, left out)."""
    acc = {}
    for r in rows:
        if not r["table_us"]:
            continue
        kind = "random" if r["routing"] == "random" else "concentrated"
        for name, v in r["candidates"].items():
            if v.get("us"):
                cell = acc.setdefault(int(r["band"]), {}).setdefault(name, [{}, 0])
                cell[0][kind] = round(max(cell[0].get(kind, 0.0), v["us"] / r["table_us"]), 4)
                cell[1] += 1
    return acc


def grid_summary(rows: list) -> dict:
    """Per band and candidate: the worst ratio of its time to the table's over the band's rows,
    on random routing and on the concentrated routings. {band: {candidate: {"random": r,
    "concentrated": r}}} (a routing kind without rows, or a failed candidate, is left out)."""
    return {str(band): {name: ratio for name, (ratio, _) in cands.items()}
            for band, cands in _worst_ratios(rows).items()}


def pick_gate_up(rows: list, max_random_loss: float = 0.02,
                 max_conc_loss: float | None = None) -> dict:
    """The gate-up config per table band from a --grid run's rows: among the candidates timed
    at every row of the band and at most ``max_random_loss`` slower than the table on random
    routing at each of them, the one with the best worst-case ratio on the concentrated
    routings (ties: the better worst case on random). A band keeps the table's config when no
    candidate beats it on concentrated routing. Random routing is what a real router's worst
    case looks like; concentrated routing is the stock dummy fill, and a tree whose tokens
    share experts. With ``max_conc_loss`` the other way round: among the candidates at most
    that much slower than the table on every concentrated row, the one with the best worst case
    on random routing, if it beats the table there (for a change that trades a bounded loss
    where tokens share experts for a gain where they do not). {band: {"gate_up": [ints],
    "random": worst ratio, "concentrated": worst ratio, "random_us_at_max_m": us}}."""
    return _pick(rows, max_random_loss, "gate_up", random_only=False,
                 max_conc_loss=max_conc_loss)


def pick_down(rows: list, max_random_loss: float = 0.02) -> dict:
    """The down config per table band from --breakdown runs (``down_grid_rows``): the gate-up
    rule (``pick_gate_up``) where the band has rows on concentrated routing; in a band timed on
    random routing only (the large-M bands, where a call spreads over most experts), the
    candidate with the best worst-case ratio on random routing, if it beats the table there.
    {band: {"down": [ints], "random": ..., "concentrated": ... (where timed), ...}}."""
    return _pick(rows, max_random_loss, "down", random_only=True)


def _pick(rows: list, max_random_loss: float, field: str, random_only: bool,
          max_conc_loss: float | None = None) -> dict:
    picks = {}
    for band, cands in sorted(_worst_ratios(rows).items()):
        band_rows = [r for r in rows if int(r["band"]) == band]
        if not all(r["table_us"] for r in band_rows):
            continue
        conc_rows = any(r["routing"] != "random" for r in band_rows)
        both = [(ratio, name) for name, (ratio, timed) in cands.items()
                if timed == len(band_rows) and "random" in ratio and "concentrated" in ratio]
        by_random = (conc_rows or not random_only) and max_conc_loss is not None
        if by_random:  # (random, concentrated, name): the best on random routing first
            ok = [(r["random"], r["concentrated"], name) for r, name in both
                  if r["concentrated"] <= 1 + max_conc_loss and r["random"] < 1]
        elif conc_rows or not random_only:
            ok = [(r["concentrated"], r["random"], name) for r, name in both
                  if r["random"] <= 1 + max_random_loss and r["concentrated"] < 1]
        else:
            ok = [(ratio["random"], ratio["random"], name)
                  for name, (ratio, timed) in cands.items()
                  if timed == len(band_rows) and ratio.get("random", 1) < 1]
        if not ok:
            continue
        first, second, name = min(ok)
        rand, conc = (first, second) if by_random else (second, first)
        top = [r for r in band_rows if r["routing"] == "random"
               and r["m"] == max(x["m"] for x in band_rows)]
        picks[band] = {field: [int(v) for v in name.split(",")], "random": rand,
                       "random_us_at_max_m": top[0]["candidates"][name]["us"] if top else None}
        if conc_rows:
            picks[band]["concentrated"] = conc
    return picks


def down_grid_rows(runs: list) -> list:
    """--breakdown runs (their JSON dicts) as --grid-style rows of down-GEMM times, one per M
    and routing: the table's down config's time as ``table_us``, every other down candidate's
    under its comma-joined GemmConfig fields (the table's own config, timed a second time among
    the candidates, is no choice and is left out), the band from the table's max_m. Runs
    written before session 28 name their routing only in the command line (``--routing``;
    random where absent). A candidate that sets a removed tile option (mw._REMOVED_GEMM:
    prefetch_ahead, in runs of sessions 54-56, among them the one of session 55's down pick)
    is no choice either; the option's 0 in every other config of those runs is dropped."""
    out = {}
    for run in runs:
        cmd = run.get("command", "").split()
        fallback = cmd[cmd.index("--routing") + 1] if "--routing" in cmd else "random"
        table_down = {r["m"]: r["config"]["down"] for r in run["rows"] if r["table_config"]}
        for r in run["rows"]:
            routing = r.get("routing", fallback)
            row = out.setdefault((r["m"], routing), {
                "m": r["m"], "band": _band_of(r["m"]),
                "routing": routing, "table_us": None, "candidates": {}})
            if r["table_config"]:
                row["table_us"] = r["us"]["down"]
            elif r["config"]["down"] != table_down.get(r["m"]):
                down = r["config"]["down"]
                if any(down.get(gone) for gone in mw._REMOVED_GEMM):
                    continue
                row["candidates"][config_name(mw.gemm_config(down))] = {"us": r["us"]["down"]}
    return list(out.values())


# --grid / --breakdown-down lists of 12 fields set GemmConfig.prefetch_ahead (sessions 54-56)
# or, in session 56's down lists, col_parts
_GONE_12TH = ("a 12th field (GemmConfig.prefetch_ahead, removed in "
              + mw._REMOVED_GEMM["prefetch_ahead"] + "; in a down list of session 56, "
              "col_parts, removed in " + mw._REMOVED_GEMM["col_parts"] + ")")


def config_name(cfg) -> str:
    """A GemmConfig as a --grid / --breakdown-down list: the first eight fields, then
    par_acc, scale_once and max_regs only up to the last one set (so names from before
    session 52 still match)."""
    vals = [int(v) for v in dataclasses.astuple(cfg)]
    while len(vals) > 8 and vals[-1] == 0:
        vals.pop()
    return ",".join(map(str, vals))


def _percent(x: float) -> str:
    """0.02 -> '2%', 0.035 -> '3.5%' (a pick rule's threshold as its table entry states it)."""
    return f"{x:.0%}" if round(x * 100, 6) == round(x * 100) else f"{x:.1%}"


def gemm_json(cfg) -> dict:
    """A GemmConfig as the table writes it (split_target, par_acc, scale_once and max_regs
    only where a band has them)."""
    d = dataclasses.asdict(cfg)
    for opt in ("split_target", "par_acc", "scale_once", "max_regs"):
        if not d.get(opt):
            d.pop(opt, None)
    return d


def apply_picks(path: str, picks: dict, meta: dict) -> None:
    """Write picked configs into the table at ``path``: only those bands' ``gate_up`` or
    ``down`` (whichever the pick names; for gate-up picks also ``half_m`` and ``wide_halves``,
    set from the pick or removed, ``block_m`` where the pick has one (a grid run with
    --grid-block-m), and ``us``, the random-routing time at max_m of the whole call, where the
    grid has it) change; the other GEMM stays; ``meta`` is recorded under "tuned" with the
    bands it changed."""
    with open(path) as f:
        table = json.load(f)
    for max_m in sorted(int(b) for b in picks):
        if all(band["max_m"] != max_m for band in table["bands"]):
            # a new band (--pick-new-band): a copy of the band that served its M until now
            # (the largest for M past the table), then the pick below
            served = next((b for b in table["bands"] if b["max_m"] > max_m), table["bands"][-1])
            table["bands"].append({**copy.deepcopy(served), "max_m": max_m})
            table["bands"].sort(key=lambda b: b["max_m"])
    changed = []
    for band in table["bands"]:
        pick = picks.get(band["max_m"]) or picks.get(str(band["max_m"]))
        if pick is None:
            continue
        if "gate_up" in pick:
            band["gate_up"] = gemm_json(mw.GemmConfig(*pick["gate_up"]))
            if pick.get("block_m"):
                band["block_m"] = pick["block_m"]
            if pick.get("half_m"):
                band["half_m"] = pick["half_m"]
            else:
                band.pop("half_m", None)
            if pick.get("wide_halves"):
                band["wide_halves"] = pick["wide_halves"]
            else:
                band.pop("wide_halves", None)
            if pick.get("random_us_at_max_m"):
                band["us"] = pick["random_us_at_max_m"]
        else:
            band["down"] = gemm_json(mw.GemmConfig(*pick["down"]))
        changed.append(band["max_m"])
    runs = table.get("tuned", [])
    runs = ([runs] if isinstance(runs, dict) else runs) + [{**meta, "max_m": changed}]
    _dump_table(path, table.get("note", ""), runs, table["bands"], table.get(mw.DEVICES))


def table_overrides(dev: torch.device) -> str | None:
    """The device name whose overrides (the config table's ``devices`` section) the table
    read here serves this run with, or None: the bands as written."""
    name = mw.cuda_device_name(dev)
    return name if name in mw.device_overrides() else None


def run_header(dev: torch.device, fields: dict) -> dict:
    """A result's provenance (command, GPU, date, versions, source digest, the table's
    overrides in effect) and ``fields``."""
    return {"command": " ".join([sys.executable] + sys.argv), "gpu": _device_name(dev),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__},
            "source_digest": checkout_digest(__file__),
            "table_overrides_for": table_overrides(dev), **fields}


def breakdown(args, layers, make_inputs, dev) -> dict:
    """Per-kernel times by differences: graphs that stop after kernel 1, 2, 3 and 4.

    Each M is timed with the config table's choice and with every down candidate of that band's
    block_m (``--breakdown-down`` instead where given; gate-up, block_m and half_m fixed to
    the table's); gate-up and down bandwidth use their own bytes.
    """
    w13_bytes = args.hidden // 8 * 2 * args.inter * 4 + args.hidden // 32 * 2 * args.inter * 2
    w2_bytes = args.inter // 8 * args.hidden * 4 + args.inter // 32 * args.hidden * 2
    out = run_header(dev, {
        "copy_bandwidth_gbs": copy_bandwidth_gbs(dev), "rows": []})
    for m in args.ms:
        xs, tws, tis, _ = make_inputs(m)
        touched = sum(int(torch.unique(ti).numel()) for ti in tis) / len(tis)
        base = mw.select_config(m)
        downs = args.breakdown_down or CANDIDATES.get(base.block_m, ([], []))[1]
        cands = [base] + [dataclasses.replace(base, down=mw.GemmConfig(*c)) for c in downs]
        for cfg in cands:
            t = []
            for upto in (1, 2, 3, 4):
                def run(upto=upto):
                    run_ours(layers, xs, tws, tis, config=cfg, _upto=upto)
                try:
                    t.append(graph_time_us(run, args.iters, dev) / len(layers))
                except Exception as exc:
                    t.append(float("nan"))
                    print(f"M={m} {cfg}: {exc!r}"[:300], flush=True)
            k = {"align": t[0], "gate_up": t[1] - t[0], "down": t[2] - t[1],
                 "combine": t[3] - t[2], "total": t[3]}
            row = {"m": m, "routing": args.routing, "touched_experts": touched,
                   "config": dataclasses.asdict(cfg),
                   "table_config": cfg is base, "us": k,
                   "gbs": {"gate_up": touched * w13_bytes / k["gate_up"] / 1e3,
                           "down": touched * w2_bytes / k["down"] / 1e3}}
            out["rows"].append(row)
            print(f"M={m:5d} dn={dataclasses.astuple(cfg.down)} "
                  + " ".join(f"{n} {v:7.1f}" for n, v in k.items())
                  + f" | GB/s gu {row['gbs']['gate_up']:.0f} dn {row['gbs']['down']:.0f}",
                  flush=True)
    return out


def interleaved_rounds(calls: dict, args, dev, per_call: int) -> dict:
    """Each of ``calls`` (name -> fn) timed by CUDA-graph replay in turn, for at least 3 rounds
    (``--rounds``), ``per_call`` calls per fn: {"us": {name: median us per call},
    "us_rounds": {name: [us per call, one per round]}}, rounded to 0.01 us."""
    rounds = {n: [] for n in calls}
    for _ in range(max(args.rounds, 3)):
        for n, fn in calls.items():
            rounds[n].append(graph_time_us(fn, args.iters, dev) / per_call)
    return {"us": {n: round(statistics.median(v), 2) for n, v in rounds.items()},
            "us_rounds": {n: [round(t, 2) for t in v] for n, v in rounds.items()}}


PROLOGUE_VARIANTS = (("rows", "one", 4), ("rows", "one", 2), ("rows", "one", 1),
                     ("chunks", "one", 4), ("rows", "two", 4), ("chunks", "two", 4),
                     ("chunks", "two", 2), ("chunks", "two", 1),
                     ("rows", "small", 4), ("rows", "small", 2), ("rows", "small", 8),
                     ("chunks", "small", 4))


def prologue_times(args, layers, make_inputs, dev) -> dict:
    """The prologue alone (moe_align: the grouping by expert and x's plane-major copy) per M and
    routing, for x's copy laid out per row and per 1,024-column chunk (``copy``), the
    grouping in one launch or two (``method``) and warps per program, interleaved over at
    least 3 rounds; medians.
    Every variant's outputs are compared with the first variant's (grouping and copy must be
    equal)."""
    out = run_header(dev, {
        "note": "us per moe_align call (grouping + x copy), mean of CUDA-graph replays over "
                f"{len(layers)} calls, median of the rounds; block_m and block_k from the "
                "table; variant names copy/method/warps",
        "rows": []})
    names = ["/".join(map(str, v)) for v in PROLOGUE_VARIANTS]
    for m in args.ms:
        cfg = mw.select_config(m)
        block_k = mw._fit(cfg.gate_up, args.inter, args.hidden).block_k
        for routing in args.routings.split(","):
            xs, _, tis, _ = make_inputs(m, routing)

            def align(variant, i):
                copy, method, warps = variant
                return mw.moe_align(tis[i], args.experts, cfg.block_m, xs[i], block_k,
                                    copy=copy, method=method, warps=warps)

            for i in range(len(xs)):
                a = align(PROLOGUE_VARIANTS[0], i)
                used = int(a[1][-1]) * cfg.block_m  # moe_align's used-block count
                for v in PROLOGUE_VARIANTS[1:]:
                    b = align(v, i)
                    if not (torch.equal(a[0][:used], b[0][:used]) and torch.equal(a[1], b[1])
                            and torch.equal(a[2], b[2])):
                        raise SystemExit(f"--prologue: {v} disagrees with "
                                         f"{PROLOGUE_VARIANTS[0]} at M={m}")
            row = {"m": m, "routing": routing, "block_m": cfg.block_m, "block_k": block_k,
                   **interleaved_rounds(
                       {n: (lambda v=v: [align(v, i) for i in range(len(xs))])
                        for n, v in zip(names, PROLOGUE_VARIANTS)}, args, dev, len(xs))}
            out["rows"].append(row)
            print(f"M={m} {routing}: " + " ".join(f"{c} {u}" for c, u in row["us"].items()),
                  flush=True)
    return out


COMBINE_SHAPES = ((1024, 4), (512, 4), (512, 2), (256, 2), (2048, 8), (256, 1))


def combine_times(args, layers, make_inputs, dev) -> dict:
    """The combine launch alone (``moe_w4a16.combine``) per M and launch shape (block_n,
    num_warps), on random per-slot rows ``y`` (one buffer per weight set, so that
    consecutive calls do not share them), interleaved over at least 3 rounds; medians. Every
    shape's output must equal the first's bit for bit."""
    out = run_header(dev, {
        "note": "us per combine call, mean of CUDA-graph replays over "
                f"{len(layers)} calls (distinct y), median of the rounds; shape = "
                "block_n,num_warps; gbs = bytes of y read plus out written per us",
        "rows": []})
    names = [",".join(map(str, c)) for c in COMBINE_SHAPES]
    for m in args.ms:
        _, _, tis, _ = make_inputs(m)
        g = torch.Generator(device=dev).manual_seed(m)
        ys = [torch.randn(m * args.topk, args.hidden, device=dev, generator=g,
                          dtype=torch.bfloat16) for _ in tis]
        outs = [torch.empty(m, args.hidden, device=dev, dtype=torch.bfloat16) for _ in tis]

        def run(shape):
            for y, ti, o in zip(ys, tis, outs):
                mw.combine(y, ti, o, args.routed_scaling, args.experts, shape)

        run(COMBINE_SHAPES[0])
        want = [o.clone() for o in outs]
        for shape in COMBINE_SHAPES[1:]:
            run(shape)
            if not all(torch.equal(a, b) for a, b in zip(want, outs)):
                raise SystemExit(f"--combine: shape {shape} disagrees at M={m}")
        timed = interleaved_rounds(
            {n: (lambda c=c: run(c)) for n, c in zip(names, COMBINE_SHAPES)}, args, dev, len(tis))
        nbytes = (m * args.topk + m) * args.hidden * 2
        us = timed["us"]
        row = {"m": m, "us": us, "gbs": {n: round(nbytes / u / 1e3, 1) for n, u in us.items()},
               "us_rounds": timed["us_rounds"]}
        out["rows"].append(row)
        print(f"M={m}: " + " ".join(f"{n} {u}" for n, u in us.items()), flush=True)
    return out


def shared_expert_weights(n: int, hidden: int, inter: int, dev: torch.device) -> list:
    """``n`` bf16 shared experts of a Kimi K2 TP8 rank (gate-up ``[2 I, H]``, down
    ``[H, I]``; K2's one shared expert of 2,048 split 8 ways: I = 256), as SGLang keeps them
    (the int4 scheme leaves shared experts in bf16)."""
    g = torch.Generator(device=dev).manual_seed(1234)
    return [{"gate_up": (torch.randn(2 * inter, hidden, device=dev, generator=g) * 0.02
                         ).to(torch.bfloat16),
             "down": (torch.randn(hidden, inter, device=dev, generator=g) * 0.02
                      ).to(torch.bfloat16)} for _ in range(n)]


def run_shared(x: torch.Tensor, sw: dict) -> torch.Tensor:
    """The shared expert as SGLang's unquantized path computes it: two GEMMs around
    SiLU-and-multiply."""
    gu = x @ sw["gate_up"].t()
    inter = gu.shape[1] // 2
    return (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ sw["down"].t()


def dual_stream_times(args, layers, make_inputs, dev) -> dict:
    """Our MoE beside the shared expert, as SGLang's DeepseekV2 layer runs them inside CUDA
    graphs (``DeepseekV2MoE.forward_normal_dual_stream``: the routed experts on the main
    stream, then the shared expert on a second stream, joined before the sum). Per M and
    routing, in one graph over ``--layers`` weight sets each: the MoE alone, the shared
    expert alone, both on one stream (serial) and both on two streams (dual); medians of at
    least 3 interleaved rounds, us per layer. ``dual`` is what a served step pays; ``dual``
    above ``max(moe, shared)`` is what the two streams cost each other. Off a GPU (the CPU
    smoke run) the two streams are one."""
    side = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
    shared = shared_expert_weights(len(layers), args.hidden, args.inter, dev)
    out = run_header(dev, {
        "note": "us per layer (one MoE call and / or one shared expert), mean of CUDA-graph "
                f"replays over {len(layers)} layers, median of the rounds; the table's "
                "configs; dual = the shared expert on a second stream after the MoE's "
                "launches, as SGLang 0.5.17 captures a DeepseekV2 MoE layer",
        "rows": []})
    kinds = ("moe", "shared", "serial", "dual")
    for m in args.ms:
        for routing in args.routings.split(","):
            xs, tws, tis, _ = make_inputs(m, routing)

            def moe(i):
                return mw.fused_moe_w4a16(xs[i], layers[i]["w13_packed"], layers[i]["w13_scale"],
                                          layers[i]["w2_packed"], layers[i]["w2_scale"], tws[i],
                                          tis[i])

            def run(kind):
                two_streams = kind == "dual" and side is not None
                for i in range(len(layers)):
                    if not two_streams:  # moe, shared, serial (and dual off a GPU)
                        if kind != "shared":
                            moe(i)
                        if kind != "moe":
                            run_shared(xs[i], shared[i])
                        continue
                    main = torch.cuda.current_stream(dev)
                    side.wait_stream(main)
                    moe(i)
                    with torch.cuda.stream(side):
                        run_shared(xs[i], shared[i])
                    main.wait_stream(side)

            timed = interleaved_rounds({k: (lambda k=k: run(k)) for k in kinds}, args, dev,
                                       len(layers))
            us = timed["us"]
            touched = sum(int(torch.unique(ti).numel()) for ti in tis) / len(tis)
            row = {"m": m, "routing": routing, "touched_experts": touched, "us": us,
                   "us_rounds": timed["us_rounds"],
                   "dual_over_longer": round(us["dual"] / max(us["moe"], us["shared"]), 4),
                   "dual_over_serial": round(us["dual"] / us["serial"], 4)}
            out["rows"].append(row)
            print(f"M={m} {routing}: " + " ".join(f"{k} {u}" for k, u in us.items())
                  + f" dual/longer {row['dual_over_longer']}", flush=True)
    return out


def write_table(path: str, tuned: dict, meta: dict) -> None:
    """Merge tuned bands into the config table at ``path`` (bands with other max_m are kept)."""
    old = {"bands": []}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    new_ms = {b["max_m"] for b in tuned["bands"]}
    # the table keeps each band's config and time; the candidates' times go to --out
    new = [{k: v for k, v in b.items() if k != "gate_up_candidates_us"} for b in tuned["bands"]]
    bands = [b for b in old["bands"] if b["max_m"] not in new_ms] + new
    # one entry per tuning run that still owns a band: its metadata and the bands it tuned
    runs = old.get("tuned", [])
    runs = [runs] if isinstance(runs, dict) else runs
    for run in runs:
        run.setdefault("max_m", [b["max_m"] for b in old["bands"]])
        run["max_m"] = [m for m in run["max_m"] if m not in new_ms]
    runs = [r for r in runs if r["max_m"]] + [{**meta, "max_m": sorted(new_ms)}]
    _dump_table(path, old.get("note", ""), runs, sorted(bands, key=lambda b: b["max_m"]),
                old.get(mw.DEVICES))


def _dump_table(path: str, note: str, runs: list, bands: list, devices: dict | None = None) -> None:
    """The config table as committed: one tuning run, one band and one device's overrides per
    line (diffable). The overrides (``devices``) are kept as they were: picks and tuning runs
    write the bands, which serve every device without an override."""
    lines = ["{", f' "note": {json.dumps(note)},', ' "tuned": [']
    lines += [f"  {json.dumps(r)}," for r in runs]
    lines[-1] = lines[-1].rstrip(",")
    lines += [" ],", ' "bands": [']
    lines += [f"  {json.dumps(b)}," for b in bands]
    lines[-1] = lines[-1].rstrip(",")
    if devices:
        lines += [" ],", f' "{mw.DEVICES}": {{']
        lines += [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in devices.items()]
        lines[-1] = lines[-1].rstrip(",")
        lines += [" }"]
    else:
        lines += [" ]"]
    with open(path, "w") as f:
        f.write("\n".join(lines + ["}"]) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_results/fused_moe_h200.json")
    ap.add_argument("--ms", type=int, nargs="+", default=DEFAULT_MS)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4, help="distinct weight sets per graph")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--combine", action="store_true",
                    help="time only the combine launch, over its launch shapes (COMBINE_SHAPES)")
    ap.add_argument("--prologue", action="store_true",
                    help="time only the prologue (moe_align): x's copy per row and per chunk, "
                         "the grouping in one launch and in two (PROLOGUE_VARIANTS), over --ms "
                         "and --routings (at least 3 interleaved rounds)")
    ap.add_argument("--dual-stream", action="store_true",
                    help="time our MoE beside a bf16 shared expert on a second stream, as "
                         "SGLang's DeepseekV2 layer runs them in CUDA graphs, against each alone "
                         "and both on one stream, over --ms and --routings (table configs)")
    ap.add_argument("--routed-scaling", type=float, default=2.827)
    ap.add_argument("--routing", default="random",
                    help="random (top-k of random logits) or concentrated:N (every token's "
                         "top-k among the same N experts, as under SGLang's stock dummy fill "
                         "or a tree whose tokens share experts)")
    ap.add_argument("--no-sglang", action="store_true")
    ap.add_argument("--baselines", default="sglang_triton,sglang_marlin",
                    help="SGLang paths to compare with, timed in this order (session 5: a run "
                         "with both set up made no progress on its first row within 120 s)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    ap.add_argument("--check", action="store_true", help="also compare outputs with the reference")
    ap.add_argument("--config", default=None, help="alternative config JSON for our kernel")
    ap.add_argument("--tune", action="store_true",
                    help="search launch configs per M instead of benchmarking (see --tune-out)")
    ap.add_argument("--tune-out", default="bench_results/fused_moe_tuned_configs.json",
                    help="config table to write/merge the tuned bands into")
    ap.add_argument("--breakdown", action="store_true",
                    help="per-kernel times (align, gate-up, down, combine) by differences of "
                         "graphs that stop after each kernel, for the table's config and the "
                         "down-kernel candidates; JSON to --out. With programmatic dependent "
                         "launch (on by default on sm_90+) neighbouring launches overlap, so "
                         "the differences are not each launch's own time: set "
                         "SGLANG_DDTREE_MOE_PDL=0 for per-launch times")
    ap.add_argument("--breakdown-down", default=None, metavar="CONFIGS",
                    help="--breakdown: these down configs (';'-separated block_n,block_k,"
                         "num_warps,num_stages[,n_per_cta[,split_dq,split_k,split_target"
                         "[,par_acc[,scale_once[,max_regs]]]]]; split_target > 0 with "
                         "n_per_cta: live column ranges) instead of the block_m's candidates")
    ap.add_argument("--grid", default=None,
                    help="time the whole call per M and routing for the table's config and "
                         "for each of these gate-up configs (';'-separated block_n,block_k,"
                         "num_warps,num_stages[,n_per_cta,split_dq,split_k,split_target"
                         "[,par_acc[,scale_once[,max_regs]]]]; block_m and the "
                         "down config stay the table's for that M), outputs checked against "
                         "the table's; with a per-band summary against the table; JSON to --out")
    ap.add_argument("--grid-block-m", type=int, default=0,
                    help="--grid only: run the candidates with this block_m (0: the table's)")
    ap.add_argument("--grid-half-m", type=int, nargs="?", const=1, default=0, choices=(0, 1, 2),
                    help="--grid only: run the candidates with MoeConfig.half_m (blocks "
                         "narrowed to the fewest rows holding their real ones, down to 8 with "
                         "--grid-block-m 16 and 16 with 32 or 64; 2: the gate-up only)")
    ap.add_argument("--grid-wide-halves", type=int, nargs="?", const=1, default=0, choices=(0, 1),
                    help="--grid only, with --grid-half-m and --grid-block-m 16 or 32: run the "
                         "candidates with MoeConfig.wide_halves (a full block's gate-up as two "
                         "tiles of block_n / 2 columns)")
    ap.add_argument("--routings", default="concentrated:8,concentrated:32,random",
                    help="--grid only: the routings to time, comma-separated")
    ap.add_argument("--pick-from", nargs="+", default=None, metavar="GRID_JSON",
                    help="no GPU: choose each band's gate-up config from --grid runs' JSON "
                         "(pick_gate_up's rule, --max-random-loss; several runs of the same "
                         "grid: the worst ratio over all of them) and write the choices into "
                         "--tune-out (an existing table; other fields kept)")
    ap.add_argument("--pick-down-from", nargs="+", default=None, metavar="BREAKDOWN_JSON",
                    help="no GPU: choose each band's down config from --breakdown runs (on "
                         "several routings; pick_down's rule, --max-random-loss) and write the "
                         "choices into --tune-out (an existing table; other fields kept)")
    ap.add_argument("--pick-routings", default=None, metavar="R1,R2",
                    help="--pick-from: judge by these routings' rows only (e.g. "
                         "random,concentrated:32 leaves out concentrated:8, the routing of "
                         "SGLang's stock dummy fill, where every token picks the same experts)")
    ap.add_argument("--pick-bands", type=int, nargs="*", default=None, metavar="MAX_M",
                    help="--pick-from: only these bands (by max_m) may change (default: all "
                         "the grid timed)")
    ap.add_argument("--max-conc-loss", type=float, default=None,
                    help="--pick-from: pick by random routing instead (pick_gate_up): the "
                         "largest slowdown against the table on concentrated routing a pick may "
                         "have at any M of its band, then the best worst case on random routing")
    ap.add_argument("--pick-new-band", type=int, nargs="*", default=(), metavar="MAX_M",
                    help="--pick-from: judge the grid's rows of M <= MAX_M as a band of their own "
                         "(from the band that served them) and write it into the table as a new "
                         "band, a copy of that band with the pick")
    ap.add_argument("--max-random-loss", type=float, default=0.02,
                    help="--pick-from: the largest slowdown against the table on random "
                         "routing a pick may have at any M of its band")
    ap.add_argument("--pick-why", default=None, metavar="TEXT",
                    help="--pick-from / --pick-down-from: the reason for this pick (e.g. for a "
                         "--max-random-loss other than the default), kept in its 'tuned' entry")
    ap.add_argument("--profiler", action="store_true",
                    help="time by kernel durations from the CUDA profiler over eager calls "
                         "(no CUDA graphs; each implementation over all M before the next, "
                         "ours first, saved after every row)")
    ap.add_argument("--ours-variants", nargs="*", default=None, metavar="NAME:VAR=VALUE",
                    help="also time our kernel with these env switches set while its graphs are "
                         "captured (e.g. twolaunch:SGLANG_DDTREE_MOE_SERIAL_REDUCE=0), "
                         "interleaved with the rest; rows get us['ours_NAME']")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every implementation this many times per M, interleaved; the "
                         "row keeps the median (all rounds under 'us_rounds')")
    ap.add_argument("--profile-ms", type=int, nargs="*", default=None,
                    help="only run a few eager calls per M (for ncu) and exit")
    args = ap.parse_args(argv)
    if args.breakdown_down is not None:
        try:
            args.breakdown_down = [tuple(int(v) for v in c.split(","))
                                   for c in args.breakdown_down.split(";") if c]
        except ValueError:
            args.breakdown_down = []
        if any(len(c) == 12 for c in args.breakdown_down):
            ap.error(f"--breakdown-down: {_GONE_12TH}")
        if not args.breakdown_down or any(len(c) not in (4, 5, 8, 9, 10, 11)
                                          for c in args.breakdown_down):
            ap.error("--breakdown-down: ';'-separated block_n,block_k,num_warps,num_stages"
                     "[,n_per_cta[,split_dq,split_k,split_target[,par_acc[,scale_once"
                     "[,max_regs]]]]] "
                     "lists")
    variants = parse_variants(args.ours_variants)

    def parse_routing(routing):  # -> experts to concentrate on, 0 for random
        if routing == "random":
            return 0
        kind, _, n = routing.partition(":")
        if kind != "concentrated" or not n.isdigit() or not args.topk <= int(n) <= args.experts:
            ap.error(f"--routing: random or concentrated:N with {args.topk} <= N <= "
                     f"{args.experts}, got {routing!r}")
        return int(n)

    parse_routing(args.routing)

    def write_picks(picks, field, source, rule):
        """--pick-from / --pick-down-from: keep --pick-bands, print, write into --tune-out."""
        if args.pick_bands is not None:
            picks = {b: p for b, p in picks.items() if int(b) in args.pick_bands}
        for band, p in picks.items():
            print(f"band <= {band}: {field} {p[field]} (worst vs table: random {p['random']}, "
                  f"concentrated {p.get('concentrated', 'not timed')})")
        apply_picks(args.tune_out, picks, {
            "command": shlex.join(["python", "scripts/bench_fused_moe.py"]
                                  + list(sys.argv[1:] if argv is None else argv)),
            "gpu": source.get("gpu"), "date": source.get("date"), "rule": rule,
            **({"why": args.pick_why} if args.pick_why else {})})
        print(f"wrote {args.tune_out}")
        return 0

    if args.pick_down_from:
        runs = []
        for path in args.pick_down_from:
            with open(path) as f:
                loaded = json.load(f)
            runs += loaded["runs"] if "runs" in loaded else [loaded]
        return write_picks(
            pick_down(down_grid_rows(runs), args.max_random_loss), "down",
            runs[0] if runs else {},
            f"down picked from --breakdown runs: where a band was timed on concentrated "
            f"routing, at most {_percent(args.max_random_loss)} slower than the table on random "
            "routing at every measured M and the best worst case on concentrated routing; "
            "where only on random routing, the best worst case there; block_m and gate-up "
            "unchanged")
    if args.pick_from:
        grid_runs = []
        for path in args.pick_from:
            with open(path) as f:
                grid_runs.append(json.load(f))
        block_ms = {int(g.get("grid_block_m") or 0) for g in grid_runs}
        half_ms = {int(g.get("grid_half_m") or 0) for g in grid_runs}
        wides = {int(g.get("grid_wide_halves") or 0) for g in grid_runs}
        for gone, why in mw._REMOVED.items():  # (grids of sessions 29 / 46 / 55)
            if any(g.get(f"grid_{gone}") for g in grid_runs):
                ap.error(f"--pick-from: a grid run with MoeConfig.{gone}, removed in {why}")
        if any(len(c.split(",")) == 12 for g in grid_runs for r in g["rows"]
               for c in r["candidates"]):  # (sessions 54-56's prefetch_ahead grids)
            ap.error(f"--pick-from: a grid run whose candidates have {_GONE_12TH}")
        if len(block_ms) > 1 or len(half_ms) > 1 or len(wides) > 1:
            ap.error(f"--pick-from: the grids ran with different --grid-block-m "
                     f"{sorted(block_ms)}, --grid-half-m {sorted(half_ms)} or "
                     f"--grid-wide-halves {sorted(wides)}; pick from runs of one grid")
        block_m, half_m, wide = block_ms.pop(), half_ms.pop(), wides.pop()
        if half_m and not block_m:
            ap.error("--pick-from: a grid with --grid-half-m but no --grid-block-m; half_m "
                     "needs the block_m it was timed with")
        rows = [copy.deepcopy(r) for g in grid_runs for r in g["rows"]]
        for new_band in sorted(args.pick_new_band, reverse=True):
            for r in rows:
                if r["m"] <= new_band < int(r["band"]):
                    r["band"] = new_band
        routings = args.pick_routings.split(",") if args.pick_routings else None
        if routings:
            for r in routings:
                parse_routing(r)
            rows = [r for r in rows if r["routing"] in routings]
        picks = pick_gate_up(rows, args.max_random_loss, args.max_conc_loss)
        loss, bounded, best = ((args.max_random_loss, "random", "concentrated")
                               if args.max_conc_loss is None else
                               (args.max_conc_loss, "concentrated", "random"))
        for pick in picks.values():  # a grid run with --grid-half-m: its picks take its half_m
            pick["half_m"] = half_m  # (and wide_halves)
            pick["wide_halves"] = wide
            if block_m:  # and one with --grid-block-m its block_m (the down config stays)
                pick["block_m"] = block_m
        return write_picks(
            picks, "gate_up", grid_runs[0],
            f"gate-up picked from {', '.join(os.path.basename(g) for g in args.pick_from)}: "
            + (f"at most {_percent(loss)} slower than the table on {bounded} routing at every "
               "measured M of the band" + (" in every run" if len(grid_runs) > 1 else "")
               + f", the best worst case on {best} routing")
            + (f" (rows of {', '.join(routings)} only)" if routings else "")
            + ("; block_m " + (f"{block_m} (the grid's)" if block_m else "unchanged"))
            + "; down unchanged; 'us' is the pick's random-routing time at max_m"
            + (f"; the grid ran with half_m {half_m}" if half_m else "")
            + ("; with wide_halves" if wide else "")
            + (f"; new bands {sorted(args.pick_new_band)}" if args.pick_new_band else ""))
    grid = None
    if args.grid is not None:
        try:
            grid = [tuple(int(v) for v in c.split(",")) for c in args.grid.split(";") if c]
        except ValueError:
            ap.error(f"--grid: ';'-separated block_n,block_k,num_warps,num_stages"
                     f"[,n_per_cta,split_dq,split_k,split_target[,par_acc[,scale_once"
                     f"[,max_regs]]]] "
                     f"lists, got {args.grid!r}")
        if any(len(c) == 12 for c in grid):
            ap.error(f"--grid: {_GONE_12TH}, got {args.grid!r}")
        if not grid or any(not 4 <= len(c) <= 11 for c in grid):
            ap.error(f"--grid: 4 to 11 integers per gate-up config, got {args.grid!r}")
        if args.grid_wide_halves and not (args.grid_half_m and args.grid_block_m in (16, 32)):
            ap.error("--grid-wide-halves needs --grid-half-m and --grid-block-m 16 or 32")
        for r in args.routings.split(","):
            parse_routing(r)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    if args.config:
        os.environ["SGLANG_DDTREE_MOE_CONFIG"] = os.path.abspath(args.config)

    t0 = time.perf_counter()
    layers = [make_random_moe(args.experts, args.hidden, args.inter, device=dev, seed=i)
              for i in range(args.layers)]
    print(f"[{time.perf_counter() - t0:6.1f} s] {args.layers} random weight sets", flush=True)

    def make_inputs(m, routing=args.routing):
        concentrated = parse_routing(routing)
        g = torch.Generator(device=dev).manual_seed(m)
        xs = [torch.randn(m, args.hidden, device=dev, generator=g, dtype=torch.bfloat16)
              for _ in layers]
        logits = [torch.randn(m, args.experts, device=dev, generator=g) for _ in layers]
        if concentrated:
            # every token's top-k among the same few experts (a distinct set per layer)
            for lg in logits:
                few = torch.randperm(args.experts, device=dev, generator=g)[:concentrated]
                lg[:, few] += 100.0
        routes = [torch.topk(lg.softmax(-1), args.topk) for lg in logits]
        return (xs, [r.values.float().contiguous() for r in routes],
                [r.indices.to(torch.int32).contiguous() for r in routes], logits)

    if args.profile_ms:  # eager calls for an outside profiler (ncu): no graphs, no timing
        for m in args.profile_ms:
            xs, tws, tis, _ = make_inputs(m)
            for _ in range(3):
                run_ours(layers, xs, tws, tis, n=1)
            _sync(dev)
            print(f"profiled M={m} with {mw.select_config(m)}", flush=True)
        return 0
    def save(result, path=args.out):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    if grid is not None or args.prologue or args.breakdown or args.dual_stream or args.combine:
        if grid is not None:
            save(gate_up_grid(args, layers, make_inputs, dev, grid, save=save))
        elif args.dual_stream:
            save(dual_stream_times(args, layers, make_inputs, dev))
        elif args.combine:
            save(combine_times(args, layers, make_inputs, dev))
        else:
            save((prologue_times if args.prologue else breakdown)(args, layers, make_inputs, dev))
        print(f"wrote {args.out}")
        return 0
    if args.tune:
        tuned = tune(args, layers, make_inputs, dev)
        meta = {"command": " ".join([sys.executable] + sys.argv), "gpu": _device_name(dev),
                "routing": args.routing,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "triton": __import__("triton").__version__, "git": _git_rev(),
                "source_digest": checkout_digest(__file__)}
        os.makedirs(os.path.dirname(os.path.abspath(args.tune_out)), exist_ok=True)
        write_table(args.tune_out, tuned, meta)
        if args.out != ap.get_default("out"):  # every candidate's time, beside the table
            save({**meta, **tuned})
        for err in tuned["errors"]:
            print("skipped:", err)
        print(f"wrote {args.tune_out}")
        return 0
    wanted = [b for b in args.baselines.split(",") if b]
    baselines, baseline_errors = ({}, {"all": "--no-sglang"}) if args.no_sglang else \
        sglang_baselines(layers, args, wanted)
    baselines = {name: baselines[name] for name in wanted if name in baselines}
    print(f"[{time.perf_counter() - t0:6.1f} s] baselines {sorted(baselines)}, missing "
          f"{baseline_errors or 'none'}", flush=True)
    copy_gbs = copy_bandwidth_gbs(dev, nbytes=(2 << 30) if dev.type == "cuda" else (16 << 20))
    per_expert = expert_bytes(args.hidden, args.inter)
    rows = []
    result = {
        "command": " ".join([sys.executable] + sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "gpu": _device_name(dev),
        "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__,
                     "python": platform.python_version(), "sglang": _sglang_version()},
        "git": _git_rev(),  # the device's .git can be stale: source_digest is what counts
        "source_digest": checkout_digest(__file__),
        "table_overrides_for": table_overrides(dev),
        "shapes": {"experts": args.experts, "topk": args.topk, "hidden": args.hidden,
                   "inter": args.inter, "group": 32, "layers_per_graph": args.layers},
        "routing": args.routing,
        "copy_bandwidth_gbs": copy_gbs,
        "bytes_formula": "touched_experts * (packed w13 + w2 + bf16 scales) + 2 * M * hidden * 2",
        "baseline_errors": baseline_errors,
        "ours_variants": variants,
        "rows": rows,
    }

    def dump():  # after every row: a run cut short by its time limit keeps what it measured
        save(result)

    def new_row(m, tis):
        touched = sum(int(torch.unique(ti).numel()) for ti in tis) / len(tis)
        return {"m": m, "touched_experts": touched,
                "bytes": touched * per_expert + 2 * m * args.hidden * 2, "us": {}, "gbs": {}}

    def implementations(xs, tws, tis, logits):
        """{name: one call over every weight set}: ours first, then the SGLang baselines."""
        impls = {"ours": lambda: run_ours(layers, xs, tws, tis,
                                          routed_scaling_factor=args.routed_scaling)}
        for name, env in variants.items():  # same kernel, other env switches (A/B in one run)
            impls[name] = with_env(env, impls["ours"])
        for name, (prep, fn) in baselines.items():
            impls[name] = (lambda prep=prep, fn=fn: [fn(xs[i], prep[i], tws[i], tis[i], logits[i])
                                                     for i in range(len(layers))])
        return impls

    t_start = time.perf_counter()
    print(f"setup done (weights, baselines, copy bandwidth {copy_gbs:.0f} GB/s)", flush=True)
    if args.profiler:
        result["timing"] = "CUDA profiler kernel-duration sums over eager calls (no graphs)"
        inputs = {m: make_inputs(m) for m in args.ms}
        impls = {m: implementations(*inputs[m]) for m in args.ms}
        by_m = {m: new_row(m, inputs[m][2]) for m in args.ms}
        rows.extend(by_m.values())
        for name in ["ours"] + list(baselines):
            for m in args.ms:
                row = by_m[m]
                print(f"[{time.perf_counter() - t_start:6.1f} s] M={m}: profiling {name}",
                      flush=True)
                us = profiler_time_us(impls[m][name], args.iters) / len(layers)
                row["us"][name], row["gbs"][name] = us, row["bytes"] / (us * 1e-6) / 1e9
                compare_with_sglang(row)
                dump()
                print(f"M={m} {name}: {us:.1f} us", flush=True)
        print(f"wrote {args.out}")
        return 0
    for m in args.ms:
        xs, tws, tis, logits = make_inputs(m)
        row = new_row(m, tis)
        nbytes = row["bytes"]
        impls = implementations(xs, tws, tis, logits)
        times = {name: [] for name in impls}
        for rnd in range(args.rounds):
            for name, fn in impls.items():
                if name in row.get("errors", {}):
                    continue
                print(f"[{time.perf_counter() - t_start:6.1f} s] M={m}: timing {name}"
                      + (f" (round {rnd + 1})" if args.rounds > 1 else ""), flush=True)
                try:
                    times[name].append(graph_time_us(fn, args.iters, dev) / len(layers))
                except Exception as exc:
                    row.setdefault("errors", {})[name] = repr(exc)
        for name, ts in times.items():
            us = statistics.median(ts) if ts and name not in row.get("errors", {}) else None
            row["us"][name] = us
            row["gbs"][name] = None if us is None else nbytes / (us * 1e-6) / 1e9
        if args.rounds > 1:
            row["us_rounds"] = {name: [round(t, 3) for t in ts] for name, ts in times.items()}
        if args.check:
            lw = layers[0]
            got = run_ours(layers, xs, tws, tis, n=1,
                           routed_scaling_factor=args.routed_scaling).float()
            ref = moe_w4a16_reference(xs[0], lw["w13_packed"], lw["w13_scale"], lw["w2_packed"],
                                      lw["w2_scale"], tws[0], tis[0], args.routed_scaling)
            row["rel_err_vs_ref"] = float((got - ref).norm() / ref.norm())
            for name, env in variants.items():  # the same call under the variant's switches
                other = with_env(env, lambda: run_ours(
                    layers, xs, tws, tis, n=1, routed_scaling_factor=args.routed_scaling))()
                row[f"bits_equal_{name}"] = bool(torch.equal(other.float(), got))
            for name, (prep, fn) in baselines.items():
                if row["us"].get(name) is None:
                    continue  # failed to run: the error is in row["errors"]
                other = fn(xs[0], prep[0], tws[0], tis[0], logits[0]).float()
                row[f"rel_err_{name}_vs_ref"] = float((other - ref).norm() / ref.norm())
        compare_with_sglang(row)
        rows.append(row)
        dump()
        print(f"[{time.perf_counter() - t_start:6.1f} s] M={m}: "
              + ", ".join(f"{k} {v:.1f} us" if v else f"{k} failed" for k, v in row["us"].items())
              + (f", rel err {row['rel_err_vs_ref']:.2e}" if "rel_err_vs_ref" in row else ""),
              flush=True)

    dump()
    names = ["ours"] + list(variants) + list(baselines)
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; baselines missing: {baseline_errors or 'none'}")
    print(f"{'M':>5} {'experts':>7} " + " ".join(f"{n + ' us':>18}" for n in names)
          + f" {'ours GB/s':>9} {'%copy':>6} {'speedup':>7}")
    for r in rows:
        cells = " ".join(f"{(r['us'].get(n) or float('nan')):18.1f}" for n in names)
        gbs = r["gbs"].get("ours") or float("nan")
        print(f"{r['m']:5d} {r['touched_experts']:7.1f} {cells} {gbs:9.0f} "
              f"{100 * gbs / copy_gbs:5.0f}% {r.get('speedup_vs_best_sglang', float('nan')):7.2f}"
              + (f" err {r['rel_err_vs_ref']:.2e}" if "rel_err_vs_ref" in r else ""))
    print(f"wrote {args.out}")
    return 0


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"


def _sglang_version():
    try:
        import sglang
        return sglang.__version__
    except Exception as exc:
        return f"unavailable: {exc!r}"


def _git_rev():
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
