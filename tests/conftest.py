"""Test-suite wide settings: GPU-marked tests skip cleanly where CUDA is absent.

Without CUDA, Triton kernels can only run in its interpreter, and Triton fixes the mode of its
library functions (tl.sum, tl.cumsum, ...) at its first import. So on a CPU-only machine the
whole session is put in interpreter mode here, before any test module (or SGLang) imports Triton.
"""
import os

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
