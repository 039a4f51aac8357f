"""scripts/bench_fused_moe.py's --breakdown / --tune on tiny shapes in Triton's interpreter
(cases: bench_fused_moe_cases.py), in a fresh process: interpreter kernels cannot share a pytest
process with modules that imported triton in compiled mode (see test_moe_w4a16.py)."""
from __future__ import annotations

from pathlib import Path

from tests.triton_kernels._moe_kernels import run_isolated


def test_benchmark_modes_in_the_interpreter():
    run_isolated(str(Path(__file__).with_name("bench_fused_moe_cases.py")), interpret=True)
