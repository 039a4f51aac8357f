"""``sglang-ddtree doctor --graphs``: check tree-verify CUDA graphs on this GPU before serving.

For every (kernel, budget, batch size) the doctor plans the tree-verify attention the way the
verify forward does (buffers sized for the batch, budget + 1 tree tokens and the maximum context),
captures one ``run()`` in a CUDA graph, then replays it on fresh random inputs copied into the
captured buffers (new prefix lengths, page tables, tree masks, queries) and compares the replay
with an eager run (must be bit-identical) and with the fp32 PyTorch reference (relative error
below the stated tolerance). Each case ends as ``pass``, ``mismatch`` (wrong numbers) or ``error``
(an exception: capture failure, illegal memory access, ...). An illegal memory access poisons the
CUDA context, so every case after it reports ``error`` too: rerun the doctor with ``--budgets`` /
``--batch-sizes`` narrowed to the failing case to see it alone.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

# relative error budget vs the fp32 reference (max |err| / max |ref|), per KV cache dtype
TOLERANCE = {"bf16": 2e-2, "fp8": 2e-2}

# per-rank shapes the doctor exercises by default (Qwen3-8B; Kimi K2.6 on TP8)
MHA_SHAPE = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
MLA_SHAPE = dict(num_heads=8, kv_lora_rank=512, rope_dim=64)
# the DFlash drafter of the Kimi TP8-rank emulation (SGLANG_DDTREE_DRAFT_ATTENTION):
# GQA 8:1, every block query attends the whole block (an all-ones mask)
DRAFT_SHAPE = dict(num_q_heads=8, num_kv_heads=1, head_dim=128)


@dataclass
class CaseResult:
    kernel: str          # "mha", "mha_fa3", "mla", "mla_fp8", "mla_flashmla" or "draft"
    budget: int          # "draft" rows: the drafter's block size (its N), not a budget
    batch_size: int
    status: str          # "pass" | "mismatch" | "error"
    graph_vs_eager_equal: Optional[bool] = None
    rel_err_vs_reference: Optional[float] = None
    num_splits: Optional[int] = None
    detail: str = ""
    trials: int = 0
    extra: dict = field(default_factory=dict)


# the context a doctor plans its kernels for unless told: a long-context server's (the split
# counts of a short plan, at most max_context / 256, leave the served 33- and 64-split launches
# and their one-step reduce unchecked)
DEFAULT_PLAN_CONTEXT = 131072


def _check_case(kernel: str, budget: int, bs: int, max_context: int, page_size: int,
                trials: int, seed: int, device: str = "cuda",
                plan_context: int = 0) -> CaseResult:
    """One case. ``device="cpu"`` (tests, Triton's interpreter) runs the same steps with the
    graph's capture and replay standing in as plain calls on the same static buffers. The
    kernel is planned for max(plan_context, max_context) tokens, as a server plans it for its
    context length (the split count, the reduce and the partial buffers follow from it), and
    replayed on prefixes of at most max_context."""
    import torch

    from sglang_ddtree.triton_kernels import reference as ref_mod
    from sglang_ddtree.triton_kernels.tree_attention import TreeAttention
    from sglang_ddtree.triton_kernels.tree_attention_mla import TreeAttentionMLA

    res = CaseResult(kernel, budget, bs, "error")
    planned = max(plan_context, max_context)  # the context the kernel is planned for
    draft = kernel == "draft"  # the drafter's block attention (SGLANG_DDTREE_DRAFT_ATTENTION)
    n = budget if draft else budget + 1
    dev = device
    on_gpu = torch.device(dev).type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    is_mla = kernel.startswith("mla")
    flashmla = kernel == "mla_flashmla"  # the prefix on FlashMLA (SGLANG_DDTREE_MLA_PREFIX)
    fa3 = kernel == "mha_fa3"  # the prefix on FA3 (SGLANG_DDTREE_MHA_PREFIX)
    if flashmla:
        from .mla_prefix import PAGE, FlashMLAPrefix

        page_size = PAGE
    if fa3:
        from .mha_prefix import FA3Prefix
    if is_mla:
        hq, hkv = MLA_SHAPE["num_heads"], 1
        dq, dv = MLA_SHAPE["kv_lora_rank"] + MLA_SHAPE["rope_dim"], MLA_SHAPE["kv_lora_rank"]
        sm_scale = 192 ** -0.5
        attn = TreeAttentionMLA.plan(max_batch_size=bs, num_tree_tokens=n, num_heads=hq,
                                     max_context_len=planned, device=dev,
                                     sm_scale=sm_scale, kv_lora_rank=dv,
                                     rope_dim=MLA_SHAPE["rope_dim"])
    else:
        shape = DRAFT_SHAPE if draft else MHA_SHAPE
        hq, hkv, dq = shape["num_q_heads"], shape["num_kv_heads"], shape["head_dim"]
        dv, sm_scale = dq, dq ** -0.5
        attn = TreeAttention.plan(max_batch_size=bs, num_tree_tokens=n, num_q_heads=hq,
                                  num_kv_heads=hkv, head_dim=dq,
                                  max_context_len=planned, device=dev,
                                  ordered_mask=not draft)
    # the prefix elsewhere: our kernel attends the tree keys only, in one split
    res.num_splits = 1 if flashmla or fa3 else attn.num_splits(bs)
    # the tile this GPU gets (MLA: 16 rows where 32 do not fit; the merging launch's own tile
    # with the prefix elsewhere)
    cfg = attn.merge_config_for(bs) if flashmla or fa3 else attn.config_for(bs)
    res.extra["tile"] = f"{cfg.block_m}x{cfg.block_n}/{cfg.num_warps}w"
    if flashmla or fa3:
        res.extra["page_size"] = page_size
    fp8 = kernel.endswith("fp8")
    kv_scale = 0.5 if fp8 else 1.0
    g = torch.Generator().manual_seed(seed)
    pages_per_req = (max_context + n + page_size - 1) // page_size
    num_slots = (bs * pages_per_req + 4) * page_size
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    k_cache = torch.randn(num_slots, hkv, dq, device=dev).to(kv_dtype)
    v_cache = None if is_mla else torch.randn(num_slots, hkv, dv, device=dev).to(kv_dtype)

    # the graph's static inputs, as the verify forward's CUDA-graph runner holds them
    q = torch.zeros(bs * n, hq, dq, device=dev, dtype=torch.bfloat16)
    req_to_token = torch.zeros(bs + 2, max_context + n, dtype=torch.int32, device=dev)
    req_pool_indices = torch.zeros(bs, dtype=torch.int64, device=dev)
    seq_lens = torch.ones(bs, dtype=torch.int64, device=dev)
    out_cache_loc = torch.zeros(bs * n, dtype=torch.int64, device=dev)
    tree_mask = (torch.ones if draft else torch.eye)(n, n, dtype=torch.bool,
                                                     device=dev).repeat(bs, 1, 1)
    out = torch.zeros(bs * n, hq, dv, device=dev, dtype=torch.bfloat16)
    kv_kwargs = dict(req_to_token=req_to_token, req_pool_indices=req_pool_indices,
                     seq_lens=seq_lens)
    prefix = None
    if flashmla:
        prefix = FlashMLAPrefix(num_tree_tokens=n, num_heads=hq, v_dim=dv, device=dev,
                                context_width=req_to_token.shape[1])
        prefix.init_graph_buffers(bs)
    if fa3:
        prefix = FA3Prefix(num_tree_tokens=n, page_size=page_size, device=dev,
                           context_width=req_to_token.shape[1], table_dtype=req_to_token.dtype)
        prefix.init_graph_buffers(bs)
        # the verify backend's static snapshot of the batch's req_to_token rows
        snapshot = torch.zeros(bs, req_to_token.shape[1], dtype=req_to_token.dtype, device=dev)
        snap_rows = torch.arange(bs, device=dev)

    def prepare(static):  # outside the graph, before each replay (as the verify backend)
        if fa3:
            torch.index_select(req_to_token, 0, req_pool_indices, out=snapshot)
            prefix.prepare(snapshot, snap_rows, seq_lens, static=static)
        elif prefix is not None:
            prefix.prepare(req_to_token, req_pool_indices, seq_lens, static=static)

    def call(o):
        if fa3:
            p_out, p_lse = prefix.run(q, k_cache, v_cache, sm_scale)
            return attn.run(q, k_cache, v_cache, out_cache_loc, tree_mask, out=o,
                            prefix_out=p_out, prefix_lse=p_lse, **kv_kwargs)
        if prefix is not None:
            p_out, p_lse = prefix.run(q, k_cache, sm_scale)
            return attn.run(q, k_cache, out_cache_loc, tree_mask, out=o, prefix_out=p_out,
                            prefix_lse=p_lse, **kv_kwargs)
        if is_mla:
            return attn.run(q, k_cache, out_cache_loc, tree_mask, kv_scale=kv_scale, out=o,
                            **kv_kwargs)
        return attn.run(q, k_cache, v_cache, out_cache_loc, tree_mask, out=o, **kv_kwargs)

    prepare(static=True)
    call(out)  # JIT-compile outside the capture
    sync()
    if on_gpu:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call(out)
        replay = graph.replay
    else:
        graph, replay = None, (lambda: call(out))
    sync()

    worst = 0.0
    all_equal = True
    for trial in range(trials):
        # fresh inputs: prefix lengths anywhere in 1..max_context, incl. the extremes
        lens = torch.randint(1, max_context + 1, (bs,), generator=g)
        if trial == 0:
            lens[0] = max_context
            lens[-1] = 1
        layout = ref_mod.random_paged_layout(lens, n, page_size, g, max_ctx=max_context + n)
        layout = layout.to(dev)
        req_to_token.zero_()
        req_to_token[: layout.req_to_token.shape[0]].copy_(layout.req_to_token)
        req_pool_indices.copy_(layout.req_pool_indices)
        seq_lens.copy_(layout.seq_lens)
        out_cache_loc.copy_(layout.out_cache_loc)
        if not draft:  # the drafter's mask stays all ones
            tree_mask.copy_(ref_mod.random_tree_mask(bs, n, g))
        q.copy_(torch.randn(q.shape, generator=g).to(q))
        out.fill_(float("nan"))
        prepare(static=True)
        replay()
        prepare(static=False)
        eager = call(None)
        sync()
        all_equal &= bool(torch.equal(out, eager))
        if is_mla:
            ref = ref_mod.mla_tree_attention_reference(
                q, k_cache, out_cache_loc, tree_mask, kv_lora_rank=dv, sm_scale=sm_scale,
                kv_scale=kv_scale, **layout.table_kwargs())
        else:
            ref = ref_mod.tree_attention_reference(q, k_cache, v_cache, out_cache_loc,
                                                   tree_mask, **layout.table_kwargs())
        err = ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
        worst = max(worst, err if err == err else float("inf"))  # NaN counts as infinite
        res.trials = trial + 1
    del graph
    res.graph_vs_eager_equal = all_equal
    res.rel_err_vs_reference = worst
    tol = TOLERANCE["fp8" if fp8 else "bf16"]
    res.status = "pass" if all_equal and worst < tol else "mismatch"
    if res.status == "mismatch":
        res.detail = ("graph replay differs from eager; " if not all_equal else "") + \
            f"rel err {worst:.3g} (tolerance {tol})"
    return res


def default_kernels() -> list:
    """The doctor's kernels: MHA, MLA bf16 and fp8 KV and the drafter's block everywhere; MLA
    with the prefix on FlashMLA and MHA with the prefix on FA3 (``SGLANG_DDTREE_MLA_PREFIX`` /
    ``SGLANG_DDTREE_MHA_PREFIX``, auto by default) where that kernel can run (Hopper)."""
    import torch

    from .mha_prefix import machine_problems as fa3_problems
    from .mla_prefix import machine_problems

    kernels = ["mha", "mla", "mla_fp8", "draft"]
    if torch.cuda.is_available() and not machine_problems(torch.device("cuda")):
        kernels.append("mla_flashmla")
    if torch.cuda.is_available() and not fa3_problems(torch.device("cuda")):
        kernels.append("mha_fa3")
    return kernels


def run_graph_doctor(budgets: Sequence[int] = (4, 8, 9, 16, 32, 64, 128),
                     batch_sizes: Sequence[int] = (1, 2, 8, 32),
                     kernels: Optional[Sequence[str]] = None,
                     max_context: int = 2048, page_size: int = 16, trials: int = 2,
                     out: Optional[str] = None, verbose: bool = True,
                     plan_context: int = DEFAULT_PLAN_CONTEXT) -> list:
    """Capture and replay tree-verify attention graphs for every case; print a table.

    Parameters
    ----------
    budgets, batch_sizes : sequences of int
        Tree budgets (N = budget + 1 verify tokens per request) and batch sizes to capture.
    kernels : sequence of str
        ``"mha"`` (GQA 32/8 x 128), ``"mla"`` (8 heads, 512 + 64 latent, bf16 cache) and
        ``"mla_fp8"`` (the same with an fp8 e4m3 cache), ``"mla_flashmla"`` (bf16, pages of 64,
        the prefix on FlashMLA and the tree keys on our kernel: Hopper only), ``"mha_fa3"``
        (the MHA shape with the prefix on FA3, pages of ``page_size``: Hopper only),
        ``"draft"`` (the DFlash drafter's block attention,
        ``SGLANG_DDTREE_DRAFT_ATTENTION=triton``: GQA 8:1 x 128, an all-ones block mask; its
        rows read each budget as the block size). Default: :func:`default_kernels`.
    max_context : int
        Replays draw prefix lengths in 1..max_context.
    plan_context : int
        Context the kernels are planned for (at least max_context): a server plans for its
        context length, which sets the split count, most splits then empty on short prefixes.
        Default 131,072; pass your ``--context-length`` to check exactly what you serve.
    trials : int
        Fresh-input replays per captured graph.
    out : str, optional
        Write the results (plus GPU, versions, settings) as JSON to this path.

    Returns
    -------
    list of CaseResult
    """
    import torch

    results = []
    if not torch.cuda.is_available():
        print("doctor --graphs needs a CUDA GPU (torch.cuda.is_available() is False)")
        return results
    kernels = list(kernels) if kernels is not None else default_kernels()
    for kernel in kernels:
        for budget in budgets:
            for bs in batch_sizes:
                t0 = time.perf_counter()
                try:
                    r = _check_case(kernel, budget, bs, max_context, page_size, trials,
                                    seed=budget * 1000 + bs, plan_context=plan_context)
                except Exception as exc:  # reported per case, never swallowed silently
                    r = CaseResult(kernel, budget, bs, "error",
                                   detail=f"{type(exc).__name__}: {exc}"[:300])
                r.extra["seconds"] = round(time.perf_counter() - t0, 3)
                results.append(r)
                if verbose:
                    print(_row(r), flush=True)
    if verbose:
        _summary(results)
    if out:
        _write_json(out, results, dict(budgets=list(budgets), batch_sizes=list(batch_sizes),
                                       kernels=list(kernels), max_context=max_context,
                                       plan_context=max(plan_context, max_context),
                                       page_size=page_size, trials=trials))
    return results


def _row(r: CaseResult) -> str:
    err = "-" if r.rel_err_vs_reference is None else f"{r.rel_err_vs_reference:.2e}"
    eq = "-" if r.graph_vs_eager_equal is None else ("yes" if r.graph_vs_eager_equal else "NO")
    return (f"{r.kernel:8s} budget {r.budget:4d} bs {r.batch_size:3d} splits "
            f"{r.num_splits if r.num_splits is not None else '-':>3} "
            f"tile {r.extra.get('tile', '-'):9s}  graph==eager {eq:3s}  "
            f"rel_err {err:9s}  {r.status.upper():8s} {r.detail}")


def _summary(results: list) -> None:
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "mismatch", "error")}
    print(f"doctor --graphs: {counts['pass']} pass, {counts['mismatch']} mismatch, "
          f"{counts['error']} error ({len(results)} cases)")


def _write_json(path: str, results: list, settings: dict) -> None:
    import os

    import torch
    import triton

    meta = dict(command="sglang-ddtree doctor --graphs", settings=settings,
                date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), python=platform.python_version(),
                torch=torch.__version__, triton=triton.__version__,
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                tolerance=TOLERANCE)
    # run from a checkout (not an installed wheel): which code it checked, as the benchmarks
    # record it (scripts/which_commit.py names the commit)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, "pyproject.toml")):
        from .provenance import source_digest

        meta["source_digest"] = source_digest(root)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, results=[asdict(r) for r in results]), f, indent=1)
    print(f"wrote {path}")


def _ints(text: str) -> list:
    return [int(x) for x in text.split(",") if x]


def add_subparser(subparsers) -> argparse.ArgumentParser:
    """Add the ``doctor`` subcommand to an argparse ``subparsers`` object (``func`` default)."""
    p = subparsers.add_parser("doctor", help="check this GPU before serving",
                              description=__doc__.splitlines()[0])
    p.add_argument("--graphs", action="store_true",
                   help="capture and replay tree-verify attention CUDA graphs")
    p.add_argument("--out", metavar="JSON", default=None, help="write results as JSON here")
    p.add_argument("--budgets", type=_ints, default=[4, 8, 9, 16, 32, 64, 128])
    p.add_argument("--batch-sizes", type=_ints, default=[1, 2, 8, 32])
    p.add_argument("--kernels", type=lambda s: s.split(","), default=None,
                   help="mha,mla,mla_fp8,draft[,mla_flashmla][,mha_fa3] (default: these, "
                        "mla_flashmla / mha_fa3 where FlashMLA / FA3 run; draft rows read the "
                        "budgets as block sizes)")
    p.add_argument("--max-context", type=int, default=2048,
                   help="longest prefix the replays draw")
    p.add_argument("--plan-context", type=int, default=DEFAULT_PLAN_CONTEXT,
                   help="context the kernels are planned for, as a server plans them for its "
                        "--context-length (sets the split counts); default %(default)s")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--trials", type=int, default=2)
    p.set_defaults(func=run_doctor_cli)
    return p


def run_doctor_cli(args: argparse.Namespace) -> int:
    """Entry for ``sglang-ddtree doctor``; returns the process exit code (0 = all pass)."""
    if not args.graphs:
        print("nothing to check: pass --graphs")
        return 2
    results = run_graph_doctor(args.budgets, args.batch_sizes, args.kernels, args.max_context,
                               args.page_size, args.trials, out=args.out,
                               plan_context=args.plan_context)
    return 0 if results and all(r.status == "pass" for r in results) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_ddtree.doctor")
    sub = parser.add_subparsers(dest="command", required=True)
    add_subparser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
