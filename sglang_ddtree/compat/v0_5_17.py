"""SGLang 0.5.17: every SGLang internal the plugin touches, in one place.

Module-level imports are the light, CPU-importable ones (plugin registration runs in every
process, including the launcher); the worker's GPU-side imports are resolved lazily through
``__getattr__`` so that ``import sglang_ddtree.compat.v0_5_17`` stays cheap.
"""

from __future__ import annotations

import importlib

from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: F401
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: F401
from sglang.srt.speculative.spec_registry import CustomSpecAlgo  # noqa: F401
from sglang.srt.speculative.spec_registry import get_spec as get_registered_spec  # noqa: F401

VERSION = "0.5.17"

# plugin.HOOK_TARGETS entries this version hooks elsewhere (none: 0.5.17 is the baseline)
HOOK_TARGET_OVERRIDES = {}

# create_dummy_verify_input's positional parameters, in order
DUMMY_VERIFY_INPUT_PARAMS = ("spec_algorithm", "server_args", "custom_mask",
                             "num_tokens_per_req", "is_draft_worker")

# name -> (module, attribute), imported on first use
_LAZY = {
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
    "get_tp_group": ("sglang.srt.distributed", "get_tp_group"),
    "multinomial_with_seed": ("sglang.srt.layers.sampler", "multinomial_with_seed"),
    "RadixAttention": ("sglang.srt.layers.radix_attention", "RadixAttention"),
    # CUDA/HIP: sgl_kernel.verify_tree_greedy
    "verify_tree_greedy_func": ("sglang.srt.speculative.eagle_utils", "verify_tree_greedy_func"),
}


def __getattr__(name):
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(name) from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def _lazy(name):
    """A lazy name from inside this module (module ``__getattr__`` only serves outside lookups);
    a value assigned onto the module (tests) wins."""
    return globals()[name] if name in globals() else __getattr__(name)


def builtin_algorithm_names() -> set:
    return {a.name for a in SpeculativeAlgorithm}


def ddtree_is_active() -> bool:
    """Whether this process serves --speculative-algorithm DDTREE (SGLang's runtime context)."""
    from sglang.srt.runtime_context import get_spec

    try:
        algo = getattr(get_spec(), "speculative_algorithm", None)
    except ValueError:  # not published: this process serves no model
        return False
    return str(getattr(algo, "name", algo) or "").upper() == "DDTREE"


def handle_dflash_server_args(server_args) -> None:
    from sglang.srt.arg_groups.speculative_hook import _handle_dflash

    _handle_dflash(server_args)


def resolved_arg(server_args, name: str):
    """The resolved value of a ServerArgs field (0.5.17 resolves into the fields themselves)."""
    return getattr(server_args, name)


def decode_graphs_enabled(server_args) -> bool:
    return not server_args.disable_cuda_graph


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


def attention_backend_name(model_runner) -> str:
    """The CLI name of the backend that runs the target's TARGET_VERIFY forward."""
    backend = model_runner.attn_backend
    for _ in range(4):  # hybrid wrappers hold the full-attention backend inside
        inner = getattr(backend, "full_attn_backend", None) or getattr(
            backend, "decode_backend", None)
        if inner is None:
            break
        backend = inner
    name = type(backend).__name__
    return _BACKEND_NAMES.get(name, name)


def max_capture_bs() -> int:
    from sglang.srt.runtime_context import get_exec

    return max(get_exec().graph.cuda_graph_config.decode.bs)


def max_running_requests(worker) -> int:
    return int(worker.model_runner.req_to_token_pool.size)


def tp_rank(worker) -> int:
    return int(worker.ps.tp_rank)


def reserved_kv_lens(draft_input):
    """(host [bs] reserved KV lengths or None, their sum or None) from the step's draft input."""
    return draft_input.reserved_seq_lens_cpu, draft_input.reserved_seq_lens_sum


def check_drafter_variant(worker) -> None:
    """0.5.17's DFLASH drafters all end in the target's lm_head: DDTREE's top-K head fits."""


def set_draft_block_size(worker, block_size: int) -> None:
    """0.5.17's drafter has no block-size-dependent layers and DFLASH never resizes it."""


def check_kv_layout(worker) -> None:
    """0.5.17 KV slot ids index the pools directly: nothing to refuse."""


def verify_logits(worker, logits_output):
    """[bs * N, V] full-vocab verify logits."""
    return logits_output.next_token_logits


def draft_block_embeddings(worker, block_ids):
    """[bs, B, H] drafter input embeddings of the block (the target's embedding table)."""
    return worker.model_runner.model.get_input_embeddings()(block_ids)


def run_draft_block(worker, batch, *, block_size: int, **fields):
    """Run the drafter's block forward built from ``fields`` (ForwardBatch keyword arguments);
    returns the draft runner's output."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    forward_batch = ForwardBatch(**fields)
    with torch.inference_mode():
        return worker.draft_model_runner.forward(forward_batch)


# --- the triton tree-verify backend (verify_backend.py) ------------------------------------

def kv_write_loc(forward_batch):
    """What ``token_to_kv_pool.set_kv_buffer`` takes as the write location of the batch's new
    tokens (0.5.17 pools take the bare ``out_cache_loc``, as the triton backend passes it)."""
    return forward_batch.out_cache_loc


def dcp_enabled() -> bool:
    """Whether decode context parallelism shards this rank's KV (``--dcp-size`` > 1)."""
    from sglang.srt.runtime_context import get_parallel

    return bool(get_parallel().dcp_enabled)


def apply_verify_logits_adjustments(logits, sampling_info, num_tokens: int) -> None:
    from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments

    apply_dflash_verify_logits_adjustments(
        next_token_logits=logits, sampling_info=sampling_info, draft_token_num=num_tokens
    )


def tree_greedy_walk(tree, predicted, path_width: int):
    """SGLang's ``verify_tree_greedy`` kernel over our tree: (accept_len, accepted_nodes, bonus).

    accepted_nodes: [bs, path_width] node indices (root at column 0, -1 padding).
    """
    import torch

    verify_tree_greedy_func = _lazy("verify_tree_greedy_func")
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
