"""DDTREE's MLA verify: the absorbed head projections on our Triton kernel instead of cuBLAS.

SGLang's DeepSeek-family absorbed attention multiplies by two small per-head weights a layer,
both through ``torch.bmm`` (cuBLAS): ``q_nope W_UK`` in ``forward_absorb_prepare``
(``self.w_kc`` [H, 128, 512]) and ``o W_UV`` in ``forward_absorb_core`` (``self.w_vc``
[H, 512, 128], into an ``out=`` view). At a verify's few tokens per request these are launch-
and latency-bound (1 MB of weights a layer on a Kimi K2.6 TP8 rank), and cuBLAS takes split-K
tiles plus a reduce launch there (``triton_kernels/mla_absorb.py`` cites the profile).

How the model is reached: for the length of a TARGET_VERIFY call on DDTREE's MLA verify backend
(the wrappers in :mod:`.mla_split`), the layer's ``w_kc`` / ``w_vc`` attribute is a
:class:`AbsorbWeight` view of the same storage. Its ``__torch_function__`` sends
``torch.bmm(a, w[, out=])`` to :func:`~sglang_ddtree.triton_kernels.mla_absorb.absorb_bmm`
where that kernel takes the operands (bf16, unit K strides, at most :data:`MAX_TOKENS` tokens);
every other use of the attribute (dtype checks, shapes, another op) runs torch's own function
on plain tensors. The attribute is restored after the call, so decode, prefill and other
backends never see the view, and a captured verify graph holds our kernels.
``SGLANG_DDTREE_MLA_ABSORB=1`` turns it on (off by default until timed and checked lossless
in a server).
"""
from __future__ import annotations

import contextlib

import torch

# Tokens of a verify up to which the bmm runs on our kernel (cuBLAS above: a prefill-sized
# product is compute-shaped, where cuBLAS's tiles are the better ones).
MAX_TOKENS = 512


class AbsorbWeight(torch.Tensor):
    """A weight whose ``torch.bmm`` runs :func:`absorb_bmm` (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if (func is torch.bmm and len(args) == 2 and type(args[1]) is cls
                    and set(kwargs) <= {"out"}):
                a, w, out = args[0], args[1].as_subclass(torch.Tensor), kwargs.get("out")
                if takes(a, w, out):
                    from .triton_kernels.mla_absorb import absorb_bmm

                    return absorb_bmm(a, w, out=out)
            return func(*args, **kwargs)


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def takes(a, w, out=None) -> bool:
    """Whether :func:`absorb_bmm` runs ``torch.bmm(a, w, out=out)`` (plain tensors)."""
    from .triton_kernels.mla_absorb import check_shapes

    return (isinstance(a, torch.Tensor) and _on_gpu(a) and a.dim() == 3
            and 1 <= a.shape[1] <= MAX_TOKENS and check_shapes(a, w, out) is None)


def weight_applies(w) -> bool:
    """Whether a layer's ``w_kc`` / ``w_vc`` may be swapped: a bf16 CUDA tensor, K-contiguous
    (SGLang's loader layout for bf16 weights; fp8 / DeepGEMM weights keep their own path)."""
    return (type(w) is torch.Tensor and w.dtype == torch.bfloat16 and _on_gpu(w)
            and w.dim() == 3 and w.stride(1) == 1)


@contextlib.contextmanager
def swapped(layer, name: str):
    """``layer.<name>`` is an :class:`AbsorbWeight` view inside the block (unchanged where
    :func:`weight_applies` says no, or where the layer runs DeepGEMM's bmm)."""
    w = getattr(layer, name, None)
    if not weight_applies(w) or getattr(layer, "use_deep_gemm_bmm", False):
        yield False
        return
    setattr(layer, name, w.as_subclass(AbsorbWeight))
    try:
        yield True
    finally:
        setattr(layer, name, w)
