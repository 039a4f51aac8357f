"""Tests of the Triton kernels (triton_kernels/, installed as sglang_ddtree.triton_kernels).

:func:`load_kernels` imports the kernel files straight from the repository under a private package
name. Triton decides interpreter vs compiled mode when a kernel is *decorated*, so CPU tests need a
copy imported with ``TRITON_INTERPRET=1`` while GPU tests in the same pytest process need compiled
ones; two private copies keep the modes apart and need no installed package.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

_KERNEL_DIR = Path(__file__).resolve().parents[2] / "triton_kernels"


def load_copy(tag: str, submodules, interpret: bool, kernel_dir=None) -> dict:
    """Import ``triton_kernels/<sub>.py`` (or ``kernel_dir/<sub>.py``: another checkout's kernels)
    for each sub under a private package name (one copy per tag and mode); returns
    {sub: module}."""
    name = f"_ddtree_{tag}_{'interp' if interpret else 'compiled'}"
    kdir = Path(kernel_dir).resolve() if kernel_dir is not None else _KERNEL_DIR
    if name not in sys.modules:
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
        try:
            spec = importlib.util.spec_from_file_location(
                name, kdir / "__init__.py", submodule_search_locations=[str(kdir)])
            pkg = importlib.util.module_from_spec(spec)
            sys.modules[name] = pkg
            spec.loader.exec_module(pkg)
            for sub in submodules:
                importlib.import_module(f"{name}.{sub}")
        finally:
            if old is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = old
    return {sub: sys.modules[f"{name}.{sub}"] for sub in submodules}


def load_kernels(interpret: bool) -> types.SimpleNamespace:
    """Return ``tree_attention``, ``tree_attention_mla``, ``tree_attention_plan`` and
    ``reference`` modules.

    ``interpret=True`` gives a copy whose kernels run in Triton's CPU interpreter.
    """
    return types.SimpleNamespace(**load_copy(
        "kernels", ("tree_attention", "tree_attention_mla", "tree_attention_plan", "reference"),
        interpret))
