"""CPU cases (Triton interpreter) of the skinny bf16 GEMM against the fp32 reference.

Run by tests/triton_kernels/test_skinny_gemm.py in a fresh process with ``TRITON_INTERPRET=1``
(directly: ``TRITON_INTERPRET=1 pytest tests/triton_kernels/skinny_gemm_cases.py``).

Tolerance vs the fp32 reference: max |err| <= 1e-2 * max |ref| + 1e-3. Under the interpreter the
dots run in fp32, so the only error is the output's bf16 rounding (2^-8 relative, the
interpreter truncates: up to 2^-7). A wrong row, column or K slice gives errors of order 1.
Outputs are poisoned with NaN to catch unwritten elements.
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_kernels import load_copy

SG = load_copy("skinny", ("skinny_gemm",), interpret=True)["skinny_gemm"]
REL = 1e-2


def _check(m, n, k, cfg=None, x_stride=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(m, x_stride or k, generator=g).to(torch.bfloat16)
    x = rows[:, :k]  # a row stride above K (a view of wider rows), as SGLang's q/kv split gives
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    got = SG.skinny_gemm(x, w, out=out, config=cfg)
    ref = SG.skinny_gemm_reference(x, w)
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(got.float()).all(), "unwritten output elements"
    err = (got.float() - ref).abs().max().item()
    assert err <= REL * ref.abs().max().item() + 1e-3, (m, n, k, cfg, err)
    return got


@pytest.mark.parametrize("m", [1, 3, 16, 17, 33, 64])
def test_matches_the_reference_at_every_row_count(m):
    _check(m, 128, 512, SG.SkinnyConfig(64, 128, 2, 4, 1))


@pytest.mark.parametrize("split", [1, 2, 4])
def test_k_splits_are_summed_by_the_last_program(split):
    _check(9, 192, 512, SG.SkinnyConfig(64, 128, split, 4, 1))


def test_the_sum_does_not_depend_on_the_split_order():
    """Bitwise equal over repeated calls (the last program adds the partials in split order),
    and the counters are back at zero after each call."""
    cfg = SG.SkinnyConfig(64, 128, 4, 4, 1)
    first = _check(5, 128, 512, cfg, seed=3)
    for _ in range(3):
        again = _check(5, 128, 512, cfg, seed=3)
        assert torch.equal(first, again)
    assert int(SG.counters_for(torch.device("cpu"), 2)[:2].abs().sum()) == 0


@pytest.mark.parametrize("split", [1, 4])
def test_fp32_out_stores_the_sums_unrounded(split):
    """An fp32 ``out`` (the MoE router's GEMM returns fp32): the sums stored as they are, so
    within fp32 rounding of the reference (the interpreter dots in fp32), far inside bf16's."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(21, 512, generator=g).to(torch.bfloat16)
    w = (torch.randn(128, 512, generator=g) * 0.05).to(torch.bfloat16)
    out = torch.full((21, 128), float("nan"), dtype=torch.float32)
    got = SG.skinny_gemm(x, w, out=out, config=SG.SkinnyConfig(64, 128, split, 4, 1))
    ref = SG.skinny_gemm_reference(x, w)
    assert got.data_ptr() == out.data_ptr() and got.dtype == torch.float32
    err = (got - ref).abs().max().item()
    assert err <= 1e-5 * ref.abs().max().item(), err
    bf16 = SG.skinny_gemm(x, w, config=SG.SkinnyConfig(64, 128, split, 4, 1))
    assert (bf16.float() - ref).abs().max().item() > 10 * err  # bf16 rounding is visible


def test_pdl_modes_are_checked(monkeypatch):
    """PDL needs an sm_90+ GPU: the interpreter refuses mode 1, by argument or by the
    environment, naming the variable; unknown modes (session 68's removed 2 among them) are
    refused anywhere; 0 and unset run."""
    x = torch.randn(3, 256).to(torch.bfloat16)
    w = (torch.randn(128, 256) * 0.05).to(torch.bfloat16)
    cpu = torch.device("cpu")
    assert SG.pdl_mode(cpu) == 0 and SG.pdl_mode(cpu, 0) == 0 and SG.pdl_mode(cpu, "0") == 0
    for mode in (1, "1"):
        with pytest.raises(ValueError, match="SGLANG_DDTREE_SKINNY_PDL=.*sm_90"):
            SG.skinny_gemm(x, w, pdl=mode)
    for bad in (2, "on", "1:g"):
        with pytest.raises(ValueError, match="0 \\(plain launches\\) or 1"):
            SG.pdl_mode(cpu, bad)
    monkeypatch.setenv("SGLANG_DDTREE_SKINNY_PDL", "1")
    with pytest.raises(ValueError, match="SGLANG_DDTREE_SKINNY_PDL=1"):
        SG.skinny_gemm(x, w)
    monkeypatch.setenv("SGLANG_DDTREE_SKINNY_PDL", "0")
    assert torch.isfinite(SG.skinny_gemm(x, w).float()).all()


def test_default_config_splits_thin_matrices():
    # 2 column tiles of 8 K steps on the interpreter's 2-SM "machine": 4 programs wanted
    cfg = SG.default_config(128, 1024, sms=2)
    assert (cfg.block_n, cfg.block_k, cfg.split_k) == (64, 128, 2)
    _check(7, 128, 1024, x_stride=1100)


def test_plan_split_kimi_rank_shapes():
    """132 SMs, 264 programs wanted, splits up to 16 dividing the K steps (64 x 128 tiles)."""
    sms2 = 264
    # q/kv down-projection 7168 -> 2112: 33 tiles x 8 = 264
    assert SG.plan_split(2112 // 64, 7168 // 128, sms2) == 8
    # o_proj 1024 -> 7168: 112 tiles x 4
    assert SG.plan_split(7168 // 64, 1024 // 128, sms2) == 4
    # shared expert gate-up 7168 -> 512: 8 tiles; 33 splits wanted, 14 the most dividing 56
    assert SG.plan_split(512 // 64, 7168 // 128, sms2) == 14
    # shared expert down 256 -> 7168: two K steps, both split
    assert SG.plan_split(7168 // 64, 256 // 128, sms2) == 2
    assert SG.plan_split(320, 56, sms2) == 1  # a rank's lm_head: 320 tiles already


def test_bad_input_names_the_problem():
    x = torch.zeros(3, 256, dtype=torch.bfloat16)
    w = torch.zeros(128, 256, dtype=torch.bfloat16)
    for args, kwargs, what in (
            ((x.float(), w), {}, "bf16"),
            ((torch.zeros(65, 256, dtype=torch.bfloat16), w), {}, "M <= 64"),
            ((x, w.t().contiguous().t()), {}, "contiguous"),
            ((x, torch.zeros(100, 256, dtype=torch.bfloat16)), {}, "multiple of 64"),
            ((x, w), {"config": SG.SkinnyConfig(64, 128, 3)}, "does not tile"),
            ((x, w), {"out": torch.zeros(3, 64, dtype=torch.bfloat16)}, "out [3, 128]"),
            ((x, w), {"out": torch.zeros(3, 128, dtype=torch.float16)}, "bf16 or fp32")):
        with pytest.raises(ValueError, match=what.replace("[", r"\[")):
            SG.skinny_gemm(*args, **kwargs)


def test_benchmark_script_smoke_run(tmp_path):
    """scripts/bench_skinny_gemm.py on the interpreter: tiny shapes, the JSON it writes."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_skinny_gemm.py"
    spec = importlib.util.spec_from_file_location("_bench_skinny_smoke", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "skinny.json"
    assert bench.main(["--device", "cpu", "--shapes", "128x512", "--ms", "3", "17",
                       "--layers", "2", "--iters", "1", "--rounds", "2", "--out", str(out),
                       "--sweep", "32,128,0;64,256,2;64,128,3;256,128,1"]) == 0
    res = json.loads(out.read_text())
    assert [(r["shape"], r["m"]) for r in res["rows"]] == [("128x512", 3), ("128x512", 17)]
    for r in res["rows"]:
        assert set(r["us"]) == {"ours", "cublas"} and r["max_rel_err_vs_fp32"] < 1e-2
        assert r["config"]["split_k"] == 2 and r["layers"] == 2
        sw = r["sweep_us"]
        assert isinstance(sw["32,128,0"], float) and isinstance(sw["64,256,2"], float)
        assert sw["64,128,3"] == sw["256,128,1"] == "does not tile"  # 4 K steps; N 128
    out32 = tmp_path / "skinny32.json"
    assert bench.main(["--device", "cpu", "--shapes", "128x512", "--ms", "17", "--layers", "1",
                       "--iters", "1", "--rounds", "1", "--fp32-out", "--out", str(out32),
                       "--sweep", "32,128,0"]) == 0
    res32 = json.loads(out32.read_text())
    assert res32["out_dtype"] == "float32" and res32["rows"][0]["max_rel_err_vs_fp32"] < 1e-4
    assert isinstance(res32["rows"][0]["sweep_us"]["32,128,0"], float)
    for pdl in (["--pdl"], ["--pdl", "2"]):  # PDL needs an sm_90+ GPU; --pdl takes no value
        with pytest.raises(SystemExit):
            bench.main(["--device", "cpu", "--shapes", "128x512", *pdl,
                        "--out", str(tmp_path / "pdl.json")])
    assert not (tmp_path / "pdl.json").exists()
    with pytest.raises(SystemExit, match="NxK"):
        bench.parse_shapes("128by512")
    with pytest.raises(SystemExit, match="block_n,block_k,split_k"):
        bench.parse_sweep("64,128")
