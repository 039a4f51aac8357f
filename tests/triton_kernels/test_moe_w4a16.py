"""CPU tests of the fused W4A16 MoE kernel in Triton's interpreter (cases: moe_w4a16_cases.py).

``triton.language``'s own jit functions (tl.sum, tl.cumsum, ...) take the mode of the first
``import triton`` in a process, so interpreter cases cannot share a pytest process with modules
that imported triton in compiled mode: they run in a fresh process with ``TRITON_INTERPRET=1``
and the child's report is shown on failure.
"""
from __future__ import annotations

from pathlib import Path

from tests.triton_kernels._moe_kernels import run_isolated


def test_interpreter_cases():
    run_isolated(str(Path(__file__).with_name("moe_w4a16_cases.py")), interpret=True)
