"""The few places where DDTREE changes SGLang's behaviour, as hook functions.

Each hook is a plain function taking the original first (HookRegistry AROUND convention), so it
can be tested without SGLang. :func:`register_all` installs them through SGLang's HookRegistry.

1. CLI: ``--speculative-ddtree-budget`` / ``--speculative-ddtree-topk`` /
   ``--speculative-ddtree-verify-backend`` in SGLang's speculative argument group;
   ``from_cli_args`` copies them into the environment (the one source of truth, inherited by
   scheduler processes) before ``ServerArgs`` resolves the algorithm.
2. Requests: SGLang validates DFLASH-family requests at admission; DDTREE also refuses
   ``return_logprob`` there on a release without speculative logprobs (aborting that request
   with a message, never the server).
3. CUDA graphs: for an unknown (plugin) algorithm SGLang builds no dummy verify input, and for the
   DFLASH family it builds one *without* a custom mask on triton/flashinfer. Either way the target
   verify graph would be captured causal and silently ignore the tree at replay. For DDTREE's
   target runner we hand back a verify input that carries the runner's custom-mask buffer and the
   verify width, so the mask path is what gets captured.
"""

from __future__ import annotations

import argparse
import logging
import os

from . import config as cfg

logger = logging.getLogger(__name__)

def _is_ddtree(spec_algorithm) -> bool:
    return getattr(spec_algorithm, "name", None) == cfg.ALGORITHM_NAME


def add_ddtree_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the DDTree flags, inside SGLang's speculative-decoding group when it has one."""
    group = parser
    for g in getattr(parser, "_action_groups", []):  # the group holding SGLang's spec flags
        if any("--speculative-algorithm" in a.option_strings for a in g._group_actions):
            group = g
            break
    group.add_argument(
        "--speculative-ddtree-budget",
        type=_budget_arg,
        default=None,
        help=f"DDTREE: draft-tree nodes verified per step ({cfg.MIN_BUDGET}..{cfg.MAX_BUDGET}, "
        f"default {cfg.DEFAULT_BUDGET}; env {cfg.ENV_BUDGET}), or 'auto': a budget per batch "
        f"size from {cfg.ENV_AUTO_TABLE} (default '{cfg.DEFAULT_AUTO_TABLE}').",
    )
    group.add_argument(
        "--speculative-ddtree-topk",
        type=int,
        default=None,
        help="DDTREE: candidates per depth K (default min(budget, vocab); env "
        f"{cfg.ENV_TOPK}).",
    )
    group.add_argument(
        "--speculative-ddtree-verify-backend",
        type=str,
        choices=cfg.VERIFY_BACKENDS,
        default=None,
        help="DDTREE: kernels of the target's tree-verify forward. 'native': the target's "
        "attention backend with a tree mask (triton, flashinfer for MHA; triton for MLA); "
        "'triton': sglang-ddtree's Triton tree-attention kernels, while prefill and decode keep "
        "the target's backend (lets fa3 and the MLA backends flashinfer/flashmla/cutlass_mla/"
        "trtllm_mla serve DDTREE); 'auto' (default): native where the target's backend can "
        f"express a tree, else triton. Env {cfg.ENV_VERIFY_BACKEND}.",
    )
    if group is not parser:
        _place_after_speculative_flags(group)


def _budget_arg(value: str):
    """argparse type of --speculative-ddtree-budget: an int, or 'auto'."""
    if str(value).strip().lower() == cfg.AUTO_BUDGET:
        return cfg.AUTO_BUDGET
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer in [{cfg.MIN_BUDGET}, {cfg.MAX_BUDGET}] or 'auto', got "
            f"{value!r}") from None


def _place_after_speculative_flags(group) -> None:
    """List our flags right after SGLang's last ``--speculative-*`` flag in ``--help``.

    SGLang 0.5.17 puts every flag in one argparse group, so "under the speculative options"
    means next to them in the listing.
    """
    actions = group._group_actions
    ours = [a for a in actions if any(o.startswith("--speculative-ddtree") for o in a.option_strings)]
    rest = [a for a in actions if a not in ours]
    is_spec = lambda a: any(o.startswith("--speculative-") for o in a.option_strings)  # noqa
    first = next((i for i, a in enumerate(rest) if "--speculative-algorithm" in a.option_strings),
                 None)
    if first is None:
        return
    last = first
    while last + 1 < len(rest) and is_spec(rest[last + 1]):
        last += 1
    actions[:] = rest[: last + 1] + ours + rest[last + 1:]


def add_cli_args_hook(original, parser, *args, **kwargs):
    result = original(parser, *args, **kwargs)
    add_ddtree_cli_args(parser)
    return result


def export_cli_args(args: argparse.Namespace, environ=os.environ) -> None:
    """Copy parsed DDTree flags into the environment (validated here: fail before model load)."""
    budget = getattr(args, "speculative_ddtree_budget", None)
    if budget is not None:
        if str(budget).strip().lower() == cfg.AUTO_BUDGET:
            cfg.read_auto_table(environ)  # a bad SGLANG_DDTREE_AUTO_TABLE fails here
            environ[cfg.ENV_BUDGET] = cfg.AUTO_BUDGET
        else:
            environ[cfg.ENV_BUDGET] = str(cfg.validate_budget(int(budget)))
        cfg.read_auto_mode(environ)  # a bad or misplaced SGLANG_DDTREE_AUTO_MODE fails here
    topk = getattr(args, "speculative_ddtree_topk", None)
    if topk is not None:
        if topk < 1:
            raise cfg.DDTreeConfigError(f"--speculative-ddtree-topk must be >= 1, got {topk}.")
        environ[cfg.ENV_TOPK] = str(int(topk))
    verify = getattr(args, "speculative_ddtree_verify_backend", None)
    if verify is not None:
        environ[cfg.ENV_VERIFY_BACKEND] = cfg.validate_verify_backend(str(verify))


ENGINE_KWARGS = ("speculative_ddtree_budget", "speculative_ddtree_topk",
                 "speculative_ddtree_verify_backend")


def server_args_init_hook(original, self, *args, **kwargs):
    """``sglang.Engine(..., speculative_ddtree_budget=64)``: ServerArgs has no such field, so the
    keywords are taken out (and exported like the CLI flags) before ServerArgs sees them."""
    ours = {k: kwargs.pop(k) for k in ENGINE_KWARGS if k in kwargs}
    if ours:
        export_cli_args(argparse.Namespace(**{k: ours.get(k) for k in ENGINE_KWARGS}))
    return original(self, *args, **kwargs)


def from_cli_args_hook(original, cls, args, *rest, **kwargs):
    export_cli_args(args)
    return original(cls, args, *rest, **kwargs)


def make_get_spec_info_hook(verify_input_cls, capture_full):
    """Hook for ``DecodeCudaGraphRunner.get_spec_info(self, num_tokens)``."""

    def get_spec_info_hook(original, runner, num_tokens, *args, **kwargs):
        mr = runner.model_runner
        if not _is_ddtree(mr.spec_algorithm) or mr.is_draft_worker:
            return original(runner, num_tokens, *args, **kwargs)
        return verify_input_cls(
            draft_token=None,
            positions=None,
            draft_token_num=runner.captured_req_width,
            custom_mask=runner.buffers.custom_mask,
            capture_hidden_mode=capture_full,
        )

    return get_spec_info_hook


DUMMY_VERIFY_INPUT_PARAMS = ("spec_algorithm", "server_args", "custom_mask",
                             "num_tokens_per_req", "is_draft_worker")


def make_dummy_verify_input_hook(verify_input_cls, capture_full, capture_null,
                                 params=DUMMY_VERIFY_INPUT_PARAMS):
    """Hook for ``create_dummy_verify_input(algo, [server_args,] custom_mask, n, is_draft)``.

    ``params``: the hooked function's parameter names in order (SGLang 0.5.23 dropped
    ``server_args``); the hook reads its arguments by name.
    """

    def dummy_verify_input_hook(original, *args, **kwargs):
        bound = dict(zip(params, args), **kwargs)
        if not _is_ddtree(bound["spec_algorithm"]):
            return original(*args, **kwargs)
        is_draft_worker = bound["is_draft_worker"]
        num_tokens_per_req, custom_mask = bound["num_tokens_per_req"], bound["custom_mask"]
        return verify_input_cls(
            draft_token=None,
            positions=None,
            draft_token_num=num_tokens_per_req,
            custom_mask=None if is_draft_worker else custom_mask,
            capture_hidden_mode=capture_null if is_draft_worker else capture_full,
        )

    return dummy_verify_input_hook


def make_validate_request_hook(ddtree_active, spec_logprobs=False):
    """Hook for ``validate_dflash_request(req, enable_overlap) -> Optional[str]`` (an error
    string aborts just that request). ``ddtree_active()`` says whether this server runs DDTREE;
    ``spec_logprobs``: whether this SGLang release computes speculative logprobs (0.5.23 does;
    0.5.17's own check refuses ``return_logprob`` first)."""

    def validate_request_hook(original, req, *args, **kwargs):
        err = original(req, *args, **kwargs)
        if err is not None or not ddtree_active():
            return err
        if getattr(req, "return_logprob", False) and not spec_logprobs:
            return ("DDTREE does not support return_logprob with this SGLang release; send the "
                    "request to a server without DDTREE or drop return_logprob.")
        return None  # grammar-constrained requests are served (worker: the tree's bitmask)

    return validate_request_hook
