"""The one cached loader of sglang-ddtree's compiled CUDA code (the fused tree-build kernel).

Nothing here runs at import time. The first :func:`load_tree_build_ext` call JIT-builds
``tree_build.cpp`` + ``tree_build.cu`` with ``torch.utils.cpp_extension.load`` (nvcc of the CUDA
toolkit torch finds through ``CUDA_HOME``), for the running GPU's architecture only
(``-gencode`` sm_90 on Hopper, sm_100 / sm_103 on Blackwell, plus that arch's PTX), into a cache
directory keyed by torch version, CUDA version, arch and a hash of the sources; later processes
load the cached library. The outcome (module or failure reason) is cached per process.

``SGLANG_DDTREE_TREE_BACKEND`` picks the tree builder (see ``sglang_ddtree.tree_backend``):
``auto`` (default) uses this extension when it builds and falls back to the torch-op builder
with one log line when it cannot (no GPU, no nvcc, build error); ``cuda`` turns any failure into
an error; ``torch`` never builds. ``SGLANG_DDTREE_CACHE_DIR`` overrides the cache root
(default ``$XDG_CACHE_HOME/sglang_ddtree`` or ``~/.cache/sglang_ddtree``).
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from typing import List, Optional, Tuple

logger = logging.getLogger(__name__)

ENV_BACKEND = "SGLANG_DDTREE_TREE_BACKEND"
ENV_CACHE_DIR = "SGLANG_DDTREE_CACHE_DIR"
BACKENDS = ("auto", "cuda", "torch")

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = ("tree_build.cpp", "tree_build.cu")
_HEADERS = ("tree_build_kernel.cuh", "tree_build_params.h")
_EXT_NAME = "sglang_ddtree_tree_build"
_CUDA_CFLAGS = ["-O3", "-lineinfo"]


class ExtensionUnavailable(RuntimeError):
    """The CUDA tree builder cannot be used here; ``reason`` says why in one line."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason + (f"\n{detail}" if detail else ""))
        self.reason = reason
        self.detail = detail


def backend_from_env() -> str:
    """``SGLANG_DDTREE_TREE_BACKEND`` (auto|cuda|torch, default auto), validated."""
    value = os.environ.get(ENV_BACKEND, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{ENV_BACKEND}: expected one of {'|'.join(BACKENDS)}, got {value!r}")
    return value


def arch_flags(capability: Tuple[int, int]) -> List[str]:
    """nvcc ``-gencode`` flags for one compute capability: its SASS and its PTX.

    (9, 0) -> sm_90, (10, 0) -> sm_100, (10, 3) -> sm_103. The kernel uses no arch-specific
    ("a") features, so the plain targets suffice; the PTX lets a newer driver JIT it.
    """
    major, minor = capability
    arch = f"{major}{minor}"
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}",
            f"-gencode=arch=compute_{arch},code=compute_{arch}"]


def _source_hash(extra: List[str]) -> str:
    h = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        with open(os.path.join(_HERE, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    h.update("\0".join(extra).encode())
    return h.hexdigest()[:12]


def cache_dir(capability: Tuple[int, int], extra: List[str]) -> str:
    """Build directory for this torch / CUDA / arch / source combination."""
    import torch

    root = os.environ.get(ENV_CACHE_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "sglang_ddtree")
    key = (f"tree_build-torch{torch.__version__}-cu{torch.version.cuda}"
           f"-sm{capability[0]}{capability[1]}-{_source_hash(extra)}")
    return os.path.join(root, re.sub(r"[^A-Za-z0-9._-]", "_", key))


# ----------------------------------------------------------------------------------------------
# Probes (small functions so that tests can simulate a missing GPU, nvcc or a failing build).


def _cuda_capability() -> Tuple[int, int]:
    import torch

    if torch.version.cuda is None:
        raise ExtensionUnavailable(f"torch {torch.__version__} is not a CUDA build")
    if not torch.cuda.is_available():
        raise ExtensionUnavailable("no CUDA device visible")
    return torch.cuda.get_device_capability()


def _toolkit_flags() -> Tuple[List[str], List[str]]:
    """Check that nvcc and the CUDA headers exist; return (extra include dirs, extra ldflags).

    torch derives CUDA_HOME from ``$CUDA_HOME``, else ``which nvcc``, else /usr/local/cuda. When
    nvcc on PATH is a wrapper script (CUDA_HOME then lacks include/), point the build at a real
    toolkit root that has the same nvcc version's headers.
    """
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if not home:
        raise ExtensionUnavailable("nvcc not found (torch sees no CUDA_HOME; set CUDA_HOME to the "
                                   "CUDA toolkit)")
    nvcc = os.path.join(home, "bin", "nvcc")
    if not os.path.exists(nvcc):
        raise ExtensionUnavailable(f"nvcc not found at {nvcc} (set CUDA_HOME to the CUDA toolkit)")
    if os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
        return [], []
    for root in ("/usr/local/cuda", *sorted(_glob_cuda_roots(), reverse=True)):
        if os.path.exists(os.path.join(root, "include", "cuda_runtime.h")):
            return [os.path.join(root, "include")], [f"-L{os.path.join(root, 'lib64')}"]
    raise ExtensionUnavailable(f"CUDA headers not found (no cuda_runtime.h under {home}/include "
                               f"or /usr/local/cuda*/include)")


def _glob_cuda_roots() -> List[str]:
    import glob

    return glob.glob("/usr/local/cuda-*")


def _ninja_check() -> None:
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise ExtensionUnavailable("ninja not found (pip install ninja)")


def _build(build_dir: str, cuda_cflags: List[str], include_dirs: List[str], ldflags: List[str]):
    from torch.utils.cpp_extension import load

    os.makedirs(build_dir, exist_ok=True)
    return load(
        name=_EXT_NAME,
        sources=[os.path.join(_HERE, s) for s in _SOURCES],
        extra_cflags=["-O3"],
        extra_cuda_cflags=cuda_cflags,
        extra_include_paths=[_HERE] + include_dirs,
        extra_ldflags=ldflags,
        build_directory=build_dir,
        verbose=False,
    )


# ----------------------------------------------------------------------------------------------

_lock = threading.Lock()
_state: dict = {"attempted": False, "module": None, "error": None}


def _try_load():
    capability = _cuda_capability()
    include_dirs, ldflags = _toolkit_flags()
    _ninja_check()
    cuda_cflags = _CUDA_CFLAGS + arch_flags(capability)
    build_dir = cache_dir(capability, cuda_cflags)
    arch = f"sm_{capability[0]}{capability[1]}"
    t0 = time.perf_counter()
    try:
        module = _build(build_dir, cuda_cflags, include_dirs, ldflags)
    except Exception as e:  # compiler / linker / import errors all mean "no extension"
        text = str(e).strip()
        first = text.splitlines()[0] if text else type(e).__name__
        raise ExtensionUnavailable(f"build for {arch} failed: {first[:200]}", text) from e
    logger.info("sglang_ddtree: CUDA tree builder ready for %s in %.1f s (cache %s)", arch,
                time.perf_counter() - t0, build_dir)
    return module


def load_tree_build_ext(required: bool = False):
    """The compiled extension module, or None when it cannot be used here (reason logged once).

    required=True raises :class:`ExtensionUnavailable` instead of returning None. Thread-safe;
    the build is attempted at most once per process.
    """
    with _lock:
        if not _state["attempted"]:
            _state["attempted"] = True
            try:
                _state["module"] = _try_load()
            except ExtensionUnavailable as e:
                _state["error"] = e
                logger.warning("sglang_ddtree: CUDA tree builder unavailable (%s); using the "
                               "torch-op tree builder", e.reason)
                if e.detail:
                    logger.debug("sglang_ddtree: CUDA tree builder build log:\n%s", e.detail)
        module, error = _state["module"], _state["error"]
    if module is None and required:
        raise ExtensionUnavailable(
            f"{ENV_BACKEND}=cuda but the CUDA tree builder is unavailable: {error.reason}",
            error.detail)
    return module


def unavailable_reason() -> Optional[str]:
    """Why the last load attempt failed (None if it succeeded or was never attempted)."""
    err = _state["error"]
    return None if err is None else err.reason


def _reset_for_tests() -> None:
    with _lock:
        _state.update(attempted=False, module=None, error=None)
