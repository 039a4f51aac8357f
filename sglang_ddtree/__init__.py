"""sglang-ddtree: DDTree speculative decoding for SGLang.

Importing this package is cheap: it imports neither SGLang nor CUDA code. The SGLang plugin entry
point is :func:`sglang_ddtree.plugin.register`.
"""

__version__ = "0.1.0"
