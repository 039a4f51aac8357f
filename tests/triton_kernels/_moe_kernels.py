"""Private copies of the fused-MoE kernel modules for tests, in interpreter or compiled mode.

Triton fixes interpreter vs compiled mode when a kernel is decorated, so CPU tests (interpreter)
and GPU tests (compiled) in one pytest process each import their own copy of
``triton_kernels/moe_w4a16.py`` under a private package name (the same idea as
``tests.triton_kernels.load_kernels``, kept separate so each helper owns its module list).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

_KERNEL_DIR = Path(__file__).resolve().parents[2] / "triton_kernels"


def load_moe(interpret: bool) -> types.SimpleNamespace:
    """Return ``moe_w4a16`` and ``moe_reference`` modules (interpreter copy if ``interpret``)."""
    name = "_ddtree_moe_interp" if interpret else "_ddtree_moe_compiled"
    if name not in sys.modules:
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
        try:
            spec = importlib.util.spec_from_file_location(
                name, _KERNEL_DIR / "__init__.py", submodule_search_locations=[str(_KERNEL_DIR)])
            pkg = importlib.util.module_from_spec(spec)
            sys.modules[name] = pkg
            spec.loader.exec_module(pkg)
            for sub in ("moe_w4a16", "moe_reference"):
                importlib.import_module(f"{name}.{sub}")
        finally:
            if old is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = old
    return types.SimpleNamespace(
        moe=sys.modules[f"{name}.moe_w4a16"], ref=sys.modules[f"{name}.moe_reference"])


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
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           test_file], cwd=_KERNEL_DIR.parent, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
