"""CPU-only check that the skinny GEMM compiles for Hopper (sm_90) at the Kimi rank's shapes:
within shared memory, no register spills, and its dot on the warpgroup MMA (wgmma) with the
weight tile as the A operand. Triton compiles for a named target without a GPU (see
test_moe_w4a16_compile.py, whose harness and process rules this follows).
"""
from __future__ import annotations

import pytest

from tests.triton_kernels import load_copy
from tests.triton_kernels._moe_kernels import lang_mode_matches, run_isolated
from tests.triton_kernels._sm90 import SMEM_LIMIT, assert_no_spills, compile_sm90


def _sg():
    return load_copy("skinny", ("skinny_gemm",), interpret=False)["skinny_gemm"]


def _mode_ok() -> bool:
    _sg()
    return lang_mode_matches(interpret=False)


@pytest.fixture(scope="module")
def SG():
    if not _mode_ok():
        pytest.skip("triton was imported in interpreter mode here; see test_rerun_in_clean_process")
    return _sg()


def _compile(SG, n, k, block_m, cfg, stages=None, pdl=0):
    """As a launch compiles it: the row strides (K and N) specialized as multiples of 16, the
    stages launch_stages gives (or ``stages``); ``pdl`` the wrapper's PDL mode (0 / 1)."""
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32",
           "cnt_ptr": "*i32", "M": "i32", "stride_xm": "i32", "stride_ym": "i32"}
    const = {"N": n, "K": k, "BLOCK_M": block_m, "BLOCK_N": cfg.block_n,
             "BLOCK_K": cfg.block_k, "SPLIT_K": cfg.split_k, "PORTABLE": False,
             **({"PDL": 1} if pdl else {})}
    return compile_sm90(SG._skinny_gemm_kernel, sig, const, cfg.num_warps,
                        stages or SG.launch_stages(cfg, block_m),
                        div16=("stride_xm", "stride_ym"))


# the rank's shapes and the splits default_config gives them on 132 SMs
CASES = [(2112, 7168), (7168, 1024), (512, 7168), (7168, 256)]


@pytest.mark.parametrize("n,k", CASES)
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_compiles_for_sm90_without_spills(SG, n, k, block_m, tmp_path):
    cfg = SG.default_config(n, k, sms=132)
    kern = _compile(SG, n, k, block_m, cfg)
    # two programs per SM, as plan_split counts (the launch's stage count sees to it)
    assert kern.metadata.shared <= SG._SMEM_TWO_PER_SM, kern.metadata.shared
    assert "wgmma" in kern.asm["ptx"], "the dot left the warpgroup MMA"
    assert_no_spills(kern, tmp_path)


@pytest.mark.parametrize("n,k,block_m", [(2112, 7168, 32), (384, 7168, 32), (512, 7168, 16)])
def test_pdl_compiles_without_spills(SG, n, k, block_m, tmp_path):
    """PDL mode 1 at the q / kv down-projection's, the router's (its served split:
    dense_hook.ROUTER_CONFIG) and the shared expert gate-up's shapes: the wait is in the binary
    before any global load, the dot still wgmma, the shared memory of two programs an SM, no
    spills; without PDL no griddepcontrol at all."""
    cfg = SG.default_config(n, k, sms=132)
    kern = _compile(SG, n, k, block_m, cfg, pdl=1)
    ptx = kern.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "wgmma" in ptx
    assert kern.metadata.shared <= SG._SMEM_TWO_PER_SM, kern.metadata.shared
    assert_no_spills(kern, tmp_path)
    assert "griddepcontrol" not in _compile(SG, n, k, block_m, cfg).asm["ptx"]
    first_load = min(i for i in (ptx.find("ld.global"), ptx.find("cp.async")) if i >= 0)
    assert ptx.find("griddepcontrol.wait") < first_load


def test_four_stages_at_64_rows_would_hold_one_program_per_sm(SG):
    """Why launch_stages clamps: with the strides specialized Triton stages x as well as W in
    shared memory, and 4 stages of 64 x 64 x 128 tiles take 131,072 bytes."""
    cfg = SG.default_config(2112, 7168, sms=132)
    assert SG.launch_stages(cfg, 64) == 3 and SG.launch_stages(cfg, 32) == 4
    kern = _compile(SG, 2112, 7168, 64, cfg, stages=4)
    assert SG._SMEM_TWO_PER_SM < kern.metadata.shared <= SMEM_LIMIT


def test_rerun_in_clean_process():
    if _mode_ok():
        pytest.skip("ran in this process")
    run_isolated(__file__, interpret=False)
