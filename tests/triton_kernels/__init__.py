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


def compiled_kernels_where(kernel: str, machine_problems) -> types.SimpleNamespace:
    """GPU tests of a prefix kernel (FlashMLA, FA3): :func:`load_kernels` compiled where a CUDA
    GPU is there and ``machine_problems(device)`` finds nothing, else the test is skipped with
    the reason."""
    import pytest
    import torch

    if not torch.cuda.is_available():
        pytest.skip(f"{kernel} cannot run here: no CUDA GPU")
    why = machine_problems(torch.device("cuda"))
    if why:
        pytest.skip(f"{kernel} cannot run here: {'; '.join(why)}")
    return load_kernels(interpret=False)


def rel_err(out, ref) -> float:
    """max |out - ref| / max |ref| (the GPU tests' relative error)."""
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def graph_replay(call, like):
    """``call(out)`` captured in a CUDA graph (after a warm-up run outside the capture) and
    replayed into a NaN-filled buffer shaped as ``like``; returns that buffer."""
    import torch

    out = torch.full_like(like, float("nan"))
    call(out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return out
