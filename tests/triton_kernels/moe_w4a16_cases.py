"""CPU cases (Triton interpreter) of the fused W4A16 MoE kernel against the fp32 reference.

Run by tests/triton_kernels/test_moe_w4a16.py in a fresh process with ``TRITON_INTERPRET=1``
(directly: ``TRITON_INTERPRET=1 pytest tests/triton_kernels/moe_w4a16_cases.py``).

Tolerance vs the fp32 reference (dequantize, fp32 matmuls): relative Frobenius error <= 2e-2 and
max |err| <= 3e-2 * max |ref|. Under the interpreter the weights stay fp32 and the dots run in
fp32, so the error is the three bf16 roundings (h, per-slot y, output), which the interpreter does
by truncation (up to 2^-7 relative each, biased): about 1e-2 is typical. A wrong scale group, nibble,
expert or token gives errors of order 1. Outputs are poisoned with NaN to catch unwritten rows.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.triton_kernels._moe_kernels import load_moe

K = load_moe(interpret=True)
MOE, REF = K.moe, K.ref
REL_FRO, REL_MAX = 2e-2, 3e-2

# Tiny shapes that still exercise 2 K tiles in gate-up (hidden 256, block_k 128), 2 N tiles in
# gate-up (intermediate 128, block_n 64) and 4 N tiles in down (block_n 64).
H, I = 256, 128
CFG = MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1), MOE.GemmConfig(64, 128, 4, 1))
# Gate-up with the dequant in two halves (SPLIT_DQ).
CFG_SPLIT = MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1, 0, 1), MOE.GemmConfig(64, 128, 4, 1))
# Gate-up split over K in 2 programs per tile, plus the reduce kernel.
CFG_SPLITK = MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1, 0, 0, 2),
                           MOE.GemmConfig(64, 128, 4, 1, 128))
# The down GEMM as one loop per program (_down_loop_kernel): 2 programs per block, 2 column steps.
CFG_LOOP = MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1), MOE.GemmConfig(64, 128, 4, 1, 128))
# One-warp 16-column gate-up tiles with the split dequant (the tuner's n16* candidates): 16 N tiles.
CFG_N16 = MOE.MoeConfig(16, MOE.GemmConfig(16, 128, 1, 1, 0, 1), MOE.GemmConfig(64, 128, 4, 1))
# 32-row blocks that run as 16-row tiles while their second half is padding (HALF_M), with
# the per-tile down kernel, the looped one, and split-K gate-up.
CFG_HALF = MOE.MoeConfig(32, MOE.GemmConfig(64, 128, 4, 1), MOE.GemmConfig(64, 128, 4, 1),
                         half_m=1)
CFG_HALF_LOOP = MOE.MoeConfig(32, MOE.GemmConfig(64, 128, 4, 1),
                              MOE.GemmConfig(64, 128, 4, 1, 128), half_m=1)
CFG_HALF_SPLITK = MOE.MoeConfig(32, MOE.GemmConfig(64, 128, 4, 1, 0, 0, 2),
                                MOE.GemmConfig(64, 128, 4, 1), half_m=1)
# 16-row blocks narrowed to 8 rows (session 46): looped down; and half_m 2 (the gate-up only)
# with a live split-K gate-up
CFG_HALF16_LOOP = MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1),
                                MOE.GemmConfig(64, 128, 4, 1, 128), half_m=1)
CFG_HALF16_GU_LIVE = MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1, 0, 1, 2, 8),
                                   MOE.GemmConfig(64, 128, 4, 1, 128), half_m=2)
# wide_halves (session 53): a full 16- or 32-row block's gate-up as two half-width tiles
# (block_n 64 -> 32 columns), with a looped down, with half_m 2 and a live split, with a fixed
# split on 32-row blocks
CFG_WIDE16_LOOP = MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1),
                                MOE.GemmConfig(64, 128, 4, 1, 128), half_m=1, wide_halves=1)
CFG_WIDE16_GU_LIVE = MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1, 0, 1, 2, 8),
                                   MOE.GemmConfig(64, 128, 4, 1, 128), half_m=2, wide_halves=1)
CFG_WIDE32_SPLITK = MOE.MoeConfig(32, MOE.GemmConfig(64, 128, 4, 1, 0, 0, 2),
                                  MOE.GemmConfig(64, 128, 4, 1), half_m=1, wide_halves=1)
# 64-row blocks narrowed to 32 or 16 rows
CFG_HALF64 = MOE.MoeConfig(64, MOE.GemmConfig(64, 128, 4, 1), MOE.GemmConfig(64, 128, 4, 1),
                           half_m=1)
CFG_HALF64_LOOP_SPLITK = MOE.MoeConfig(64, MOE.GemmConfig(64, 128, 4, 1, 0, 1, 2),
                                       MOE.GemmConfig(64, 128, 4, 1, 128), half_m=1)


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def experts():
    return {e: REF.make_random_moe(e, H, I, seed=e) for e in (4, 9)}


def check(out, ref):
    assert not out.isnan().any(), "unwritten output rows (NaN poison survived)"
    d = out.float() - ref
    rel = (d.norm() / ref.norm()).item()
    mx = (d.abs().max() / ref.abs().max()).item()
    assert rel <= REL_FRO and mx <= REL_MAX, f"rel fro {rel:.3e}, rel max {mx:.3e}"


def run(w, x, tw, ti, scale=1.0, cfg=CFG):
    out = torch.full((x.shape[0], H), float("nan"), dtype=torch.bfloat16)
    got = MOE.fused_moe_w4a16(x, w["w13_packed"], w["w13_scale"], w["w2_packed"], w["w2_scale"],
                              tw, ti, routed_scaling_factor=scale, out=out, config=cfg)
    assert got is out
    ref = REF.moe_w4a16_reference(x, w["w13_packed"], w["w13_scale"], w["w2_packed"],
                                  w["w2_scale"], tw, ti, scale)
    return out, ref


def random_routing(m, e, topk, seed, id_dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    probs = torch.randn(m, e, generator=g).softmax(-1)
    tw, ti = torch.topk(probs, topk)
    return tw.contiguous(), ti.to(id_dtype).contiguous()


@pytest.mark.parametrize("m,e,topk,id_dtype", [
    (1, 4, 2, torch.int32),
    (7, 9, 3, torch.int64),
    (64, 9, 2, torch.int32),  # several blocks per expert
])
def test_matches_reference(experts, m, e, topk, id_dtype):
    x = torch.randn(m, H, generator=torch.Generator().manual_seed(m)).bfloat16()
    tw, ti = random_routing(m, e, topk, seed=100 + m, id_dtype=id_dtype)
    check(*run(experts[e], x, tw, ti, scale=2.5))


@pytest.mark.parametrize("m", [1, 40])
def test_down_loop_kernel_matches_reference(experts, m):
    x = torch.randn(m, H, generator=torch.Generator().manual_seed(m)).bfloat16()
    tw, ti = random_routing(m, 9, 3, seed=200 + m)
    ti[-1, 0] = -1  # a dropped slot: its y row is never written nor read
    out, ref = run(experts[9], x, tw, ti, scale=1.5, cfg=CFG_LOOP)
    check(out, ref)
    plain, _ = run(experts[9], x, tw, ti, scale=1.5)
    assert torch.equal(out, plain), "loop and per-tile down kernels must round identically"


def test_split_dequant_matches_reference():
    w = REF.make_random_moe(9, H, I, seed=3)
    x = torch.randn(20, H, generator=torch.Generator().manual_seed(20)).bfloat16()
    tw, ti = random_routing(20, 9, 3, seed=21)
    out, ref = run(w, x, tw, ti, cfg=CFG_SPLIT)
    check(out, ref)
    plain, _ = run(w, x, tw, ti)
    assert torch.equal(out, plain)


def assert_rounding_close(a, b):
    """Equal up to a bf16 rounding of an intermediate (h or a slot's y: 2^-8 relative, carried
    into the output) against the largest output: far below a wrong row, nibble or scale."""
    d = (a.float() - b.float()).abs().max()
    assert float(d) <= 2.0 ** -8 * float(b.float().abs().max()), float(d)


# 8-row expert blocks (session 45: the M = 8 and 9-16 bands), with the shipped bands' kinds of
# gate-up (two-half dequant, fixed and live K splits) and the looped down kernel
CFG_BM8 = MOE.MoeConfig(8, MOE.GemmConfig(32, 128, 2, 1, 0, 1, 2), MOE.GemmConfig(64, 128, 4, 1, 128))
CFG_BM8_LIVE = MOE.MoeConfig(8, MOE.GemmConfig(64, 128, 4, 1, 0, 1, 2, 8),
                             MOE.GemmConfig(64, 128, 4, 1, 128))


@pytest.mark.parametrize("cfg", [CFG_BM8, CFG_BM8_LIVE], ids=["split2", "live"])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_8_row_blocks_match_the_reference_and_16_row_blocks(experts, cfg, m, monkeypatch):
    """Experts with 1-8 rows (one block), more than 8 (several blocks, the last part padding),
    none, and a dropped slot: the reference within tolerance, and the same K split with 16-row
    blocks to within bf16 rounding (the same products; on the GPU one m16n8k16 per 8 rows
    either way, but the interpreter's numpy matmuls may order a sum by the operand shape)."""
    x = torch.randn(m, H, generator=torch.Generator().manual_seed(60 + m)).bfloat16()
    tw, ti = random_routing(m, 9, 3, seed=61 + m)
    if m == 40:
        ti[:20] = torch.tensor([0, 1, 2])  # 20 rows on each of 3 experts: 3 blocks of 8
    ti[0, 1] = -1
    out, ref = run(experts[9], x, tw, ti, scale=1.3, cfg=cfg)
    check(out, ref)
    sixteen, _ = run(experts[9], x, tw, ti, scale=1.3, cfg=dataclasses.replace(cfg, block_m=16))
    if not cfg.gate_up.split_target:  # (a live split follows the used-block count)
        assert_rounding_close(out, sixteen)


# par_acc (session 52): planes 0-3 and 4-7 of each K step summed into separate accumulators
@pytest.mark.parametrize("cfg", [
    MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1, 0, 0, 1, 0, 1), MOE.GemmConfig(64, 128, 4, 1)),
    dataclasses.replace(CFG_BM8, gate_up=dataclasses.replace(CFG_BM8.gate_up, par_acc=1)),
    dataclasses.replace(CFG_BM8_LIVE, gate_up=dataclasses.replace(CFG_BM8_LIVE.gate_up,
                                                                  par_acc=1)),
], ids=["one_half", "bm8_split2", "bm8_live"])
@pytest.mark.parametrize("m", [1, 40])
def test_two_accumulators_match_the_reference_and_one(experts, cfg, m):
    """The reference within tolerance, and the one-accumulator gate-up (same tiles, same
    splits) to within bf16 rounding: only the fp32 summation order differs."""
    x = torch.randn(m, H, generator=torch.Generator().manual_seed(70 + m)).bfloat16()
    tw, ti = random_routing(m, 9, 3, seed=71 + m)
    if m == 40:
        ti[:20] = torch.tensor([0, 1, 2])
    ti[0, 1] = -1
    out, ref = run(experts[9], x, tw, ti, scale=1.1, cfg=cfg)
    check(out, ref)
    one, _ = run(experts[9], x, tw, ti, scale=1.1,
                 cfg=dataclasses.replace(cfg, gate_up=dataclasses.replace(cfg.gate_up,
                                                                          par_acc=0)))
    assert_rounding_close(out, one)


@pytest.mark.parametrize("block_m,half_m", [(8, 0), (16, 1)])
@pytest.mark.parametrize("m", [1, 40])
def test_two_accumulator_looped_down_matches_the_reference_and_one(experts, block_m, half_m, m):
    x = torch.randn(m, H, generator=torch.Generator().manual_seed(80 + m)).bfloat16()
    tw, ti = random_routing(m, 9, 3, seed=81 + m)
    if m == 40:
        ti[:20] = torch.tensor([0, 1, 2])
    ti[0, 1] = -1
    down = MOE.GemmConfig(64, 128, 4, 1, 128)
    one_cfg = MOE.MoeConfig(block_m, MOE.GemmConfig(64, 128, 4, 1), down, half_m=half_m)
    par_cfg = dataclasses.replace(one_cfg, down=dataclasses.replace(down, par_acc=1))
    out, ref = run(experts[9], x, tw, ti, scale=0.9, cfg=par_cfg)
    check(out, ref)
    one, _ = run(experts[9], x, tw, ti, scale=0.9, cfg=one_cfg)
    assert_rounding_close(out, one)
    # scale_once on the looped down: the same bits, with and without par_acc
    for cfg, same in ((one_cfg, one), (par_cfg, out)):
        once = dataclasses.replace(cfg, down=dataclasses.replace(cfg.down, scale_once=1))
        assert torch.equal(run(experts[9], x, tw, ti, scale=0.9, cfg=once)[0], same)


@pytest.mark.parametrize("cfg", [CFG_BM8, CFG_BM8_LIVE, CFG_HALF16_GU_LIVE, CFG_SPLIT],
                         ids=["bm8_split2", "bm8_live", "half16_live", "split_dq"])
@pytest.mark.parametrize("par_acc", [0, 1])
def test_scales_once_per_group_change_no_bit(experts, cfg, par_acc):
    """GemmConfig.scale_once loads a group's scale once and repeats it in registers: the same
    scale values, so the same outputs bit for bit (with or without par_acc)."""
    m = 40
    x = torch.randn(m, H, generator=torch.Generator().manual_seed(90)).bfloat16()
    tw, ti = random_routing(m, 9, 3, seed=91)
    ti[:20] = torch.tensor([0, 1, 2])
    base = dataclasses.replace(cfg, gate_up=dataclasses.replace(cfg.gate_up, par_acc=par_acc))
    once = dataclasses.replace(base, gate_up=dataclasses.replace(base.gate_up, scale_once=1))
    out, ref = run(experts[9], x, tw, ti, scale=1.2, cfg=once)
    check(out, ref)
    plain, _ = run(experts[9], x, tw, ti, scale=1.2, cfg=base)
    assert torch.equal(out, plain)


def test_par_acc_values_and_kernels():
    """par_acc and scale_once are 0 or 1, and on the down only for the looped kernel
    (n_per_cta > 0)."""
    x = torch.randn(2, H).bfloat16()
    tw, ti = random_routing(2, 4, 2, seed=1)
    w = REF.make_random_moe(4, H, I, seed=1)
    for bad in (MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1, par_acc=2),
                              MOE.GemmConfig(64, 128, 4, 1)),
                MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1),
                              MOE.GemmConfig(64, 128, 4, 1, par_acc=1)),
                MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1),
                              MOE.GemmConfig(64, 128, 4, 1, 128, par_acc=2)),
                MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1, scale_once=2),
                              MOE.GemmConfig(64, 128, 4, 1)),
                MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1),
                              MOE.GemmConfig(64, 128, 4, 1, scale_once=1))):
        with pytest.raises(ValueError, match="does not tile"):
            run(w, x, tw, ti, cfg=bad)


def test_block_m_below_8_is_refused(experts):
    x = torch.randn(2, H).bfloat16()
    tw, ti = random_routing(2, 9, 3, seed=1)
    with pytest.raises(ValueError, match="does not tile"):
        run(experts[9], x, tw, ti, cfg=dataclasses.replace(CFG_BM8, block_m=4))


@pytest.mark.parametrize("m", [1, 40])
def test_split_k_gate_up_matches_reference(experts, m):
    x = torch.randn(m, H, generator=torch.Generator().manual_seed(30 + m)).bfloat16()
    tw, ti = random_routing(m, 9, 3, seed=31 + m)
    ti[0, 1] = -1
    out, ref = run(experts[9], x, tw, ti, scale=0.7, cfg=CFG_SPLITK)
    check(out, ref)
    again, _ = run(experts[9], x, tw, ti, scale=0.7, cfg=CFG_SPLITK)
    assert torch.equal(out, again), "split-K must be deterministic (fixed-order reduce)"


@pytest.mark.parametrize("cfg", [CFG_SPLITK, CFG_HALF_SPLITK, CFG_HALF64_LOOP_SPLITK,
                                 CFG_WIDE32_SPLITK],
                         ids=["16", "half32", "half64", "wide32"])
def test_serial_split_k_equals_the_reduce_kernel(experts, cfg, monkeypatch):
    """The split-K partials summed by each tile's last program (one launch) equal the reduce
    kernel's sum bit for bit, and every arrival counter is re-armed to 0 afterwards."""
    m = 40
    x = torch.randn(m, H, generator=torch.Generator().manual_seed(50)).bfloat16()
    tw, ti = random_routing(m, 9, 3, seed=51)
    ti[:12] = torch.tensor([0, 1, 2])  # 12 tokens on 3 experts: blocks of 16 rows, full and not
    monkeypatch.setenv(MOE.SERIAL_REDUCE_ENV, "0")
    MOE._counters.clear()
    two_launch, ref = run(experts[9], x, tw, ti, cfg=cfg)
    assert not MOE._counters, "the reduce kernel path must not allocate counters"
    monkeypatch.setenv(MOE.SERIAL_REDUCE_ENV, "1")
    serial, _ = run(experts[9], x, tw, ti, cfg=cfg)
    check(serial, ref)
    assert torch.equal(serial, two_launch)
    counters = MOE._counters[("cpu", None)]
    assert counters.numel() >= MOE._MIN_COUNTERS and int(counters.abs().sum()) == 0
    again, _ = run(experts[9], x, tw, ti, cfg=cfg)
    assert torch.equal(again, serial)


def _block_case(case, m, hidden, seed):
    """x and top-2 routing over 9 experts for ``m`` tokens: ``one_block`` (slot 1 dropped,
    slot 0 on expert 3: m rows, one 16-row block), ``two_blocks`` (experts 1 and 6: m rows
    each) or ``many_blocks`` (random)."""
    x = torch.randn(m, hidden, generator=torch.Generator().manual_seed(m)).bfloat16()
    tw, ti = random_routing(m, 9, 2, seed=seed + m)
    if case == "one_block":
        ti[:, 0], ti[:, 1] = 3, -1
    elif case == "two_blocks":
        ti[:, 0], ti[:, 1] = 1, 6
    return x, tw, ti


# Live split (split_target): hidden 512 gives 4 K steps of 128, so the call's split can be 1, 2
# or 4; intermediate 128 in 64-column tiles gives 2 tiles per block. Target 8 programs: 1 used
# block -> split 4, 2-3 -> split 2, 4 or more -> split 1.
H_LIVE = 512


def _live_cfg(split_k, target):
    return MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1, 0, 0, split_k, target),
                         MOE.GemmConfig(64, 128, 4, 1, 128))


def _table_live_bands():
    import json
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "triton_kernels" / "moe_w4a16_configs.json"
    return [b["max_m"] for b in json.loads(path.read_text())["bands"]
            if b["gate_up"].get("split_target")]


@pytest.mark.parametrize("band", [0] + _table_live_bands())
@pytest.mark.parametrize("case", ["one_block", "two_blocks", "many_blocks"])
@pytest.mark.parametrize("serial", ["1", "0"])
def test_live_split_equals_the_fixed_split_it_picks(band, case, serial, monkeypatch):
    """A live-split call equals, bit for bit, the fixed-split call with the split the rule picks
    for its block count (host mirror ``live_split``), in one launch and with the reduce kernel;
    the counters end at 0. ``band`` 0: _live_cfg's tile; otherwise the gate-up tile (block_n,
    block_k, warps, split_dq) of that live-split band of the shipped table (M = 8, 9-16, 17-32,
    33-48, 49-64 since session 46) with split_k 4 (the bands' 4, or 2 at M 49-64), at 4 K
    steps with the target scaled alike (1 used block splits 4 ways, 2 blocks 2, 4 or more not
    at all)."""
    monkeypatch.setenv(MOE.SERIAL_REDUCE_ENV, serial)
    if band:
        gu = MOE.select_config(band).gate_up
        assert gu.split_k in (2, 4), gu
        hidden, num_n = 4 * gu.block_k, I // gu.block_n

        def cfg_of(split_k, target):
            return MOE.MoeConfig(16, MOE.GemmConfig(gu.block_n, gu.block_k, gu.num_warps, 1, 0,
                                                    gu.split_dq, split_k, target),
                                 MOE.GemmConfig(64, 128, 4, 1, 128))
    else:
        hidden, num_n, cfg_of = H_LIVE, 2, _live_cfg
    w = REF.make_random_moe(9, hidden, I, seed=77 + band)
    m = {"one_block": 5, "two_blocks": 12, "many_blocks": 40}[case]
    x, tw, ti = _block_case(case, m, hidden, 300)
    blocks = int(MOE.moe_align(ti, 9, 16)[1][-1])
    want = {"one_block": 4, "two_blocks": 2, "many_blocks": 1}[case]
    assert MOE.live_split(blocks, num_n, 4, 4, 4 * num_n) == want, blocks

    _live_equals_fixed(w, x, tw, ti, cfg_of(4, 4 * num_n), cfg_of(want, 0), serial)


@pytest.mark.parametrize("case", ["one_block", "many_blocks"])
@pytest.mark.parametrize("serial", ["1", "0"])
def test_live_split_of_seven(case, serial, monkeypatch):
    """A K split that is no power of two (split_k 7, as the H100's M 9-16 band since session
    61 at its 28 K steps): at 7 K steps a live call of one used block splits 7 ways, one of many
    blocks not at all, equal bit for bit to that fixed split (one launch and the reduce
    kernel)."""
    monkeypatch.setenv(MOE.SERIAL_REDUCE_ENV, serial)
    hidden = 7 * 128

    def cfg_of(split_k, target):
        return MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1, 0, 0, split_k, target),
                             MOE.GemmConfig(64, 128, 4, 1, 128))

    w = REF.make_random_moe(9, hidden, I, seed=7)
    m = {"one_block": 5, "many_blocks": 40}[case]
    x, tw, ti = _block_case(case, m, hidden, 300)
    blocks = int(MOE.moe_align(ti, 9, 16)[1][-1])
    want = {"one_block": 7, "many_blocks": 1}[case]
    assert MOE.live_split(blocks, I // 64, 7, 7, 7 * I // 64) == want, blocks
    _live_equals_fixed(w, x, tw, ti, cfg_of(7, 7 * I // 64), cfg_of(want, 0), serial)


def _live_equals_fixed(w, x, tw, ti, live_cfg, fixed_cfg, serial):
    """The call with ``live_cfg`` (a live split) is within tolerance of the reference and
    equal bit for bit to the one with ``fixed_cfg``; with serial sums the counters end at 0."""
    def call(cfg):
        out = torch.full(x.shape, float("nan"), dtype=torch.bfloat16)
        return MOE.fused_moe_w4a16(x, w["w13_packed"], w["w13_scale"], w["w2_packed"],
                                   w["w2_scale"], tw, ti, out=out, config=cfg)

    live = call(live_cfg)
    ref = REF.moe_w4a16_reference(x, w["w13_packed"], w["w13_scale"], w["w2_packed"],
                                  w["w2_scale"], tw, ti, 1.0)
    check(live, ref)
    assert torch.equal(live, call(fixed_cfg))
    if serial == "1":
        assert int(MOE._counters[("cpu", None)].abs().sum()) == 0


@pytest.mark.parametrize("m,experts_used,target,split_k,k_steps", [
    (5, 1, 8, 4, 4), (12, 2, 8, 4, 4), (40, 0, 8, 4, 4), (8, 8, 256, 8, 56),
    (3, 3, 64, 8, 56), (64, 0, 256, 4, 28)])
def test_live_split_on_device_matches_the_host_rule(m, experts_used, target, split_k, k_steps):
    """_live_split reads moe_align's block count and picks what ``live_split`` says (0 experts
    used: random top-2 routing over 9 experts)."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(be_ptr, out_ptr, max_blocks, NUM_N: tl.constexpr, KS: tl.constexpr,
              SPLIT_K: tl.constexpr, SPLIT_TARGET: tl.constexpr):
        split, live = MOE._live_split(be_ptr, max_blocks, NUM_N, KS, SPLIT_K, SPLIT_TARGET)
        tl.store(out_ptr, split)
        tl.store(out_ptr + 1, live)

    _, ti = random_routing(m, 9, 2, seed=400 + m)
    if experts_used:
        ti = torch.stack([torch.arange(m) % experts_used, torch.full((m,), -1)], 1).int()
    _, block_expert, _ = MOE.moe_align(ti, 9, 16)
    out = torch.zeros(2, dtype=torch.int32)
    probe[(1,)](block_expert, out, block_expert.numel() - 1, NUM_N=8, KS=k_steps,
                SPLIT_K=split_k, SPLIT_TARGET=target)
    used = int(block_expert[-1])
    assert out.tolist() == [MOE.live_split(used, 8, k_steps, split_k, target), used * 8]


def test_live_split_rule():
    """The host mirror: the smallest divisor of the K steps up to split_k that reaches the
    target, split_k when none does, and split_k itself without a target."""
    assert MOE.live_split(8, 8, 56, 8, 256) == 4  # 8 experts at M = 8: 64 tiles
    assert MOE.live_split(61, 8, 56, 8, 256) == 1  # random routing at M = 8: 488 tiles
    assert MOE.live_split(20, 8, 56, 8, 256) == 2
    assert MOE.live_split(5, 8, 56, 8, 256) == 7  # 40 tiles: 7 divides 56, 6 and 5 do not
    assert MOE.live_split(1, 8, 28, 4, 256) == 4  # none reaches it: split_k
    assert MOE.live_split(1, 8, 56, 8, 0) == 8


@pytest.mark.parametrize("k_steps,split_k,target", [(56, 8, 256), (56, 8, 512), (28, 4, 256),
                                                    (28, 4, 1024), (4, 4, 8), (28, 7, 300)])
def test_live_grid_holds_every_call(k_steps, split_k, target):
    """No call of at most max_tiles used tiles needs more programs than live_grid gives, and
    the bound is tight (some call needs them all)."""
    for max_tiles in (1, 7, 64, 512, 1568):
        grid = MOE.live_grid(max_tiles, k_steps, split_k, target)
        need = [t * MOE.live_split(t, 1, k_steps, split_k, target)
                for t in range(max_tiles + 1)]
        assert max(need) == grid, (max_tiles, grid, max(need))


# Live down column ranges (the down config's split_target): hidden 256 in one 256-column range
# of 4 steps of 64, so a call's range splits into 1, 2 or 4 parts. Target 4 programs: 1 used
# block -> 4 parts, 2-3 -> 2, 4 or more -> 1.
def _live_down_cfg(n_per_cta, target, block_m=16, half_m=0):
    return MOE.MoeConfig(block_m, MOE.GemmConfig(64, 128, 4, 1),
                         MOE.GemmConfig(64, 128, 4, 1, n_per_cta, 0, 1, target), half_m=half_m)


@pytest.mark.parametrize("block_m,half_m", [(16, 0), (16, 1), (8, 0), (32, 1)])
@pytest.mark.parametrize("case", ["one_block", "two_blocks", "many_blocks"])
def test_live_down_equals_the_fixed_range_it_picks(experts, block_m, half_m, case):
    """A down call with live column ranges equals, bit for bit, the fixed-range call with the
    range the rule picks for its block count (host mirror ``live_split`` over the range's
    column steps), and matches the reference; with 8- / 16-row blocks and narrowed ones."""
    m = {"one_block": 5, "two_blocks": 6, "many_blocks": 40}[case]
    x, tw, ti = _block_case(case, m, H, 500)
    blocks = int(MOE.moe_align(ti, 9, block_m)[1][-1])
    parts = MOE.live_split(blocks, 1, 4, 4, 4)
    want = {"one_block": 4, "two_blocks": 2, "many_blocks": 1}[case]
    assert parts == want, blocks
    out_live, ref = run(experts[9], x, tw, ti, cfg=_live_down_cfg(256, 4, block_m, half_m))
    check(out_live, ref)
    out_fixed, _ = run(experts[9], x, tw, ti, cfg=_live_down_cfg(256 // parts, 0, block_m,
                                                                  half_m))
    assert torch.equal(out_live, out_fixed)


def test_live_down_keeps_its_target():
    """split_target on the looped down survives _fit (it is dropped elsewhere, as before); a
    negative one is refused."""
    cfg = _live_down_cfg(256, 4)
    assert MOE._fitted(cfg, H, I)[1].split_target == 4
    plain = MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1), MOE.GemmConfig(64, 128, 4, 1, 0, 0,
                                                                             1, 4))
    assert MOE._fitted(plain, H, I)[1].split_target == 0  # per-tile down: no live range
    with pytest.raises(ValueError, match="does not tile"):
        MOE._fitted(_live_down_cfg(256, -1), H, I)


def test_tile_counters_grow_and_keep_the_old_buffer(monkeypatch):
    monkeypatch.setenv(MOE.SERIAL_REDUCE_ENV, "1")
    MOE._counters.clear()
    dev = torch.device("cpu")
    first = MOE._tile_counters(dev, 10)
    assert first.numel() == MOE._MIN_COUNTERS and MOE._tile_counters(dev, 10) is first
    bigger = MOE._tile_counters(dev, MOE._MIN_COUNTERS + 1)
    assert bigger.numel() == MOE._MIN_COUNTERS + 1 and int(bigger.abs().sum()) == 0
    assert MOE._counters[("old", "cpu", None)] == [first]
    monkeypatch.setenv(MOE.SERIAL_REDUCE_ENV, "0")
    assert MOE._tile_counters(dev, 10) is None
    MOE._counters.clear()


def test_down_loop_config_must_tile():
    w = REF.make_random_moe(4, H, I, seed=1)
    x = torch.randn(3, H).bfloat16()
    tw, ti = random_routing(3, 4, 2, seed=1)
    bad = MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1), MOE.GemmConfig(64, 128, 4, 1, 96))
    with pytest.raises(ValueError, match="does not tile"):
        run(w, x, tw, ti, cfg=bad)



def test_shape_bound_options_fall_back():
    # A table written for Kimi shapes must serve other sizes: split-K 4 over 2 K steps and a
    # looped down kernel whose tile is not the whole intermediate size both fall back.
    cfg = MOE.GemmConfig(64, 128, 4, 1, 0, 1, 4)
    assert MOE._fit(cfg, 128, 256).split_k == 1 and MOE._fit(cfg, 128, 512).split_k == 4
    down = MOE.GemmConfig(64, 256, 4, 1, 512)
    assert MOE._fit(down, 7168, 768).n_per_cta == 0 and MOE._fit(down, 7168, 256).n_per_cta == 512
    # the looped kernel's options go with it; a gate-up keeps its own
    both = dataclasses.replace(down, par_acc=1, scale_once=1)
    assert MOE._fit(both, 7168, 768) == MOE._fit(down, 7168, 768)
    assert MOE._fit(both, 7168, 256) == dataclasses.replace(MOE._fit(down, 7168, 256), par_acc=1,
                                                            scale_once=1)
    gu = MOE.GemmConfig(64, 256, 4, 1, 0, 1, 4, 0, 1, 1)
    assert (MOE._fit(gu, 256, 7168).par_acc, MOE._fit(gu, 256, 7168).scale_once) == (1, 1)
    assert MOE._fit(down, 256, 128) == MOE.GemmConfig(64, 128, 4, 1, 256)
    w = REF.make_random_moe(4, H, I, seed=2)
    x = torch.randn(5, H).bfloat16()
    tw, ti = random_routing(5, 4, 2, seed=2)
    odd = MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1, 0, 0, 4), MOE.GemmConfig(64, 128, 4, 1))
    check(*run(w, x, tw, ti, cfg=odd))


def test_all_tokens_one_expert_and_idle_experts(experts):
    # Every token routes to experts (3, 0): two experts get all 40 tokens (3 blocks each), seven
    # experts get none.
    m = 40
    x = torch.randn(m, H, generator=torch.Generator().manual_seed(1)).bfloat16()
    ti = torch.tensor([[3, 0]], dtype=torch.int32).repeat(m, 1)
    tw = torch.rand(m, 2, generator=torch.Generator().manual_seed(2))
    check(*run(experts[9], x, tw, ti))


def test_padding_ids_contribute_nothing(experts):
    # SGLang writes -1 into the topk ids of CUDA-graph padding tokens.
    m = 9
    x = torch.randn(m, H, generator=torch.Generator().manual_seed(5)).bfloat16()
    tw, ti = random_routing(m, 9, 3, seed=6)
    ti[6:] = -1  # three padding tokens
    ti[2, 1] = -1  # and one dropped slot of a real token
    out, ref = run(experts[9], x, tw, ti)
    check(out, ref)
    assert (out[6:] == 0).all()
    sorted_ids, block_expert, _ = MOE.moe_align(ti, 9, 16)
    rows, owners = _align_reference(ti, 9, 16)
    assert sorted_ids[: len(rows)].tolist() == rows and block_expert[: len(owners)].tolist() == owners


def test_strided_hidden_states_and_deterministic(experts):
    m = 7
    wide = torch.randn(m, H + 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    x = wide[:, 32:32 + H]  # row stride H + 64
    tw, ti = random_routing(m, 4, 2, seed=4)
    out, ref = run(experts[4], x, tw, ti)
    check(out, ref)
    again, _ = run(experts[4], x.contiguous(), tw, ti)
    assert torch.equal(out, again)


def _align_reference(ids, e, bm):
    """Python oracle: per expert, pair ids in flat order, padded to a multiple of bm with T."""
    flat = ids.reshape(-1).tolist()
    t = len(flat)
    rows, owners = [], []
    for ex in range(e):
        mine = [i for i, v in enumerate(flat) if v == ex]
        if not mine:
            continue
        pad = -len(mine) % bm
        rows += mine + [t] * pad
        owners += [ex] * ((len(mine) + pad) // bm)
    return rows, owners


@pytest.mark.parametrize("m,e,topk,bm", [(1, 4, 2, 16), (7, 9, 3, 16), (64, 9, 2, 32),
                                         (300, 40, 8, 16)])  # 2400 pairs: 3 chunks of 1024
def test_align(m, e, topk, bm):
    _, ti = random_routing(m, e, topk, seed=m)
    sorted_ids, block_expert, _ = MOE.moe_align(ti, e, bm)
    rows, owners = _align_reference(ti, e, bm)
    assert sorted_ids.numel() == MOE.max_padded_rows(m * topk, e, bm) >= len(rows)
    assert sorted_ids[: len(rows)].tolist() == rows
    nb = len(owners)
    assert block_expert.numel() == sorted_ids.numel() // bm + 1
    assert block_expert[:nb].tolist() == owners
    assert (block_expert[nb:-1] == -1).all()
    assert int(block_expert[-1]) == nb, "the used-block count past the labels"


@pytest.mark.parametrize("block_k", [128, 256])
def test_prologue_copy_layouts_agree(block_k, monkeypatch):
    """x's plane-major copy, one program per row (rows) or per 1,024-column chunk launched before
    the experts' programs (chunks): both equal the permutation _plane_major_src describes (K of
    1,280 leaves a partial last chunk; x strided), and the grouping is the same."""
    m, e, topk, k = 5, 9, 3, 1280
    _, ti = random_routing(m, e, topk, seed=77)
    wide = torch.randn(m, k + 32, generator=torch.Generator().manual_seed(78)).bfloat16()
    x = wide[:, 16:16 + k]
    kp = block_k // 8
    o = torch.arange(k)
    within = o % block_k
    want = x[:, o - within + (within % kp) * 8 + within // kp]
    got = {}
    for copy in ("rows", "chunks"):
        got[copy] = MOE.moe_align(ti, e, 16, x, block_k, copy=copy)
        assert torch.equal(got[copy][2], want), copy
    used = len(_align_reference(ti, e, 16)[0])  # rows past the last block are unspecified
    assert torch.equal(got["rows"][0][:used], got["chunks"][0][:used])
    assert torch.equal(got["rows"][1], got["chunks"][1])
    monkeypatch.setenv(MOE.PROLOGUE_ENV, "chunks")
    assert torch.equal(MOE.moe_align(ti, e, 16, x, block_k)[2], want)
    monkeypatch.setenv(MOE.PROLOGUE_ENV, "columns")
    with pytest.raises(ValueError, match="rows or chunks"):
        MOE.moe_align(ti, e, 16, x, block_k)


@pytest.mark.parametrize("m,e,topk,bm", [(7, 9, 3, 16), (300, 40, 8, 16), (257, 384, 8, 16)])
def test_two_pass_align_equals_one_launch(m, e, topk, bm):
    """moe_align's two-launch grouping (chunk histograms, then each chunk's pairs placed by a
    sort) gives _prologue_kernel's sorted_ids, block labels and x copy bit for bit: one chunk,
    three chunks (2,400 pairs; chunks of 1,024) and Kimi's 384 experts, with a padding slot
    (-1) among the ids."""
    _, ti = random_routing(m, e, topk, seed=m + 5)
    ti[m // 2, topk - 1] = -1
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).bfloat16()
    one = MOE.moe_align(ti, e, bm, x, 128, method="one")
    two = MOE.moe_align(ti, e, bm, x, 128, method="two", warps=1)
    rows, owners = _align_reference(ti, e, bm)
    assert two[0][: len(rows)].tolist() == rows
    assert torch.equal(one[1], two[1]) and torch.equal(one[2], two[2])
    assert int(two[1][len(two[0]) // bm]) == len(owners)


@pytest.mark.parametrize("m,e,topk,bm,copy", [(1, 4, 2, 16, "rows"), (7, 9, 3, 16, "chunks"),
                                              (8, 384, 8, 8, "rows"), (16, 384, 8, 8, "rows"),
                                              (5, 9, 3, 8, "rows"), (128, 384, 8, 16, "rows"),
                                              (90, 9, 3, 16, "chunks")])
def test_small_align_equals_one_launch(m, e, topk, bm, copy):
    """moe_align's one-program grouping (a histogram and a sort) gives _prologue_kernel's
    sorted ids, labels and x copy bit for bit: Kimi's 384 experts at M = 8 / 16 / 128 (128 x 8
    pairs, the most it takes), few experts with 9-21 or about 30 pairs each (several blocks
    per expert), with padding slots (-1) among the ids."""
    _, ti = random_routing(m, e, topk, seed=m + 11)
    ti[m // 2, topk - 1] = -1
    if m > 1:
        ti[0, 0] = -1
    x = torch.randn(m, 1280, generator=torch.Generator().manual_seed(m)).bfloat16()
    one = MOE.moe_align(ti, e, bm, x, 256, copy=copy, method="one")
    small = MOE.moe_align(ti, e, bm, x, 256, copy=copy, method="small", warps=2)
    rows, owners = _align_reference(ti, e, bm)
    assert small[0][: len(rows)].tolist() == rows
    assert torch.equal(one[1], small[1]) and torch.equal(one[2], small[2])
    assert int(small[1][-1]) == len(owners)


@pytest.mark.parametrize("m,topk", [(1, 2), (8, 4), (16, 8), (40, 4)])
def test_whole_call_equal_with_each_grouping(experts, m, topk, monkeypatch):
    """A whole MoE call gives the same bits with each grouping: M = 1 / 8 / 16, where ``auto``
    takes the one-program grouping, and 160 pairs, past auto's 128 (the one-launch kernel) but
    within ``small``'s 1,024; a padding slot (-1) among the ids."""
    x = torch.randn(m, H, generator=torch.Generator().manual_seed(m)).bfloat16()
    tw, ti = random_routing(m, 9, topk, seed=m + 1)
    ti[m // 2, 0] = -1
    got = {}
    for method in ("one", "two", "small", "auto"):
        monkeypatch.setenv(MOE.ALIGN_ENV, method)
        got[method], ref = run(experts[9], x, tw, ti)
    check(got["one"], ref)
    for method in ("two", "small", "auto"):
        assert torch.equal(got[method], got["one"]), method


def test_small_align_all_pairs_on_one_expert():
    """Every token on the same 8 experts (SGLang's dummy fill): M pairs per expert, one to 16
    blocks each; at M = 129 (1,032 pairs, past ALIGN_SMALL_MAX_PAIRS) ``small`` falls back to
    auto's grouping."""
    for m, bm in ((8, 8), (16, 8), (16, 16), (128, 8), (129, 16)):
        ti = torch.arange(8, dtype=torch.int32).repeat(m, 1)
        rows, owners = _align_reference(ti, 384, bm)
        got = MOE.moe_align(ti, 384, bm, method="small")
        assert got[0][: len(rows)].tolist() == rows, (m, bm)
        assert got[1][: len(owners)].tolist() == owners and int(got[1][-1]) == len(owners)


def test_align_method_switch(monkeypatch):
    _, ti = random_routing(3, 9, 2, seed=3)
    monkeypatch.setenv(MOE.ALIGN_ENV, "two")
    assert MOE.moe_align(ti, 9, 16)[0][:16].tolist() == _align_reference(ti, 9, 16)[0][:16]
    monkeypatch.setenv(MOE.ALIGN_ENV, "small")
    assert MOE.moe_align(ti, 9, 16)[0][:16].tolist() == _align_reference(ti, 9, 16)[0][:16]
    monkeypatch.setenv(MOE.ALIGN_ENV, "three")
    with pytest.raises(ValueError, match="one, two, small or auto"):
        MOE.moe_align(ti, 9, 16)
    monkeypatch.setenv(MOE.ALIGN_ENV, "auto")
    for bad in ("four", "0", "2:2"):
        monkeypatch.setenv(MOE.ALIGN_WARPS_ENV, bad)
        with pytest.raises(ValueError, match=MOE.ALIGN_WARPS_ENV):
            MOE.moe_align(ti, 9, 16)


def test_combine_env_is_checked(monkeypatch):
    _, ti = random_routing(2, 9, 2, seed=4)
    y = torch.zeros(4, 64, dtype=torch.bfloat16)
    out = torch.empty(2, 64, dtype=torch.bfloat16)
    for bad in ("512", "512,4", "a:4", "512:0"):
        monkeypatch.setenv(MOE.COMBINE_ENV, bad)
        with pytest.raises(ValueError, match=MOE.COMBINE_ENV):
            MOE.combine(y, ti, out, 1.0, 9)
    monkeypatch.setenv(MOE.COMBINE_ENV, "64:2")
    assert torch.equal(MOE.combine(y, ti, out, 1.0, 9), torch.zeros(2, 64, dtype=torch.bfloat16))


def test_pdl_mode_is_checked(experts, monkeypatch):
    """SGLANG_DDTREE_MOE_PDL: an unknown spec, or PDL where it cannot run (here: the
    interpreter), stops the call before any launch with an error naming the variable; 0 runs
    as unset. The specs' meaning (moe_pdl)."""
    w = experts[4]
    x = torch.randn(3, H, dtype=torch.bfloat16)
    tw, ti = random_routing(3, 4, 2, seed=5)
    for bad in ("3", "on", "-1", "1:x", "1:aa", "2:a", "1,a", "1:ee", "2:ee", "2:", "0:e", "1:E"):
        monkeypatch.setenv(MOE.PDL_ENV, bad)
        with pytest.raises(ValueError, match=MOE.PDL_ENV):
            run(w, x, tw, ti)
    for spec in ("1", "2", "1:gd", "1:gdec", "2:e"):
        monkeypatch.setenv(MOE.PDL_ENV, spec)
        with pytest.raises(ValueError, match="sm_90"):
            run(w, x, tw, ti)
    with pytest.raises(ValueError, match="sm_90"):
        MOE.pdl_mode(x.device, True, MOE.Pdl(True))
    assert MOE.parse_pdl("2") == MOE.Pdl(True, "agrd") == MOE.parse_pdl("1:drga")
    assert MOE.parse_pdl("1") == MOE.Pdl(True, "") and MOE.parse_pdl("0") == MOE.Pdl()
    assert MOE.Pdl().launch("g") == {}
    assert MOE.Pdl(True, "g").launch("g") == {"PDL": 2, "launch_pdl": True}
    assert MOE.Pdl(True, "g").launch("d") == {"PDL": 1, "launch_pdl": True}
    assert MOE.parse_pdl("1:cged") == MOE.Pdl(True, "gd", "ec") == MOE.parse_pdl("1:gdec")
    assert MOE.parse_pdl("2:c") == MOE.Pdl(True, "agrd", "c")
    assert MOE.Pdl(True, "gd", "ec").down_loop() == {"PDL": 2, "launch_pdl": True, "EARLY": True}
    assert MOE.Pdl(True, "gd", "c").down_loop() == {"PDL": 2, "launch_pdl": True}
    assert MOE.Pdl(True, "gd", "e").combine() == {"PDL": 1, "launch_pdl": True}
    assert MOE.Pdl(True, "", "c").combine() == {"PDL": 1, "launch_pdl": True, "EARLY": True}
    assert MOE.Pdl(early="c").combine() == {"EARLY": True}  # (the tests' form: no wait)
    monkeypatch.setenv(MOE.PDL_ENV, "0")
    check(*run(w, x, tw, ti))
    monkeypatch.delenv(MOE.PDL_ENV)  # unset: plain launches where PDL cannot run
    check(*run(w, x, tw, ti))


# looped downs: 2 column steps a range (16-row blocks, and 32 narrowed), 1 step, live ranges
# (1-4 steps a range by the call's blocks)
_EARLY_CFGS = {"loop": CFG_LOOP, "half_loop": CFG_HALF_LOOP,
               "one_step": MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1),
                                         MOE.GemmConfig(64, 128, 4, 1, 64)),
               "live_bm8": _live_down_cfg(256, 4, 8, 0)}


@pytest.mark.parametrize("cfg", list(_EARLY_CFGS), ids=str)
@pytest.mark.parametrize("case", ["one_block", "many_blocks"])
def test_early_loads_change_no_bit(experts, cfg, case):
    """moe_pdl's loads before the wait (the looped down's block, rows and routing weights
    ``e``, the combine's expert ids ``c``), run here without PDL: the same bits as the plain
    kernels, with dropped slots (-1) and ids past the experts (no y row), unused blocks and
    programs past a live range."""
    m = {"one_block": 5, "many_blocks": 40}[case]
    x, tw, ti = _block_case(case, m, H, 700)
    ti[-1, 0] = -1
    ti[0, -1] = 9  # outside [0, E): contributes nothing
    w = experts[9]

    def call(pdl):
        out = torch.full((m, H), float("nan"), dtype=torch.bfloat16)
        return MOE.fused_moe_w4a16(x, w["w13_packed"], w["w13_scale"], w["w2_packed"],
                                   w["w2_scale"], tw, ti, out=out, config=_EARLY_CFGS[cfg],
                                   pdl=pdl)

    plain = call(None)
    check(plain, REF.moe_w4a16_reference(x, w["w13_packed"], w["w13_scale"], w["w2_packed"],
                                         w["w2_scale"], tw, ti))
    for early in ("e", "c", "ec"):
        assert torch.equal(call(MOE.Pdl(early=early)), plain), early


@pytest.mark.parametrize("cfg", ["live", "live_bm8", "fixed", "plain"])
@pytest.mark.parametrize("case", ["one_block", "two_blocks", "many_blocks"])
def test_gate_up_rows_in_one_round_change_no_bit(cfg, case):
    """MoeConfig.early_rows (the gate-up's block expert and row ids loaded together, under a
    live split for every split the call may take): the same bits as without, at each split a
    live call takes (4 / 2 / 1 by its blocks), a fixed split and none."""
    conf = {"live": _live_cfg(4, 8), "live_bm8": dataclasses.replace(_live_cfg(4, 8), block_m=8),
            "fixed": CFG_SPLITK, "plain": CFG}[cfg]
    m = {"one_block": 5, "two_blocks": 6, "many_blocks": 40}[case]
    hidden = H_LIVE if cfg.startswith("live") else H
    x, tw, ti = _block_case(case, m, hidden, 900)
    w = REF.make_random_moe(9, hidden, I, seed=9)
    out = [MOE.fused_moe_w4a16(x, w["w13_packed"], w["w13_scale"], w["w2_packed"],
                               w["w2_scale"], tw, ti, config=dataclasses.replace(conf,
                                                                                 early_rows=r))
           for r in (0, 1)]
    assert torch.equal(out[0], out[1])
    check(out[1], REF.moe_w4a16_reference(x, w["w13_packed"], w["w13_scale"], w["w2_packed"],
                                          w["w2_scale"], tw, ti))


def test_pdl_default_follows_the_device(monkeypatch):
    """Unset, SGLANG_DDTREE_MOE_PDL means DEFAULT_SPEC (1:gdec) on an sm_90+ GPU and plain
    launches before sm_90 or on the portable path; a set value wins either way."""
    monkeypatch.delenv(MOE.PDL_ENV, raising=False)
    dev = torch.device("cuda", 0)  # (no CUDA call: the capability is patched)
    for cap, want in (((9, 0), MOE.Pdl(True, "gd", "ec")), ((10, 0), MOE.Pdl(True, "gd", "ec")),
                      ((8, 9), MOE.Pdl())):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        assert MOE.pdl_mode(dev, False) == want, cap
        assert MOE.pdl_mode(dev, True) == MOE.Pdl(), cap  # the portable path
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setenv(MOE.PDL_ENV, "0")
    assert MOE.pdl_mode(dev, False) == MOE.Pdl()
    monkeypatch.setenv(MOE.PDL_ENV, "2")
    assert MOE.pdl_mode(dev, False) == MOE.Pdl(True, "agrd")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    with pytest.raises(ValueError, match="sm_90"):
        MOE.pdl_mode(dev, False)


@pytest.mark.parametrize("shape", [(1024, 4), (64, 2), (64, 1)])
def test_combine_shapes_agree(shape):
    """Every combine launch shape sums the valid slots in slot order: equal bit for bit to the
    default shape (K = 200: a partial last column tile), and the fp32 sum within one bf16
    rounding."""
    m, topk, hidden, e = 5, 3, 200, 9
    g = torch.Generator().manual_seed(11)
    _, ti = random_routing(m, e, topk, seed=12)
    ti[1, 0] = -1
    y = torch.randn(m * topk, hidden, generator=g).bfloat16()
    outs = []
    for sh in (MOE.COMBINE_DEFAULT, shape):
        outs.append(MOE.combine(y, ti, torch.empty(m, hidden, dtype=torch.bfloat16), 2.5, e, sh))
    assert torch.equal(outs[0], outs[1])
    live = ((ti >= 0) & (ti < e)).reshape(-1, 1)
    ref = torch.zeros(m, hidden)
    yf = torch.where(live, y.float(), 0.0).reshape(m, topk, hidden)
    for k in range(topk):
        ref += yf[:, k]
    # one bf16 rounding (the interpreter truncates: up to 2^-7 relative)
    assert torch.allclose(outs[1].float(), ref * 2.5, rtol=2 ** -7, atol=1e-6)


def test_config_table_tiles_kimi_shapes():
    table = MOE._config_table(MOE._CONFIG_PATH)
    assert [b for b, _ in table] == sorted(b for b, _ in table)
    for _, cfg in table:
        assert cfg.block_m in (8, 16, 32, 64, 128)  # (8: the MMA n minimum, session 45)
        for g, n, k in ((cfg.gate_up, 256, 7168), (cfg.down, 7168, 256)):
            assert n % g.block_n == 0 and k % g.block_k == 0 and g.block_k % 128 == 0, cfg
    assert MOE.select_config(1) == table[0][1]
    assert MOE.select_config(10**9) == table[-1][1]


def test_shape_errors_name_the_tensor(experts):
    w = experts[4]
    x = torch.randn(3, H).bfloat16()
    tw, ti = random_routing(3, 4, 2, seed=0)
    with pytest.raises(ValueError, match="w2_scale"):
        MOE.fused_moe_w4a16(x, w["w13_packed"], w["w13_scale"], w["w2_packed"],
                            w["w2_scale"][:, :, :-1].contiguous(), tw, ti, config=CFG)
    with pytest.raises(ValueError, match="topk_weights"):
        MOE.fused_moe_w4a16(x, w["w13_packed"], w["w13_scale"], w["w2_packed"], w["w2_scale"],
                            tw[:2].contiguous(), ti, config=CFG)


def test_pack_layout_matches_compressed_tensors():
    """Our unpack reads compressed-tensors' packing after SGLang's transpose."""
    ct = pytest.importorskip("compressed_tensors.compressors.quantized_compressors.pack_quantized")
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (24, 64), generator=g, dtype=torch.int8)  # checkpoint [out, in]
    packed = ct.pack_to_int32(q, 4)  # [out, in // 8], as stored in the checkpoint
    loaded = packed.t().contiguous()[None]  # FusedMoE's weight loader: loaded_weight.t()
    assert torch.equal(REF.unpack_int4(loaded)[0], q.t())
    assert torch.equal(REF.pack_int4(q.t()[None].to(torch.int32)), loaded)


def _emulate_ptx(ptx: str, w0: int, w1: int, s_pair: int, n_out=8) -> dict:
    """Execute the dequant PTX's instruction subset on Python ints (fma.rn.bf16x2 exactly:
    the products and sums of these bf16 values are exact in float64, then one RNE rounding)."""
    def bf(h):
        return torch.tensor([h & 0xFFFF], dtype=torch.int32).to(torch.int16).view(
            torch.bfloat16).double().item()

    def to_bf(x):
        return torch.tensor([x], dtype=torch.float64).float().bfloat16().view(
            torch.int16).item() & 0xFFFF

    regs = {f"${n_out}": w0, f"${n_out + 1}": w1, f"${n_out + 2}": s_pair}
    val = lambda a: regs[a] if a in regs else int(a, 16) if a.startswith("0x") else int(a)  # noqa
    out = {}
    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        d, *a = [x.strip() for x in rest.split(",")]
        if op == "mov.b32":
            r = val(a[0])
        elif op == "prmt.b32":
            by = [(val(a[0]) >> 8 * i) & 0xFF for i in range(4)] + \
                 [(val(a[1]) >> 8 * i) & 0xFF for i in range(4)]
            r = sum(by[(val(a[2]) >> 4 * i) & 7] << 8 * i for i in range(4))
        elif op == "lop3.b32":
            assert val(a[3]) == 0xEA
            r = (val(a[0]) & val(a[1])) | val(a[2])
        elif op == "shr.u32":
            r = val(a[0]) >> val(a[1])
        elif op == "fma.rn.bf16x2":
            x, y, z = (val(v) for v in a)
            r = sum(to_bf(bf(x >> h) * bf(y >> h) + bf(z >> h)) << h for h in (0, 16))
        else:
            raise AssertionError(f"unexpected PTX op {op}")
        (out if d.startswith("$") else regs)[d] = r & 0xFFFFFFFF
    return out


def test_dequant_ptx_semantics():
    """The GPU dequant PTX gives (q * s).to(bf16) for both words of a pair, bit for bit."""
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        w = torch.randint(0, 2**32, (2,), generator=g, dtype=torch.int64).tolist()
        s = (torch.randn(2, generator=g) * 10 ** torch.empty(2).uniform_(-4, 1, generator=g))
        sb = s.bfloat16().view(torch.int16).to(torch.int64).tolist()
        out = _emulate_ptx(MOE._DEQUANT_PTX.value, w[0], w[1], (sb[0] & 0xFFFF) | (sb[1] & 0xFFFF) << 16)
        for j in range(8):
            for half, (wi, si) in zip((0, 16), ((w[0], s[0]), (w[1], s[1]))):
                q = ((wi >> 4 * j) & 0xF) - 8
                want = (torch.tensor(q, dtype=torch.float64) * si.bfloat16().double()).float().bfloat16()
                got = torch.tensor([(out[f"${j}"] >> half) & 0xFFFF], dtype=torch.int32).to(
                    torch.int16).view(torch.bfloat16)[0]
                assert got.item() == want.item(), (j, q, got, want)
        # the two halves (nibbles 0-3 / 4-7) give the same planes
        s_pair = (sb[0] & 0xFFFF) | (sb[1] & 0xFFFF) << 16
        lo = _emulate_ptx(MOE._DEQUANT_PTX_LO.value, w[0], w[1], s_pair, n_out=4)
        hi = _emulate_ptx(MOE._DEQUANT_PTX_HI.value, w[0], w[1], s_pair, n_out=4)
        for i in range(4):
            assert lo[f"${i}"] == out[f"${i}"] and hi[f"${i}"] == out[f"${i + 4}"], i


def test_sixteen_column_gate_up_tiles(experts):
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(5)).bfloat16()
    tw, ti = random_routing(9, 9, 3, seed=77)
    check(*run(experts[9], x, tw, ti, scale=1.5, cfg=CFG_N16))



@pytest.mark.parametrize("cfg", [CFG_HALF, CFG_HALF_LOOP, CFG_HALF_SPLITK, CFG_HALF64,
                                 CFG_HALF64_LOOP_SPLITK, CFG_HALF16_LOOP, CFG_HALF16_GU_LIVE],
                         ids=["down", "down_loop", "split_k", "bm64", "bm64_loop_split_k",
                              "bm16_loop", "bm16_gate_up_only_live_split"])
def test_half_m_blocks_match_reference(experts, cfg):
    """HALF_M: experts with 6-7 rows, 20 and 40 (32-row blocks: quarter (8 rows, since
    session 68); full; full then quarter. 64-row blocks: quarter; half; full. 16-row blocks:
    half; full then half; full, full, half), and with 64-row blocks one of 70 (full, then a
    quarter): every row written once, outputs within tolerance of the reference and of the
    same blocks run full width."""
    m = 70 if cfg.block_m == 64 else 40
    x = torch.randn(m, H, generator=torch.Generator().manual_seed(41)).bfloat16()
    tw, ti = random_routing(m, 9, 3, seed=42)
    ti[:, 0] = 5  # expert 5: all 40 tokens, blocks of 32 + 8 rows
    ti[:, 1] = torch.where(torch.arange(m) < 20, 7, 8)  # experts 7 and 8: 20 rows, second half live
    ti[:, 2] = torch.tensor([0, 1, 2, 3, 4, 6])[torch.arange(m) % 6]  # 6-7 rows each: half tiles
    ti[-1, 2] = -1  # a dropped slot
    if m == 70:
        ti[:, 1] = torch.where(torch.arange(m) < 20, 7, torch.where(torch.arange(m) < 60, 8, 3))
    counts = torch.bincount(ti[ti >= 0].long(), minlength=9)
    assert counts[5] == m and counts[7] == 20 and 6 <= counts[0] <= 12, counts
    out, ref = run(experts[9], x, tw, ti, scale=1.3, cfg=cfg)
    check(out, ref)
    full = MOE.MoeConfig(min(cfg.block_m, 32), cfg.gate_up, cfg.down)
    wide, _ = run(experts[9], x, tw, ti, scale=1.3, cfg=full)
    assert (out.float() - wide.float()).abs().max() <= 2e-2 * wide.float().abs().max()


@pytest.mark.parametrize("cfg", [CFG_HALF, CFG_HALF_LOOP, CFG_HALF_SPLITK],
                         ids=["down", "down_loop", "split_k"])
def test_32_row_blocks_take_8_16_and_32_row_tiles(experts, cfg):
    """32-row blocks under HALF_M (session 68: the quarter level, as 64-row blocks have):
    experts of 5 rows (an 8-row tile), 12 (16-row) and 28 (the full block) in one call, and one
    of 33 (a full block, then an 8-row tile): within tolerance of the reference and of the same
    call on unnarrowed 32-row blocks."""
    m = 33
    x = torch.randn(m, H, generator=torch.Generator().manual_seed(43)).bfloat16()
    tw, ti = random_routing(m, 9, 3, seed=44)
    ti[:, 0] = 2  # expert 2: all 33 rows
    ti[:, 1] = torch.where(torch.arange(m) < 28, 4, torch.where(torch.arange(m) < 31, 6, 7))
    ti[:, 2] = torch.where(torch.arange(m) < 12, 5, torch.where(torch.arange(m) < 17, 1, 3))
    counts = torch.bincount(ti.long().flatten(), minlength=9)
    assert [counts[e].item() for e in (2, 4, 5, 1, 3)] == [33, 28, 12, 5, 16], counts
    out, ref = run(experts[9], x, tw, ti, scale=1.2, cfg=cfg)
    check(out, ref)
    full, _ = run(experts[9], x, tw, ti, scale=1.2,
                  cfg=MOE.MoeConfig(32, cfg.gate_up, cfg.down))
    assert (out.float() - full.float()).abs().max() <= 2e-2 * full.float().abs().max()


@pytest.mark.parametrize("cfg", [CFG_WIDE16_LOOP, CFG_WIDE16_GU_LIVE, CFG_WIDE32_SPLITK],
                         ids=["bm16_loop", "bm16_gate_up_only_live_split", "bm32_split_k"])
def test_wide_halves_match_the_reference_and_half_m(experts, cfg):
    """wide_halves: full blocks (an expert of 40 rows: full, full, half with 16-row blocks;
    experts of 20 rows: full then half) run as two half-width gate-up tiles, blocks that narrow
    (experts of 6-7 rows) as half_m runs them: every row written once, within tolerance of the
    reference and of the same config without wide_halves."""
    m = 40
    x = torch.randn(m, H, generator=torch.Generator().manual_seed(43)).bfloat16()
    tw, ti = random_routing(m, 9, 3, seed=44)
    ti[:, 0] = 5
    ti[:, 1] = torch.where(torch.arange(m) < 20, 7, 8)
    ti[:, 2] = torch.tensor([0, 1, 2, 3, 4, 6])[torch.arange(m) % 6]
    ti[-1, 2] = -1
    out, ref = run(experts[9], x, tw, ti, scale=0.9, cfg=cfg)
    check(out, ref)
    plain, _ = run(experts[9], x, tw, ti, scale=0.9, cfg=dataclasses.replace(cfg, wide_halves=0))
    assert (out.float() - plain.float()).abs().max() <= 2e-2 * plain.float().abs().max()


@pytest.mark.parametrize("case", ["one_block", "two_blocks", "many_blocks"])
@pytest.mark.parametrize("serial", ["1", "0"])
def test_wide_halves_live_split_equals_the_fixed_split_it_picks(case, serial, monkeypatch):
    """wide_halves with a live split takes the split of the used blocks' block_n tiles (the
    same rule as without it) and equals that fixed split bit for bit; the counters (two a
    column tile) end at 0. one_block: 5 rows on one expert (a narrowed block); two_blocks: 12
    rows on each of two experts (full blocks, half-width tiles); many_blocks: both kinds."""
    monkeypatch.setenv(MOE.SERIAL_REDUCE_ENV, serial)
    w = REF.make_random_moe(9, H_LIVE, I, seed=91)
    m = {"one_block": 5, "two_blocks": 12, "many_blocks": 40}[case]
    x, tw, ti = _block_case(case, m, H_LIVE, 310)
    blocks = int(MOE.moe_align(ti, 9, 16)[1][-1])
    want = {"one_block": 4, "two_blocks": 2, "many_blocks": 1}[case]
    assert MOE.live_split(blocks, 2, 4, 4, 8) == want, blocks

    def cfg_of(split_k, target):
        return MOE.MoeConfig(16, MOE.GemmConfig(64, 128, 4, 1, 0, 0, split_k, target),
                             MOE.GemmConfig(64, 128, 4, 1, 128), half_m=1, wide_halves=1)

    _live_equals_fixed(w, x, tw, ti, cfg_of(4, 8), cfg_of(want, 0), serial)


def test_register_limit_is_a_launch_option_only(experts):
    """GemmConfig.max_regs only limits ptxas (the interpreter drops it): the same bits; values
    that are not a multiple of 8 in 64-248 are refused."""
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(8)).bfloat16()
    tw, ti = random_routing(12, 9, 3, seed=81)
    limited = dataclasses.replace(
        CFG_WIDE16_LOOP, gate_up=dataclasses.replace(CFG_WIDE16_LOOP.gate_up, max_regs=128),
        down=dataclasses.replace(CFG_WIDE16_LOOP.down, max_regs=96))
    out, ref = run(experts[9], x, tw, ti, cfg=limited)
    check(out, ref)
    assert torch.equal(out, run(experts[9], x, tw, ti, cfg=CFG_WIDE16_LOOP)[0])
    for bad in (100, 56, 256):
        cfg = dataclasses.replace(CFG, gate_up=dataclasses.replace(CFG.gate_up, max_regs=bad))
        with pytest.raises(ValueError, match="does not tile"):
            run(experts[9], x, tw, ti, cfg=cfg)


def test_wide_halves_needs_half_m_on_16_or_32_row_blocks():
    w = REF.make_random_moe(4, H, I, seed=1)
    x = torch.randn(3, H).bfloat16()
    tw, ti = random_routing(3, 4, 2, seed=1)
    for bm, half, bn in ((16, 0, 64), (8, 0, 64), (64, 1, 64), (16, 1, 16)):
        bad = MOE.MoeConfig(bm, MOE.GemmConfig(bn, 128, 4, 1), MOE.GemmConfig(64, 128, 4, 1),
                            half_m=half, wide_halves=1)
        with pytest.raises(ValueError, match="does not tile"):
            run(w, x, tw, ti, cfg=bad)


def test_config_table_is_checked_against_the_shapes(tmp_path):
    """check_config_table (run by the SGLang hook while weights load): the shipped table tiles
    Kimi's rank shapes and these tests' tiny ones; a table with a band that cannot (half_m 3,
    a gate-up block_n that does not divide the intermediate size, 4-row blocks, early_rows
    other than 0 / 1 or beside a narrowed gate-up) or with an
    unreadable band is refused, naming the band's max_m and the fix."""
    import json
    from pathlib import Path
    assert MOE.check_config_table(7168, 256) == MOE._CONFIG_PATH
    assert MOE.check_config_table(H, I) == MOE._CONFIG_PATH
    table = json.loads(Path(MOE._CONFIG_PATH).read_text())
    for band, change, shape in ((512, {"half_m": 3}, (7168, 256)),
                                (32, {"gate_up": dict(table["bands"][0]["gate_up"], block_n=96)},
                                 (7168, 256)),
                                (2048, {"block_m": 4}, (H, I)),
                                (32, {"early_rows": 1}, (7168, 256)),  # with half_m
                                (8, {"early_rows": 2}, (7168, 256))):
        bad = json.loads(json.dumps(table))
        next(b for b in bad["bands"] if b["max_m"] == band).update(change)
        path = tmp_path / f"bad_{band}.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=f"band max_m={band}: .*SGLANG_DDTREE_MOE_CONFIG"):
            MOE.check_config_table(*shape, str(path))
    del bad["bands"][0]["down"]
    (tmp_path / "no_down.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="unreadable band"):
        MOE.check_config_table(7168, 256, str(tmp_path / "no_down.json"))
    # a band with an option removed in session 47 (never in the shipped table), in session
    # 55 (MoeConfig.prefetch_down, slower on the H200) or in session 58 (self_route, as
    # session 57's timed tables set it: bench_results/moe_w4a16_configs_self_route*_s57.json)
    for gone, when in (("pairs", "session 47"), ("run_m", "session 47"),
                       ("prefetch_down", r"session 55 \(slower on the H200"),
                       ("self_route", r"session 58 \(slower on the H200")):
        old = json.loads(json.dumps(table))
        old["bands"][2][gone] = 128 if gone == "prefetch_down" else 2
        (tmp_path / f"{gone}.json").write_text(json.dumps(old))
        with pytest.raises(ValueError, match=f"unreadable band.*'{gone}' was removed in {when}"):
            MOE.check_config_table(7168, 256, str(tmp_path / f"{gone}.json"))
    for n in ("", "2"):  # session 57's timed tables are refused, not served grouped
        timed = (Path(__file__).resolve().parents[2] / "bench_results"
                 / f"moe_w4a16_configs_self_route{n}_s57.json")
        with pytest.raises(ValueError, match="'self_route' was removed in session 58"):
            MOE.check_config_table(7168, 256, str(timed))
    # a tile config with GemmConfig.prefetch_ahead (removed in session 56, slower on the
    # H200) or col_parts (session 56, slower on an H100), in either GEMM; 0, as the runs of
    # sessions 54-56 wrote every config, is dropped
    for field, why in (("prefetch_ahead", "on the H200"), ("col_parts", "on an H100")):
        for kind in ("gate_up", "down"):
            old = json.loads(json.dumps(table))
            old["bands"][2][kind][field] = 2
            path = tmp_path / f"{field}_{kind}.json"
            path.write_text(json.dumps(old))
            with pytest.raises(ValueError, match=(
                    f"unreadable band.*max_m={old['bands'][2]['max_m']} {kind}: '{field}' "
                    rf"was removed in session 56 \(slower {why}")):
                MOE.check_config_table(7168, 256, str(path))
            old["bands"][2][kind][field] = 0
            path.write_text(json.dumps(old))
            MOE.check_config_table(7168, 256, str(path))
            assert (MOE.select_config(old["bands"][2]["max_m"], str(path))
                    == MOE.select_config(old["bands"][2]["max_m"]))


def _assert_refused_for_card_x(table: dict, tmp_path, cases) -> None:
    """Each (override band, message pattern) of ``cases``, as the only override of ``table``'s
    "Card X", is refused at the check the SGLang hook runs, naming the card and the fix."""
    import json
    for i, (over, match) in enumerate(cases):
        bad = json.loads(json.dumps(table))
        bad[MOE.DEVICES]["Card X"]["bands"] = [over]
        path = tmp_path / f"bad{i}.json"  # (tables are cached by path)
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=f"overridden for 'Card X'.*{match}.*fix"):
            MOE.check_config_table(7168, 256, str(path))


def test_device_overrides_replace_fields_for_their_card_only(tmp_path, monkeypatch):
    """A table's ``devices`` overrides (keyed by torch.cuda.get_device_name()): the card named
    gets the fields they give merged into the bands they name (inside gate_up / down field by
    field), every other card and a CPU the bands as written; table_json gives the merged JSON
    without the section; an override of a band the table lacks, or one that cannot tile the
    shapes, is refused at the check the SGLang hook runs, naming the card and the fix."""
    import json
    from pathlib import Path
    table = json.loads(Path(MOE._CONFIG_PATH).read_text())
    table.pop(MOE.DEVICES, None)
    table[MOE.DEVICES] = {"Card X": {"why": "a test", "bands": [
        {"max_m": 8, "down": {"n_per_cta": 512}, "early_rows": 0},
        {"max_m": 16, "block_m": 16}]}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    base = {b["max_m"]: b for b in table["bands"]}
    for name in (None, "Card Y"):
        assert MOE.select_config(8, str(path), name) == MOE.select_config(8, str(path), None)
        assert MOE.table_json(str(path), name)["bands"] == table["bands"]
    x8 = MOE.select_config(8, str(path), "Card X")
    assert x8.down == MOE.gemm_config(dict(base[8]["down"], n_per_cta=512))
    assert x8.gate_up == MOE.gemm_config(base[8]["gate_up"]) and x8.early_rows == 0
    assert MOE.select_config(16, str(path), "Card X").block_m == 16
    assert MOE.select_config(32, str(path), "Card X") == MOE.select_config(32, str(path), None)
    merged = MOE.table_json(str(path), "Card X")
    assert MOE.DEVICES not in merged and len(merged["bands"]) == len(table["bands"])
    assert MOE.device_overrides(str(path)) == ["Card X"]
    assert MOE.check_config_table(7168, 256, str(path)) == str(path)
    # the default name: the current CUDA device's, none on a CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert MOE.cuda_device_name() is None and MOE.cuda_device_name(torch.device("cpu")) is None
    assert MOE.select_config(8, str(path)) == MOE.select_config(8, str(path), None)
    _assert_refused_for_card_x(table, tmp_path, (
        ({"max_m": 9, "down": {"n_per_cta": 512}}, "names band max_m=9"),
        ({"max_m": 8, "gate_up": {"block_n": 96}}, "band max_m=8")))


def test_device_split_override_adds_a_band_for_its_card_only(tmp_path):
    """An override band with ``"split": 1`` adds a band the table lacks for that card: a copy
    of the band that serves its max_m as written (before the card's other overrides, without
    its "us"), then its own fields; the band it was cut from keeps the M above it. A split of
    a band the table has, or past its last band, is refused naming the card and the fix."""
    import json
    from pathlib import Path
    table = json.loads(Path(MOE._CONFIG_PATH).read_text())
    table.pop(MOE.DEVICES, None)
    base = {b["max_m"]: b for b in table["bands"]}
    assert 20 not in base and 32 in base and 48 in base
    table[MOE.DEVICES] = {"Card X": {"why": "a test", "bands": [
        {"max_m": 32, "block_m": 32, "gate_up": {"split_k": 7}},
        {"max_m": 20, "split": 1, "down": {"split_target": 896}}]}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    assert MOE.check_config_table(7168, 256, str(path)) == str(path)
    x = MOE.table_json(str(path), "Card X")["bands"]
    assert [b["max_m"] for b in x] == sorted([20] + list(base))
    b20 = next(b for b in x if b["max_m"] == 20)
    want = {k: v for k, v in json.loads(json.dumps(base[32])).items() if k != "us"}
    want["max_m"], want["down"]["split_target"] = 20, 896
    assert b20 == want  # the band as written, not its Card X override (block_m 32, split_k 7)
    for m in (17, 20):
        assert MOE.select_config(m, str(path), "Card X") == dataclasses.replace(
            MOE.select_config(m, str(path), None), down=MOE.gemm_config(want["down"]))
    for m in (21, 32):
        got = MOE.select_config(m, str(path), "Card X")
        assert got.block_m == 32 and got.gate_up.split_k == 7
        assert got.down == MOE.select_config(m, str(path), None).down
    assert MOE.select_config(33, str(path), "Card X") == MOE.select_config(33, str(path), None)
    for name in (None, "Card Y"):
        assert MOE.table_json(str(path), name)["bands"] == table["bands"]
    _assert_refused_for_card_x(table, tmp_path, (
        ({"max_m": 32, "split": 1}, "splits off band max_m=32, which the table already has"),
        ({"max_m": 10 ** 6, "split": 1}, "past the table's last band"),
        ({"max_m": 20, "block_m": 32}, "names band max_m=20.*\"split\": 1 to add")))


def test_launch_picks_the_band_of_its_device(monkeypatch):
    """fused_moe_w4a16 without a config picks the band by its input's device's name."""
    seen = []
    real = MOE.select_config
    monkeypatch.setattr(MOE, "select_config", lambda m, path=None, device_name=None: (
        seen.append((m, device_name)) or real(m, path, None)))
    monkeypatch.setattr(MOE, "cuda_device_name", lambda device=None: f"name of {device}")
    w = REF.make_random_moe(4, H, I, seed=1)
    x = torch.randn(3, H).bfloat16()
    tw, ti = random_routing(3, 4, 2, seed=1)
    MOE.fused_moe_w4a16(x, w["w13_packed"], w["w13_scale"], w["w2_packed"], w["w2_scale"], tw,
                        ti)
    assert seen == [(3, "name of cpu")]


def test_half_m_needs_blocks_of_16_32_or_64():
    w = REF.make_random_moe(4, H, I, seed=1)
    x = torch.randn(3, H).bfloat16()
    tw, ti = random_routing(3, 4, 2, seed=1)
    for bm, half in ((8, 1), (128, 1), (16, 3)):
        bad = MOE.MoeConfig(bm, MOE.GemmConfig(64, 128, 4, 1), MOE.GemmConfig(64, 128, 4, 1),
                            half_m=half)
        with pytest.raises(ValueError, match="does not tile"):
            run(w, x, tw, ti, cfg=bad)

