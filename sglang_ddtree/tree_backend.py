"""Which draft-tree builder a step uses: the fused CUDA kernel or the torch-op ``build_tree``.

Both take ``(root_ids, topk_logp, topk_ids, budget, out=None)`` and return the same
:class:`~sglang_ddtree.tree.DraftTree` bit for bit (contract: ``tree.py``). The CUDA kernel
(``cuda_ext/tree_build.cu``) does a whole step in one launch, one thread block per request;
``build_tree`` needs dozens of small kernels per depth.

:func:`get_tree_builder` decides once per process from ``SGLANG_DDTREE_TREE_BACKEND``
(auto|cuda|torch, default auto) and logs the choice once. Building the extension happens on that
first call, never at import. In ``auto`` mode calls the kernel cannot serve (CPU tensors,
min(D, budget) > 63, more shared memory than the GPU has) go to ``build_tree``.

The extension holds kernels with the same output: the level-wise one (any budget up to 1024;
its time grows with the tree's depth), its deferred variant (budgets up to 256: a depth appends
its candidates to a set of up to 8B nodes (4B above budget 128) instead of selecting the best B,
a score histogram prunes, one count at the end keeps the best B; about half the block barriers
per depth), and
the best-first "frontier" one (budgets up to 287; its time grows with the budget, not the
depth). ``SGLANG_DDTREE_TREE_KERNEL`` (auto|levelwise|frontier|merge|deferred|deferred_warp,
default auto) picks one; auto takes the frontier kernel up to budget 16 and above it the
deferred variant with warp runs (``deferred_warp``: warp 0 alone takes runs of narrow levels, at
most 64 parents and 64 candidates, with no block barrier), as the H200 measured fastest
(``bench_results/tree_build_h200_s12.json``, session 12). ``merge`` (budgets up to 128) is the
level-wise kernel with one warp merging each narrow depth into a sorted best-B set (measured
slower).
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys
import threading
from typing import Callable, Optional

import torch

from .tree import DraftTree, _check_inputs, build_tree

logger = logging.getLogger(__name__)

KERNEL_MAX_DEPTH = 63  # ddtree::kMaxDepth: min(D, budget) must not exceed it

ENV_KERNEL = "SGLANG_DDTREE_TREE_KERNEL"
KERNEL_ALGOS = {"auto": 0, "levelwise": 1, "frontier": 2, "merge": 3,
                "deferred": 4, "deferred_warp": 5}  # ddtree::TreeAlgo


def kernel_algo_from_env() -> int:
    """``SGLANG_DDTREE_TREE_KERNEL`` (auto|levelwise|frontier|merge|deferred|deferred_warp,
    default auto) as
    ddtree::TreeAlgo."""
    value = os.environ.get(ENV_KERNEL, "auto").strip().lower() or "auto"
    if value not in KERNEL_ALGOS:
        raise ValueError(f"{ENV_KERNEL}: expected one of {'|'.join(KERNEL_ALGOS)}, got {value!r}")
    return KERNEL_ALGOS[value]

TreeBuilder = Callable[..., DraftTree]


def _loader():
    """``sglang_ddtree.cuda_ext.loader``; in a source checkout without install, the same file."""
    try:
        from sglang_ddtree.cuda_ext import loader
        return loader
    except ModuleNotFoundError:
        name = "_sglang_ddtree_cuda_ext_loader"
        if name not in sys.modules:
            path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "cuda_ext", "loader.py")
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        return sys.modules[name]


def build_tree_cuda(root_ids: torch.Tensor, topk_logp: torch.Tensor, topk_ids: torch.Tensor,
                    budget: int, out: Optional[DraftTree] = None, *,
                    seq_lens: Optional[torch.Tensor] = None,
                    positions: Optional[torch.Tensor] = None,
                    full_mask: Optional[torch.Tensor] = None, threads: int = 0,
                    algo: Optional[int] = None) -> DraftTree:
    """``build_tree`` in one CUDA launch (one thread block per request). Graph-safe.

    No host synchronisation and no allocation when ``out`` is given, so it can be captured in a
    CUDA graph and replayed. Builds the extension on first use (raises ExtensionUnavailable if
    it cannot).

    Parameters
    ----------
    root_ids : [bs] int64 (contiguous); topk_logp : [bs, D, K] float32, rows sorted descending,
        contiguous along K; topk_ids : [bs, D, K] int64; budget : python int, 1..1024, with
        min(D, budget) <= 63. All on one CUDA device.
    out : optional ``DraftTree.empty(bs, budget, device)``; every element is written.
    seq_lens : optional [bs] int64 prefix lengths; with it the kernel also writes
    positions : optional [bs, N] int64, ``seq_lens[b] + depths[b, i]``, and
    full_mask : optional 1-D bool buffer of at least ``sum_b N * (seq_lens[b] + N)`` elements
        (not checked: that needs a sync), the FULL_MASK layout of ``tree.full_mask_layout``;
        elements past the used length are left untouched.
    threads : threads per block, a multiple of 32 up to 1024 (0 = by budget: 128..1024).
    algo : which kernel (0 auto, 1 level-wise, 2 frontier, 3 merge); None =
        ``SGLANG_DDTREE_TREE_KERNEL``.
        The frontier kernel serves budgets up to 287 with every depth's log-probs in shared
        memory; outside that the level-wise kernel serves whatever was asked.
    """
    bs, depth, _ = _check_inputs(root_ids, topk_logp, topk_ids, budget)
    if algo is None:
        algo = kernel_algo_from_env()
    if not topk_logp.is_cuda:
        raise ValueError(f"build_tree_cuda: topk_logp must be a CUDA tensor, got {topk_logp.device}")
    ext = _loader().load_tree_build_ext(required=True)
    if out is None:
        out = DraftTree.empty(bs, budget, topk_logp.device)
    # the extension returns its error message instead of throwing (see tree_build.cpp)
    err = ext.tree_build(root_ids, topk_logp, topk_ids, budget, out.tokens, out.parents,
                         out.depths, out.valid, out.scores, out.ancestor_mask, out.retrive_index,
                         out.retrive_next_token, out.retrive_next_sibling, seq_lens, positions,
                         full_mask, threads, algo)
    if err:
        raise RuntimeError(err)
    out.max_depth = depth
    return out


build_tree_cuda.single_launch = True
build_tree_cuda.writes_layout = True


def _kernel_fits(budget: int, k: int, depth: int, device_index: int) -> bool:
    return _kernel_fits_algo(budget, k, depth, device_index, kernel_algo_from_env())


@functools.lru_cache(maxsize=None)
def _kernel_fits_algo(budget: int, k: int, depth: int, device_index: int, algo: int) -> bool:
    if min(depth, budget) > KERNEL_MAX_DEPTH:
        return False
    props = torch.cuda.get_device_properties(device_index)
    have = getattr(props, "shared_memory_per_block_optin", None)
    # the launcher sizes the deferred variants' G to what the device grants (ddtree::defer_cap)
    need = _loader().load_tree_build_ext(required=True).smem_bytes(
        budget, k, depth, algo, -1 if have is None else have)
    return have is None or need <= have


def build_tree_auto(root_ids: torch.Tensor, topk_logp: torch.Tensor, topk_ids: torch.Tensor,
                    budget: int, out: Optional[DraftTree] = None, *,
                    seq_lens: Optional[torch.Tensor] = None,
                    positions: Optional[torch.Tensor] = None,
                    full_mask: Optional[torch.Tensor] = None) -> DraftTree:
    """The CUDA kernel where it can serve the call, else ``build_tree`` (decided on shapes only).

    ``seq_lens`` / ``positions`` / ``full_mask``: the verify layout, as in
    :func:`build_tree_cuda`; on the ``build_tree`` path it is written by ``verify``'s ops."""
    if topk_logp.is_cuda and topk_logp.dim() == 3 and isinstance(budget, int) and 1 <= budget:
        _, depth, k = topk_logp.shape
        if _kernel_fits(budget, k, depth, topk_logp.device.index or 0):
            return build_tree_cuda(root_ids, topk_logp, topk_ids, budget, out,
                                   seq_lens=seq_lens, positions=positions, full_mask=full_mask)
    tree = build_tree(root_ids, topk_logp, topk_ids, budget, out)
    if positions is not None or full_mask is not None:
        from .verify import write_verify_layout

        if seq_lens is None:
            raise ValueError("build_tree_auto: positions and full_mask need seq_lens")
        write_verify_layout(tree, seq_lens, full_mask, positions)
    return tree


# single launch only where the kernel fits; the worker checks shapes at start-up, so the flag
# holds for the step shapes it serves (see worker._tree_builder). Both kernel entry points also
# write the verify layout (positions, FULL_MASK) in that launch.
build_tree_auto.single_launch = True
build_tree_auto.writes_layout = True

_choice_lock = threading.Lock()
_choice: dict = {"builder": None}


def get_tree_builder() -> TreeBuilder:
    """The tree builder this process uses (decided and logged once).

    ``SGLANG_DDTREE_TREE_BACKEND``: ``torch`` -> ``build_tree``; ``cuda`` -> ``build_tree_cuda``,
    raising ExtensionUnavailable with the reason if the kernel cannot be built; ``auto`` ->
    ``build_tree_auto`` if the kernel builds, else ``build_tree`` (the loader logs why).
    """
    with _choice_lock:
        if _choice["builder"] is None:
            loader = _loader()
            mode = loader.backend_from_env()
            kernel = os.environ.get(ENV_KERNEL, "auto").strip().lower() or "auto"
            kernel_algo_from_env()  # a bad value fails at start-up, not in the first step
            if mode == "torch":
                builder, why = build_tree, f"{loader.ENV_BACKEND}=torch"
            elif mode == "cuda":
                loader.load_tree_build_ext(required=True)
                builder, why = build_tree_cuda, f"{loader.ENV_BACKEND}=cuda"
            elif loader.load_tree_build_ext() is not None:
                builder, why = build_tree_auto, "auto: fused CUDA kernel built"
            else:
                builder, why = build_tree, f"auto: {loader.unavailable_reason()}"
            if builder is not build_tree:
                why += f"; {ENV_KERNEL}={kernel}"
            logger.info("sglang_ddtree: tree builder = %s (%s)", builder.__name__, why)
            _choice["builder"] = builder
        return _choice["builder"]


def _reset_for_tests() -> None:
    with _choice_lock:
        _choice["builder"] = None
    _kernel_fits_algo.cache_clear()
    _loader()._reset_for_tests()


def _parity_inputs(bs: int, depth: int, k: int, device, seed: int):
    """Random drafter-like inputs with exact ties (quantised log-probs) and -inf tails."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    logp = -(torch.rand(bs, depth, k, generator=g) * 6).div(0.25).floor().mul(0.25)
    logp = logp.sort(dim=-1, descending=True).values
    logp[..., k - max(1, k // 8):] = float("-inf")
    ids = torch.argsort(torch.rand(bs * depth, 4 * k + 7, generator=g), dim=-1)[:, :k]
    roots = torch.randint(0, 4 * k, (bs,), generator=g)
    return (roots.to(device), logp.to(device), ids.view(bs, depth, k).to(device))


def verified_tree_builder(budget: int, depth: int, k: int, device) -> TreeBuilder:
    """:func:`get_tree_builder`, but a kernel builder must first reproduce ``build_tree`` bit for
    bit on random inputs of this step's shapes (ties, -inf); otherwise ``build_tree`` is used and
    the reason logged. Runs once at worker start-up (it synchronizes)."""
    builder = get_tree_builder()
    if builder is build_tree:
        return builder
    if builder is build_tree_auto and not _kernel_fits(budget, k, depth,
                                                       torch.device(device).index or 0):
        logger.info("sglang_ddtree: the fused kernel cannot take budget=%d, D=%d, K=%d; using "
                    "build_tree", budget, depth, k)
        return build_tree
    for bs, seed in ((1, 0), (3, 1), (5, 2)):
        args = _parity_inputs(bs, depth, k, device, seed)
        try:
            got = builder(*args, budget)
        except Exception as e:  # reported below, then the torch builder serves
            reason = f"{type(e).__name__}: {e}"
            break
        want = build_tree(*args, budget)
        bad = [n for n, t in want.tensors().items() if not torch.equal(getattr(got, n), t)]
        if bad:
            reason = f"differs from build_tree in {bad} (bs={bs}, seed={seed})"
            break
    else:
        ext = _loader().load_tree_build_ext()  # which kernel serves, for the log (if built)
        kernel = (ext.kernel_name(budget, k, depth, kernel_algo_from_env())
                  if ext is not None else "n/a")
        logger.info("sglang_ddtree: %s passed the start-up parity check (budget=%d, D=%d, K=%d; "
                    "kernel %s)", getattr(builder, "__name__", builder), budget, depth, k, kernel)
        return builder
    logger.error("sglang_ddtree: %s failed the start-up parity check (%s); using build_tree",
                 builder.__name__, reason)
    return build_tree
