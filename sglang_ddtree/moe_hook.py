"""Opt-in: run SGLang's compressed-tensors WNA16 MoE layers on our fused W4A16 Triton kernel.

Switch: ``SGLANG_DDTREE_FUSED_MOE=1`` (``maybe_install``); ``install`` does it unconditionally. It
must run in every process that builds the model (the plugin's ``register`` does, before weights
load), because it changes what happens at weight-loading time.

What SGLang 0.5.17 loads (``CompressedTensorsWNA16MoE.create_weights`` +
``FusedMoE._weight_loader_impl``, which transposes every ``weight_packed`` / ``weight_scale`` of these
classes with ``loaded_weight.t()``). A compressed-tensors ``pack-quantized`` checkpoint stores a
projection ``[out, in]`` as ``weight_packed [out, in // 8] int32`` (8 little-endian nibbles along
``in``, each ``q + 8`` for ``q`` in ``[-8, 7]``) and ``weight_scale [out, in // 32]``. After the
transpose and the gate/up merge the layer holds, for E local experts, hidden H and per-rank
intermediate I:

* ``w13_weight_packed [E, H // 8, 2 I] int32``: columns ``[0, I)`` gate (w1), ``[I, 2I)`` up (w3);
* ``w13_weight_scale  [E, H // 32, 2 I]`` params dtype (bf16 for Kimi K2);
* ``w2_weight_packed  [E, I // 8, H] int32`` and ``w2_weight_scale [E, I // 32, H]``;
* ``w13/w2_weight_g_idx`` and ``*_g_idx_sort_indices`` (act-order only; unused for Kimi).

Stock SGLang then repacks the weights into Marlin tiles (``gptq_marlin_moe_repack`` +
``marlin_moe_permute_scales``, in place) and runs ``fused_marlin_moe``. With the switch on, the
patched ``process_weights_after_loading`` skips that repack and keeps the loaded layout, which the
kernel reads directly: no repack, zero extra memory and no load-time cost (it only drops the unused
act-order index tensors, as SGLang's own path does). The patched ``apply_weights`` calls
``fused_moe_w4a16`` with the same semantics as the Marlin path (SiLU-and-multiply, top-k weights
applied per slot, ``routed_scaling_factor`` on the sum, output into SGLang's zero-copy MoE buffer
when one is published).

Supported: int4, group size 32, symmetric, no act-order, bf16 params, SiLU, no expert-parallel
map. Anything else raises at weight-processing or first-forward time with what was found; nothing
falls back silently.

Dummy weights. ``--load-format dummy`` fills only floating-point parameters
(``initialize_dummy_weights``), so the int32 packed experts keep whatever memory they were
allocated in: runs with and without the switch could not be compared. With
``SGLANG_DDTREE_MOE_DUMMY_INT4_SEED=<seed>`` (``maybe_install_dummy_int4_fill``), ``create_weights``
also fills the packed tensors with seeded random words (every bit pattern is a valid set of
nibbles), identically in both modes; the scales come from SGLang's dummy fill.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os

import torch

logger = logging.getLogger(__name__)

ENV_SWITCH = "SGLANG_DDTREE_FUSED_MOE"
ENV_DUMMY_SEED = "SGLANG_DDTREE_MOE_DUMMY_INT4_SEED"
ENV_DUMMY_RANGE = "SGLANG_DDTREE_DUMMY_INIT_RANGE"
ENV_DUMMY_ROUTER = "SGLANG_DDTREE_DUMMY_ROUTER_LOGIT_STD"
ENV_STATS = "SGLANG_DDTREE_MOE_STATS"
_SCHEME_MODULE = "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16_moe"
_MARLIN_CLASS = "CompressedTensorsWNA16MoE"
_TRITON_CLASS = "CompressedTensorsWNA16TritonMoE"
# Fragments of SGLang 0.5.17's source that the layout above depends on.
_CREATE_WEIGHTS_FRAGMENTS = (
    '"w13_weight_packed"', '"w2_weight_packed"', '"w13_weight_scale"', '"w2_weight_scale"',
    "hidden_size // self.packed_factor", "2 * intermediate_size_per_partition",
    "intermediate_size_per_partition // self.packed_factor", '"is_transposed": True',
)
_LOADER_FRAGMENTS = ('"CompressedTensorsWNA16MoE"', "loaded_weight.t()")
_PATCHED = ("process_weights_after_loading", "apply_weights")


class FusedMoeHookError(RuntimeError):
    """SGLang's internals differ from what the fused-MoE hook was written against."""


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise FusedMoeHookError(
            f"{ENV_SWITCH}=1: SGLang internals are not as expected ({what}); this hook was written "
            "against SGLang 0.5.17's compressed-tensors WNA16 MoE scheme. Unset the switch to use "
            "SGLang's own MoE path.")


def find_classes():
    """Import the WNA16 MoE scheme classes and check the layout contract; return (marlin, triton)."""
    import importlib

    try:
        mod = importlib.import_module(_SCHEME_MODULE)
    except ImportError as exc:
        raise FusedMoeHookError(f"{ENV_SWITCH}=1: cannot import {_SCHEME_MODULE}: {exc!r}") from exc
    marlin = getattr(mod, _MARLIN_CLASS, None)
    triton_cls = getattr(mod, _TRITON_CLASS, None)
    _require(inspect.isclass(marlin), f"{_SCHEME_MODULE}.{_MARLIN_CLASS} missing")
    _require(inspect.isclass(triton_cls) and issubclass(triton_cls, marlin),
             f"{_TRITON_CLASS} missing or not a subclass of {_MARLIN_CLASS}")
    for cls in (marlin, triton_cls):
        for name, params in (("process_weights_after_loading", ["self", "layer"]),
                             ("apply_weights", ["self", "layer", "dispatch_output"])):
            fn = cls.__dict__.get(name) or getattr(cls, name, None)
            _require(callable(fn), f"{cls.__name__}.{name} missing")
            found = list(inspect.signature(fn).parameters)
            _require(found == params, f"{cls.__name__}.{name} takes {found}, expected {params}")
    src = inspect.getsource(marlin.create_weights)
    missing = [f for f in _CREATE_WEIGHTS_FRAGMENTS if f not in src]
    _require(not missing, f"{_MARLIN_CLASS}.create_weights lacks {missing}")
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    loader = getattr(FusedMoE, "_weight_loader_impl", None)
    _require(callable(loader), "FusedMoE._weight_loader_impl missing")
    loader_src = inspect.getsource(loader)
    missing = [f for f in _LOADER_FRAGMENTS if f not in loader_src]
    _require(not missing, f"FusedMoE._weight_loader_impl lacks {missing} (transposed WNA16 loading)")
    return marlin, triton_cls


def _process_weights_after_loading(self, layer: torch.nn.Module) -> None:
    """Keep the loaded pack-quantized layout (no Marlin repack); check it fits the kernel."""
    if getattr(layer, "_ddtree_fused_moe_ready", False):
        return
    if (self.num_bits, self.group_size, self.sym) != (4, 32, True) or self.actorder not in (
            None, "static") or self.strategy != "group":
        raise NotImplementedError(
            f"{ENV_SWITCH}=1 supports int4 group-32 symmetric experts without act-order; this "
            f"layer has num_bits={self.num_bits} group_size={self.group_size} sym={self.sym} "
            f"actorder={self.actorder!r} strategy={self.strategy!r}")
    w13, s13 = layer.w13_weight_packed, layer.w13_weight_scale
    w2, s2 = layer.w2_weight_packed, layer.w2_weight_scale
    e, hp, n2 = w13.shape
    hidden, inter = hp * 8, n2 // 2
    expected = {
        "w13_weight_packed": ((e, hidden // 8, 2 * inter), torch.int32),
        "w13_weight_scale": ((e, hidden // 32, 2 * inter), torch.bfloat16),
        "w2_weight_packed": ((e, inter // 8, hidden), torch.int32),
        "w2_weight_scale": ((e, inter // 32, hidden), torch.bfloat16),
    }
    for name, t in (("w13_weight_packed", w13), ("w13_weight_scale", s13),
                    ("w2_weight_packed", w2), ("w2_weight_scale", s2)):
        shape, dtype = expected[name]
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise NotImplementedError(
                f"{ENV_SWITCH}=1: layer.{name} is {tuple(t.shape)} {t.dtype} "
                f"(contiguous={t.is_contiguous()}), expected {shape} {dtype} contiguous")
    # The act-order index tensors are empty placeholders without act-order; free them as SGLang
    # does (each is E x hidden int32, ~11 MB per layer for Kimi).
    for name in ("w13_weight_g_idx", "w2_weight_g_idx", "w13_g_idx_sort_indices",
                 "w2_g_idx_sort_indices"):
        setattr(layer, name, torch.nn.Parameter(
            torch.empty((e, 0), dtype=torch.int32, device=w13.device), requires_grad=False))
    _check_config_table_once(hidden, inter)
    _check_pdl(w13.device)
    layer._ddtree_fused_moe_ready = True
    _log_first_layer(e, hidden, inter)


_checked_tables: dict = {}


def _check_config_table_once(hidden: int, inter: int) -> None:
    """The kernel's launch-config table (the shipped one or SGLANG_DDTREE_MOE_CONFIG) checked
    against this layer's shapes while the server loads weights, once per shape and table: a
    band that cannot tile them would otherwise fail at the first MoE call of its size, maybe a
    large prefill long after start-up."""
    from .triton_kernels.moe_w4a16 import check_config_table

    key = (hidden, inter, os.environ.get("SGLANG_DDTREE_MOE_CONFIG"))
    if key in _checked_tables:
        return
    try:
        _checked_tables[key] = check_config_table(hidden, inter)
    except (ValueError, FileNotFoundError) as exc:
        raise FusedMoeHookError(f"{ENV_SWITCH}=1: {exc}") from None


def _check_pdl(device: torch.device) -> None:
    """SGLANG_DDTREE_MOE_PDL (the kernel's programmatic dependent launch, moe_pdl) checked
    while the server loads weights: an unknown spec, or PDL asked for where it cannot run,
    stops the start-up instead of the first MoE call."""
    from .triton_kernels._device import portable
    from .triton_kernels.moe_pdl import pdl_mode

    try:
        pdl_mode(device, portable(device))
    except ValueError as exc:
        raise FusedMoeHookError(f"{ENV_SWITCH}=1: {exc}") from None


_logged_layer = {"done": False}


def _log_first_layer(experts: int, hidden: int, inter: int) -> None:
    """One line per process when the first MoE layer switches to the fused kernel. Weight loading
    runs after SGLang has set up logging, unlike the plugin's registration, whose "installed"
    line can fall before any handler exists and be lost (as in the session-6 H200 server logs)."""
    if _logged_layer["done"]:
        return
    _logged_layer["done"] = True
    logger.warning("sglang-ddtree: %s=1: MoE layers run the fused W4A16 Triton kernel (first "
                   "layer: %d experts, hidden %d, intermediate %d per rank; no Marlin repack)",
                   ENV_SWITCH, experts, hidden, inter)


def _apply_weights(self, layer: torch.nn.Module, dispatch_output):
    """Same contract as ``CompressedTensorsWNA16MoE.apply_weights``, on the fused Triton kernel."""
    from sglang.srt.layers import zero_copy_context
    from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

    from .triton_kernels.moe_w4a16 import fused_moe_w4a16

    cfg = self.moe_runner_config
    unsupported = {
        "activation": (cfg.activation, "silu"), "is_gated": (cfg.is_gated, True),
        "gemm1_alpha": (cfg.gemm1_alpha, None), "gemm1_clamp_limit": (cfg.gemm1_clamp_limit, None),
        "swiglu_limit": (cfg.swiglu_limit, None),
        "apply_router_weight_on_input": (cfg.apply_router_weight_on_input, False),
        "no_combine": (cfg.no_combine, False),
    }
    bad = {k: v for k, (v, want) in unsupported.items() if v != want}
    if bad:
        raise NotImplementedError(f"{ENV_SWITCH}=1: unsupported MoE runner settings {bad}")
    if getattr(getattr(layer, "dispatcher", None), "local_expert_mapping", None) is not None:
        raise NotImplementedError(f"{ENV_SWITCH}=1: expert-parallel expert maps are not supported")
    if not getattr(layer, "_ddtree_fused_moe_ready", False):
        raise FusedMoeHookError(f"{ENV_SWITCH}=1: layer weights were not processed by the hook "
                                "(was it installed after the model loaded?)")
    x = dispatch_output.hidden_states
    topk_weights, topk_ids, _ = dispatch_output.topk_output
    out = fused_moe_w4a16(
        x, layer.w13_weight_packed, layer.w13_weight_scale, layer.w2_weight_packed,
        layer.w2_weight_scale, topk_weights.contiguous(), topk_ids.contiguous(),
        routed_scaling_factor=1.0 if cfg.routed_scaling_factor is None else cfg.routed_scaling_factor,
        out=zero_copy_context.get_moe_output(x))
    return StandardCombineInput(hidden_states=out)


# SGLANG_DDTREE_MOE_STATS=1: how many distinct experts each MoE routing call picks, by its token count M
# (what a verify's extra weight bytes come from). Accumulated on the GPU with fixed-shape ops, so
# it works inside CUDA graphs; read only by moe_stats_summary (a host sync: diagnostic use).
_STATS_MAX_M = 8192
_stats = {"on": False, "buf": None, "warned": False}


def record_distinct_experts(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Add this call's distinct-expert count to row min(M, 8192) of the stats buffer (column 0:
    sum of counts, column 1: calls). Ids outside [0, num_experts) (padding tokens routed nowhere,
    a fused shared expert) are not counted."""
    if _stats["buf"] is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            if not _stats["warned"]:  # the buffer must outlive the graph pools: make it eagerly
                _stats["warned"] = True
                logger.warning("%s: first MoE call inside a CUDA graph capture; not counted "
                               "until an eager call", ENV_STATS)
            return
        _stats["buf"] = torch.zeros((_STATS_MAX_M + 1, 2), dtype=torch.int64,
                                    device=topk_ids.device)
    ids = topk_ids.reshape(-1).to(torch.int64)
    # negative (padding) and out-of-range (fused shared expert) ids land in a slot not counted
    ids = torch.where((ids < 0) | (ids >= num_experts), torch.full_like(ids, num_experts), ids)
    mark = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    mark.scatter_(0, ids, 1)
    one = torch.ones(1, dtype=torch.int64, device=ids.device)
    row = _stats["buf"][min(topk_ids.shape[0], _STATS_MAX_M)]
    row.add_(torch.cat([mark[:num_experts].sum().reshape(1), one]))


def stats_enabled() -> bool:
    """Whether ``SGLANG_DDTREE_MOE_STATS`` turned the distinct-expert counts on here."""
    return _stats["on"]


def moe_stats_summary() -> dict:
    """{M: [mean distinct experts per call, calls]} over the calls so far (a host sync)."""
    buf = _stats["buf"]
    if buf is None:
        return {}
    rows = buf.tolist()
    return {m: [round(tot / n, 2), n] for m, (tot, n) in enumerate(rows) if n}


def install_topk_stats() -> bool:
    """Wrap SGLang's ``TopK.forward_cuda`` / ``forward_native`` (every MoE layer's routing,
    whatever its experts' format or kernel) to count the distinct experts of each call's
    top-k ids. Must run before the model is built (``MultiPlatformOp`` binds the method at
    construction). Outputs without ``topk_ids`` (SGLang's bypassed / triton-kernels formats) are
    not counted. Returns False when already installed."""
    from sglang.srt.layers.moe.topk import TopK

    done = False
    for name in ("forward_cuda", "forward_native"):
        original = TopK.__dict__.get(name)
        if original is None or getattr(original, "_ddtree_stats", False):
            continue

        def wrapped(self, hidden_states, router_logits, *args, _original=original, **kwargs):
            out = _original(self, hidden_states, router_logits, *args, **kwargs)
            ids = getattr(out, "topk_ids", None)
            if isinstance(ids, torch.Tensor) and ids.dim() == 2:
                record_distinct_experts(ids, router_logits.shape[-1])
            return out

        wrapped = functools.wraps(original)(wrapped)
        wrapped._ddtree_stats = True
        setattr(TopK, name, wrapped)
        done = True
    return done


def maybe_enable_stats(environ=os.environ) -> bool:
    """Turn the distinct-expert counts on when ``SGLANG_DDTREE_MOE_STATS`` is 1/true/yes."""
    _stats["on"] = environ.get(ENV_STATS, "").strip().lower() in ("1", "true", "yes")
    if _stats["on"]:
        install_topk_stats()
        logger.warning("sglang-ddtree: %s=1: counting distinct experts per MoE routing call "
                       "(diagnostic; DDTREE's stage-timer log lines print the counts)", ENV_STATS)
    return _stats["on"]


def install(hook_registry=None) -> list[str]:
    """Patch both WNA16 MoE scheme classes (plain attribute replacement; idempotent).

    ``hook_registry`` is accepted for a uniform plugin call and not used: SGLang's HookRegistry
    does not patch functions stored as class attributes. Returns the patched qualified names.
    Raises :class:`FusedMoeHookError` when SGLang's classes or layout are not as expected.
    """
    del hook_registry
    patched = []
    for cls in find_classes():
        for name in _PATCHED:
            current = cls.__dict__.get(name)
            ours = globals()[f"_{name}"]
            if current is ours:
                continue
            setattr(cls, f"_ddtree_original_{name}", current)  # None when inherited
            setattr(cls, name, ours)
            patched.append(f"{cls.__name__}.{name}")
    if patched:
        logger.info("fused W4A16 MoE kernel installed on %s", ", ".join(patched))
    return patched


def uninstall() -> None:
    """Undo :func:`install` and :func:`install_dummy_int4_fill` (tests)."""
    marlin, _ = find_classes()
    current = marlin.__dict__["create_weights"]
    if getattr(current, "_ddtree_dummy_seed", None) is not None:
        marlin.create_weights = current.__wrapped__
    for cls in find_classes():
        for name in _PATCHED:
            key = f"_ddtree_original_{name}"
            if key in cls.__dict__:
                original = cls.__dict__[key]
                if original is None:
                    delattr(cls, name)
                else:
                    setattr(cls, name, original)
                delattr(cls, key)


def enabled(environ=os.environ) -> bool:
    """Whether the env switch asks for the fused kernel ("1"/"true"/"yes", case-insensitive)."""
    return environ.get(ENV_SWITCH, "").strip().lower() in ("1", "true", "yes")


def maybe_install(hook_registry=None, environ=os.environ) -> bool:
    """Install when ``SGLANG_DDTREE_FUSED_MOE`` is on; return whether it did."""
    if not enabled(environ):
        return False
    install(hook_registry)
    return True


def _fill_packed_(t: torch.Tensor, seed: int) -> None:
    """Seeded random int32 words, one expert at a time (bounded temporary memory)."""
    g = torch.Generator(device=t.device).manual_seed(seed)
    for e in range(t.shape[0]):
        words = torch.randint(-(2**31), 2**31, t.shape[1:], generator=g, device=t.device,
                              dtype=torch.int64)
        t[e].copy_(words.to(torch.int32))


def install_dummy_int4_fill(seed: int) -> bool:
    """Make ``create_weights`` fill the packed int32 experts with seeded random words.

    Wraps ``CompressedTensorsWNA16MoE.create_weights`` (inherited by the Triton variant); works with
    the fused kernel switch on or off. Returns False when already installed.
    """
    marlin, _ = find_classes()
    original = marlin.__dict__["create_weights"]
    if getattr(original, "_ddtree_dummy_seed", None) is not None:
        return False

    @functools.wraps(original)  # keeps inspect.getsource (find_classes' layout check) working
    def create_weights(self, layer, *args, **kwargs):
        original(self, layer, *args, **kwargs)
        with torch.no_grad():
            _fill_packed_(layer.w13_weight_packed.data, seed)
            _fill_packed_(layer.w2_weight_packed.data, seed + 1)

    create_weights._ddtree_dummy_seed = seed
    marlin.create_weights = create_weights
    logger.info("%s=%d: int4 MoE experts get seeded random packed weights", ENV_DUMMY_SEED, seed)
    return True


def _env_value(environ, name: str, parse, what: str):
    """``parse`` of the variable's value, None when unset or empty; a clear error otherwise."""
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return parse(raw)
    except ValueError:
        raise ValueError(f"{name} must be {what}, got {raw!r}") from None


def _positive_env(environ, name: str):
    """The variable as a positive float, None when unset or empty; a clear error otherwise."""
    value = _env_value(environ, name, float, "a positive number")
    if value is not None and not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return value


def maybe_install_dummy_int4_fill(environ=os.environ) -> bool:
    """Install the seeded packed-weight fill when ``SGLANG_DDTREE_MOE_DUMMY_INT4_SEED`` is set."""
    seed = _env_value(environ, ENV_DUMMY_SEED, int, "an integer seed")
    return seed is not None and install_dummy_int4_fill(seed)


def install_dummy_init_range(bound: float) -> bool:
    """``--load-format dummy`` with weights that give a non-degenerate model: every float
    parameter uniform in [-bound, bound] (SGLang's default is 1e-3, which makes the logits
    nearly flat, so two kernels' outputs cannot be told apart), and every norm weight 1.

    Wraps ``initialize_dummy_weights`` where SGLang's loader calls it (same seed as SGLang's, so
    two servers with the same setting get the same weights). For end-to-end kernel comparisons
    (scripts/e2e_fused_moe.py), not for serving. Returns False when already installed.
    """
    from sglang.srt.model_loader import loader

    original = loader.initialize_dummy_weights
    if getattr(original, "_ddtree_bound", None) is not None:
        return False

    @functools.wraps(original)
    def initialize_dummy_weights(model, *args, **kwargs):
        kwargs.pop("low", None)
        kwargs.pop("high", None)
        original(model, *args, low=-bound, high=bound, **kwargs)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight") and torch.is_floating_point(param):
                    param.fill_(1.0)

    initialize_dummy_weights._ddtree_bound = bound
    loader.initialize_dummy_weights = initialize_dummy_weights
    logger.warning("sglang-ddtree: %s=%g: dummy weights uniform in +-%g, norm weights 1",
                   ENV_DUMMY_RANGE, bound, bound)
    return True


def spread_router_logits_(model: torch.nn.Module, std: float, seed: int = 1234) -> int:
    """Give every MoE router (a module named ``*.mlp.gate`` with a 2-D ``[experts, hidden]``
    weight) normal weights whose logits have standard deviation ``std`` on its actual input,
    and zero its ``e_score_correction_bias`` if it has one; returns the number of routers.

    Why: SGLang's dummy fill gives every parameter the same values for a given size (one seed),
    so each layer's correction bias (+-1e-3) outweighs router logits of ~1e-4 and every token
    picks the same top-k experts: a verify then reads no more expert weights than a decode step.
    The router's input is the layer's ``post_attention_layernorm`` output, x / rms(x) * w, whose
    norm is ||w||, so weights N(0, std / ||w||) give logits of about ``std``; a seed per layer
    makes layers route differently. Real routers lie between the two: this is the upper bound on
    distinct experts per token set (independent routing), the stock dummy fill the lower one."""
    modules = dict(model.named_modules())
    n = 0
    for name, mod in modules.items():
        w = getattr(mod, "weight", None)
        if not name.endswith(".mlp.gate") or not isinstance(w, torch.Tensor) or w.dim() != 2:
            continue
        norm = modules.get(name[: -len(".mlp.gate")] + ".post_attention_layernorm")
        if norm is None or getattr(norm, "weight", None) is None:
            raise FusedMoeHookError(f"{ENV_DUMMY_ROUTER}: no post_attention_layernorm next to "
                                    f"{name}; cannot scale its router")
        scale = float(norm.weight.detach().float().norm())
        if not scale > 0:
            raise FusedMoeHookError(f"{ENV_DUMMY_ROUTER}: {name}'s input norm weight is zero")
        g = torch.Generator(device=w.device).manual_seed(seed + n)
        with torch.no_grad():
            w.copy_(torch.randn(w.shape, generator=g, device=w.device,
                                dtype=torch.float32) * (std / scale))
            bias = getattr(mod, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.zero_()
        n += 1
    return n


def install_dummy_router_spread(std: float) -> bool:
    """Wrap the loader's ``initialize_dummy_weights`` so that, after it (and after
    :func:`install_dummy_init_range`'s wrapper, when installed first), MoE routers get
    :func:`spread_router_logits_`. For cost measurements with ``--load-format dummy``. Returns
    False when already installed."""
    from sglang.srt.model_loader import loader

    original = loader.initialize_dummy_weights
    if getattr(original, "_ddtree_router_std", None) is not None:
        return False

    @functools.wraps(original)
    def initialize_dummy_weights(model, *args, **kwargs):
        original(model, *args, **kwargs)
        n = spread_router_logits_(model, std)
        logger.warning("sglang-ddtree: %s=%g: %d MoE routers re-initialised (logit std %g, "
                       "correction bias 0): tokens route independently", ENV_DUMMY_ROUTER, std,
                       n, std)

    initialize_dummy_weights._ddtree_router_std = std
    loader.initialize_dummy_weights = initialize_dummy_weights
    return True


def maybe_install_dummy_router_spread(environ=os.environ) -> bool:
    """Install :func:`install_dummy_router_spread` when ``SGLANG_DDTREE_DUMMY_ROUTER_LOGIT_STD``
    is set."""
    std = _positive_env(environ, ENV_DUMMY_ROUTER)
    return std is not None and install_dummy_router_spread(std)


def maybe_install_dummy_init_range(environ=os.environ) -> bool:
    """Install :func:`install_dummy_init_range` when ``SGLANG_DDTREE_DUMMY_INIT_RANGE`` is set."""
    bound = _positive_env(environ, ENV_DUMMY_RANGE)
    return bound is not None and install_dummy_init_range(bound)
