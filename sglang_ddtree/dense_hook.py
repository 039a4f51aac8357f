"""Run SGLang's unquantized (bf16) linear layers (opt-in) and the MoE router's GEMM (DDTREE's
default on sm_90) on our skinny GEMM for verify-sized token counts.

Switch: ``SGLANG_DDTREE_SKINNY_GEMM=<lo>-<hi>`` (e.g. ``17-32``: calls of 17 to 32 token rows;
``1`` means ``17-32``), read by :func:`maybe_install` in every process that builds the model.
Other calls, layers the kernel cannot tile, and weights that are not wide in K (``K >= 2 N``)
keep SGLang's path (``F.linear``: cuBLAS).

Why 17: SGLang 0.5.17 serves DeepSeek / Kimi's q / kv down-projection with its dsv3
``fused_a_gemm`` up to 16 tokens and cuBLAS above, and session 30's profile of the Kimi rank
put the GEMMs of a layer (the lm_head left out) at about 11 us more at 33 tokens than at 1
(``bench_results/profile_step_kimi_l8_int4_*_h200_s30.json``).

Why 32 and ``K >= 2 N`` (session 32, H200, ``bench_results/skinny_gemm_h200_s32.json``, CUDA
graphs over 256 MB of distinct weights): against cuBLAS at the Kimi rank's seven dense shapes,
the kernel wins only on the three with K = 7168 and N <= K / 2 (the q / kv down-projection
2112 x 7168, the shared expert's gate-up 512 x 7168, the router 384 x 7168), by 1.05-1.14x at
17-32 rows and 1.13-1.31x at 1-16; at 33-64 rows it loses on every shape (0.81-1.00x), and on
the four narrow-K shapes (1536 x 1536, 7168 x 1024, 7168 x 256, 7168 x 2304) at every row count
(0.38-0.98x). So the default range stops at 32, and a weight takes the kernel only when
``K >= WIDE_K * N``. The switch stays off by default: not yet served end to end.

What is patched (plain attribute replacement, idempotent, undone by :func:`uninstall`):

- ``UnquantizedLinearMethod.apply(layer, x, bias)``: SGLang's bf16 linear layers (the q / kv
  down-projection, the shared experts' GEMMs, ...);
- the MoE router's bf16 x bf16 -> fp32 GEMM, ``linear_bf16_fp32(x, weight)``, which SGLang's
  DeepseekV2 ``MoEGate`` imports at call time for rows above its tiny-router kernel's limit
  (16 on sm_90). Its module differs between releases (``compat.<release>.ROUTER_GEMM``). The
  kernel then stores fp32, as the original does; calls with keyword arguments keep the
  original.

A call takes the kernel when ``bias`` is None, ``x`` is a 2-D CUDA bf16 tensor with unit column
stride and ``lo <= M <= hi``, and the weight is a contiguous bf16 ``[N, K]`` that the kernel
tiles (N a multiple of 64, K of 128) with ``K >= 2 N``. Each weight gets its own arrival
counters (a slice of one per-device buffer, handed out at its first call), because SGLang's
DeepseekV2 layer runs the shared expert's GEMMs on a second stream inside CUDA graphs, beside
the router. The buffer is allocated at the first eligible call, which
SGLang makes eagerly (its graph runner warms every batch size up before capturing); a first
call inside capture raises with the fix.

A second, narrower switch puts only the MoE router's GEMM (``[N, K]`` = 384 x 7168 on the Kimi
rank, fp32 logits) on the kernel: ``SGLANG_DDTREE_ROUTER_GEMM=<lo>-<hi>`` (``1`` means
``DEFAULT_ROUTER_RANGE``; ``auto``, what a DDTREE server's schedulers get where it is unset
(``spec_algo``): ``DEFAULT_ROUTER_RANGE`` under PDL on sm_90 GPUs, SGLang's GEMMs on other
cards and where they are not found; ``0`` turns it off). It patches both of SGLang's router
GEMMs: the tiny one DeepseekV2's ``MoEGate`` calls up to 16 rows (0.5.17: the dsv3 JIT
``dsv3_router_gemm``; 0.5.23: ``tiny_gemm_bf16``; ``compat.<release>.ROUTER_TINY_GEMM``) and
``linear_bf16_fp32`` above.
Why: session 30's profile of the Kimi rank (8 layers, batch 1) had the dsv3 router GEMM at 3.3
us a call for one token and 8.1 us for 16 (cuBLAS at 17 rows: 6.6 us plus a 2.6 us split-K
reduce), about 5 us a layer of the verify's extra time over decode. Its tiles come from
``SGLANG_DDTREE_ROUTER_GEMM_CONFIG=block_n,block_k,split_k[,num_warps[,num_stages]]``
(default ``ROUTER_CONFIG``: of 32 tilings in session 42's sweeps the fastest at 1 row and
within 0.2 us of the fastest, 16 x 128 on 2 warps, at 8 and 16).

``SGLANG_DDTREE_SKINNY_PDL=1`` (with either switch; ``triton_kernels/skinny_gemm.py``) launches
the kernel with programmatic dependent launch, as SGLang's own dsv3 kernels launch at up to 16
tokens and cuBLAS does not: 0.25-0.35 us less a call on an H100 (session 68,
``bench_results/skinny_pdl_*_h100_s68.json``; the router at 32 rows 7.73 against 7.96 us,
cuBLAS 8.01). Unset, it is 0, except under the router switch's ``auto``: PDL on the cards
where ``auto`` takes the kernel, plain launches elsewhere.

Measured (session 42, H200, ``bench_results/skinny_router_*_h200_s42.json``, CUDA graphs over
256 MB of router weights, us per call at 1 / 2 / 8 / 16 rows): SGLang 0.5.17's dsv3 router
3.07 / 3.30 / 4.92 / 7.45, this kernel 5.13 / 5.78 / 5.85 / 6.03, cuBLAS 7.32 / 7.29 / 7.40 /
7.62; at 17 / 32 rows this kernel 7.28 / 7.81 against cuBLAS 7.63 / 7.74. The dsv3 kernel's time
grows with the rows and crosses this one's near 12, hence ``DEFAULT_ROUTER_RANGE``. Served on the
61-layer int4 Kimi rank at budget 15, batch 1 (one verify of 16 rows a step), range 2-32: verify
7.452 ms against 7.476 without the switch (AR 6.235 ms: 1.195 against 1.199), a 0.3 % gain;
DDTREE budgets 15 / 16 at batch 1 / 2 on the 8-layer int4 rank with the switch: 48 / 48
identical to AR. When both switches are set, the router switch alone decides the
router's calls (one config and one set of arrival counters per weight).

Why ``auto`` for DDTREE (sessions 74-75, H100, the 61-layer int4 Kimi rank, budget 31, batch 1,
``bench_results/cost_curves_kimi_l61_b31_*_h100_s7[45].json``): the verify 7.801 / 7.811 /
7.806 / 7.833 ms as before against 7.667 / 7.729 / 7.689 / 7.685 ms with ``1`` and PDL, the
runs interleaved in session 75 (two leases; AR 6.097 / 6.125 ms: 1.275 -> 1.255 on session 75's
medians); budget 15 6.736 / 6.732 against 6.676; 16 / 16 outputs identical to AR at budget 31
(``e2e_lossless_kimi_int4_b31_router_pdl_h100_s7[45].json``). Not timed on other cards, so
``auto`` leaves them SGLang's; AR and DFLASH servers are not touched.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import os

import torch

logger = logging.getLogger(__name__)

ENV_SWITCH = "SGLANG_DDTREE_SKINNY_GEMM"
DEFAULT_RANGE = (17, 32)
ROUTER_ENV = "SGLANG_DDTREE_ROUTER_GEMM"
ROUTER_CONFIG_ENV = "SGLANG_DDTREE_ROUTER_GEMM_CONFIG"
DEFAULT_ROUTER_RANGE = (12, 32)  # below 12 rows SGLang's dsv3 router is faster (session 42)
ROUTER_AUTO = "auto"  # the router switch DDTREE servers get when it is unset (spec_algo)
AUTO_CAPABILITIES = ((9, 0),)  # where ``auto`` takes the kernel: the cards it was timed on
ROUTER_CONFIG = (64, 128, 14, 4, 0)  # block_n, block_k, split_k, num_warps, num_stages
WIDE_K = 2  # a weight [N, K] takes the kernel only when K >= WIDE_K * N (see above)
_COUNTERS_PER_DEVICE = 1 << 20  # 4 MB of int32: N // 64 each for thousands of layers


class SkinnyGemmHookError(RuntimeError):
    """The switch is set but SGLang's linear method or the environment does not fit it."""


def parse_range(value: str, env: str = ENV_SWITCH,
                default: tuple[int, int] = DEFAULT_RANGE) -> tuple[int, int] | None:
    """``""``/``0``/``off`` -> None; ``1``/``on`` -> ``default``; ``lo-hi`` -> (lo, hi) with
    1 <= lo <= hi <= the kernel's MAX_M (64). Anything else raises, naming the accepted forms."""
    v = value.strip().lower()
    if v in ("", "0", "off", "false", "no"):
        return None
    if v in ("1", "on", "true", "yes"):
        return default
    lo, sep, hi = v.partition("-")
    from .triton_kernels.skinny_gemm import MAX_M

    if sep and lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi) <= MAX_M:
        return int(lo), int(hi)
    auto = f", {ROUTER_AUTO} (DDTREE's default)" if env == ROUTER_ENV else ""
    raise SkinnyGemmHookError(f"{env}={value!r}: expected 0, 1 (= {default[0]}-"
                              f"{default[1]}){auto} or LO-HI "
                              f"token rows with 1 <= LO <= HI <= {MAX_M}")


def parse_router(value: str):
    """``SGLANG_DDTREE_ROUTER_GEMM``'s value: ``ROUTER_AUTO`` for ``auto`` (any case, spaces
    ignored), else :func:`parse_range`'s (None for off, ``(lo, hi)``; raises naming the forms,
    ``auto`` among them). Unset or empty is off here: DDTREE's launcher exports ``auto``."""
    if value.strip().lower() == ROUTER_AUTO:
        return ROUTER_AUTO
    return parse_range(value, ROUTER_ENV, DEFAULT_ROUTER_RANGE)


def parse_router_config(value: str):
    """``block_n,block_k,split_k[,num_warps[,num_stages]]`` (empty: ``ROUTER_CONFIG``) -> a
    SkinnyConfig; raises naming the form. Whether it tiles a router is checked at install."""
    from .triton_kernels import skinny_gemm as sg

    v = value.strip()
    vals = v.split(",") if v else [str(x) for x in ROUTER_CONFIG]
    if not 3 <= len(vals) <= 5 or not all(x.strip().isdigit() for x in vals):
        raise SkinnyGemmHookError(f"{ROUTER_CONFIG_ENV}={value!r}: expected "
                                  "block_n,block_k,split_k[,num_warps[,num_stages]] (integers)")
    nums = [int(x) for x in vals]
    keys = ("block_n", "block_k", "split_k", "num_warps", "num_stages")
    cfg = sg.SkinnyConfig(**dict(zip(keys, nums)))
    pow2 = all(x > 0 and x & (x - 1) == 0 for x in (cfg.block_n, cfg.block_k, cfg.num_warps))
    if not pow2 or cfg.block_n < 16 or cfg.block_k < 16 or cfg.split_k < 1 or cfg.num_stages < 0:
        raise SkinnyGemmHookError(f"{ROUTER_CONFIG_ENV}={value!r}: block_n / block_k >= 16 and "
                                  "num_warps powers of two, split_k >= 1, num_stages >= 0")
    return cfg


_state = {"range": None, "buffers": {}, "next": {}, "router": None, "router_range": None,
          "router_config": None, "tiny": None, "pdl": None, "router_auto": False}
_auto_devices: dict = {}  # CUDA device index -> whether ``auto`` takes the kernel there


def auto_device(device: torch.device) -> bool:
    """Whether the router switch's ``auto`` puts calls on ``device`` on the kernel (with PDL):
    a GPU of ``AUTO_CAPABILITIES`` (sm_90: H100 / H200, where sessions 74-75 timed it) outside
    the Triton interpreter. Asked once a device; other cards keep SGLang's router GEMMs."""
    from .triton_kernels import _device

    key = device.index if device.index is not None else torch.cuda.current_device()
    ok = _auto_devices.get(key)
    if ok is None:
        capability = torch.cuda.get_device_capability(key)
        ok = not _device.portable(device) and capability in AUTO_CAPABILITIES
        _auto_devices[key] = ok
        logger.info("sglang-ddtree: %s=%s on cuda:%d (sm_%d%d): the MoE router's GEMM %s",
                    ROUTER_ENV, ROUTER_AUTO, key, *capability,
                    "takes the skinny Triton GEMM under PDL" if ok else "stays SGLang's")
    return ok


def describe_router(value: str, capability: tuple[int, int] | None) -> str:
    """What a DDTREE server's router GEMM does for ``SGLANG_DDTREE_ROUTER_GEMM=value`` (unset or
    empty: DDTREE's ``auto``) on a GPU of ``capability`` (None: no GPU): ``sglang-ddtree
    info``'s line. A bad value is described, not raised (a diagnostic)."""
    try:
        rng = parse_router(value) if value.strip() else ROUTER_AUTO
    except SkinnyGemmHookError as exc:
        return f"error: {exc}"
    if rng == ROUTER_AUTO:
        head = f"{ROUTER_AUTO} (DDTREE's default)"
        rows = (f"{DEFAULT_ROUTER_RANGE[0]}-{DEFAULT_ROUTER_RANGE[1]} rows on the skinny "
                "Triton GEMM under PDL")
        if capability is None:
            return f"{head}: no GPU here; {rows} on sm_90"
        arch = "sm_%d%d" % tuple(capability)
        if tuple(capability) in AUTO_CAPABILITIES:
            return f"{head}: {rows} ({arch})"
        return f"{head}: SGLang's router GEMMs ({arch}: not sm_90)"
    if rng is None:
        return "off: SGLang's router GEMMs"
    return f"{rng[0]}-{rng[1]} rows on the skinny Triton GEMM (asked for, any card)"


def _counters_for_layer(layer, device: torch.device, n_tiles: int):
    """The call site's own slice of its device's counter buffer (handed out once); ``layer``
    holds it: a module, or the router's weight tensor."""
    cnt = getattr(layer, "_ddtree_skinny_counters", None)
    if cnt is not None:
        return cnt
    key = (device.type, device.index)
    buf = _state["buffers"].get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise SkinnyGemmHookError(
                f"{ENV_SWITCH}: the first eligible GEMM came inside CUDA-graph capture, where "
                "its counters cannot be zeroed; run one eager forward first (SGLang's graph "
                "runner does) or unset the switch")
        buf = torch.zeros(_COUNTERS_PER_DEVICE, dtype=torch.int32, device=device)
        _state["buffers"][key] = buf
        _state["next"][key] = 0
    start = _state["next"][key]
    if start + n_tiles > buf.numel():
        raise SkinnyGemmHookError(f"{ENV_SWITCH}: more than {buf.numel()} counters needed")
    _state["next"][key] = start + n_tiles
    cnt = buf[start:start + n_tiles]
    layer._ddtree_skinny_counters = cnt
    return cnt


def eligible(layer: torch.nn.Module, x: torch.Tensor, bias, lo: int, hi: int) -> bool:
    """Whether this call takes the skinny GEMM (see the module docstring)."""
    return x.is_cuda and shapes_fit(getattr(layer, "weight", None), x, bias, lo, hi)


def _operands_fit(w, x: torch.Tensor, lo: int, hi: int) -> bool:
    """A 2-D bf16 ``x`` of ``lo``-``hi`` rows with unit column stride against a contiguous bf16
    ``[N, K]`` weight of the same K: what every call the kernel takes has."""
    return (isinstance(w, torch.Tensor) and x.dim() == 2 and lo <= x.shape[0] <= hi
            and x.dtype == torch.bfloat16 and x.stride(1) == 1 and w.dtype == torch.bfloat16
            and w.dim() == 2 and w.is_contiguous() and w.shape[1] == x.shape[1])


def shapes_fit(w, x: torch.Tensor, bias, lo: int, hi: int) -> bool:
    """:func:`eligible` but for the device: no bias, 2-D bf16 ``x`` of ``lo``-``hi`` rows with
    unit column stride, and a contiguous bf16 ``[N, K]`` weight the kernel tiles, wide in K
    (``K >= WIDE_K * N``: the only shapes it beat cuBLAS on)."""
    from .triton_kernels import skinny_gemm as sg  # the tiles the kernel's default config takes

    return (bias is None and _operands_fit(w, x, lo, hi) and w.shape[0] % sg.BLOCK_N == 0
            and w.shape[1] % sg.BLOCK_K == 0 and w.shape[1] >= WIDE_K * w.shape[0])


def _skinny(holder, w: torch.Tensor, x: torch.Tensor, out=None, config=None):
    """The skinny GEMM with ``holder``'s config and counters (fixed at its first call:
    ``config``, else the kernel's default for the shape)."""
    from .triton_kernels import skinny_gemm as sg

    cfg = getattr(holder, "_ddtree_skinny_config", None)
    if cfg is None:  # per call site, once: its tiles, and so its counter count, stay fixed
        cfg = config or sg.default_config(w.shape[0], w.shape[1], sg._sms(x.device))
        holder._ddtree_skinny_config = cfg
    pdl = _state["pdl"]
    if pdl == ROUTER_AUTO:  # the router switch's auto with SGLANG_DDTREE_SKINNY_PDL unset
        pdl = int(auto_device(x.device))
    return sg.skinny_gemm(x, w, out=out, config=cfg, counters=_counters_for_layer(
        holder, x.device, w.shape[0] // cfg.block_n), pdl=pdl)


def router_fits(w, x: torch.Tensor, lo: int, hi: int, cfg) -> bool:
    """Whether a router call takes the kernel under the router switch: ``lo``-``hi`` rows of a
    2-D CUDA bf16 ``x`` (unit column stride) against a contiguous bf16 ``[N, K]`` weight that
    ``cfg`` tiles (N a multiple of block_n, K of block_k x split_k)."""
    return (_operands_fit(w, x, lo, hi) and w.shape[0] % cfg.block_n == 0
            and w.shape[1] % (cfg.block_k * cfg.split_k) == 0)


def _router_call(x: torch.Tensor, weight: torch.Tensor, out_dtype):
    """The router GEMM on our kernel where a switch takes this call, else None: the router
    switch alone decides where it is set (its range and tiles), else the skinny switch (its
    range, wide-K weights, default tiles)."""
    rng, cfg = _state["router_range"], _state["router_config"]
    if not x.is_cuda:
        return None
    if rng is not None and _state["router_auto"] and not auto_device(x.device):
        rng = cfg = None  # auto, off the cards it was timed on: as if the switch were unset
    if rng is not None:
        if not router_fits(weight, x, *rng, cfg):
            return None
    elif _state["range"] is None or not shapes_fit(weight, x, None, *_state["range"]):
        return None
    out = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype, device=x.device)
    return _skinny(weight, weight, x, out=out, config=cfg)


def _apply(self, layer: torch.nn.Module, x: torch.Tensor, bias=None):
    rng = _state["range"]
    if rng is not None and eligible(layer, x, bias, *rng):
        return _skinny(layer, layer.weight, x)
    return type(self)._ddtree_original_apply(self, layer, x, bias)


def _router_linear(x: torch.Tensor, weight: torch.Tensor, **kwargs):
    """Stands in for SGLang's ``linear_bf16_fp32`` (the MoE router's fp32-output GEMM)."""
    y = None if kwargs else _router_call(x, weight, torch.float32)
    return y if y is not None else _state["router"][2](x, weight, **kwargs)


def _router_tiny(x: torch.Tensor, weight: torch.Tensor, *args, **kwargs):
    """Stands in for SGLang's tiny router GEMM (0.5.17 ``dsv3_router_gemm(x, w, out_dtype=,
    output=)``, 0.5.23 ``tiny_gemm_bf16(x, w, out=None, *, out_dtype=, n_split=, max_m=)``):
    calls that pass no output buffer and ask for bf16 or fp32 may take the kernel."""
    tiny = _state["tiny"]
    out_dtype = kwargs.get("out_dtype") or torch.bfloat16
    if (not args and set(kwargs) <= {"out_dtype", "max_m", "n_split"}
            and out_dtype in (torch.float32, torch.bfloat16)):
        y = _router_call(x, weight, out_dtype)
        if y is not None:
            return y
    return tiny[2](x, weight, *args, **kwargs)


def _find_sglang_fn(spec, compat_name: str, env: str, what: str):
    """(module, attribute, function) that ``spec`` (default ``compat.<release>.<compat_name>``)
    names; raises SkinnyGemmHookError naming ``env`` where it is missing."""
    if spec is None:
        from . import compat

        spec = getattr(compat.load(), compat_name)
    mod_name, attr = spec
    try:
        mod = importlib.import_module(mod_name)
        return mod, attr, getattr(mod, attr)
    except (ImportError, AttributeError) as exc:
        raise SkinnyGemmHookError(f"{env}: cannot find SGLang's {what} {mod_name}.{attr}: "
                                  f"{exc!r}; unset the switch") from exc


def _router_target(spec: tuple[str, str] | None = None):
    """(module, attribute name) of the router GEMM ``spec`` names (default: the installed
    release's, ``compat.<release>.ROUTER_GEMM``); raises SkinnyGemmHookError where it is
    missing or takes other arguments."""
    mod, attr, fn = _find_sglang_fn(spec, "ROUTER_GEMM", ENV_SWITCH, "router GEMM")
    if fn is not _router_linear:  # already ours: SGLang's was checked when it was patched
        params = list(inspect.signature(fn).parameters.values())
        if [p.name for p in params[:2]] != ["x", "y"] or any(
                p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params[2:]):
            raise SkinnyGemmHookError(f"{ENV_SWITCH}: {mod.__name__}.{attr} takes "
                                      f"{[p.name for p in params]}, expected (x, y, *, ...); "
                                      "unset the switch")
    return mod, attr


def _tiny_router_target(spec: tuple[str, str] | None = None):
    """(module, attribute name) of SGLang's tiny router GEMM (default: the installed release's,
    ``compat.<release>.ROUTER_TINY_GEMM``); raises SkinnyGemmHookError naming the fix where it
    is missing (a build without CUDA does not import it)."""
    mod, attr, fn = _find_sglang_fn(spec, "ROUTER_TINY_GEMM", ROUTER_ENV, "tiny router GEMM")
    if fn is not _router_tiny:
        params = list(inspect.signature(fn).parameters)
        if len(params) < 2 or "out_dtype" not in params:
            raise SkinnyGemmHookError(f"{ROUTER_ENV}: {mod.__name__}.{attr} takes {params}, "
                                      "expected (x, w, ..., out_dtype, ...); unset the switch")
    return mod, attr


def _patch(key: str, target, stand_in) -> bool:
    """Put ``stand_in`` at ``target`` (``(module, attribute)``, None: nothing) unless ``key``'s
    slot already holds a patch; the original is kept in ``_state[key]`` for :func:`uninstall`."""
    if target is None or _state[key] is not None:
        return False
    mod, attr = target
    _state[key] = (mod, attr, getattr(mod, attr))
    setattr(mod, attr, stand_in)
    return True


def install_router(token_range: tuple[int, int] = DEFAULT_ROUTER_RANGE, config=None,
                   tiny_target="sglang", router_target="sglang") -> bool:
    """Put the MoE router's GEMM for ``token_range`` rows on the skinny kernel with ``config``
    (default ``ROUTER_CONFIG``): patch SGLang's tiny router GEMM (``tiny_target``) and its
    ``linear_bf16_fp32`` (``router_target``; ``(module, attribute)`` each, None to leave it).
    False if both were already patched."""
    if tiny_target == "sglang":
        tiny_target = _tiny_router_target()
    if router_target == "sglang":
        router_target = _router_target()
    _state["router_range"] = token_range
    _state["router_config"] = config or parse_router_config("")
    patched = _patch("tiny", tiny_target, _router_tiny)
    patched = _patch("router", router_target, _router_linear) or patched
    if patched:  # the default (auto) at info level, a value asked for as a warning
        (logger.info if _state["router_auto"] else logger.warning)(
            "sglang-ddtree: %s: the MoE router's GEMM runs the skinny Triton GEMM for %d-%d "
            "token rows (%s)%s", ROUTER_ENV, *token_range, _state["router_config"],
            f" on sm_90 GPUs ({ROUTER_AUTO}, DDTREE's default; 0 turns it off)"
            if _state["router_auto"] else "")
    return patched


def _linear_method_class():
    try:
        from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
    except ImportError as exc:
        raise SkinnyGemmHookError(f"{ENV_SWITCH}: cannot import SGLang's "
                                  f"UnquantizedLinearMethod: {exc!r}; unset the switch") from exc
    params = list(inspect.signature(UnquantizedLinearMethod.apply).parameters)
    if params[:3] != ["self", "layer", "x"] or "bias" not in params:
        raise SkinnyGemmHookError(f"{ENV_SWITCH}: UnquantizedLinearMethod.apply takes {params}, "
                                  "expected (self, layer, x, bias); unset the switch")
    return UnquantizedLinearMethod


def install(token_range: tuple[int, int] = DEFAULT_RANGE, cls=None,
            router_target="sglang") -> bool:
    """Patch ``cls`` (default: SGLang's UnquantizedLinearMethod) and the router GEMM
    (``router_target``: ``(module, attribute)``, default the installed release's, None to
    leave it); False if already patched."""
    cls = cls or _linear_method_class()
    if router_target == "sglang":
        router_target = _router_target()
    _state["range"] = token_range
    _patch("router", router_target, _router_linear)
    if cls.__dict__.get("apply") is _apply:
        return False
    cls._ddtree_original_apply = cls.apply
    cls.apply = _apply
    logger.warning("sglang-ddtree: %s: bf16 linear layers%s run the skinny Triton GEMM for "
                   "%d-%d token rows where K >= %d N", ENV_SWITCH,
                   " and the MoE router" if _state["router"] else "", *token_range, WIDE_K)
    return True


def uninstall(cls=None) -> None:
    """Undo :func:`install` and :func:`install_router` (tests)."""
    if cls is None and _state["range"] is not None:
        cls = _linear_method_class()
    if cls is not None and cls.__dict__.get("apply") is _apply:
        cls.apply = cls.__dict__["_ddtree_original_apply"]
        del cls._ddtree_original_apply
    for key in ("router", "tiny"):
        if _state[key] is not None:
            mod, attr, original = _state[key]
            setattr(mod, attr, original)
    _state.update(range=None, buffers={}, next={}, router=None, router_range=None,
                  router_config=None, tiny=None, pdl=None, router_auto=False)


def check_pdl(environ, switched_on: bool) -> int:
    """``SGLANG_DDTREE_SKINNY_PDL`` (the kernel's launches with programmatic dependent launch:
    ``skinny_gemm.parse_pdl``) as a mode, 0 if unset; raises for
    another value, and for a mode above 0 while neither switch is on (it would do nothing).
    Whether the GPU can run it is checked at the first call, which SGLang makes at start-up."""
    from .triton_kernels import skinny_gemm as sg

    try:
        mode = sg.parse_pdl(environ.get(sg.PDL_ENV, ""))
    except ValueError as exc:
        raise SkinnyGemmHookError(str(exc)) from exc
    if mode and not switched_on:
        raise SkinnyGemmHookError(f"{sg.PDL_ENV}={mode} applies to the skinny GEMM only: set "
                                  f"{ENV_SWITCH} or {ROUTER_ENV} too, or unset it")
    return mode


def maybe_install(environ=os.environ) -> bool:
    """Install what ``SGLANG_DDTREE_SKINNY_GEMM`` and ``SGLANG_DDTREE_ROUTER_GEMM`` ask for
    (both values and ``SGLANG_DDTREE_SKINNY_PDL`` checked first); return whether either is
    on."""
    from .triton_kernels import skinny_gemm as sg

    rng = parse_range(environ.get(ENV_SWITCH, ""))
    router_rng = parse_router(environ.get(ROUTER_ENV, ""))
    auto = router_rng == ROUTER_AUTO
    if auto:
        router_rng = DEFAULT_ROUTER_RANGE
    router_cfg = parse_router_config(environ.get(ROUTER_CONFIG_ENV, ""))
    pdl = check_pdl(environ, rng is not None or router_rng is not None)
    if auto and not environ.get(sg.PDL_ENV, "").strip():
        pdl = ROUTER_AUTO  # PDL where auto takes the kernel (sm_90), plain launches elsewhere
    _state["pdl"] = pdl  # every call's mode (install() / install_router() alone: the kernel's)
    if pdl and pdl != ROUTER_AUTO:
        logger.warning("sglang-ddtree: SGLANG_DDTREE_SKINNY_PDL=%d: the skinny GEMM launches "
                       "with programmatic dependent launch", pdl)
    if rng is not None:
        install(rng)
    if router_rng is not None and auto:
        _state["router_auto"] = True
        try:  # a default, not asked for: where SGLang's router GEMMs are not found, keep them
            install_router(router_rng, router_cfg)
        except Exception as exc:  # noqa: BLE001 (an import of SGLang's module may raise more)
            logger.warning("sglang-ddtree: %s=%s: SGLang's MoE router GEMMs kept (%r)",
                           ROUTER_ENV, ROUTER_AUTO, exc)
            _state["router_auto"] = False
            _state["pdl"] = check_pdl(environ, rng is not None)
            router_rng = None
    elif router_rng is not None:
        install_router(router_rng, router_cfg)
    return rng is not None or router_rng is not None
