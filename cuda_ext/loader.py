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


# ----------------------------------------------------------------------------------------------
# The small-M W4A16 MoE GEMMs (moe_w4a16_small.cu): a plain shared library built by nvcc alone
# (static CUDA runtime, no torch headers: a few seconds, not the minute a torch extension takes)
# and called through ctypes by sglang_ddtree.triton_kernels.moe_w4a16_small.

_MOE_SOURCES = ("moe_w4a16_small.cu", "moe_w4a16_small.cuh")
_MOE_FLAGS = ["-O3", "-std=c++17", "-lineinfo", "-shared", "-Xcompiler", "-fPIC"]
_moe_lock = threading.Lock()
_moe_state: dict = {"attempted": False, "lib": None, "error": None, "probe": {}}
# Kernels the probe reports, in the order ddtree_moe_small_probe writes them:
# (kind, n-tiles, ring stages).
_MOE_GU = ((1, 4), (1, 6), (1, 8), (2, 4))
_MOE_DN = ((1, 4), (1, 8), (2, 4), (2, 6))
MOE_KERNELS = (tuple(("gate_up", nt, st) for nt, st in _MOE_GU)
               + tuple(("down", nt, st) for nt, st in _MOE_DN))


def moe_build_command(nvcc: str, capability: Tuple[int, int], include_dirs: List[str],
                      out: str) -> List[str]:
    """The nvcc command line of the MoE library (tests check it; the build runs it)."""
    return ([nvcc] + _MOE_FLAGS + arch_flags(capability)
            + [f"-I{_HERE}"] + [f"-I{d}" for d in include_dirs]
            + [os.path.join(_HERE, _MOE_SOURCES[0]), "-o", out])


def moe_cache_path(capability: Tuple[int, int]) -> str:
    """Where the built library lives: keyed by CUDA version, arch and a hash of the sources."""
    import torch

    h = hashlib.sha256()
    for name in _MOE_SOURCES:
        with open(os.path.join(_HERE, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    h.update("\0".join(_MOE_FLAGS + arch_flags(capability)).encode())
    root = os.environ.get(ENV_CACHE_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "sglang_ddtree")
    key = (f"moe_small-cu{torch.version.cuda}-sm{capability[0]}{capability[1]}"
           f"-{h.hexdigest()[:12]}")
    return os.path.join(root, re.sub(r"[^A-Za-z0-9._-]", "_", key), "libddtree_moe_small.so")


def _moe_declare(lib) -> None:
    import ctypes

    p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.ddtree_moe_small_gate_up.argtypes = [p, ll, p, p, p, p, p, p, p] + [i] * 9 + [p]
    lib.ddtree_moe_small_gate_up.restype = i
    lib.ddtree_moe_small_down.argtypes = [p, p, p, p, p, p, i, p] + [i] * 8 + [p]
    lib.ddtree_moe_small_down.restype = i
    lib.ddtree_moe_small_probe.argtypes = [i, ctypes.POINTER(ctypes.c_int), i]
    lib.ddtree_moe_small_probe.restype = i


def _moe_try_load():
    import ctypes
    import subprocess

    from torch.utils import cpp_extension

    capability = _cuda_capability()
    include_dirs, _ = _toolkit_flags()
    nvcc = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
    path = moe_cache_path(capability)
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        cmd = moe_build_command(nvcc, capability, include_dirs, tmp)
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            first = (r.stderr.strip().splitlines() or ["nvcc failed"])[0]
            raise ExtensionUnavailable(f"MoE library build for sm_{capability[0]}{capability[1]} "
                                       f"failed: {first[:200]}", r.stderr)
        os.replace(tmp, path)  # atomic: a concurrent process loads a whole file or builds its own
        logger.info("sglang_ddtree: small-M MoE library built in %.1f s (%s)",
                    time.perf_counter() - t0, path)
    lib = ctypes.CDLL(path)
    _moe_declare(lib)
    return lib


def load_moe_small_lib(required: bool = False):
    """The ctypes library of the small-M MoE GEMMs, or None when it cannot be used here (reason
    logged once). required=True raises :class:`ExtensionUnavailable` instead of returning None.
    Built at most once per process (and once per machine: cached on disk)."""
    with _moe_lock:
        if not _moe_state["attempted"]:
            _moe_state["attempted"] = True
            try:
                _moe_state["lib"] = _moe_try_load()
            except ExtensionUnavailable as e:
                _moe_state["error"] = e
                logger.warning("sglang_ddtree: small-M MoE CUDA kernels unavailable (%s); the "
                               "Triton MoE serves every M", e.reason)
        lib, error = _moe_state["lib"], _moe_state["error"]
    if lib is None and required:
        raise ExtensionUnavailable(f"small-M MoE CUDA kernels unavailable: {error.reason}",
                                   error.detail)
    return lib


def moe_probe(device: int) -> dict:
    """Load every MoE kernel on ``device`` (outside stream capture; raises each one's dynamic
    shared memory limit) and return {(kind, n_tiles, stages): (registers, spill bytes per
    thread, resident CTAs per SM, dynamic shared bytes)}; cached per device."""
    import ctypes

    with _moe_lock:
        if device in _moe_state["probe"]:
            return _moe_state["probe"][device]
    lib = load_moe_small_lib(required=True)
    buf = (ctypes.c_int * (4 * len(MOE_KERNELS)))()
    n = lib.ddtree_moe_small_probe(device, buf, len(buf))
    if n < 0:
        raise RuntimeError(f"ddtree_moe_small_probe: CUDA error {-n}")
    if n != len(MOE_KERNELS):
        raise RuntimeError(f"ddtree_moe_small_probe: {n} kernels, expected {len(MOE_KERNELS)}")
    out = {k: tuple(buf[4 * j:4 * j + 4]) for j, k in enumerate(MOE_KERNELS)}
    with _moe_lock:
        _moe_state["probe"][device] = out
    return out
