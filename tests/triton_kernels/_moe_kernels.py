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
