"""GPU tests of the small-M MoE path (``SGLANG_DDTREE_MOE_SMALL``: the gate-up and down GEMMs on
the CUDA kernels of ``cuda_ext/moe_w4a16_small.cuh``) at Kimi K2 TP8-rank shapes.

Tolerances: as ``test_moe_w4a16_gpu.py`` against the fp32 reference (relative Frobenius <= 1e-2,
max <= 3e-2 of max |ref|); against the Triton path, which has the same rounding points,
relative Frobenius <= 5e-3 (only the fp32 summation order differs). CUDA-graph replays with new
routing equal eager calls bit for bit; two eager calls are bitwise equal (the split-K fix-up sums
in CTA order).
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu.test_moe_w4a16_gpu import (E, H, I, REL_FRO, REL_MAX, TOPK, captured, errors,
                                          few_or_random, ours, reference, replays, routing)
from tests.gpu.test_moe_w4a16_gpu import K as K  # noqa: F401  (fixture)
from tests.gpu.test_moe_w4a16_gpu import w as w  # noqa: F401  (fixture)
from tests.triton_kernels._moe_kernels import lang_mode_matches, load_moe, run_isolated

pytestmark = pytest.mark.gpu
SMALL = "SGLANG_DDTREE_MOE_SMALL"
CFG = "SGLANG_DDTREE_MOE_SMALL_CFG"


@pytest.fixture(autouse=True)
def small_on(monkeypatch):
    monkeypatch.setenv(SMALL, "64")
    monkeypatch.delenv(CFG, raising=False)


def triton_path(K, w, x, tw, ti, monkeypatch, scale=1.0):
    monkeypatch.setenv(SMALL, "0")
    try:
        return ours(K, w, x, tw, ti, scale=scale)
    finally:
        monkeypatch.setenv(SMALL, "64")


def test_library_builds_and_kernels_fit(K):
    small = K.moe._small
    assert small.library() is not None, small._loader().unavailable_reason()
    probe = small._loader().moe_probe(torch.cuda.current_device())
    print({f"{k[0]}_nt{k[1]}_u{k[2]}": v for k, v in probe.items()})
    # (registers, spill bytes, CTAs per SM) of the kernels the default settings launch
    for m in (8, 16):
        cfg = small.config_for(m)
        for key in (("gate_up", cfg.n_tiles, cfg.stages_gate_up),
                    ("down", cfg.n_tiles, cfg.stages_down)):
            regs, spill, occ, smem = probe[key]
            assert spill == 0 and occ >= 2, (key, probe[key])


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 12, 16, 24, 32, 64])
@pytest.mark.parametrize("route", ["random", "few"])
def test_small_vs_reference_and_triton(K, w, m, route, monkeypatch):
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    tw, ti = few_or_random(m, seed=m, few=route == "few")
    out = torch.full((m, H), float("nan"), device="cuda", dtype=torch.bfloat16)
    ours(K, w, x, tw, ti, scale=2.827, out=out)
    assert not out.isnan().any(), "unwritten output rows"
    rel, mx = errors(out, reference(K, w, x, tw, ti, 2.827))
    assert rel <= REL_FRO and mx <= REL_MAX, (rel, mx)
    tri = triton_path(K, w, x, tw, ti, monkeypatch, scale=2.827)
    d = (out.float() - tri.float()).norm() / tri.float().norm()
    assert d <= 5e-3, f"vs the Triton path: {d:.3g}"


CONFIGS = ["nt=1,s=4", "nt=1,s=6", "nt=1,s=8", "nt=2,s=4", "nt=1,ds=4", "nt=1,ds=8",
           "nt=2,ds=4", "nt=2,ds=6", "dw=2", "dw=5"]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_every_setting_vs_reference(K, w, cfg, monkeypatch):
    monkeypatch.setenv(CFG, cfg)
    for m, few in ((1, False), (8, False), (8, True), (16, False), (16, True)):
        x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
        tw, ti = few_or_random(m, seed=m + 5, few=few)
        out = ours(K, w, x, tw, ti)
        rel, mx = errors(out, reference(K, w, x, tw, ti))
        assert rel <= REL_FRO and mx <= REL_MAX, (cfg, m, few, rel, mx)


def test_padding_ids_and_bf16_weights(K, w):
    m = 12
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    tw, ti, _ = routing(m, seed=3)
    ti[9:] = -1
    ti[0, 3] = -1
    out = ours(K, w, x, tw.to(torch.bfloat16), ti)
    assert (out[9:] == 0).all()
    rel, mx = errors(out[:9], reference(K, w, x, tw.to(torch.bfloat16), ti)[:9])
    assert rel <= REL_FRO and mx <= REL_MAX, (rel, mx)


def test_strided_rows(K, w):
    m = 6
    big = torch.randn(m, H + 64, device="cuda", dtype=torch.bfloat16)
    x = big[:, :H]
    tw, ti, _ = routing(m, seed=4)
    out = ours(K, w, x, tw, ti)
    assert torch.equal(out, ours(K, w, x.contiguous(), tw, ti))


@pytest.mark.parametrize("m", [4, 8, 16])
def test_graph_replays_equal_eager(K, w, m):
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    tw, ti, _ = routing(m, seed=1)
    first = ours(K, w, x, tw, ti).clone()
    assert torch.equal(first, ours(K, w, x, tw, ti))
    out = torch.empty_like(first)
    graph = captured(K, w, x, tw, ti, out)
    for i, tw2, ti2 in replays(graph, x, tw, ti, 12, 300 + m):
        assert torch.equal(out, ours(K, w, x, tw2, ti2)), f"replay {i}"


def test_rerun_in_clean_process():
    load_moe(interpret=False)
    if lang_mode_matches(interpret=False):
        pytest.skip("ran in this process")
    run_isolated(__file__, interpret=False)
