"""The fused tree-build kernel's logic on a CPU, bit for bit against ``build_tree_reference``.

``cuda_ext/tree_build_kernel.cuh`` is compiled with the host C++ compiler against a small CUDA
emulation (``tests/cuda_ext_emu/``: one std::thread per CUDA thread, std::barrier for
``__syncthreads`` and warp shuffles) and run on the inputs of the GPU tests. This catches
algorithm and indexing bugs in CI, where no GPU runs; the compiled kernel itself is tested on the
GPU by ``tests/gpu/test_cuda_ext_tree_gpu.py``. Skipped without a C++20 compiler.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from sglang_ddtree.tree import DraftTree, build_tree_reference, full_mask_layout
from sglang_ddtree.tree_backend import KERNEL_ALGOS
from tests.gpu.test_cuda_ext_tree_gpu import make_inputs
from tests.test_tree import assert_same_tree

ROOT = Path(__file__).resolve().parents[1]
EMU_DIR = ROOT / "tests" / "cuda_ext_emu"
KERNEL_DIR = ROOT / "cuda_ext"
GUARD = 16  # guard bytes (value 2) on each side of the FULL_MASK buffer


def build_emu(source: str, exe) -> None:
    """Compile tests/cuda_ext_emu/<source> against the kernel headers on the host (skips the
    test without a C++20 compiler)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    cmd = [cxx, "-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas", f"-I{EMU_DIR}",
           f"-I{KERNEL_DIR}", str(EMU_DIR / source), "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        if "barrier" in r.stderr and ("No such file" in r.stderr or "not found" in r.stderr):
            pytest.skip(f"{cxx} lacks C++20 <barrier>")
        pytest.fail(f"emulation build failed ({' '.join(cmd)}):\n{r.stderr[-4000:]}")


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    exe = tmp_path_factory.mktemp("cuda_ext_emu") / "emu_driver"
    build_emu("emu_driver.cpp", exe)
    return exe


def run_emulated(exe, tmp_path, roots, lp, ids, budget, threads, seq, fill=0xAB, algo=0,
                 smem_limit=None, log=None):
    """smem_limit: the shared memory per block the emulated launcher sees (default: its
    buffer's 240 KB); log: a list that gets the driver's stderr lines."""
    bs, depth, k = lp.shape
    n = budget + 1
    fin, fout = tmp_path / "in.bin", tmp_path / "out.bin"
    with open(fin, "wb") as f:
        np.array([bs, depth, k, budget, threads, fill, algo], np.int64).tofile(f)
        lp.numpy().astype(np.float32).tofile(f)
        ids.numpy().astype(np.int64).tofile(f)
        roots.numpy().astype(np.int64).tofile(f)
        seq.numpy().astype(np.int64).tofile(f)
    env = dict(os.environ)
    if smem_limit is not None:
        env["DDTREE_EMU_SMEM_LIMIT"] = str(smem_limit)
    r = subprocess.run([str(exe), str(fin), str(fout)], check=True, timeout=300, env=env,
                       capture_output=True, text=True)
    if log is not None:
        log.extend(r.stderr.splitlines())
    raw = np.fromfile(fout, np.uint8)
    at = 0

    def take(dtype, count, shape):
        nonlocal at
        nbytes = np.dtype(dtype).itemsize * count
        a = raw[at:at + nbytes].view(dtype).reshape(shape)
        at += nbytes
        return torch.from_numpy(a.copy())

    bn = bs * n
    tree = DraftTree(tokens=take(np.int64, bn, (bs, n)), parents=take(np.int64, bn, (bs, n)),
                     depths=take(np.int64, bn, (bs, n)),
                     valid=take(np.uint8, bn, (bs, n)).to(torch.bool),
                     scores=take(np.float32, bn, (bs, n)),
                     ancestor_mask=take(np.uint8, bn * n, (bs, n, n)).to(torch.bool),
                     retrive_index=take(np.int64, bn, (bs, n)),
                     retrive_next_token=take(np.int64, bn, (bs, n)),
                     retrive_next_sibling=take(np.int64, bn, (bs, n)), max_depth=depth)
    positions = take(np.int64, bn, (bs, n))
    full = torch.from_numpy(raw[at:].copy())
    return tree, positions, full


def check(exe, tmp_path, bs, budget, depth, k, threads, mode, seed, algo=0, smem_limit=None,
          log=None):
    roots, lp, ids = make_inputs(bs, depth, k, seed, mode)
    seq = torch.randint(0, 40, (bs,), generator=torch.Generator().manual_seed(seed))
    ref = build_tree_reference(roots, lp, ids, budget)
    tree, positions, full = run_emulated(exe, tmp_path, roots, lp, ids, budget, threads, seq,
                                         algo=algo, smem_limit=smem_limit, log=log)
    tag = f"bs={bs} B={budget} D={depth} K={k} threads={threads} mode={mode} algo={algo}"
    # every element of the (0xAB/77/NaN-poisoned) outputs must be written and equal the oracle
    assert_same_tree(ref, tree, tag)
    assert torch.equal(positions, seq[:, None] + ref.depths), tag
    n = budget + 1
    sizes = n * (seq + n)
    expect = torch.zeros(int(sizes.sum()), dtype=torch.bool)
    full_mask_layout(ref.ancestor_mask, seq, expect, sizes.cumsum(0) - sizes)
    assert torch.equal(full[GUARD:GUARD + expect.numel()], expect.to(torch.uint8)), tag
    assert bool((full[:GUARD] == 2).all()) and bool((full[GUARD + expect.numel():] == 2).all()), \
        f"{tag}: FULL_MASK written out of bounds"
    return roots, lp, ids, seq, tree


# (bs, budget, D, K, threads, mode): every input mode of the GPU tests, one warp to 1024 threads,
# log-probs staged up front and per depth (K x D > 8192), D > 31 and D > 63 with a small budget.
CASES = [
    (2, 5, 4, 4, 32, "random"),
    (3, 16, 6, 16, 64, "ties"),
    (2, 64, 15, 64, 128, "peaked"),
    (2, 64, 15, 64, 128, "round"),
    (3, 20, 5, 8, 64, "ninf"),
    (2, 30, 5, 16, 32, "short_vocab"),
    (4, 16, 6, 8, 64, "dead_depth"),
    (1, 200, 4, 256, 256, "ties"),
    (1, 1024, 3, 1024, 256, "random"),
    (1, 1024, 9, 1024, 1024, "peaked"),
    (2, 33, 40, 5, 32, "peaked"),
    (1, 20, 70, 4, 32, "peaked"),
    (2, 1, 15, 64, 32, "random"),
    # the masks' two writers: N = 288 (bit rows, ddtree::kBitRowsMaxN) and 289 (ancestor table)
    (2, 287, 5, 64, 256, "ties"),
    (2, 288, 5, 64, 256, "ties"),
]


ALGO_LEVELWISE, ALGO_FRONTIER = KERNEL_ALGOS["levelwise"], KERNEL_ALGOS["frontier"]
FRONTIER_MAX_BUDGET = 287  # ddtree::kFrontierMaxBudget


def frontier_fits(budget, depth, k):
    """ddtree::frontier_fits: the budget fits 9 slots per lane, every depth's rows fit smem."""
    return budget <= FRONTIER_MAX_BUDGET and min(k, budget) * min(depth, budget) <= 8192


@pytest.mark.parametrize("bs, budget, depth, k, threads, mode", CASES)
def test_emulated_kernel_matches_reference(driver, tmp_path, bs, budget, depth, k, threads, mode):
    check(driver, tmp_path, bs, budget, depth, k, threads, mode, seed=budget * 7 + depth,
          algo=ALGO_LEVELWISE)


# The frontier (best-first) kernel on every case it can serve, plus budgets at each item-count
# boundary (31/32, 63/64, 95/96, 159/160, 287) and exact score ties across parents.
FRONTIER_CASES = [c for c in CASES if frontier_fits(c[1], c[2], c[3])] + [
    (2, 31, 6, 32, 64, "random"),
    (2, 32, 6, 32, 32, "ties"),
    (2, 63, 15, 64, 128, "ties"),
    (2, 95, 15, 16, 128, "peaked"),
    (2, 96, 8, 96, 128, "round"),
    (1, 159, 10, 64, 256, "ties"),
    (1, 160, 10, 64, 256, "random"),
    (1, 287, 8, 287, 256, "ties"),
    (3, 64, 15, 64, 128, "ninf"),
    (4, 64, 15, 64, 128, "dead_depth"),
]


# The level-wise kernel's merge variant (budgets <= 128, every depth staged up front): every
# level-wise case it can take, plus deep narrow trees (peaked), the hand-over from merged depths
# back to block depths (wide top-K after narrow depths), G not yet full, and exact ties.
ALGO_MERGE = KERNEL_ALGOS["merge"]
MERGE_MAX_BUDGET = 128  # ddtree::kMergeMaxBudget


def merge_fits(budget, depth, k):
    return budget <= MERGE_MAX_BUDGET and min(k, budget) * min(depth, budget) <= 8192


# Deep narrow trees (peaked), wide top-K after narrow depths, G not yet full, exact ties: for
# both variants of the level-wise kernel below.
VARIANT_EXTRA_CASES = [
    (3, 64, 15, 64, 128, "peaked"),
    (3, 64, 15, 64, 64, "ties"),
    (2, 128, 15, 128, 128, "peaked"),
    (2, 128, 12, 128, 256, "round"),
    (3, 32, 15, 32, 32, "peaked"),
    (3, 16, 15, 8, 64, "random"),
    (2, 100, 10, 20, 128, "ninf"),
    (4, 48, 15, 48, 96, "dead_depth"),
    (2, 64, 15, 64, 128, "short_vocab"),
]
MERGE_CASES = [c for c in CASES if merge_fits(c[1], c[2], c[3])] + VARIANT_EXTRA_CASES


# The level-wise kernel's deferred variant (budgets <= 256: G holds up to 8B nodes, 4B above
# budget 128, and a score histogram prunes): every level-wise case it takes, plus deep narrow
# trees, G overflowing (flat rows: many candidates beat the histogram's threshold), scores below
# the histogram's range (-512 nats), K < B (no threshold until B nodes exist), and exact ties
# across parents.
ALGO_DEFERRED = KERNEL_ALGOS["deferred"]
DEFER_MAX_BUDGET = 256  # ddtree::kDeferMaxBudget

DEFER_CASES = [c for c in CASES if c[1] <= DEFER_MAX_BUDGET] + VARIANT_EXTRA_CASES + [
    (2, 256, 8, 256, 256, "peaked"),
    (2, 256, 15, 64, 256, "ties"),
    (2, 64, 15, 64, 128, "flat"),
    (2, 64, 15, 64, 128, "far"),
    (3, 64, 6, 8, 64, "random"),
    # the served block size: warp-run levels of 33-64 candidates (the warp appends them) and of
    # more (handed to the block, ddtree::kRunMaxCandidates), next to narrow ones
    (4, 64, 15, 64, 256, "peaked"),
    (2, 96, 15, 96, 256, "flat"),
    # a level of 2-3 parents with far more children than a warp run appends
    (2, 64, 15, 64, 128, "fan"),
    (2, 64, 15, 32, 64, "fan"),
    # K x D > 8192: each depth's log-probs staged when it is reached (not up front)
    (1, 200, 50, 200, 256, "peaked"),
    (1, 160, 60, 160, 128, "flat"),
]

# (kernel, case) for the frontier kernel and the merge and deferred variants; the seed differs
# per kernel
VARIANT_CASES = ([("frontier", c) for c in FRONTIER_CASES] + [("merge", c) for c in MERGE_CASES]
                 + [("deferred", c) for c in DEFER_CASES]
                 + [("deferred_warp", c) for c in DEFER_CASES])
SEED_STEP = {"frontier": 5, "merge": 3, "deferred": 11, "deferred_warp": 13}


@pytest.mark.parametrize("name, case", VARIANT_CASES)
def test_emulated_variant_matches_reference(driver, tmp_path, name, case):
    bs, budget, depth, k, threads, mode = case
    check(driver, tmp_path, bs, budget, depth, k, threads, mode,
          seed=budget * SEED_STEP[name] + depth, algo=KERNEL_ALGOS[name])


@pytest.mark.parametrize("algo", [ALGO_LEVELWISE, ALGO_FRONTIER, ALGO_MERGE, ALGO_DEFERRED,
                                  KERNEL_ALGOS["deferred_warp"]])
def test_result_does_not_depend_on_stale_shared_memory(driver, tmp_path, algo):
    roots, lp, ids, seq, first = check(driver, tmp_path, 2, 64, 15, 64, 64, "ties", seed=5,
                                       algo=algo)
    for fill in (0x00, 0xFF):
        again, _, _ = run_emulated(driver, tmp_path, roots, lp, ids, 64, 64, seq, fill=fill,
                                   algo=algo)
        assert_same_tree(first, again, f"fill {fill:#x} algo {algo}")


# (budget, D, K, mode, G's capacity with room, the smem limit that forces the smaller one)
# ddtree::defer_cap: 8B up to budget 128 (4B above), half that when the larger layout exceeds
# the device's shared memory per block (60,288 bytes at budget 64, 95,584 at 256; depth 15, K 64)
CAP_CASES = [
    (64, 15, 64, "flat", 512, 60287),
    (64, 15, 64, "peaked", 512, 60287),
    (256, 15, 64, "flat", 1024, 95583),
]


@pytest.mark.parametrize("algo", [ALGO_DEFERRED, KERNEL_ALGOS["deferred_warp"]])
@pytest.mark.parametrize("budget, depth, k, mode, cap, small_limit", CAP_CASES)
def test_deferred_capacity_follows_the_smem_limit(driver, tmp_path, algo, budget, depth, k, mode,
                                                 cap, small_limit):
    """The launcher gives G the larger capacity where its layout fits the device, half of it
    where it does not (a GPU with less shared memory per block); the tree is the same."""
    for limit, want in ((None, cap), (small_limit, cap // 2)):
        log = []
        check(driver, tmp_path, 2, budget, depth, k, 0, mode, seed=budget + 3, algo=algo,
              smem_limit=limit, log=log)
        assert f"gcap: {want}" in log, (limit, [x for x in log if x.startswith("gcap")])


def test_phase_count_of_the_emulated_kernel(driver, tmp_path):
    """scripts/tree_build_phases.py reads the block barriers a launch passed: a deep tree
    (peaked draft distributions, many depths) takes more serial phases than a one-depth one."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "tree_build_phases", ROOT / "scripts" / "tree_build_phases.py")
    phases_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(phases_mod)
    from bench_tree_build import make_topk

    roots, lp, ids = make_topk(2, 15, 16, 1000, "peaked", seed=1, device="cpu")
    deep, _, atomics, depth, most = phases_mod.phases(str(driver), str(tmp_path), roots, lp,
                                                      ids, 16, 64)
    shallow, _, _, _, _ = phases_mod.phases(str(driver), str(tmp_path), roots,
                                         lp[:, :1].contiguous(), ids[:, :1].contiguous(), 16, 64)
    assert 3 <= shallow < deep <= most
    # deep narrow levels select by counting ranks: no histogram atomics
    assert atomics == 0
    # a level with many candidates (flat depth 2: 16 parents x 16 ranks beat the threshold)
    # takes the radix select: its atomics are counted, the busiest bin's share at most all
    r = torch.arange(16, dtype=torch.float32)
    flat_lp = torch.stack([-0.5 * r, -1e-4 * r]).expand(2, 2, 16).contiguous()
    flat_ids = torch.arange(16).expand(2, 2, 16).contiguous()
    _, _, atomics, depth, _ = phases_mod.phases(str(driver), str(tmp_path), roots, flat_lp,
                                                flat_ids, 16, 64)
    assert atomics > 0 and 0 < depth <= atomics


def test_warp_run_helpers_match_direct_counts(tmp_path):
    """ddtree::count_above (8 probes per round) on sorted rows with ties and -inf tails, at
    every row sum as the threshold and one float step either side, Kp = 1 to 1024; and
    ddtree::warp_hist_add (one atomic per run of equal bins) against one count per active lane.
    A histogram that undercounts would only loosen the pruning, which the tree tests cannot
    see."""
    exe = tmp_path / "count_driver"
    build_emu("count_driver.cpp", exe)
    out = subprocess.run([str(exe), "7", "340"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    bad, checked = map(int, out.stdout.split())
    assert bad == 0 and checked > 100_000
