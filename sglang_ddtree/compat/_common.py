"""Pieces of the SGLang compat layer that are identical in every supported release.

Each version module (``v0_5_17``, ``v0_5_23``, ...) re-exports these; only what differs lives
there. Imports of SGLang stay inside the functions: this module imports nothing from SGLang at
import time.
"""

from __future__ import annotations

import importlib
from typing import Optional


# name -> (module, attribute) of the SGLang symbols every supported release has at one place;
# each version module adds its own to this table
LAZY_COMMON = {
    "DFlashWorkerV2": ("sglang.srt.speculative.dflash_worker_v2", "DFlashWorkerV2"),
    "DFlashVerifyInput": ("sglang.srt.speculative.dflash_info", "DFlashVerifyInput"),
    "CaptureHiddenMode": ("sglang.srt.model_executor.forward_batch_info", "CaptureHiddenMode"),
    "ForwardBatch": ("sglang.srt.model_executor.forward_batch_info", "ForwardBatch"),
    "ForwardMode": ("sglang.srt.model_executor.forward_batch_info", "ForwardMode"),
    "GenerationBatchResult": ("sglang.srt.managers.scheduler", "GenerationBatchResult"),
    "parse_dflash_draft_config": (
        "sglang.srt.speculative.dflash_utils", "parse_dflash_draft_config"),
    "build_block_pos_offsets": (
        "sglang.srt.speculative.draft_worker_common", "build_block_pos_offsets"),
    "make_draft_block_spec_info": (
        "sglang.srt.speculative.draft_worker_common", "make_draft_block_spec_info"),
    "make_draft_input_v2": ("sglang.srt.speculative.draft_worker_common", "make_draft_input_v2"),
    "multinomial_with_seed": ("sglang.srt.layers.sampler", "multinomial_with_seed"),
    "seeded_filtered_sampler": (
        "sglang.srt.layers.sampler", "top_k_top_p_min_p_sampling_from_probs_torch"),
    "RadixAttention": ("sglang.srt.layers.radix_attention", "RadixAttention"),
    "GrammarTree": ("sglang.srt.speculative.spec_utils", "GrammarTree"),
    "build_grammar_vocab_mask": ("sglang.srt.speculative.spec_utils", "build_grammar_vocab_mask"),
    "get_attn_backend": ("sglang.srt.model_executor.forward_context", "get_attn_backend"),
    # DeepSeek-family absorbed MLA: the mixin whose forward_absorb_core hands q / k to the
    # attention backend, and the backend names that get them split (q_nope W_UK, q_rope)
    "DeepseekMLAForwardMixin": (
        "sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla",
        "DeepseekMLAForwardMixin"),
    "FORWARD_ABSORB_CORE_ATTENTION_BACKENDS": (
        "sglang.srt.models.deepseek_common.utils", "FORWARD_ABSORB_CORE_ATTENTION_BACKENDS"),
}


def make_lazy(table: dict, namespace: dict):
    """(module ``__getattr__``, ``_lazy``) resolving ``table`` names (name -> (module, attr)) on
    first use into ``namespace`` (the version module's globals; a value assigned there wins)."""

    def __getattr__(name):
        try:
            module, attr = table[name]
        except KeyError:
            raise AttributeError(name) from None
        value = getattr(importlib.import_module(module), attr)
        namespace[name] = value
        return value

    def _lazy(name):
        return namespace[name] if name in namespace else __getattr__(name)

    return __getattr__, _lazy


def builtin_algorithm_names() -> set:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return {a.name for a in SpeculativeAlgorithm}


def ddtree_is_active() -> bool:
    """Whether this process serves --speculative-algorithm DDTREE (SGLang's runtime context)."""
    from sglang.srt.runtime_context import get_spec

    try:
        algo = getattr(get_spec(), "speculative_algorithm", None)
    except ValueError:  # not published: this process serves no model
        return False
    return str(getattr(algo, "name", algo) or "").upper() == "DDTREE"


def ensure_runtime_context(model_path: str, device: Optional[str] = None) -> bool:
    """Publish ServerArgs for ``model_path`` (dummy load format) into SGLang's process-wide
    runtime context when nothing is published yet, so that SGLang kernels called outside a
    server (benchmarks, tests) can read their config namespaces: from 0.5.17 on, SGLang's Triton
    MoE path reads ``get_exec()`` and raises "config namespace 'exec' not published" otherwise.
    ``device``: ServerArgs' device (None: SGLang's default, the GPU). Returns True when it
    published, False when a context was already there or this SGLang has no runtime context."""
    try:
        from sglang.srt import runtime_context as rc
    except ImportError:  # an SGLang without a runtime context reads ServerArgs directly
        return False
    try:
        rc.get_exec()
        return False
    except ValueError:
        pass
    from sglang.srt.server_args import ServerArgs

    kwargs = {"device": device} if device is not None else {}
    rc.publish(ServerArgs(model_path=model_path, load_format="dummy", **kwargs), role="test")
    return True


def is_hybrid_linear_target(model_config) -> bool:
    from sglang.srt.configs.hybrid_arch import mambaish_config

    return mambaish_config(model_config) is not None


def is_mla(model_config) -> bool:
    from sglang.srt.configs.model_config import AttentionArch

    return model_config.attention_arch == AttentionArch.MLA


_BACKEND_NAMES = {
    "TritonAttnBackend": "triton",
    "FlashInferAttnBackend": "flashinfer",
    "FlashInferMLAAttnBackend": "flashinfer_mla",
    "FlashAttentionBackend": "fa3",
    "FlashMLABackend": "flashmla",
    "CutlassMLABackend": "cutlass_mla",
    "TRTLLMMLABackend": "trtllm_mla",
}


def _verify_inner(backend):
    """The backend a wrapper hands TARGET_VERIFY to, or None for a leaf backend. Only objects
    count: a leaf's own fields may share a wrapper's name (flashinfer's ``decode_backend`` is
    the string "fa2")."""
    if hasattr(backend, "spec_attn_is_decode") and hasattr(backend, "prefill_backend"):
        inner = backend.decode_backend if backend.spec_attn_is_decode else backend.prefill_backend
    else:  # hybrid-linear / sparse wrappers keep the full-attention backend here
        inner = getattr(backend, "full_attn_backend", None)
    return inner if inner is not None and not isinstance(inner, (str, bytes, int)) else None


def attention_backend_name(model_runner) -> str:
    """The CLI name of the backend that runs the target's TARGET_VERIFY forward."""
    backend = model_runner.attn_backend
    for _ in range(4):  # wrappers (prefill/decode hybrid, hybrid-linear) nest one level each
        inner = _verify_inner(backend)
        if inner is None:
            break
        backend = inner
    name = type(backend).__name__
    return _BACKEND_NAMES.get(name, name)


def sampling_backend():
    """The sampling backend SGLang's Sampler uses in this process, or None outside a server."""
    try:
        from sglang.srt.runtime_context import get_exec

        return get_exec().kernel.sampling_backend
    except Exception:  # noqa: BLE001 -- no runtime context (tests, tools)
        return None


def sampler_module():
    from sglang.srt.layers import sampler

    return sampler


def max_capture_bs() -> int:
    from sglang.srt.runtime_context import get_exec

    return max(get_exec().graph.cuda_graph_config.decode.bs)


def max_running_requests(worker) -> int:
    return int(worker.model_runner.req_to_token_pool.size)


def dcp_enabled() -> bool:
    """Whether decode context parallelism shards this rank's KV (``--dcp-size`` > 1)."""
    from sglang.srt.runtime_context import get_parallel

    return bool(get_parallel().dcp_enabled)


def apply_verify_logits_adjustments(logits, sampling_info, num_tokens: int) -> None:
    from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments

    apply_dflash_verify_logits_adjustments(
        next_token_logits=logits, sampling_info=sampling_info, draft_token_num=num_tokens
    )


def tree_greedy_walk(tree, predicted, path_width: int, verify_tree_greedy_func):
    """SGLang's ``verify_tree_greedy`` kernel over our tree: (accept_len, accepted_nodes, bonus).

    accepted_nodes: [bs, path_width] node indices (root at column 0, -1 padding).
    ``verify_tree_greedy_func`` is the version's entry point (EAGLE's keyword signature).
    """
    import torch

    bs, n = tree.tokens.shape
    dev = tree.tokens.device
    accept_index = torch.full((bs, path_width), -1, dtype=torch.int32, device=dev)
    accept_num = torch.zeros((bs,), dtype=torch.int32, device=dev)
    predicts = torch.zeros((bs * n,), dtype=torch.int32, device=dev)
    verify_tree_greedy_func(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_num,
        candidates=tree.tokens,
        retrieve_index=tree.retrive_index,
        retrieve_next_token=tree.retrive_next_token,
        retrieve_next_sibling=tree.retrive_next_sibling,
        target_predict=predicted,
    )
    flat = accept_index.to(torch.int64)
    base = torch.arange(bs, device=dev, dtype=torch.int64)[:, None] * n
    nodes = torch.where(flat < 0, flat, flat - base)
    last = torch.gather(flat, 1, accept_num.to(torch.int64)[:, None])  # flat index of last node
    bonus = predicted.reshape(-1).index_select(0, last.view(-1))
    return accept_num.to(torch.int64), nodes, bonus


def build_verify_state(model_runner, num_draft_tokens: int, with_graphs: bool, wrap=None):
    """(attention backend, verify CUDA-graph runner or None) of the target model for a verify
    width other than the server's (``--speculative-ddtree-budget auto``).

    The same construction SGLang's adaptive EAGLE uses for its other step counts: a new backend
    (``_get_attention_backend(init_new_workspace=True)``) and a ``DecodeCudaGraphRunner`` built
    with ``attn_backend`` / ``speculative_num_draft_tokens``, while the runtime context reports
    that width (backends read it when they size their graph state); the context is restored
    afterwards. The runner captures at construction. ``wrap(backend)``, if given, replaces the
    new backend before the runner is built (DDTREE's Triton verify backend around it).
    """
    from sglang.srt.model_executor.runner import DecodeCudaGraphRunner
    from sglang.srt.runtime_context import get_context, get_spec

    ctx = get_context()
    previous = get_spec().speculative_num_draft_tokens
    ctx.override("ddtree.auto_budget.capture", speculative_num_draft_tokens=int(num_draft_tokens))
    try:
        workspace = model_runner.init_new_workspace
        try:
            backend = model_runner._get_attention_backend(init_new_workspace=True)
        finally:
            model_runner.init_new_workspace = workspace
        if wrap is not None:
            backend = wrap(backend)
        runner = None
        if with_graphs:
            runner = DecodeCudaGraphRunner(model_runner, attn_backend=backend,
                                           speculative_num_draft_tokens=int(num_draft_tokens))
    finally:
        ctx.override("ddtree.auto_budget.restore", speculative_num_draft_tokens=previous)
    return backend, runner
