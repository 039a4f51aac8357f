"""SGLang plugin entry point (group ``sglang.srt.plugins``): registers DDTREE and its hooks.

SGLang runs this in every process and swallows exceptions raised by plugins, so a failure here is
logged at error level with its fix, and :func:`registration_error` keeps it for ``sglang-ddtree
info`` and for the refusal raised when DDTREE is requested anyway.
"""

from __future__ import annotations

import logging

from . import config as cfg

logger = logging.getLogger(__name__)

_state = {"registered": False, "error": None}

HOOK_TARGETS = {
    "add_cli_args": "sglang.srt.server_args.ServerArgs.add_cli_args",
    "from_cli_args": "sglang.srt.server_args.ServerArgs.from_cli_args",
    "server_args_init": "sglang.srt.server_args.ServerArgs.__init__",
    "get_spec_info": (
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
        ".get_spec_info"
    ),
    "dummy_verify_input": "sglang.srt.speculative.spec_info.create_dummy_verify_input",
    "validate_request": "sglang.srt.speculative.dflash_utils.validate_dflash_request",
}


def hook_targets(sgl) -> dict:
    """HOOK_TARGETS with the installed SGLang's replacements (compat HOOK_TARGET_OVERRIDES)."""
    return {**HOOK_TARGETS, **sgl.HOOK_TARGET_OVERRIDES}


def registration_error() -> str | None:
    return _state["error"]


def is_registered() -> bool:
    return _state["registered"]


def register() -> None:
    """Entry point. Idempotent per process."""
    if _state["registered"]:
        return
    try:
        _register()
    except Exception as e:  # SGLang would swallow it: keep it and say it loudly
        _state["error"] = f"{type(e).__name__}: {e}"
        logger.error("sglang-ddtree: DDTREE is NOT available: %s", _state["error"])
        _refuse_ddtree_with_reason()
        raise
    _state["registered"] = True


def _refuse_ddtree_with_reason() -> None:
    """After a failed registration, make ``--speculative-algorithm DDTREE`` fail with our reason
    instead of SGLang's bare "Unknown speculative algorithm name"."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError:  # no SGLang at all: nothing can ask for DDTREE
        return

    def from_string_hook(original, cls, name, *args, **kwargs):
        if isinstance(name, str) and name.upper() == cfg.ALGORITHM_NAME:
            raise ValueError(f"--speculative-algorithm {cfg.ALGORITHM_NAME} is unavailable: "
                             f"sglang-ddtree failed to register ({_state['error']}).")
        return original(cls, name, *args, **kwargs)

    HookRegistry.register(
        "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.from_string", from_string_hook,
        HookType.AROUND)


def _register() -> None:
    from . import compat

    sgl = compat.load()
    from . import hooks
    from .spec_algo import make_spec_class

    spec_class = make_spec_class(sgl.CustomSpecAlgo, sgl.handle_dflash_server_args)
    existing = sgl.get_registered_spec(cfg.ALGORITHM_NAME)
    if existing is not None or cfg.ALGORITHM_NAME in sgl.builtin_algorithm_names():
        raise RuntimeError(
            f"an algorithm named {cfg.ALGORITHM_NAME} is already known to SGLang "
            f"({existing!r}); this SGLang build may ship its own DDTREE, or another plugin "
            "registered it. Uninstall one of them (pip uninstall sglang-ddtree) or set "
            "SGLANG_PLUGINS to choose."
        )

    @sgl.SpeculativeAlgorithm.register(
        cfg.ALGORITHM_NAME, supports_overlap=True, spec_class=spec_class
    )
    def _worker_factory(server_args):
        from .worker import get_worker_class

        return get_worker_class()

    targets = hook_targets(sgl)
    reg, around = sgl.HookRegistry.register, sgl.HookType.AROUND
    reg(targets["add_cli_args"], hooks.add_cli_args_hook, around)
    reg(targets["from_cli_args"], hooks.from_cli_args_hook, around)
    reg(targets["server_args_init"], hooks.server_args_init_hook, around)
    reg(
        targets["get_spec_info"],
        hooks.make_get_spec_info_hook(sgl.DFlashVerifyInput, sgl.CaptureHiddenMode.FULL),
        around,
    )
    reg(
        targets["dummy_verify_input"],
        hooks.make_dummy_verify_input_hook(
            sgl.DFlashVerifyInput, sgl.CaptureHiddenMode.FULL, sgl.CaptureHiddenMode.NULL,
            params=sgl.DUMMY_VERIFY_INPUT_PARAMS,
        ),
        around,
    )
    reg(targets["validate_request"],
        hooks.make_validate_request_hook(sgl.ddtree_is_active, sgl.SPEC_LOGPROBS), around)
    logger.info("sglang-ddtree: registered speculative algorithm %s", cfg.ALGORITHM_NAME)
    _maybe_install_fused_moe()
    _maybe_install_skinny_gemm()


def _maybe_install_skinny_gemm() -> None:
    """SGLANG_DDTREE_SKINNY_GEMM / SGLANG_DDTREE_ROUTER_GEMM, with SGLANG_DDTREE_SKINNY_PDL (see
    dense_hook; a DDTREE server's schedulers inherit SGLANG_DDTREE_ROUTER_GEMM=auto where it was
    unset, spec_algo.export_router_default): in every process, before the model runs. A bad
    value, or an SGLang linear method or router GEMM that does not fit a value asked for, raises
    SkinnyGemmHookError: no fallback (auto keeps SGLang's router GEMMs, with a warning)."""
    import os

    if not (os.environ.get("SGLANG_DDTREE_SKINNY_GEMM")
            or os.environ.get("SGLANG_DDTREE_ROUTER_GEMM")
            or os.environ.get("SGLANG_DDTREE_SKINNY_PDL")):  # alone: refused by maybe_install
        return
    from . import dense_hook

    dense_hook.maybe_install()


def _maybe_install_fused_moe() -> None:
    """Opt-in (SGLANG_DDTREE_FUSED_MOE=1 / SGLANG_DDTREE_MOE_DUMMY_INT4_SEED /
    SGLANG_DDTREE_DUMMY_INIT_RANGE / SGLANG_DDTREE_DUMMY_ROUTER_LOGIT_STD /
    SGLANG_DDTREE_MOE_STATS): in every process,
    before weights load. A layout SGLang does not match raises FusedMoeHookError: no fallback."""
    import os

    if not (os.environ.get("SGLANG_DDTREE_FUSED_MOE") or
            os.environ.get("SGLANG_DDTREE_MOE_DUMMY_INT4_SEED") or
            os.environ.get("SGLANG_DDTREE_DUMMY_INIT_RANGE") or
            os.environ.get("SGLANG_DDTREE_DUMMY_ROUTER_LOGIT_STD") or
            os.environ.get("SGLANG_DDTREE_MOE_STATS")):
        return
    from . import moe_hook

    moe_hook.maybe_install()
    moe_hook.maybe_install_dummy_int4_fill()
    moe_hook.maybe_install_dummy_init_range()  # before the router spread: it wraps this one
    moe_hook.maybe_install_dummy_router_spread()
    moe_hook.maybe_enable_stats()


def check_hooks_applied() -> list:
    """Hook targets SGLang's HookRegistry failed to patch (it logs and continues)."""
    from . import compat

    sgl = compat.load()
    return [t for t in hook_targets(sgl).values() if t not in sgl.HookRegistry._patched]
