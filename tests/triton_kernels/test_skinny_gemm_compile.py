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


def _compile(SG, n, k, block_m, cfg):
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32",
           "cnt_ptr": "*i32", "M": "i32", "stride_xm": "i32", "stride_ym": "i32"}
    const = {"N": n, "K": k, "BLOCK_M": block_m, "BLOCK_N": cfg.block_n,
             "BLOCK_K": cfg.block_k, "SPLIT_K": cfg.split_k, "PORTABLE": False}
    return compile_sm90(SG._skinny_gemm_kernel, sig, const, cfg.num_warps, cfg.num_stages)


# the rank's shapes and the splits default_config gives them on 132 SMs
CASES = [(2112, 7168), (7168, 1024), (512, 7168), (7168, 256)]


@pytest.mark.parametrize("n,k", CASES)
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_compiles_for_sm90_without_spills(SG, n, k, block_m, tmp_path):
    cfg = SG.default_config(n, k, sms=132)
    kern = _compile(SG, n, k, block_m, cfg)
    assert kern.metadata.shared <= SMEM_LIMIT, kern.metadata.shared
    assert "wgmma" in kern.asm["ptx"], "the dot left the warpgroup MMA"
    assert_no_spills(kern, tmp_path)


def test_rerun_in_clean_process():
    if _mode_ok():
        pytest.skip("ran in this process")
    run_isolated(__file__, interpret=False)
