"""The small-M MoE CUDA kernels' logic on a CPU, against a PyTorch reference with the same
rounding points.

``cuda_ext/moe_w4a16_small.cuh`` is compiled with the host C++ compiler against
``tests/cuda_ext_emu/moe_emu.h`` (one std::thread per CUDA thread; the warp-collective
``mma.sync.m16n8k16`` emulated from the PTX fragment layouts; bf16x2 arithmetic rounded to nearest
even) and run on small random problems: both n-tile widths, every pipeline depth the driver
builds, stream-K ranges inside one tile and across tiles, concentrated routing, padding slots
(-1). This checks the fragment mapping (columns, the permuted K order), the cp.async rings, the
split tiles' fix-up and the counters' re-arming in CI;
the compiled kernels are tested on the GPU by ``tests/gpu/test_moe_w4a16_small_gpu.py``.

Tolerance: ``y`` within 1e-2 of max |y_ref| (fp32 summation order differs, so an ``h`` value may
round to the neighbouring bf16); ``h`` within 2 bf16 ulps (2 ** -7 relative) of the reference
at every real row.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.triton_kernels import load_copy

_MODS = load_copy("moesmall", ("moe_reference", "moe_w4a16_small"), interpret=True)
dequantize = _MODS["moe_reference"].dequantize
make_random_moe = _MODS["moe_reference"].make_random_moe

ROOT = Path(__file__).resolve().parents[1]
EMU_DIR = ROOT / "tests" / "cuda_ext_emu"
E, K, I, TOPK = 12, 256, 64, 4


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp("moe_emu") / "moe_driver"
    cmd = [cxx, "-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas", f"-I{EMU_DIR}",
           f"-I{ROOT / 'cuda_ext'}", str(EMU_DIR / "moe_driver.cpp"), "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        if "barrier" in r.stderr and ("No such file" in r.stderr or "not found" in r.stderr):
            pytest.skip(f"{cxx} lacks C++20 <barrier>")
        pytest.fail(f"emulation build failed ({' '.join(cmd)}):\n{r.stderr[-4000:]}")
    return exe


def align(ids: np.ndarray, num_experts: int, bm: int):
    """Host mirror of moe_align: pair ids grouped by expert (flat order), each expert padded to a
    multiple of bm with T; block_expert with -1 past the used blocks and their count last."""
    flat = ids.reshape(-1)
    t = flat.size
    bound = t + min(t, num_experts) * (bm - 1)
    max_padded = -(-bound // bm) * bm
    sorted_ids = np.full(max_padded, t, dtype=np.int32)  # unspecified past the used blocks
    block_expert = np.full(max_padded // bm + 1, -1, dtype=np.int32)
    row = 0
    for e in range(num_experts):
        pairs = np.nonzero(flat == e)[0]
        if pairs.size == 0:
            continue
        sorted_ids[row:row + pairs.size] = pairs
        n = -(-pairs.size // bm) * bm
        block_expert[row // bm:(row + n) // bm] = e
        row += n
    block_expert[-1] = row // bm
    return sorted_ids, block_expert, max_padded


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def from_bits(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.uint16).view(np.int16).copy()).view(torch.bfloat16).float()


def reference(x, w, tw, ids):
    """h (per pair) and y with the kernels' rounding points: bf16(q * s), fp32 sums, bf16 h, y."""
    y = {}
    h = {}
    for p, e in enumerate(ids.reshape(-1).tolist()):
        if not 0 <= e < E:
            continue
        tok = p // TOPK
        w13 = dequantize(w["w13_packed"][e:e + 1], w["w13_scale"][e:e + 1])[0]
        w13 = w13.to(torch.bfloat16).float()
        w2 = dequantize(w["w2_packed"][e:e + 1], w["w2_scale"][e:e + 1])[0]
        w2 = w2.to(torch.bfloat16).float()
        gu = x[tok].float().double() @ w13.double()
        g, u = gu[:I], gu[I:]
        hv = (g / (1 + torch.exp(-g)) * u).float().to(torch.bfloat16)
        h[p] = hv.float()
        y[p] = ((hv.float().double() @ w2.double()) * float(tw.reshape(-1)[p])).float()
    return h, y


def run_driver(exe, tmp_path, x, w, tw, ids, nt, sgu, sdn, gu_ctas, dn_ctas, launches=2):
    m = x.shape[0]
    bm = 8 * nt
    sorted_ids, block_expert, max_padded = align(ids, E, bm)
    header = np.array([m, K, I, E, TOPK, nt, sgu, sdn, gu_ctas, dn_ctas, K, max_padded,
                       launches], dtype=np.int64)
    inp = tmp_path / "in.bin"
    with open(inp, "wb") as f:
        for a in (header, bf16_bits(x), w["w13_packed"].numpy(), bf16_bits(w["w13_scale"]),
                  w["w2_packed"].numpy(), bf16_bits(w["w2_scale"]), sorted_ids, block_expert,
                  tw.float().numpy().reshape(-1)):
            f.write(np.ascontiguousarray(a).tobytes())
    out = tmp_path / "out.bin"
    r = subprocess.run([str(exe), str(inp), str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    raw = out.read_bytes()
    n_h, n_y = max_padded * I, m * TOPK * K
    h = np.frombuffer(raw, dtype=np.uint16, count=n_h).reshape(max_padded, I)
    y = np.frombuffer(raw, dtype=np.uint16, count=n_y, offset=2 * n_h).reshape(m * TOPK, K)
    counters = np.frombuffer(raw, dtype=np.int32, offset=2 * (n_h + n_y))
    return h, y, counters, sorted_ids, int(block_expert[-1])


CASES = [
    # name, m, nt, gate-up stages, down stages, gate-up CTAs, down CTAs, routing. The gate-up
    # splits each call's used blocks x 8 K groups evenly over its CTAs (stream-K): CTAs inside
    # one tile, across tiles, more CTAs than groups, one CTA for everything.
    ("m1_one_cta", 1, 1, 4, 4, 1, 1, "random"),
    ("m3_ctas5", 3, 1, 6, 8, 5, 2, "random"),
    ("m8_ctas7", 8, 1, 4, 8, 7, 3, "random"),
    ("m8_ctas40_conc", 8, 1, 6, 4, 40, 5, "concentrated"),
    ("m2_ctas200", 2, 1, 4, 4, 200, 9, "random"),
    ("m9_nt2_ctas3", 9, 2, 4, 8, 3, 2, "random"),
    ("m16_nt2_ctas9_conc", 16, 2, 6, 4, 9, 3, "concentrated"),
    ("m13_nt2_ctas6_padding", 13, 2, 4, 8, 6, 4, "padding"),
    ("m12_nt1_ctas11", 12, 1, 6, 4, 11, 7, "random"),
]


@pytest.mark.parametrize("name,m,nt,sgu,sdn,gu_ctas,dn_ctas,routing", CASES,
                         ids=[c[0] for c in CASES])
def test_emulated_small_moe_matches_reference(driver, tmp_path, name, m, nt, sgu, sdn, gu_ctas,
                                              dn_ctas, routing):
    g = torch.Generator().manual_seed(m * 31 + nt)
    w = make_random_moe(E, K, I, seed=m)
    x = torch.randn(m, K, generator=g).to(torch.bfloat16)
    if routing == "concentrated":  # every token on the same TOPK experts: 16-row blocks fill up
        ids = np.tile(np.array([[5, 2, 11, 7]], dtype=np.int32), (m, 1))
    else:
        ids = np.stack([np.random.default_rng(m * 7 + i).choice(E, TOPK, replace=False)
                        for i in range(m)]).astype(np.int32)
        if routing == "padding":  # SGLang's CUDA-graph padding tokens carry -1
            ids[-3:] = -1
            ids[0, 1] = -1
    tw = torch.rand(m, TOPK, generator=g)
    h, y, counters, sorted_ids, used = run_driver(driver, tmp_path, x, w, tw, ids, nt, sgu, sdn,
                                                  gu_ctas, dn_ctas)
    assert (counters == 0).all(), "split tiles' counters must be re-armed"
    h_ref, y_ref = reference(x, w, tw, ids)
    flat = ids.reshape(-1)
    yt = from_bits(y)
    scale = max(float(v.abs().max()) for v in y_ref.values())
    for p in range(flat.size):
        if not 0 <= flat[p] < E:
            assert np.all(y[p] == 0xFFFF), f"pair {p} (padding) was written"
            continue
        err = float((yt[p] - y_ref[p]).abs().max())
        assert err <= 1e-2 * scale, f"pair {p}: max |y - ref| {err:.3g} vs scale {scale:.3g}"
    # h at every real row (row = place of the pair in sorted_ids)
    ht = from_bits(h)
    for row, p in enumerate(sorted_ids.tolist()):
        if p >= flat.size or p not in h_ref:
            continue
        diff = (ht[row] - h_ref[p]).abs()
        tol = 2 * 2.0 ** -7 * h_ref[p].abs().clamp_min(2.0 ** -20)
        assert bool((diff <= tol).all()), f"h row {row} (pair {p}): {float(diff.max()):.3g}"


def test_stream_k_ranges_cover_each_tile_once():
    # the kernel's contributor arithmetic: CTAs c0 .. c1 of a tile, slab 2 c + (first tile? 0 : 1)
    for used, groups, ctas in ((59, 224, 264), (8, 224, 264), (3, 8, 5), (101, 224, 396),
                               (1, 224, 1), (2, 8, 200)):
        work = used * groups
        length = -(-work // ctas)
        seen = {}
        for c in range(ctas):
            start, end = c * length, min(work, c * length + length)
            for pos in range(start, end):
                seen.setdefault(pos // groups, set()).add(c)
        for blk, cs in seen.items():
            c0, c1 = blk * groups // length, ((blk + 1) * groups - 1) // length
            assert cs == set(range(c0, c1 + 1)), (used, groups, ctas, blk)
            slabs = [2 * c + (0 if c * length // groups == blk else 1) for c in cs]
            assert len(set(slabs)) == len(slabs)
