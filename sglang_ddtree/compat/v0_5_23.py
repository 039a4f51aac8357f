"""SGLang 0.5.23: every SGLang internal the plugin touches, in one place.

Same names and meanings as :mod:`.v0_5_17`. What changed in SGLang between the two releases, and
where this module absorbs it:

- ``ServerArgs`` is a msgspec Struct resolved by declarations: a plugin's ``handle_server_args``
  receives a stand-in whose field writes are declared afterwards (``record_foreign_defaults``),
  and resolved values are read through ``resolution_result`` rather than the raw fields
  (:func:`handle_dflash_server_args`, :func:`resolved_arg`).
- ``create_dummy_verify_input`` lost its ``server_args`` parameter
  (:data:`DUMMY_VERIFY_INPUT_PARAMS`).
- ``DFlashWorkerV2(server_args, gpu_id, nccl_port, target_worker)``: no ``ps``; ranks come from
  ``get_parallel()`` (:func:`tp_rank`, :func:`get_tp_group`).
- The draft input's reserved lengths are ``nxt_kv_lens_*`` (:func:`reserved_kv_lens`).
- KV slot ids go through a per-iteration ``KVLocPlan``; every forward binds one
  (:func:`run_draft_block`), and DDTREE refuses pools whose ids need translating
  (:func:`check_kv_layout`).
- DFLASH defers the target's verify-logits vocab gather (:func:`verify_logits`) and scales the
  drafter's noise embedding (:func:`draft_block_embeddings`).
- ``verify_tree_greedy`` is a JIT op under ``sglang.kernels.ops.speculative``
  (``spec_tree.verify_tree_greedy_func`` dispatches to ``tree.verify_tree_greedy`` on CUDA).

Module-level imports are the light, CPU-importable ones; GPU-side symbols resolve lazily.
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: F401
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: F401
from sglang.srt.speculative.spec_registry import CustomSpecAlgo  # noqa: F401
from sglang.srt.speculative.spec_registry import get_spec as get_registered_spec  # noqa: F401
from ._common import (  # noqa: F401  (identical in every supported release)
    _BACKEND_NAMES, apply_verify_logits_adjustments, attention_backend_name,
    builtin_algorithm_names, dcp_enabled, ddtree_is_active, is_hybrid_linear_target, is_mla,
    LAZY_COMMON, build_verify_state, make_lazy, max_capture_bs, max_running_requests,
    sampler_module, sampling_backend,
)
from ._common import tree_greedy_walk as _tree_greedy_walk

VERSION = "0.5.23"

# plugin.HOOK_TARGETS entries this version hooks elsewhere. ServerArgs is a msgspec Struct whose
# constructor never calls a Python-level __init__, so Engine keywords are taken out one level up.
HOOK_TARGET_OVERRIDES = {"server_args_init": "sglang.srt.entrypoints.engine.Engine.__init__"}

# create_dummy_verify_input's positional parameters, in order
DUMMY_VERIFY_INPUT_PARAMS = ("spec_algorithm", "custom_mask", "num_tokens_per_req",
                             "is_draft_worker")

# the MoE router's bf16 x bf16 -> fp32 GEMM, as DeepseekV2's MoEGate imports it at call time
# above its tiny-router kernel's row limit (moved here from attention.dsv4 after 0.5.17)
ROUTER_GEMM = ("sglang.kernels.ops.gemm.bf16_fp32", "linear_bf16_fp32")

# SGLang's tiny router GEMM, the one DeepseekV2's MoEGate calls up to its
# tiny_router_gemm_max_tokens rows (dense_hook's SGLANG_DDTREE_ROUTER_GEMM patches this
# attribute of the model module)
ROUTER_TINY_GEMM = ("sglang.srt.models.deepseek_v2", "tiny_gemm_bf16")

# name -> (module, attribute), imported on first use
_LAZY = {
    **LAZY_COMMON,
    # CUDA/HIP: the JIT op sglang.kernels.ops.speculative.tree.verify_tree_greedy
    "verify_tree_greedy_func": (
        "sglang.kernels.ops.speculative.spec_tree", "verify_tree_greedy_func"),
}

__getattr__, _lazy = make_lazy(_LAZY, globals())


def tree_greedy_walk(tree, predicted, path_width: int):
    """SGLang's ``verify_tree_greedy`` over our tree: (accept_len, accepted_nodes, bonus)."""
    return _tree_greedy_walk(tree, predicted, path_width, _lazy("verify_tree_greedy_func"))


# whether this release computes speculative logprobs (``return_logprob``): DFLASH does here
SPEC_LOGPROBS = True


def spec_logprobs(batch, logits_output, predicted, accept_index) -> None:
    """Logprobs of the emitted tokens (and the requested top / token-id logprobs) into
    ``logits_output``, as DFLASH computes them, by SGLang's ``compute_spec_logprobs``.

    predicted: [bs * N] the target's token at every node; accept_index: [bs, B] the flat verify
    rows of the accepted path (root first, root-padded): emitted token j of request b is
    ``predicted[accept_index[b, j]]``, drawn from that row's logits."""
    from sglang.srt.layers.logprob_processor import compute_spec_logprobs

    compute_spec_logprobs(batch, logits_output, predicted, accept_index=accept_index)


# --- server args ---------------------------------------------------------------------------

def _record_behind(stand_in):
    """The ServerArgs record a ``record_foreign_defaults`` stand-in reads through, or None."""
    from sglang.srt.arg_groups.overrides import _ForeignDefaults, record_of

    if not isinstance(stand_in, _ForeignDefaults):
        return None
    return record_of(object.__getattribute__(stand_in, "_cfg"))


def handle_dflash_server_args(server_args) -> None:
    """Run SGLang's DFLASH server-args handler from inside DDTREE's ``handle_server_args``.

    SGLang hands a plugin's handler a stand-in that records field writes and declares them only
    when the handler returns. ``_handle_dflash`` declares on the record it is given, so it runs
    on the record behind the stand-in, after the plugin's writes so far have been declared there
    (it must see them, e.g. ``speculative_num_draft_tokens`` = the drafter block). Reads through
    the stand-in see its declarations; the plugin's later writes are declared after them.
    """
    from sglang.srt.arg_groups.arg_utils import field_names
    from sglang.srt.arg_groups.overrides import declare_resolution
    from sglang.srt.arg_groups.speculative_hook import _handle_dflash

    record = _record_behind(server_args)
    if record is None:  # a plain record (or a test double): SGLang's own calling convention
        _handle_dflash(server_args)
        return
    fields = field_names(type(record))
    written = {k: v for k, v in object.__getattribute__(server_args, "_written").items()
               if k in fields}
    if written:
        declare_resolution(record, "sglang_ddtree.handle_server_args", **written)
    _handle_dflash(record)


def resolved_arg(server_args, name: str):
    """The resolved value of a ServerArgs field (the raw field holds the operator's input)."""
    from sglang.srt.arg_groups.overrides import resolution_result

    return resolution_result(server_args, name)


def deterministic_prefill_align(server_args):
    """None: 0.5.23's scheduler refuses a chunked prefill size below its deterministic-mode
    alignment itself (``check_truncation_align_fits_chunk``)."""
    return None


def decode_graphs_enabled(server_args) -> bool:
    """Whether decode CUDA graphs are on (the deprecated ``disable_cuda_graph`` field is raw)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.runtime_context import get_exec

    return get_exec().graph.cuda_graph_config.decode.backend != Backend.DISABLED


# --- model / runner introspection ----------------------------------------------------------


def get_tp_group():
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().tp_group


def tp_rank(worker) -> int:
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_rank)


def reserved_kv_lens(draft_input):
    """(host [bs] reserved KV lengths or None, their sum or None) from the step's draft input."""
    return draft_input.nxt_kv_lens_cpu, draft_input.nxt_kv_lens_sum


def check_drafter_variant(worker) -> None:
    """Refuse the DFLASH drafter variants 0.5.23 added (Domino rollout, candidate selector,
    LiLiCorr head): their proposals are not the lm_head distribution of the drafter's hidden
    states, which is what DDTREE's per-depth top-K reads."""
    from .. import config as cfg

    variants = [name for name, on in (
        ("Domino", getattr(worker, "_is_domino", False)),
        ("candidate selector", getattr(worker, "selector", None) is not None),
        ("LiLiCorr", getattr(worker, "lilicorr", None) is not None)) if on]
    if variants:
        raise cfg.DDTreeConfigError(
            f"DDTREE supports plain DFlash drafters; this drafter has a {', '.join(variants)} "
            "head. Use --speculative-algorithm DFLASH for it."
        )


def set_draft_block_size(worker, block_size: int) -> None:
    """Give the drafter its real block size back. DFLASH's constructor sets it to
    ``speculative_num_draft_tokens``, which for DDTREE is max(budget+1, block); the drafter's
    block convolutions index positions modulo this value."""
    worker.draft_model.set_block_size(int(block_size))


def check_kv_layout(worker) -> None:
    """Refuse KV pools whose slot ids need translating (unified / fused-draft pools).

    DDTREE reads its verify slots from ``req_to_token`` and moves accepted KV by those ids,
    which only index the pools directly when no translation is in play.
    """
    from .. import config as cfg

    for role, runner in (("target", worker.model_runner), ("drafter", worker.draft_model_runner)):
        translator = getattr(runner, "kv_index_translator", None)
        if translator is not None and translator.is_translating:
            raise cfg.DDTreeConfigError(
                f"DDTREE does not support the unified/fused KV pool the {role} uses in SGLang "
                f"{VERSION} (its KV slot ids are virtual). Run without the unified KV pool "
                "(no --enable-page-major-kv-layout / unified hybrid pool)."
            )


# --- one decode step -----------------------------------------------------------------------

def verify_logits(worker, logits_output):
    """[bs * N, V] full-vocab verify logits (DFLASH defers the TP vocab gather of verify)."""
    logits = logits_output.next_token_logits
    processor = getattr(worker, "_target_logits_processor", None)
    if processor is not None and processor.is_deferred_shard(logits):
        logits = processor.finish_deferred_gather(logits)
        logits_output.next_token_logits = logits
    return logits


def draft_block_embeddings(worker, block_ids):
    """[bs, B, H] drafter input embeddings of the block, as DFLASH builds them."""
    import torch

    full = getattr(worker, "_full_embed_gpu", None)
    if full is not None:  # dp attention: gathered table
        embeds = torch.nn.functional.embedding(block_ids, full)
    else:
        from sglang.srt.lora.layers import unwrap_lora_layer
        from sglang.srt.speculative.dflash_worker_v2 import _resolve_dflash_embedding_module

        module = unwrap_lora_layer(_resolve_dflash_embedding_module(
            worker.draft_model, worker.target_worker.model_runner.model))
        embeds = module(block_ids)
    scale = float(getattr(worker, "_noise_embed_scale", 1.0))
    return embeds * scale if scale != 1.0 else embeds


def run_draft_block(worker, batch, *, block_size: int, **fields):
    """Run the drafter's block forward (TARGET_VERIFY) built from ``fields`` (ForwardBatch
    keyword arguments); returns the draft runner's output.

    As DFLASH does: the iteration's slots are planned on the target's translator (the window
    ``fields['out_cache_loc']``, reads up to ``block_size`` past ``seq_lens``) and bound for the
    drafter; the forward runs in the drafter's parallel scope.
    """
    import torch
    from sglang.srt.model_executor.forward_batch_info import (
        ForwardBatch,
        enable_num_token_non_padded,
    )
    from sglang.srt.speculative.spec_utils import draft_tp_context

    num_tokens = int(fields["input_ids"].numel())
    forward_batch = ForwardBatch(
        **fields,
        num_token_non_padded=(
            torch.full((), num_tokens, dtype=torch.int32, device=worker.device)
            if enable_num_token_non_padded() else None),
        global_num_token_non_padded_cpu=num_tokens,
        can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph,
    )
    spec_info = batch.spec_info
    host_lens = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else (
        spec_info.nxt_kv_lens_cpu if spec_info is not None else None)
    plan = worker.model_runner.kv_index_translator.plan(
        req_pool_indices=forward_batch.req_pool_indices,
        seq_lens=forward_batch.seq_lens,
        seq_lens_cpu=host_lens,
        write_virtual=forward_batch.out_cache_loc,
        read_extent=int(block_size),
    )
    plan.bind(forward_batch, worker.draft_model_runner.kv_index_translator)
    with torch.inference_mode(), draft_tp_context(worker.draft_parallel_layout):
        return worker.draft_model_runner.forward(forward_batch)


# --- the triton tree-verify backend (verify_backend.py) ------------------------------------

def kv_write_loc(forward_batch):
    """What ``token_to_kv_pool.set_kv_buffer`` takes as the write location of the batch's new
    tokens: the batch's ``out_cache_loc`` with its physical mark, as the triton backend passes
    it (``check_kv_layout`` has refused pools whose ids need translating)."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    return KVWriteLoc.for_batch(forward_batch)


