"""``sglang-ddtree`` command: info, patch, doctor."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def collect_info() -> dict:
    """Everything `sglang-ddtree info` prints, as a dict (also used by tests and benchmarks)."""
    from . import __version__, config
    from . import compat

    info = {
        "sglang_ddtree": __version__,
        "sglang": _version("sglang"),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "supported_sglang": list(compat.SUPPORTED_VERSIONS),
        "gpu": None,
        "gpu_arch": None,
        "ddtree_registers": False,
        "registration_error": None,
        "tree_verify_backends": {},
        "triton_verify_behind": {},
        "mla_prefix_flashmla": None,
        "mha_prefix_fa3": None,
        "requests": {},
        "settings": {},
    }
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            major, minor = torch.cuda.get_device_capability(0)
            info["gpu_arch"] = f"sm_{major}{minor}"
    except ImportError:
        pass
    try:
        from . import plugin

        plugin.register()
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        info["ddtree_registers"] = (
            SpeculativeAlgorithm.from_string(config.ALGORITHM_NAME).name == config.ALGORITHM_NAME
        )
    except Exception as e:  # reported, not hidden: this is a diagnostic command
        info["registration_error"] = f"{type(e).__name__}: {e}"
    info["requests"] = request_support()
    info["tree_verify_backends"] = installed_tree_backends()
    info["triton_verify_behind"] = triton_verify_backends()
    info["mla_prefix_flashmla"] = flashmla_prefix_status()
    info["mha_prefix_fa3"] = fa3_prefix_status()
    try:
        info["settings"] = {
            "budget": (f"auto {config.read_auto_table()}" if config.is_auto_budget()
                       else config.read_budget()),
            "topk": config.read_topk() or "min(budget, vocab)",
            "verify_backend": config.read_verify_backend(),
            "mla_prefix": _prefix_setting(config.read_mla_prefix(),
                                          config.read_mla_prefix_min_batch()),
            "mha_prefix": _prefix_setting(config.read_mha_prefix(),
                                          config.read_mha_prefix_min_batch()),
            "draft_attention": config.read_draft_attention(),
            "tree_builder": os.environ.get("SGLANG_DDTREE_TREE_BACKEND", "auto"),
            "router_gemm": router_gemm_setting(),
        }
    except config.DDTreeConfigError as e:  # a bad env value is what the user needs to see
        info["settings"] = {"error": str(e)}
    return info


def router_gemm_setting() -> str:
    """The MoE router's GEMM in DDTREE servers on this machine (``SGLANG_DDTREE_ROUTER_GEMM``,
    DDTREE's ``auto`` where unset; dense_hook.describe_router)."""
    from .dense_hook import ROUTER_ENV, describe_router

    capability = None
    try:
        import torch

        if torch.cuda.is_available():
            capability = torch.cuda.get_device_capability(0)
    except ImportError:
        pass
    return describe_router(os.environ.get(ROUTER_ENV, ""), capability)


def request_support() -> dict:
    """Per-request features with this SGLang release: what DDTREE serves and what it refuses."""
    from . import compat

    try:
        sgl = compat.load()
    except Exception as e:  # an unsupported SGLang: registration says why
        return {"error": f"{type(e).__name__}: {e}"}
    return {
        "grammar": "served (regex, json_schema, ebnf, structural_tag: a bitmask per tree node)",
        "return_logprob": ("served (SGLang's compute_spec_logprobs)" if sgl.SPEC_LOGPROBS else
                           f"refused at admission (SGLang {sgl.VERSION}'s DFLASH check)"),
    }


def _prefix_setting(name: str, min_batch: int) -> str:
    """A prefix setting as ``info`` shows it: ``flashmla:8`` reads "flashmla from batch 8"."""
    return name if min_batch == 1 else f"{name} from batch {min_batch}"


_BACKEND_MODULES = {
    "triton": "sglang.srt.layers.attention.triton_backend",
    "flashinfer": "flashinfer",
}


def installed_tree_backends() -> dict:
    """Tree-capable target attention backends per attention arch, with whether each imports."""
    from .config import TREE_VERIFY_BACKENDS

    out = {}
    for arch, names in TREE_VERIFY_BACKENDS.items():
        out[arch] = {}
        for name in names:
            try:
                importlib.import_module(_BACKEND_MODULES[name])
                out[arch][name] = "available"
            except Exception as e:
                out[arch][name] = f"not importable ({type(e).__name__})"
    return out


def triton_verify_backends() -> dict:
    """The target backends that verify through DDTREE's Triton kernels (what ``auto`` picks
    behind them), per attention arch, or why those kernels do not import here."""
    from .config import TREE_VERIFY_BACKENDS, TRITON_VERIFY_TARGET_BACKENDS

    try:
        importlib.import_module("sglang_ddtree.triton_kernels.tree_attention")
        importlib.import_module("sglang_ddtree.triton_kernels.tree_attention_mla")
    except Exception as e:
        return {"error": f"tree-verify kernels not importable ({type(e).__name__}: {e})"}
    return {arch: [b for b in names if b not in TREE_VERIFY_BACKENDS[arch]]
            for arch, names in TRITON_VERIFY_TARGET_BACKENDS.items()}


def _prefix_status(module: str, usable: str) -> str:
    """Whether a prefix kernel's machine needs (``sglang_ddtree.<module>.machine_problems``: a
    GPU of its arch, the kernel importable) hold here; the target's own needs are checked at
    start-up."""
    try:
        import importlib

        import torch

        machine_problems = importlib.import_module(f"sglang_ddtree.{module}").machine_problems
        why = machine_problems(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    except Exception as e:  # a diagnostic: say what failed
        return f"unknown ({type(e).__name__}: {e})"
    return usable if not why else "not usable: " + "; ".join(why)


def flashmla_prefix_status() -> str:
    """Whether FlashMLA's prefix (``SGLANG_DDTREE_MLA_PREFIX``: auto or flashmla) can run on
    this machine (GPU and FlashMLA; the target's own needs, --page-size 64 and a bf16 KV cache,
    are checked at start-up)."""
    return _prefix_status("mla_prefix", "usable (with --page-size 64 and a bf16 KV cache)")


def fa3_prefix_status() -> str:
    """Whether the FA3 prefix (``SGLANG_DDTREE_MHA_PREFIX``: auto or fa3) can run on this
    machine (a Hopper GPU and FA3; the target's own needs, a bf16 / fp16 KV cache and its head
    dims, are checked at start-up)."""
    return _prefix_status("mha_prefix", "usable (with a bf16 / fp16 KV cache)")


def _cmd_info(args) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            print(f"{key:22s} {value}")
    return 0 if info["ddtree_registers"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sglang-ddtree", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, GPU arch, DDTREE registration, tree backends")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_info)
    for name in ("patcher", "doctor"):
        try:
            mod = importlib.import_module(f"sglang_ddtree.{name}")
        except ImportError:
            continue
        mod.add_subparser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
