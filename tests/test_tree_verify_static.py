"""scripts/tree_verify_static.py: the verify kernel compiled for sm_90 without a GPU (skipped
where the CUDA toolkit's ptxas or Triton's CUDA backend is missing, e.g. in CI). Runs the script
in its own process: this test session may have Triton's interpreter switched on."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "scripts", "tree_verify_static.py")
_spec = importlib.util.spec_from_file_location("tree_verify_static", SCRIPT)
tvs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tvs)


def _run(*args):
    """The script's JSON rows, in its own process (compiled mode); skips where this machine
    cannot compile for CUDA or has no ptxas."""
    pytest.importorskip("triton")
    ptxas = tvs.bundled_ptxas()
    if not os.path.exists(ptxas):
        pytest.skip("no ptxas (neither Triton's nor the CUDA toolkit's)")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, SCRIPT, *args, "--ptxas", ptxas],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.strip().splitlines()]
    for row in rows:
        if "error" in row and ("backend" in row["error"].lower() or "cuda" in row["error"].lower()):
            pytest.skip(f"Triton cannot target CUDA here: {row['error']}")
        assert row.get("ptxas_error") is None and "error" not in row, row
    return rows


def test_static_report_of_one_mha_config():
    row, = _run("--kind", "mha", "--configs", "64,64,4,2,2,64")
    assert row["registers"] and row["registers"] <= 255
    assert row["wgmma"] > 0 and row["mma_sync"] == 0  # Hopper tensor-core instructions


def test_ctas_per_sm_follows_the_sm90_limits():
    # the served MLA tile: 255 registers x 4 warps fit twice in 64K registers; 114,688 bytes of
    # shared memory twice in 228 KB with the 1 KB a block reserves, 116,736 bytes once
    assert tvs.ctas_per_sm(114688, 255, 4) == {"shared": 2, "registers": 2, "warps": 16,
                                                "ctas": 2}
    assert tvs.ctas_per_sm(116736, 255, 4)["ctas"] == 1
    # registers in units of 256 a warp: 241 x 32 -> 7,936 -> 8,192; 8 warps fit once
    assert tvs.ctas_per_sm(0, 241, 8)["registers"] == 1
    assert tvs.ctas_per_sm(0, 32, 1)["ctas"] == 32  # the 32-block cap


def test_budget_specialization_follows_the_kernels_opt_out():
    class Fn:
        arg_names = ["q_ptr", "N", "stride_mb", "stride_mi"]
        do_not_specialize = []

    assert tvs.budget_specialized(Fn, 31) == {"N", "stride_mb", "stride_mi"}  # N = 32
    assert tvs.budget_specialized(Fn, 32) == set()                            # N = 33
    Fn.do_not_specialize = ["N", 2]  # by name or by index, as triton.jit takes them
    assert tvs.budget_specialized(Fn, 63) == {"stride_mi"}


@pytest.mark.parametrize("budget", [31, 32, 63])
def test_served_mla_tiles_compile_to_one_binary_at_two_programs_per_sm(budget):
    """The MLA split planner counts two programs per SM (split_count's slots). At budgets 31
    and 63 (N = 32, 64) Triton specialized N and the mask strides as multiples of 16 and the
    default tile took 116,736 bytes of shared memory, one program per SM; the kernel opts out,
    so every budget compiles what budget 32 does."""
    rows = _run("--kind", "mla", "--configs", "32,64,4,2;16,64,4,2", "--budget", str(budget),
                "--min-split-keys", "128")
    for row in rows:
        assert row["specialized"] == [], row
        assert row["ctas_per_sm"]["ctas"] >= 2, row


def test_the_drafter_block_keeps_its_specialized_binary():
    """The drafter's block (16 tokens, unordered mask; the Kimi drafter's 8:1 heads) compiles
    with N and the mask strides specialized, as its session-24 benchmarks ran it."""
    row, = _run("--kind", "mha", "--group", "8", "--configs", "64,64,4,3", "--budget", "15",
                "--draft-block")
    assert row["draft_block"] and row["specialized"] == ["N", "stride_mb", "stride_mi"], row


@pytest.mark.parametrize("arch", [90, 89])
def test_the_planners_mla_tile_table_matches_the_compiler(arch):
    """tree_attention_plan._MLA_TILE_SMEM (which tile a device's shared memory takes, and how
    many programs an SM holds) is what the compiler gives the served tiles: on the H200's
    sm_90 and on sm_89 (99 KB a block: the 32-row tile does not fit, the 16-row one does)."""
    from tests.triton_kernels import load_kernels

    plan = load_kernels(interpret=True).tree_attention_plan
    rows = _run("--kind", "mla", "--arch", str(arch), "--configs", "32,64,4,2;16,64,4,2",
                "--budget", "32", "--min-split-keys", "128")
    got = {int(r["config"].split(",")[0]): r for r in rows}
    for block_m, smem in plan._MLA_TILE_SMEM.items():
        assert got[block_m]["shared_bytes"] == smem, (arch, got[block_m])
    assert got[16]["fits_shared_memory"]
    assert got[32]["fits_shared_memory"] == (arch == 90)
    if arch == 90:  # the 8-warp tile the planner serves wide trees with on Hopper
        wide, = _run("--kind", "mla", "--arch", "90", "--configs", "64,64,8,2", "--budget", "64")
        assert wide["shared_bytes"] == plan._MLA_WGMMA_SMEM and wide["wgmma"] > 0, wide
        assert wide["ctas_per_sm"]["ctas"] == 1, wide


def test_shared_memory_record_by_arch(tmp_path):
    """scripts/shared_memory_by_arch.py (bench_results/shared_memory_by_arch_s31.json): the MLA
    tiles at the planner's table, the skinny GEMM's launch stages within two programs per SM."""
    pytest.importorskip("triton")
    out = tmp_path / "record.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, os.path.join(HERE, "..", "scripts",
                                                     "shared_memory_by_arch.py"),
                        "--archs", "89", "--skinny-archs", "90", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=900)
    if r.returncode and ("backend" in r.stderr.lower() or "ptxas" in r.stderr.lower()):
        pytest.skip(f"Triton cannot target CUDA here: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads(out.read_text())
    from tests.triton_kernels import load_copy, load_kernels

    plan = load_kernels(interpret=True).tree_attention_plan
    assert {int(row["config"].split(",")[0]): row["shared_bytes"]
            for row in rec["mla"]["89"]} == plan._MLA_TILE_SMEM
    sg = load_copy("skinny", ("skinny_gemm",), interpret=True)["skinny_gemm"]
    served = [row for row in rec["skinny"]["90"] if row["launch_stages"]]
    assert served and all(row["shared_bytes"] <= sg._SMEM_TWO_PER_SM for row in served)
    assert rec["moe"]["89"] and rec["triton"] and rec["date"]
