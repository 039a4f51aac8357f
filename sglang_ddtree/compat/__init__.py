"""Version-specific access to SGLang internals.

Everything that imports an SGLang symbol whose path or signature moved between releases lives in
one module per supported version (``v0_5_17``, ``v0_5_23``), each exposing the same names with
the same meaning. :func:`load` picks it from the installed SGLang version and refuses unknown
versions with a message naming the supported ones.
"""

from __future__ import annotations

import importlib
from types import ModuleType

SUPPORTED_VERSIONS = ("0.5.17", "0.5.23")
_MODULES = {"0.5.17": "v0_5_17", "0.5.23": "v0_5_23"}


class UnsupportedSGLangVersion(RuntimeError):
    pass


def installed_sglang_version() -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - py<3.8
        return None
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def check_version(ver: str | None) -> str:
    if ver is None:
        raise UnsupportedSGLangVersion(
            "SGLang is not installed; sglang-ddtree is a plugin for an existing SGLang "
            f"environment (supported versions: {', '.join(SUPPORTED_VERSIONS)})."
        )
    if ver not in _MODULES:
        raise UnsupportedSGLangVersion(
            f"sglang-ddtree does not support SGLang {ver}; supported versions: "
            f"{', '.join(SUPPORTED_VERSIONS)}. Install one of those (pip install "
            f"'sglang=={SUPPORTED_VERSIONS[-1]}') or an sglang-ddtree release that lists {ver}."
        )
    return ver


def load(ver: str | None = None) -> ModuleType:
    """The compat module for ``ver`` (default: the installed SGLang)."""
    ver = check_version(installed_sglang_version() if ver is None else ver)
    return importlib.import_module(f"{__name__}.{_MODULES[ver]}")
