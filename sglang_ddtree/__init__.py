"""sglang-ddtree: DDTree speculative decoding for SGLang.

Importing this package is cheap: it imports neither SGLang nor CUDA code. The SGLang plugin entry
point is :func:`sglang_ddtree.plugin.register`.
"""

__version__ = "0.1.0"


def _source_checkout_subpackages() -> None:
    """Run from a source checkout (its root on ``sys.path``, e.g. ``python -m ...`` in the repo),
    this package is the repo's ``sglang_ddtree/`` folder, which lacks the subpackages that
    ``pip install`` maps in from the repo's top-level ``triton_kernels/``, ``cuda_ext/`` and
    ``patches/``. Let the package's import path also search the repo root, so
    ``sglang_ddtree.triton_kernels`` resolves to the same files in both layouts."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    if (not os.path.isdir(os.path.join(here, "triton_kernels"))
            and os.path.isfile(os.path.join(root, "triton_kernels", "__init__.py"))
            and os.path.isfile(os.path.join(root, "pyproject.toml"))):
        __path__.append(root)


_source_checkout_subpackages()
