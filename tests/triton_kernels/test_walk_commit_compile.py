"""CPU-only check that walk_commit's kernel compiles for Hopper (sm_90): catches what the Triton
interpreter cannot (scalar loop-carried values, int64 atomics, the constexpr branches), without
a GPU. Runs in a fresh process when this one already imported triton in interpreter mode."""
from __future__ import annotations

import pytest

from tests.triton_kernels._moe_kernels import lang_mode_matches, run_isolated
from tests.triton_kernels import load_copy


def _kernel():
    return load_copy("walk", ("walk_commit",), interpret=False)["walk_commit"]._walk_commit_kernel


def _mode_ok() -> bool:
    _kernel()
    return lang_mode_matches(interpret=False)


@pytest.mark.parametrize("width,n_pad,budgets,prefix", [(16, 64, 6, "*i64"), (16, 1024, 0, "*i32"),
                                                        (2, 2, 1, "*i64"), (8, 16, 5, "*i32")])
def test_compiles_for_sm90(width, n_pad, budgets, prefix):
    if not _mode_ok():
        pytest.skip("triton was imported in interpreter mode here; see test_rerun_in_clean_process")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    i64 = "*i64"
    sig = {"tokens_ptr": i64, "parents_ptr": i64, "valid_ptr": "*i8", "pred_ptr": i64,
           "slots_ptr": i64, "prefix_ptr": prefix, "out_tokens_ptr": i64,
           "commit_lens_ptr": "*i32", "new_lens_ptr": i64, "path_ptr": i64, "bonus_ptr": i64,
           "rows_ptr": i64, "dst_ptr": i64, "src_ptr": i64, "budgets_ptr": i64,
           "totals_ptr": i64, "N": "i32", "stride_slots": "i32"}
    const = dict(WIDTH=width, N_PAD=n_pad, NUM_BUDGETS=budgets,
                 B_PAD=triton.next_power_of_2(max(budgets, 1)))
    sig = dict(sig, **{k: "constexpr" for k in const})
    names = list(sig)
    src = ASTSource(fn=_kernel(), signature=sig,
                    constexprs={(names.index(k),): v for k, v in const.items()})
    kern = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 1 if n_pad <= 64 else 4, "num_stages": 1})
    ptx = kern.asm["ptx"]
    assert ("atom.global" in ptx or "red.global" in ptx) == (budgets > 0)


def test_rerun_in_clean_process():
    if _mode_ok():
        pytest.skip("ran in this process")
    run_isolated(__file__, interpret=False)
