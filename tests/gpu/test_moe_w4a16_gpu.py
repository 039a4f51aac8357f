"""GPU tests of the fused W4A16 MoE kernel at Kimi K2 TP8-rank shapes (384 experts, top-8,
hidden 7168, intermediate 256, int4 group 32).

Tolerances:
* vs the fp32 reference (dequantize, fp32 matmuls): relative Frobenius error <= 1e-2 and
  max |err| <= 3e-2 * max |ref|. The kernel rounds the scaled weights, h, the per-slot outputs and
  the result to bf16 (round to nearest), like SGLang's paths; about 3e-3 relative is expected.
* vs SGLang 0.5.17's own int4 paths on the same weights (Marlin, what the WNA16 scheme runs on
  CUDA, and the Triton ``use_int4_w4a16`` path): relative Frobenius difference <= 1e-2.
* CUDA-graph replay with new routing written into the captured inputs equals an eager call bit for
  bit, and two eager calls are bitwise equal (fixed-order combine, no atomics).

If another test module imported triton in interpreter mode first, these tests skip and
``test_rerun_in_clean_process`` runs this file in a fresh process.
"""
from __future__ import annotations

import dataclasses

from pathlib import Path

import pytest
import torch

from tests.triton_kernels._moe_kernels import lang_mode_matches, load_moe, run_isolated

pytestmark = pytest.mark.gpu

E, H, I, TOPK = 384, 7168, 256, 8
REL_FRO, REL_MAX = 1e-2, 3e-2


def _mode_ok() -> bool:
    load_moe(interpret=False)  # lazily: importing triton at collection would fix its mode
    return lang_mode_matches(interpret=False)


@pytest.fixture(scope="module")
def K():
    # triton.language's own jit functions take the mode of the first `import triton` in a process.
    if not _mode_ok():
        pytest.skip("triton was imported in interpreter mode here; see test_rerun_in_clean_process")
    return load_moe(interpret=False)


@pytest.fixture(scope="module")
def w(K):
    return K.ref.make_random_moe(E, H, I, device="cuda", seed=0)


def routing(m, seed, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(m, E, device=device, generator=g)
    tw, ti = torch.topk(logits.softmax(-1), TOPK)
    return tw.float().contiguous(), ti.to(torch.int32).contiguous(), logits


def ours(K, w, x, tw, ti, scale=1.0, out=None, config=None):
    return K.moe.fused_moe_w4a16(x, w["w13_packed"], w["w13_scale"], w["w2_packed"],
                                 w["w2_scale"], tw, ti, routed_scaling_factor=scale, out=out,
                                 config=config)


def reference(K, w, x, tw, ti, scale=1.0):
    return K.ref.moe_w4a16_reference(x, w["w13_packed"], w["w13_scale"], w["w2_packed"],
                                     w["w2_scale"], tw, ti, scale)


def errors(out, ref):
    d = out.float() - ref
    return (d.norm() / ref.norm()).item(), (d.abs().max() / ref.abs().max()).item()


# (M 2-16: 8-row blocks; M 17-48: 16-row blocks with half_m 1, M 49-128 with half_m 2)
@pytest.mark.parametrize("m", [1, 3, 7, 8, 16, 24, 40, 64, 100, 300, 2048])
def test_kimi_shapes_vs_reference(K, w, m):
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    tw, ti, _ = routing(m, seed=m)
    out = torch.full((m, H), float("nan"), device="cuda", dtype=torch.bfloat16)
    ours(K, w, x, tw, ti, scale=2.827, out=out)
    assert not out.isnan().any(), "unwritten output rows"
    rel, mx = errors(out, reference(K, w, x, tw, ti, 2.827))
    assert rel <= REL_FRO and mx <= REL_MAX, (rel, mx)


def _candidate_configs(K):
    """Every launch config the tuner may pick (scripts/bench_fused_moe.py CANDIDATES)."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_fused_moe.py"
    src = path.read_text()
    # only the candidate tables: the script itself imports kernels under its own name
    start, end = src.index("_GU = {"), src.index("def block_m_candidates")
    ns: dict = {}
    exec(compile(src[start:end], str(path), "exec"), ns)
    for bm, (gus, dns) in ns["CANDIDATES"].items():
        for gu in gus:
            yield K.moe.MoeConfig(bm, K.moe.GemmConfig(*gu), K.moe.GemmConfig(*dns[0]))
        for dn in dns:
            yield K.moe.MoeConfig(bm, K.moe.GemmConfig(*gus[0]), K.moe.GemmConfig(*dn))


def test_every_tuning_candidate_vs_reference(K, w):
    # The tuner may write any candidate into the shipped table: each must be correct.
    m = 96
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    tw, ti, _ = routing(m, seed=11)
    ref = reference(K, w, x, tw, ti, 2.0)
    bad = []
    for cfg in _candidate_configs(K):
        out = K.moe.fused_moe_w4a16(x, w["w13_packed"], w["w13_scale"], w["w2_packed"],
                                    w["w2_scale"], tw, ti, routed_scaling_factor=2.0, config=cfg)
        rel, mx = errors(out, ref)
        if not (rel <= REL_FRO and mx <= REL_MAX):
            bad.append((cfg, rel, mx))
    assert not bad, bad


@pytest.mark.parametrize("m", [2, 8, 16, 40])
def test_two_accumulator_gemms_vs_reference(K, w, m):
    """GemmConfig.par_acc (session 52) in both GEMMs of the table's band for m (every band's
    down is looped), random routing and every token on the same 8 experts: the reference
    within tolerance, and the band as shipped to within a bf16 rounding (only the fp32
    summation orders differ)."""
    table = K.moe.select_config(m)
    par = dataclasses.replace(table, gate_up=dataclasses.replace(table.gate_up, par_acc=1),
                              down=dataclasses.replace(table.down, par_acc=1))
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    tw, ti, _ = routing(m, seed=500 + m)
    shared = torch.tensor([[5, 0, 383, 17, 200, 9, 64, 1]], device="cuda", dtype=torch.int32)
    for ids in (ti, shared.repeat(m, 1).contiguous()):
        out = ours(K, w, x, tw, ids, scale=1.7, config=par)
        rel, mx = errors(out, reference(K, w, x, tw, ids, 1.7))
        assert rel <= REL_FRO and mx <= REL_MAX, (rel, mx)
        one = ours(K, w, x, tw, ids, scale=1.7, config=table)
        d = (out.float() - one.float()).abs().max()
        assert float(d) <= 2.0 ** -7 * float(one.float().abs().max()), float(d)


@pytest.mark.parametrize("m", [2, 8, 16, 40])
def test_scales_once_per_group_equal_bit_for_bit(K, w, m):
    """GemmConfig.scale_once (session 52) in both GEMMs of the table's band for m, alone and
    with par_acc: the same scale values reach the same dequantization, so the same bits."""
    table = K.moe.select_config(m)
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    tw, ti, _ = routing(m, seed=600 + m)
    for par in (0, 1):
        base = dataclasses.replace(table,
                                   gate_up=dataclasses.replace(table.gate_up, par_acc=par),
                                   down=dataclasses.replace(table.down, par_acc=par))
        once = dataclasses.replace(base,
                                   gate_up=dataclasses.replace(base.gate_up, scale_once=1),
                                   down=dataclasses.replace(base.down, scale_once=1))
        assert torch.equal(ours(K, w, x, tw, ti, config=once), ours(K, w, x, tw, ti,
                                                                     config=base))


def test_all_tokens_one_expert_set(K, w):
    # 300 tokens all routed to the same 8 experts: 376 experts idle, 8 with 300 rows each.
    m = 300
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    ti = torch.tensor([[5, 0, 383, 17, 200, 9, 64, 1]], device="cuda", dtype=torch.int32)
    ti = ti.repeat(m, 1).contiguous()
    tw = torch.rand(m, TOPK, device="cuda")
    out = ours(K, w, x, tw, ti)
    rel, mx = errors(out, reference(K, w, x, tw, ti))
    assert rel <= REL_FRO and mx <= REL_MAX, (rel, mx)


@pytest.mark.parametrize("bm", [16, 32, 64])
@pytest.mark.parametrize("m", [9, 17, 40])
def test_half_m_blocks_on_shared_experts(K, w, m, bm):
    """MoeConfig.half_m at Kimi shapes (block_m 16 / 32 / 64, gate-up tiles of the M 9-64 bands
    with and without split-K and the M 17-48 bands' live split, both down kernels; with
    block_m 16 also half_m 2, the gate-up only): every token on the same 8 experts (9 / 17 / 40
    rows each: every tile width) and random routing, against the reference."""
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    same = torch.tensor([[5, 0, 383, 17, 200, 9, 64, 1]], device="cuda", dtype=torch.int32)
    tw_r, ti_r, _ = routing(m, seed=70 + m)
    cases = [(torch.rand(m, TOPK, device="cuda"), same.repeat(m, 1).contiguous()), (tw_r, ti_r)]
    bad = []
    for gu in [(32, 256, 2, 3, 0, 1, 4), (64, 256, 4, 3, 0, 1, 2), (64, 256, 4, 3, 0, 1, 1),
               (64, 256, 4, 3, 0, 1, 4, 512)]:
        for dn, half in [((64, 256, 4, 3, 512), 1), ((64, 256, 4, 3), 1)] + (
                [((64, 256, 4, 3, 512), 2)] if bm == 16 else []):
            cfg = K.moe.MoeConfig(bm, K.moe.GemmConfig(*gu), K.moe.GemmConfig(*dn), half_m=half)
            for tw, ti in cases:
                out = torch.full((m, H), float("nan"), device="cuda", dtype=torch.bfloat16)
                K.moe.fused_moe_w4a16(x, w["w13_packed"], w["w13_scale"], w["w2_packed"],
                                      w["w2_scale"], tw, ti, out=out, config=cfg)
                rel, mx = errors(out, reference(K, w, x, tw, ti))
                if out.isnan().any() or not (rel <= REL_FRO and mx <= REL_MAX):
                    bad.append((gu, dn, half, rel, mx))
    assert not bad, bad


def test_padding_ids(K, w):
    # CUDA-graph padding tokens carry topk id -1 in SGLang: they must contribute nothing.
    m = 40
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    tw, ti, _ = routing(m, seed=3)
    ti[30:] = -1
    out = ours(K, w, x, tw, ti)
    assert (out[30:] == 0).all()
    rel, mx = errors(out[:30], reference(K, w, x, tw, ti)[:30])
    assert rel <= REL_FRO and mx <= REL_MAX, (rel, mx)


def few_or_random(m, seed, few):
    """Routing of m tokens: top-8 of random logits, or (few) every token's top 8 among the same
    8 experts (SGLang's dummy fill)."""
    tw, ti, _ = routing(m, seed)
    if few:
        ti = torch.randperm(E, device="cuda")[:TOPK].to(torch.int32).repeat(m, 1)
    return tw, ti.contiguous()


def replays(graph, x, tw, ti, n, seed0):
    """Replay ``graph`` n times, each with fresh x and routing (few experts on even replays)
    written into its captured inputs; yields (replay, routing weights, routing ids)."""
    for i in range(n):
        tw2, ti2 = few_or_random(x.shape[0], seed0 + i, few=i % 2 == 0)
        tw.copy_(tw2)
        ti.copy_(ti2)
        x.normal_()
        graph.replay()
        torch.cuda.synchronize()
        yield i, tw2, ti2


def captured(K, w, x, tw, ti, out, config=None):
    """A CUDA graph of one call writing ``out`` (after a warm-up call on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ours(K, w, x, tw, ti, out=out, config=config)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ours(K, w, x, tw, ti, out=out, config=config)
    return graph


def test_graph_replay_and_determinism(K, w):
    m = 48
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    tw, ti, _ = routing(m, seed=1)
    first = ours(K, w, x, tw, ti).clone()
    assert torch.equal(first, ours(K, w, x, tw, ti))
    out = torch.empty_like(first)
    graph = captured(K, w, x, tw, ti, out)
    tw2, ti2, _ = routing(m, seed=2)
    tw.copy_(tw2)
    ti.copy_(ti2)
    x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ours(K, w, x, tw2, ti2))


@pytest.mark.parametrize("m", [1, 8, 16, 64, 255, 256, 300, 1024, 2048])
@pytest.mark.parametrize("few", [False, True])
def test_two_pass_grouping_equals_one_launch(K, w, m, few, monkeypatch):
    """moe_align's two-launch grouping and its one-program grouping (a histogram and a sort;
    up to 1,024 pairs, M = 128, when forced) give the one-launch kernel's sorted ids, labels
    and x copy bit for bit on the GPU (tl.sort, the chunk histograms, the barriers, tl.gather),
    and the whole call is equal each way, eager and replayed from a CUDA graph with new
    routing (few experts on even replays)."""
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    tw, ti = few_or_random(m, seed=m, few=few)
    bm = K.moe.select_config(m).block_m
    one = K.moe.moe_align(ti, E, bm, x, 256, method="one")
    used = int(one[1][-1]) * bm
    for method, warps in (("two", 4), ("two", 1), ("one", 1), ("one", 2), ("small", 4),
                          ("small", 8)):
        two = K.moe.moe_align(ti, E, bm, x, 256, method=method, warps=warps)
        assert torch.equal(one[0][:used], two[0][:used]), (method, warps)
        assert torch.equal(one[1], two[1]) and torch.equal(one[2], two[2]), (method, warps)
    for method in ("two", "small"):
        monkeypatch.setenv(K.moe.ALIGN_ENV, "one")  # (replays leave new routing in x, tw, ti)
        want = ours(K, w, x, tw, ti).clone()
        monkeypatch.setenv(K.moe.ALIGN_ENV, method)
        assert torch.equal(ours(K, w, x, tw, ti), want), method
        replays_match_eager(K, w, x, tw, ti, want, monkeypatch, K.moe.ALIGN_ENV, method, "one",
                            seed0=m + 100)


def replays_match_eager(K, w, x, tw, ti, like, monkeypatch, var, value, eager, seed0):
    """A CUDA graph of one call captured with ``var`` = ``value``, replayed twice with new
    inputs (few experts on even replays); each replay equals, bit for bit, an eager call with
    ``var`` = ``eager``. Leaves ``var`` = ``value`` and the last replay's inputs in x, tw, ti."""
    monkeypatch.setenv(var, value)
    out = torch.empty_like(like)
    graph = captured(K, w, x, tw, ti, out)
    for _, tw2, ti2 in replays(graph, x, tw, ti, 2, seed0=seed0):
        monkeypatch.setenv(var, eager)
        assert torch.equal(out, ours(K, w, x, tw2, ti2)), (var, value)
        monkeypatch.setenv(var, value)


@pytest.mark.parametrize("m", [1, 8, 16, 64, 2048])
@pytest.mark.parametrize("few", [False, True])
def test_pdl_modes_equal_plain_launches(K, w, m, few, monkeypatch):
    """Programmatic dependent launch (moe_pdl: waits only, every early release, the default,
    the loads before the wait) gives the plain launches' bits, eager (twice, back to back: a
    call's grouping may start while the last one's combine ends) and replayed from a CUDA
    graph with new routing (few experts on even replays), with the split-K reduce launch too
    (M 1-16 split on few experts)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90+")
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    tw, ti = few_or_random(m, seed=m, few=few)
    monkeypatch.setenv(K.moe.PDL_ENV, "0")
    want = ours(K, w, x, tw, ti).clone()
    # ("": unset, the default: 1:gd on sm_90+; e / c: loads before the wait)
    for mode in ("1", "2", "1:gd", "", "1:gdec", "1:c", "2:e"):
        monkeypatch.setenv(K.moe.PDL_ENV, mode)
        a, b = ours(K, w, x, tw, ti), ours(K, w, x, tw, ti)
        assert torch.equal(a, want) and torch.equal(b, want), mode
        monkeypatch.setenv(K.moe.SERIAL_REDUCE_ENV, "0")  # the reduce launch where split
        assert torch.equal(ours(K, w, x, tw, ti), want), (mode, "reduce")
        monkeypatch.delenv(K.moe.SERIAL_REDUCE_ENV)
        replays_match_eager(K, w, x, tw, ti, want, monkeypatch, K.moe.PDL_ENV, mode, "0",
                            seed0=m + 200)
        monkeypatch.setenv(K.moe.PDL_ENV, "0")  # (the replays left new inputs: new bits)
        want = ours(K, w, x, tw, ti).clone()


@pytest.mark.parametrize("m", [1, 2, 8, 16])
@pytest.mark.parametrize("few", [False, True])
def test_gate_up_rows_in_one_round_change_no_bit(K, w, m, few):
    """MoeConfig.early_rows (the gate-up's block expert and row ids in one round of loads,
    every candidate split's under a live split) on the band of M, and off: the same bits,
    eager and replayed from a CUDA graph with new routing (few experts on even replays: other
    splits)."""
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    tw, ti = few_or_random(m, seed=m + 60, few=few)
    band = K.moe.select_config(m)
    on, off = (dataclasses.replace(band, early_rows=r) for r in (1, 0))
    want = ours(K, w, x, tw, ti, config=off)
    assert torch.equal(ours(K, w, x, tw, ti, config=on), want)
    out = torch.empty_like(want)
    graph = captured(K, w, x, tw, ti, out, config=on)
    for _, tw2, ti2 in replays(graph, x, tw, ti, 2, seed0=m + 400):
        assert torch.equal(out, ours(K, w, x, tw2, ti2, config=off))


@pytest.mark.parametrize("m", [1, 8, 64, 512])
def test_combine_shapes_equal_bit_for_bit(K, m):
    """Every combine launch shape the benchmark times gives the default shape's bits (slot
    order, fp32), with padding slots (-1) left out."""
    g = torch.Generator(device="cuda").manual_seed(m)
    y = torch.randn(m * TOPK, H, device="cuda", dtype=torch.bfloat16, generator=g)
    _, ti = few_or_random(m, seed=m, few=False)
    ti[0, -1] = -1
    want = K.moe.combine(y, ti, torch.empty(m, H, device="cuda", dtype=torch.bfloat16), 2.827,
                         E, K.moe.COMBINE_DEFAULT)
    for shape in [(1024, 4), (512, 2), (256, 2), (2048, 8), (256, 1)]:
        got = K.moe.combine(y, ti, torch.empty_like(want), 2.827, E, shape)
        assert torch.equal(got, want), shape


@pytest.mark.parametrize("m", [1, 2, 4, 9, 16, 17, 33, 64])
def test_serial_split_k_equals_two_launches(K, w, m, monkeypatch):
    """Split-K gate-up summed by each tile's last program (the served path) equals the reduce
    kernel's launch bit for bit, eager and over 20 CUDA-graph replays with fresh routing on few
    experts and on many, and leaves every arrival counter at 0."""
    moe = K.moe
    cfg = moe.select_config(m)
    assert cfg.gate_up.split_k > 1, cfg  # the table splits K at every M here
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)

    def two_launch(tw, ti):
        monkeypatch.setenv(moe.SERIAL_REDUCE_ENV, "0")
        try:
            return ours(K, w, x, tw, ti).clone()
        finally:
            monkeypatch.setenv(moe.SERIAL_REDUCE_ENV, "1")

    tw, ti = few_or_random(m, 10, few=True)
    eager = ours(K, w, x, tw, ti)
    assert torch.equal(eager, two_launch(tw, ti))
    out = torch.empty_like(eager)
    graph = captured(K, w, x, tw, ti, out)
    for i, tw2, ti2 in replays(graph, x, tw, ti, 20, 100):
        assert torch.equal(out, two_launch(tw2, ti2)), f"replay {i}"
    counters = moe._counters[("cuda", torch.cuda.current_device())]
    assert int(counters.abs().sum()) == 0


@pytest.mark.parametrize("m", [9, 12, 16, 17, 24, 40])
@pytest.mark.parametrize("half", [1, 2])
def test_wide_halves_vs_reference_and_serial(K, w, m, half, monkeypatch):
    """MoeConfig.wide_halves (session 53) on 16-row half_m blocks with the M 9-48 bands' gate-up
    tile (64 x 256, 4 warps, live split 4 / 512; half 2: the down on full blocks): every token
    on the same 8 experts (9-40 rows each: full blocks as two half-width tiles, then a narrowed
    one) and random routing, against the reference and the same config without wide_halves;
    split-K summed by each tile's last program equal to the reduce kernel bit for bit, eager and
    over 20 CUDA-graph replays on few and many experts (the two half-width tiles of a block
    count in on their own counters, which end at 0)."""
    moe = K.moe
    down = moe.select_config(32).down
    cfg = moe.MoeConfig(16, moe.GemmConfig(64, 256, 4, 3, 0, 1, 4, 512), down, half_m=half,
                        wide_halves=1)
    plain = dataclasses.replace(cfg, wide_halves=0)
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    same = torch.tensor([[5, 0, 383, 17, 200, 9, 64, 1]], device="cuda", dtype=torch.int32)
    tw_r, ti_r, _ = routing(m, seed=90 + m)
    for tw, ti in ((torch.rand(m, TOPK, device="cuda"), same.repeat(m, 1).contiguous()),
                   (tw_r, ti_r)):
        out = ours(K, w, x, tw, ti, scale=1.3, config=cfg)
        rel, mx = errors(out, reference(K, w, x, tw, ti, 1.3))
        assert rel <= REL_FRO and mx <= REL_MAX, (rel, mx)
        ref2 = ours(K, w, x, tw, ti, scale=1.3, config=plain)
        assert float((out.float() - ref2.float()).abs().max()) <= (
            2.0 ** -7 * float(ref2.float().abs().max()))

    def two_launch(tw, ti):
        monkeypatch.setenv(moe.SERIAL_REDUCE_ENV, "0")
        try:
            return ours(K, w, x, tw, ti, config=cfg).clone()
        finally:
            monkeypatch.setenv(moe.SERIAL_REDUCE_ENV, "1")

    monkeypatch.setenv(moe.SERIAL_REDUCE_ENV, "1")
    tw, ti = few_or_random(m, 10, few=True)
    eager = ours(K, w, x, tw, ti, config=cfg)
    assert torch.equal(eager, two_launch(tw, ti))
    out = torch.empty_like(eager)
    graph = captured(K, w, x, tw, ti, out, config=cfg)
    for i, tw2, ti2 in replays(graph, x, tw, ti, 20, 200):
        assert torch.equal(out, two_launch(tw2, ti2)), f"replay {i}"
    counters = moe._counters[("cuda", torch.cuda.current_device())]
    assert int(counters.abs().sum()) == 0
    # GemmConfig.max_regs 128 (4 programs an SM instead of 3): ptxas's limit, the same bits
    limited = dataclasses.replace(cfg, gate_up=dataclasses.replace(cfg.gate_up, max_regs=128))
    assert torch.equal(ours(K, w, x, tw, ti, config=limited), ours(K, w, x, tw, ti, config=cfg))


def _graph_equals_fixed(K, w, x, live, fixed, seed, seed0):
    """One call with the ``live`` config captured on 8 shared experts, replayed 8 times on
    alternating routings (``replays``, from ``seed0``): every replay equals, bit for bit,
    ``fixed(tw, ti)[0]`` (an eager call with the fixed choice the host rule names) and the
    reference within tolerance. Returns the choices (``fixed(tw, ti)[1]``) the replays took."""
    m = x.shape[0]
    tw, ti = few_or_random(m, seed, few=True)
    out = torch.empty(m, H, device="cuda", dtype=torch.bfloat16)
    graph = captured(K, w, x, tw, ti, out, config=live)
    seen = set()
    for i, tw2, ti2 in replays(graph, x, tw, ti, 8, seed0):
        want, choice = fixed(tw2, ti2)
        seen.add(choice)
        assert torch.equal(out, want), f"replay {i}, choice {choice}"
        rel, mx = errors(out, reference(K, w, x, tw2, ti2))
        assert rel <= REL_FRO and mx <= REL_MAX, (rel, mx)
    return seen


@pytest.mark.parametrize("m", [1, 8, 9, 17, 33, 64])
@pytest.mark.parametrize("serial", ["1", "0"])
def test_live_split_follows_the_routing_in_one_graph(K, w, m, serial, monkeypatch):
    """One captured graph with a live split (at most 8 / 4 splits, target 256 programs) takes
    each replay's own split: on 8 shared experts a deep one, on random routing little or none.
    Every replay equals, bit for bit, an eager call with the fixed split the host rule names
    for that routing's block count, in one launch and with the reduce kernel."""
    moe = K.moe
    monkeypatch.setenv(moe.SERIAL_REDUCE_ENV, serial)
    table = moe.select_config(m)
    base = table.gate_up
    split_k = 8 if base.block_k == 128 else 4
    live = moe.MoeConfig(table.block_m, moe.GemmConfig(
        base.block_n, base.block_k, base.num_warps, base.num_stages, 0, base.split_dq, split_k,
        256), table.down)
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)

    def fixed(tw, ti):
        blocks = int(moe.moe_align(ti, E, table.block_m)[1][-1])
        split = moe.live_split(blocks, I // base.block_n, H // base.block_k, split_k, 256)
        cfg = moe.MoeConfig(table.block_m, moe.GemmConfig(
            base.block_n, base.block_k, base.num_warps, base.num_stages, 0, base.split_dq,
            split), table.down)
        return ours(K, w, x, tw, ti, config=cfg).clone(), split

    splits = _graph_equals_fixed(K, w, x, live, fixed, 20, 200)
    if m >= 8:
        assert len(splits) > 1, splits  # the graph took more than one split
    if serial == "1":
        assert int(moe._counters[("cuda", torch.cuda.current_device())].abs().sum()) == 0


@pytest.mark.parametrize("m", [1, 8, 16, 32, 64])
@pytest.mark.parametrize("target", [896, 1792])
def test_live_down_follows_the_routing_in_one_graph(K, w, m, target):
    """One captured graph whose looped down has a live column range (the band's down tile,
    split_target ``target``) takes each replay's own range: on 8 shared experts short ranges,
    on random routing the band's own. Every replay equals, bit for bit, an eager call with the
    fixed range the host rule names for that routing's block count."""
    moe = K.moe
    table = moe.select_config(m)
    base = table.down if table.down.n_per_cta else moe.GemmConfig(64, 256, 4, 3, 512)
    steps = base.n_per_cta // base.block_n
    live = dataclasses.replace(table, down=dataclasses.replace(base, split_target=target))
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)

    def fixed(tw, ti):
        blocks = int(moe.moe_align(ti, E, table.block_m)[1][-1])
        parts = moe.live_split(blocks, H // base.n_per_cta, steps, steps, target)
        cfg = dataclasses.replace(table, down=dataclasses.replace(
            base, n_per_cta=base.n_per_cta // parts, split_target=0))  # (the band's may be live)
        return ours(K, w, x, tw, ti, config=cfg).clone(), parts

    seen = _graph_equals_fixed(K, w, x, live, fixed, 40, 500)
    if m >= 8:
        assert len(seen) > 1, seen  # the graph took more than one range


def _sglang_or_skip():
    try:
        # Through the scheme module: importing gptq_kernels first hits a circular import.
        from sglang.srt.layers.quantization.compressed_tensors.schemes import (
            compressed_tensors_wNa16_moe as wna16)
        from sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe import fused_marlin_moe
    except Exception as exc:  # SGLang or its CUDA kernels not installed here
        pytest.skip(f"SGLang int4 MoE path not importable: {exc!r}")
    return (wna16.gptq_marlin_moe_repack, fused_marlin_moe, wna16.marlin_make_workspace,
            wna16.marlin_moe_permute_scales)


@pytest.mark.parametrize("m", [7, 300])
def test_vs_sglang_marlin(K, w, m):
    repack, fused_marlin_moe, make_workspace, permute_scales = _sglang_or_skip()
    empty = torch.empty((E, 0), dtype=torch.int32, device="cuda")
    # The same conversion as CompressedTensorsWNA16MoE.process_weights_after_loading.
    w1 = repack(w["w13_packed"], empty, H, 2 * I, 4)
    w2 = repack(w["w2_packed"], empty, I, H, 4)
    s1 = permute_scales(w["w13_scale"], H, 2 * I, 32)
    s2 = permute_scales(w["w2_scale"], I, H, 32)
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    tw, ti, logits = routing(m, seed=10 + m)
    theirs = fused_marlin_moe(x, w1, w2, s1, s2, logits, tw, ti, g_idx1=empty, g_idx2=empty,
                              sort_indices1=empty, sort_indices2=empty, num_bits=4,
                              is_k_full=True, workspace=make_workspace(x.device, 4),
                              routed_scaling_factor=2.827)
    mine = ours(K, w, x, tw, ti, scale=2.827)
    rel, _ = errors(mine, theirs.float())
    assert rel <= REL_FRO, rel


def test_vs_sglang_triton_int4(K, w):
    try:
        from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
        from sglang.srt.layers.moe.moe_runner.triton_utils import fused_experts
        from sglang.srt.layers.moe.topk import StandardTopKOutput
    except Exception as exc:
        pytest.skip(f"SGLang Triton MoE path not importable: {exc!r}")
    from sglang_ddtree.compat._common import ensure_runtime_context

    # SGLang's Triton MoE reads its published config (get_exec()); any local model config will do
    ensure_runtime_context(str(Path(__file__).resolve().parent / "models" / "mla-moe-target"))
    m = 64
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    tw, ti, logits = routing(m, seed=5)
    cfg = MoeRunnerConfig(num_experts=E, num_local_experts=E, hidden_size=H,
                          intermediate_size_per_partition=I, top_k=TOPK,
                          params_dtype=torch.bfloat16, activation="silu", inplace=True)
    # CompressedTensorsWNA16TritonMoE.process_weights_after_loading's conversion. In place (on
    # a copy of x): 0.5.17's out-of-place path asks for the tensor-parallel group (to place its
    # output in symmetric memory), which a process without a server does not have.
    theirs = fused_experts(
        x.clone(), w["w13_packed"].transpose(1, 2).contiguous().view(torch.uint8),
        w["w2_packed"].transpose(1, 2).contiguous().view(torch.uint8),
        StandardTopKOutput(tw, ti, logits), cfg, use_int4_w4a16=True,
        w1_scale=w["w13_scale"].transpose(1, 2).contiguous(),
        w2_scale=w["w2_scale"].transpose(1, 2).contiguous(), block_shape=[0, 32])
    rel, _ = errors(ours(K, w, x, tw, ti), theirs.float())
    assert rel <= REL_FRO, rel


def test_rerun_in_clean_process():
    if _mode_ok():
        pytest.skip("ran in this process")
    run_isolated(__file__, interpret=False)
