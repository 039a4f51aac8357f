"""Private copies of the fused-MoE kernel modules for tests, in interpreter or compiled mode.

Triton fixes interpreter vs compiled mode when a kernel is decorated, so CPU tests (interpreter)
and GPU tests (compiled) in one pytest process each import their own copy of
``triton_kernels/moe_w4a16.py`` under a private package name (the same idea as
``tests.triton_kernels.load_kernels``; both use ``load_copy``).
"""
from __future__ import annotations

import os
import sys
import types
from pathlib import Path

from tests.triton_kernels import load_copy

_KERNEL_DIR = Path(__file__).resolve().parents[2] / "triton_kernels"


def load_moe(interpret: bool) -> types.SimpleNamespace:
    """Return ``moe_w4a16`` and ``moe_reference`` modules (interpreter copy if ``interpret``)."""
    mods = load_copy("moe", ("moe_w4a16", "moe_reference"), interpret)
    return types.SimpleNamespace(moe=mods["moe_w4a16"], ref=mods["moe_reference"])


def lang_mode_matches(interpret: bool) -> bool:
    """Whether ``triton.language``'s own jit functions (tl.sum, tl.cumsum, ...) are in the mode.

    They are decorated once, when ``triton`` is first imported: a process that imported triton in
    compiled mode cannot run interpreter kernels that call them, and vice versa. Call after
    :func:`load_moe`, which makes the first import in the mode it was asked for.
    """
    import triton.language.standard as std

    return (type(std.cumsum).__name__ == "InterpretedFunction") == interpret


def run_isolated(test_file: str, interpret: bool) -> None:
    """Run ``test_file`` with pytest in a fresh process whose triton is in the right mode."""
    import subprocess

    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1" if interpret else "0"
    # (the interpreter cases take 5-6 minutes on CI's two cores, and up to three times that
    # on a two-core machine that is slower or busy: session 54's took 11-20; CI allows 90)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           test_file], cwd=_KERNEL_DIR.parent, env=env, capture_output=True,
                          text=True, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
