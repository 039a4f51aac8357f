"""CPU tests of the cuda_ext loader and the tree-builder dispatcher (``sglang_ddtree.tree_backend``).

No GPU or compiler needed: a missing GPU, a missing nvcc and a failing build are simulated by
monkeypatching the loader's probes. Checked: the env switch, the automatic fallback to the
torch-op builder with one log line, the forced-cuda error message, one build attempt per process,
arch flags and the cache key, and that importing never builds.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from torch.utils import cpp_extension

from sglang_ddtree import tree_backend
from sglang_ddtree.tree import build_tree, build_tree_reference
from tests._tree_inputs import random_inputs
from tests.test_tree import assert_same_tree

LOADER = tree_backend._loader()
ENV = LOADER.ENV_BACKEND


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(tree_backend.ENV_KERNEL, raising=False)
    tree_backend._reset_for_tests()
    yield
    tree_backend._reset_for_tests()


def pretend_gpu(monkeypatch, capability=(9, 0)):
    monkeypatch.setattr(LOADER, "_cuda_capability", lambda: capability)


def no_gpu(monkeypatch):
    def probe():
        raise LOADER.ExtensionUnavailable("no CUDA device visible")
    monkeypatch.setattr(LOADER, "_cuda_capability", probe)


def pretend_toolchain(monkeypatch):
    monkeypatch.setattr(LOADER, "_toolkit_flags", lambda: ([], []))
    monkeypatch.setattr(LOADER, "_ninja_check", lambda: None)


def failing_build(calls):
    def build(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("Error building extension 'sglang_ddtree_tree_build'\n"
                           "nvcc fatal   : Unsupported gpu architecture 'compute_90'")
    return build


def fallback_warnings(caplog):
    return [r for r in caplog.records
            if r.levelno == logging.WARNING and "CUDA tree builder unavailable" in r.getMessage()]


def test_arch_flags_name_the_running_arch():
    assert LOADER.arch_flags((9, 0)) == ["-gencode=arch=compute_90,code=sm_90",
                                         "-gencode=arch=compute_90,code=compute_90"]
    assert LOADER.arch_flags((10, 0))[0] == "-gencode=arch=compute_100,code=sm_100"
    assert LOADER.arch_flags((10, 3))[0] == "-gencode=arch=compute_103,code=sm_103"


def test_cache_dir_keyed_by_torch_cuda_arch_and_sources(monkeypatch, tmp_path):
    monkeypatch.setenv(LOADER.ENV_CACHE_DIR, str(tmp_path))
    a = LOADER.cache_dir((9, 0), ["-O3"])
    assert os.path.dirname(a) == str(tmp_path)
    name = os.path.basename(a)
    assert "sm90" in name and f"cu{torch.version.cuda}" in name
    assert torch.__version__.split("+")[0] in name
    assert LOADER.cache_dir((10, 3), ["-O3"]) != a  # other arch, other directory
    assert LOADER.cache_dir((9, 0), ["-O2"]) != a  # other flags, other directory
    assert LOADER.cache_dir((9, 0), ["-O3"]) == a  # deterministic


def test_backend_env_is_validated(monkeypatch):
    monkeypatch.setenv(ENV, "Torch ")
    assert LOADER.backend_from_env() == "torch"
    monkeypatch.setenv(ENV, "triton")
    with pytest.raises(ValueError, match=f"{ENV}: expected one of auto\\|cuda\\|torch, got 'triton'"):
        tree_backend.get_tree_builder()


def test_kernel_env_is_validated_at_start_up(monkeypatch):
    kenv = tree_backend.ENV_KERNEL
    assert tree_backend.kernel_algo_from_env() == 0  # auto
    for value, algo in (("LevelWise", 1), (" frontier", 2), ("merge", 3), ("Deferred", 4),
                        ("auto", 0)):
        monkeypatch.setenv(kenv, value)
        assert tree_backend.kernel_algo_from_env() == algo
    monkeypatch.setenv(ENV, "torch")
    monkeypatch.setenv(kenv, "heap")
    with pytest.raises(ValueError, match=f"{kenv}: expected one of auto\\|levelwise\\|frontier\\|merge\\|deferred\\|"
                                         "deferred_warp, "
                                         "got 'heap'"):
        tree_backend.get_tree_builder()


def test_torch_backend_never_builds(monkeypatch):
    monkeypatch.setenv(ENV, "torch")
    calls = []
    monkeypatch.setattr(LOADER, "_build", failing_build(calls))
    pretend_gpu(monkeypatch)
    assert tree_backend.get_tree_builder() is build_tree
    assert calls == [] and not LOADER._state["attempted"]


def test_auto_without_gpu_falls_back(monkeypatch, caplog):
    no_gpu(monkeypatch)
    with caplog.at_level(logging.INFO):
        assert tree_backend.get_tree_builder() is build_tree
    (w,) = fallback_warnings(caplog)
    assert "no CUDA device visible" in w.getMessage() and "torch-op" in w.getMessage()


def test_auto_without_nvcc_falls_back_with_one_log_line(monkeypatch, caplog):
    pretend_gpu(monkeypatch)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    calls = []
    monkeypatch.setattr(LOADER, "_build", failing_build(calls))
    with caplog.at_level(logging.INFO):
        builder = tree_backend.get_tree_builder()
        assert tree_backend.get_tree_builder() is builder  # decided once
    assert builder is build_tree and calls == []
    (w,) = fallback_warnings(caplog)
    msg = w.getMessage()
    assert "nvcc not found" in msg and "\n" not in msg
    assert LOADER.unavailable_reason().startswith("nvcc not found")
    chosen = [r for r in caplog.records if "tree builder = build_tree" in r.getMessage()]
    assert len(chosen) == 1


def test_nvcc_path_missing_falls_back(monkeypatch, tmp_path):
    pretend_gpu(monkeypatch)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))  # no bin/nvcc inside
    assert tree_backend.get_tree_builder() is build_tree
    assert f"nvcc not found at {tmp_path}" in LOADER.unavailable_reason()


def test_auto_build_failure_falls_back_and_builds_once(monkeypatch, caplog):
    pretend_gpu(monkeypatch)
    pretend_toolchain(monkeypatch)
    calls = []
    monkeypatch.setattr(LOADER, "_build", failing_build(calls))
    with caplog.at_level(logging.DEBUG):
        assert tree_backend.get_tree_builder() is build_tree
        assert LOADER.load_tree_build_ext() is None
        assert LOADER.load_tree_build_ext() is None
    assert len(calls) == 1
    (w,) = fallback_warnings(caplog)
    assert "build for sm_90 failed: Error building extension" in w.getMessage()
    assert "\n" not in w.getMessage()
    # the full compiler output goes to the debug log
    assert any("Unsupported gpu architecture" in r.getMessage() for r in caplog.records
               if r.levelno == logging.DEBUG)


def test_fallback_builder_is_the_torch_builder_and_works(monkeypatch):
    pretend_gpu(monkeypatch)
    pretend_toolchain(monkeypatch)
    monkeypatch.setattr(LOADER, "_build", failing_build([]))
    builder = tree_backend.get_tree_builder()
    roots, lp, ids = random_inputs(3, 4, 5, 16, torch.Generator().manual_seed(0))
    assert_same_tree(builder(roots, lp, ids, 9), build_tree_reference(roots, lp, ids, 9))


def test_forced_cuda_turns_build_failure_into_clear_error(monkeypatch):
    monkeypatch.setenv(ENV, "cuda")
    pretend_gpu(monkeypatch, (10, 3))
    pretend_toolchain(monkeypatch)
    monkeypatch.setattr(LOADER, "_build", failing_build([]))
    with pytest.raises(LOADER.ExtensionUnavailable) as e:
        tree_backend.get_tree_builder()
    first = str(e.value).splitlines()[0]
    assert first.startswith(f"{ENV}=cuda but the CUDA tree builder is unavailable: build for "
                            "sm_103 failed: Error building extension")
    assert "Unsupported gpu architecture" in str(e.value)  # compiler output kept for the user
    with pytest.raises(LOADER.ExtensionUnavailable):  # still an error on the next call
        tree_backend.get_tree_builder()


def test_forced_cuda_without_nvcc(monkeypatch):
    monkeypatch.setenv(ENV, "cuda")
    pretend_gpu(monkeypatch)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    with pytest.raises(LOADER.ExtensionUnavailable, match=f"{ENV}=cuda but the CUDA tree builder "
                       "is unavailable: nvcc not found"):
        tree_backend.get_tree_builder()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_forced_cuda_without_gpu(monkeypatch):
    monkeypatch.setenv(ENV, "cuda")
    with pytest.raises(LOADER.ExtensionUnavailable, match="unavailable: (no CUDA device visible|"
                       "torch .* is not a CUDA build)"):
        tree_backend.get_tree_builder()


def test_build_tree_cuda_rejects_cpu_tensors_before_building(monkeypatch):
    calls = []
    monkeypatch.setattr(LOADER, "_build", failing_build(calls))
    roots, lp, ids = random_inputs(2, 3, 4, 16, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="topk_logp must be a CUDA tensor, got cpu"):
        tree_backend.build_tree_cuda(roots, lp, ids, 5)
    assert calls == []


def test_auto_builder_sends_cpu_calls_to_torch_builder(monkeypatch):
    calls = []
    monkeypatch.setattr(LOADER, "_build", failing_build(calls))
    roots, lp, ids = random_inputs(2, 3, 4, 16, torch.Generator().manual_seed(2))
    got = tree_backend.build_tree_auto(roots, lp, ids, 7)
    assert_same_tree(got, build_tree_reference(roots, lp, ids, 7))
    assert calls == []


def test_import_does_not_build():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import sys; import sglang_ddtree.tree_backend as tb; ld = tb._loader(); "
            "assert not ld._state['attempted']; "
            "assert not any(m.startswith('sglang_ddtree_tree_build') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=120)
