"""DDTREE's MLA verify without the model's query and latent concat copies.

SGLang's DeepSeek-family absorbed attention (``forward_absorb_core``) hands the attention
backend its inputs in one of two conventions, chosen by the backend's name:

- split, for the backends in ``FORWARD_ABSORB_CORE_ATTENTION_BACKENDS`` (fa3, flashinfer,
  trtllm_mla, ...): ``q = q_nope W_UK`` [T, H, rank], ``q_rope`` [T, H, rope], ``k = v =
  k_nope`` [T, 1, rank], ``k_rope`` [T, 1, rope];
- concatenated, for every other backend (triton, flashmla): the model first copies
  ``[q_nope W_UK | q_rope]`` and ``[k_nope | k_rope]`` (``torch.cat``), two copy kernels a layer.

Our verify backend (:mod:`.verify_backend`) takes either. With the split parts it writes the
latent row with the pool's ``set_mla_kv_buffer`` (both parts in one launch) and its kernel reads
``q_nope W_UK`` and ``q_rope`` where they lie, so behind the triton backend the concatenated
convention costs the verify two copies a layer that it does not need. Session 30's profile of
the Kimi rank (``bench_results/profile_step_kimi_l8_int4_ar_b15_b16_b32_h200_s30.json``, H200,
budget 15) had them at 2.1 us a call, about 4 us a layer, next to 3.5 us for the latent row's
indexed write. Measured (session 64, an H100, one call, the 61-layer int4 Kimi rank at batch 1,
``bench_results/cost_curves_kimi_l61_b15_split{1,0}_h100_s64.json``): budget 15's verify 6.698
ms with the split parts against 7.138 with the copies, AR decode 6.103 (verify / decode 1.097
against 1.170); the 8-layer rank's DDTREE output was identical to AR's (12 / 12).

:func:`install` wraps ``forward_absorb_core``: for a TARGET_VERIFY batch whose attention backend
is DDTREE's :class:`~sglang_ddtree.verify_backend.TreeVerifyBackend` on an MLA target, the
original runs with the layer's ``current_attention_backend`` set to :data:`SPLIT_NAME`, a name
:func:`install` appends to SGLang's list, so the model takes its split branch (that branch, for a
name no other check in it knows, calls ``attn_mqa(q_nope_out, k_nope, k_nope, q_rope=q_pe,
k_rope=k_pe)``); the name is restored after the call. Every other call runs unchanged: decode
and prefill, other backends' verify, and a layer that passes DSA top-k indices, Llama-4
scaling, a fused BMM plan or learnable sinks, and any call traced by torch.compile. The choice
depends only on the batch's mode and the backend, so a captured verify graph holds one
convention. ``SGLANG_DDTREE_MLA_SPLIT=0`` leaves
the model's own convention (A/B runs).
"""
from __future__ import annotations

import functools
import inspect
import logging

import torch

logger = logging.getLogger(__name__)

SPLIT_NAME = "ddtree_split_mla"  # what the wrapped call sees as its backend's name
# forward_absorb_core's leading parameters (after self) and those the wrapper reads by name
_LEADING = ("q_pe", "k_pe", "q_nope_out", "k_nope", "forward_batch")
_READ = ("topk_indices", "llama_4_scaling")

_state = {"cls": None, "original": None, "backends": None}


def _signature_problem(fn) -> str | None:
    """Why ``fn`` is not the forward_absorb_core this wrapper knows (None: it is)."""
    names = list(inspect.signature(fn).parameters)
    if names[0] != "self" or tuple(names[1:6]) != _LEADING:
        return f"its parameters {names} do not start with (self, {', '.join(_LEADING)})"
    missing = [n for n in _READ if n not in names]
    if missing:
        return f"it has no parameter {missing}"
    return None


def _takes_split(layer, args: dict, get_attn_backend, backend_cls) -> bool:
    """Whether this call goes through the split branch under :data:`SPLIT_NAME`."""
    fb = args.get("forward_batch")
    if fb is None or not fb.forward_mode.is_target_verify():
        return False
    if layer.current_attention_backend in _state["backends"]:
        return False  # already split
    if any(args.get(n) is not None for n in ("topk_indices", "llama_4_scaling", "fusion_plan")):
        return False
    if getattr(layer, "learnable_sink_param", None) is not None:
        return False
    backend = get_attn_backend()
    return isinstance(backend, backend_cls) and backend.takes_split_mla


def install(sgl) -> bool:
    """Wrap ``DeepseekMLAForwardMixin.forward_absorb_core`` (idempotent). False, with a
    warning, where this SGLang's method is not the one the wrapper knows (the verify then keeps
    the model's convention: correct, with the copies)."""
    from .verify_backend import TreeVerifyBackend

    if _state["cls"] is not None:
        return False
    try:
        cls = sgl.DeepseekMLAForwardMixin
        backends = sgl.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS
    except (ImportError, AttributeError) as exc:
        logger.warning("DDTREE: the MLA verify keeps the model's query / latent copies: %r",
                       exc)
        return False
    original = cls.__dict__.get("forward_absorb_core")
    problem = ("the class has no forward_absorb_core" if original is None
               else _signature_problem(original))
    if problem is not None or not isinstance(backends, list):
        logger.warning("DDTREE: the MLA verify keeps the model's query / latent copies: "
                       "SGLang's forward_absorb_core is not the one sglang_ddtree.mla_split "
                       "knows (%s)", problem or f"backend names are a {type(backends).__name__}")
        return False
    names = tuple(inspect.signature(original).parameters)[1:]
    get_attn_backend = sgl.get_attn_backend

    @functools.wraps(original)
    def forward_absorb_core(self, *args, **kwargs):
        # (under torch.compile's tracing the model keeps its convention: the swap is eager /
        # CUDA-graph capture only)
        if torch.compiler.is_compiling():
            return original(self, *args, **kwargs)
        call = dict(zip(names, args), **kwargs)
        if not _takes_split(self, call, get_attn_backend, TreeVerifyBackend):
            return original(self, *args, **kwargs)
        before = self.current_attention_backend
        self.current_attention_backend = SPLIT_NAME
        try:
            return original(self, *args, **kwargs)
        finally:
            self.current_attention_backend = before

    if SPLIT_NAME not in backends:
        backends.append(SPLIT_NAME)
    _state.update(cls=cls, original=original, backends=backends)
    cls.forward_absorb_core = forward_absorb_core
    logger.info("DDTREE: MLA verify batches hand the attention split query / latent parts "
                "(no concat copies; %s=0 turns this off)", "SGLANG_DDTREE_MLA_SPLIT")
    return True


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    if _state["cls"] is None:
        return
    _state["cls"].forward_absorb_core = _state["original"]
    if SPLIT_NAME in _state["backends"]:
        _state["backends"].remove(SPLIT_NAME)
    _state.update(cls=None, original=None, backends=None)
