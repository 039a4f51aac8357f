"""CPU tests of the MLA absorb bmm in Triton's interpreter (cases: mla_absorb_cases.py), in a
fresh process for the reason tests/triton_kernels/test_moe_w4a16.py gives."""
from __future__ import annotations

from pathlib import Path

from tests.triton_kernels._moe_kernels import run_isolated


def test_interpreter_cases():
    run_isolated(str(Path(__file__).with_name("mla_absorb_cases.py")), interpret=True)
