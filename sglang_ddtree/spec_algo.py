"""The DDTREE speculative algorithm as SGLang sees it: predicates, server-args handling, widths.

DDTREE claims ``is_dflash_family()``: SGLang then captures the target's aux hidden states for the
drafter, sizes the drafter's KV pool, loads the DFlash drafter and captures the drafter's
block-width TARGET_VERIFY graph exactly as for DFLASH. What differs (verify width budget+1, a real
tree mask in the verify graph) is set here and in :mod:`sglang_ddtree.hooks`.
"""

from __future__ import annotations

import json
import logging
import os

from . import config as cfg

logger = logging.getLogger(__name__)


def read_draft_config(draft_path: str) -> dict:
    """The drafter's config.json as a dict, with the DFlash fields DDTREE needs checked."""
    path = os.path.join(draft_path, "config.json")
    if not os.path.isfile(path):
        raise cfg.DDTreeConfigError(
            f"DDTREE drafter config not found at {path}. --speculative-draft-model-path must be a "
            "local directory holding a DFlash drafter (config.json with block_size and "
            "dflash_config)."
        )
    with open(path) as f:
        data = json.load(f)
    return validate_draft_config(data, where=path)


def validate_draft_config(data: dict, where: str = "drafter config") -> dict:
    dflash = data.get("dflash_config") or {}
    missing = []
    block = dflash.get("block_size", data.get("block_size"))
    if block is None:
        missing.append("block_size")
    if "target_layer_ids" not in dflash and "target_layer_ids" not in data:
        missing.append("dflash_config.target_layer_ids")
    if "mask_token_id" not in dflash and "mask_token" not in dflash:
        missing.append("dflash_config.mask_token_id")
    if data.get("num_hidden_layers") is None:
        missing.append("num_hidden_layers")
    if missing:
        raise cfg.DDTreeConfigError(
            f"{where} is not a DFlash drafter config: missing {', '.join(missing)}. DDTREE needs "
            "a DFlash block-diffusion drafter (architectures: DFlashDraftModel) whose config "
            "names block_size, num_hidden_layers and dflash_config.{target_layer_ids, "
            "mask_token_id}."
        )
    if int(block) < 2:
        raise cfg.DDTreeConfigError(f"{where}: block_size must be >= 2, got {block}.")
    return data


def check_server_args(server_args) -> None:
    """Startup refusals that need only ServerArgs (runs in the launcher, before any model load)."""
    if server_args.speculative_draft_model_path is None:
        raise cfg.DDTreeConfigError(
            "--speculative-algorithm DDTREE needs --speculative-draft-model-path <DFlash drafter>."
        )
    if getattr(server_args, "pp_size", 1) != 1:
        raise cfg.DDTreeConfigError(
            f"DDTREE does not support pipeline parallelism (pp_size={server_args.pp_size}); use "
            "--pp-size 1 (tensor parallelism is fine)."
        )
    if getattr(server_args, "enable_deterministic_inference", False):
        from . import compat

        align = compat.load().deterministic_prefill_align(server_args)
        chunk = getattr(server_args, "chunked_prefill_size", None)
        if align is not None and chunk is not None and 0 < chunk < align:
            raise cfg.DDTreeConfigError(
                f"--enable-deterministic-inference makes this SGLang align every prefill chunk "
                f"to {align} tokens and never schedule a shorter one, so with "
                f"--chunked-prefill-size {chunk} a prompt longer than {chunk} tokens would "
                f"wait forever. Use --chunked-prefill-size {align} or more."
            )
    cfg.read_budget()  # raises on a bad --speculative-ddtree-budget / SGLANG_DDTREE_BUDGET
    cfg.read_topk()
    verify = cfg.read_verify_backend()
    backend = server_args.decode_attention_backend or server_args.attention_backend
    if backend is None:
        return  # SGLang picks one later; the worker checks what it picked
    allowed = sorted({b for bs in cfg.TREE_VERIFY_BACKENDS.values() for b in bs})
    # a pre-check on CLI names; the worker decides on the backend SGLang built (an MLA model
    # behind "flashinfer" gets flashinfer_mla, which needs ours)
    verify = cfg.resolve_verify_backend(verify, backend, allowed, cfg.TRITON_VERIFY_CLI_BACKENDS)
    if verify == "triton":
        if backend not in cfg.TRITON_VERIFY_CLI_BACKENDS:
            raise cfg.DDTreeConfigError(
                f"DDTREE with --speculative-ddtree-verify-backend triton runs behind the "
                f"'{backend}' attention backend only if it keeps SGLang's standard KV pool; "
                f"use --attention-backend with one of: "
                f"{', '.join(cfg.TRITON_VERIFY_CLI_BACKENDS)}."
            )
        return
    if backend not in allowed:
        hint = (" Or keep it and add --speculative-ddtree-verify-backend triton (DDTREE's own "
                "Triton tree-verify kernels)." if backend in cfg.TRITON_VERIFY_CLI_BACKENDS
                else "")
        raise cfg.DDTreeConfigError(
            f"DDTREE verifies a tree, which the '{backend}' attention backend cannot express. "
            f"Use --attention-backend with one of: {', '.join(allowed)} (MLA targets: "
            f"{', '.join(cfg.TREE_VERIFY_BACKENDS['mla'])}).{hint}"
        )


def make_spec_class(base, handle_dflash_server_args):
    """Build the CustomSpecAlgo subclass against the given SGLang base class.

    ``handle_dflash_server_args`` is SGLang's own DFLASH server-args handler (drafter backend
    resolution, num_steps/topk normalisation, max_running_requests default); we run it, then widen
    ``speculative_num_draft_tokens`` for the tree.
    """

    class DDTreeSpecAlgo(base):
        def is_dflash_family(self) -> bool:
            return True

        def supports_target_verify_for_draft(self) -> bool:
            return True

        def supports_grammar_overlap(self) -> bool:
            # as DFLASH: the worker calls the scheduler's grammar barrier inside its step, before
            # it builds the tree's bitmask, so grammar batches keep the overlap scheduler
            return True

        def supports_ragged_verify(self) -> bool:
            return False

        def has_draft_kv(self) -> bool:
            return True

        def need_topk(self) -> bool:
            return False

        def carries_draft_hidden_states(self) -> bool:
            return False

        def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens=True,
                              needs_confidence_relay=False):
            from sglang.srt.managers.overlap_utils import FutureMap

            return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens,
                             needs_confidence_relay)

        def handle_server_args(self, server_args) -> None:
            check_server_args(server_args)
            draft = read_draft_config(server_args.speculative_draft_model_path)
            block = int((draft.get("dflash_config") or {}).get("block_size", draft.get("block_size")))
            if server_args.speculative_num_draft_tokens is not None:
                logger.warning(
                    "DDTREE sets speculative_num_draft_tokens itself (max(budget+1, block_size)); "
                    "ignoring --speculative-num-draft-tokens=%s. Use --speculative-ddtree-budget.",
                    server_args.speculative_num_draft_tokens,
                )
            server_args.speculative_num_draft_tokens = block
            server_args.speculative_dflash_block_size = None
            draft_backend = server_args.speculative_draft_attention_backend
            if draft_backend is None:
                target = server_args.decode_attention_backend or server_args.attention_backend
                server_args.speculative_draft_attention_backend = (
                    target if target in cfg.DRAFT_BACKENDS else "triton"
                )
            elif draft_backend not in cfg.DRAFT_BACKENDS:
                raise cfg.DDTreeConfigError(
                    f"DDTREE drafter attention backend must be one of {cfg.DRAFT_BACKENDS}, got "
                    f"--speculative-draft-attention-backend {draft_backend}."
                )
            handle_dflash_server_args(server_args)
            vocab = int(draft.get("vocab_size") or 1 << 30)
            tree_cfg = cfg.resolve(block, vocab)
            server_args.speculative_num_draft_tokens = tree_cfg.num_draft_tokens
            # Scheduler processes inherit the environment: they need the block size before the
            # drafter config is loaded there (target graph capture comes first).
            os.environ[cfg.ENV_BLOCK_SIZE] = str(block)
            if tree_cfg.auto_table is None:
                os.environ[cfg.ENV_BUDGET] = str(tree_cfg.budget)
            else:  # schedulers must see 'auto' too (and the table, inherited with the env)
                os.environ[cfg.ENV_BUDGET] = cfg.AUTO_BUDGET
            export_router_default()
            logger.info(
                "DDTREE: budget=%s topk=%d block_size=%d verify_width=%d "
                "speculative_num_draft_tokens=%d",
                tree_cfg.budget if tree_cfg.auto_table is None
                else f"auto {list(tree_cfg.auto_table)}", tree_cfg.topk, tree_cfg.block_size,
                tree_cfg.verify_width, tree_cfg.num_draft_tokens,
            )

        def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens, is_draft_worker):
            # num_draft_tokens is max(budget+1, block); the drafter runs block tokens, the target
            # verifies budget+1. Both are recovered from the environment + num_draft_tokens.
            return verify_widths(num_draft_tokens)[1 if is_draft_worker else 0]

    DDTreeSpecAlgo.__name__ = DDTreeSpecAlgo.__qualname__ = "DDTreeSpecAlgo"
    return DDTreeSpecAlgo


def export_router_default(environ=os.environ) -> bool:
    """DDTREE's default for the MoE router's GEMM: ``SGLANG_DDTREE_ROUTER_GEMM=auto`` where the
    operator left it unset or empty, exported for the schedulers (they install it when the
    plugin loads there; ``dense_hook``: our skinny GEMM under PDL for the verify's 12-32 rows on
    sm_90 GPUs, SGLang's elsewhere). Returns whether it was set here; a value given is kept,
    checked here first so that a bad one stops the launcher (SkinnyGemmHookError naming the
    accepted forms) before any scheduler starts."""
    from .dense_hook import ROUTER_AUTO, ROUTER_ENV, parse_router

    value = environ.get(ROUTER_ENV, "")
    if value.strip():
        parse_router(value)
        return False
    environ[ROUTER_ENV] = ROUTER_AUTO
    return True


def verify_widths(num_draft_tokens: int) -> tuple:
    """(target verify width, drafter block width) for SGLang's ``num_draft_tokens``.

    Called from SGLang's CUDA-graph runners in the scheduler process, which see only
    ``num_draft_tokens``; budget and block size come from the environment the launcher set.
    With ``--speculative-ddtree-budget auto`` the worker also builds verify runners for the
    smaller budgets of the auto table, asking for ``num_draft_tokens = budget + 1``: those widths
    are returned as they are (they are never equal to the server's max(largest + 1, block)).
    """
    if cfg.is_auto_budget():
        budgets = {b for _, b in cfg.read_auto_table()}
        if int(num_draft_tokens) - 1 in budgets - {max(budgets)}:
            block = os.environ.get(cfg.ENV_BLOCK_SIZE)
            return int(num_draft_tokens), int(block) if block else None
    budget = cfg.read_budget()
    block = os.environ.get(cfg.ENV_BLOCK_SIZE)
    if not block:
        raise RuntimeError(
            f"DDTREE: {cfg.ENV_BLOCK_SIZE} is unset in this process; it is set when ServerArgs "
            "resolves --speculative-algorithm DDTREE, before SGLang starts its schedulers."
        )
    n, block = budget + 1, int(block)
    if max(n, block) != int(num_draft_tokens):
        raise RuntimeError(
            f"DDTREE: speculative_num_draft_tokens={num_draft_tokens} but max(budget+1, block) = "
            f"max({n}, {block}); the budget changed between processes."
        )
    return n, block
