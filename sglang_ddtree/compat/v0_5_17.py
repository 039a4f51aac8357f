"""SGLang 0.5.17: every SGLang internal the plugin touches, in one place.

Module-level imports are the light, CPU-importable ones (plugin registration runs in every
process, including the launcher); the worker's GPU-side imports are resolved lazily through
``__getattr__`` so that ``import sglang_ddtree.compat.v0_5_17`` stays cheap.
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

VERSION = "0.5.17"

# plugin.HOOK_TARGETS entries this version hooks elsewhere (none: 0.5.17 is the baseline)
HOOK_TARGET_OVERRIDES = {}

# create_dummy_verify_input's positional parameters, in order
DUMMY_VERIFY_INPUT_PARAMS = ("spec_algorithm", "server_args", "custom_mask",
                             "num_tokens_per_req", "is_draft_worker")

# the MoE router's bf16 x bf16 -> fp32 GEMM, as DeepseekV2's MoEGate imports it at call time
# above 16 rows on sm_90 (dense_hook's SGLANG_DDTREE_SKINNY_GEMM patches this attribute)
ROUTER_GEMM = ("sglang.kernels.ops.attention.dsv4", "linear_bf16_fp32")

# SGLang's tiny router GEMM, the one DeepseekV2's MoEGate calls up to 16 rows on sm_90
# (dense_hook's SGLANG_DDTREE_ROUTER_GEMM patches this attribute of the model module)
ROUTER_TINY_GEMM = ("sglang.srt.models.deepseek_v2", "dsv3_router_gemm")

# name -> (module, attribute), imported on first use
_LAZY = {
    **LAZY_COMMON,
    "get_tp_group": ("sglang.srt.distributed", "get_tp_group"),
    # CUDA/HIP: sgl_kernel.verify_tree_greedy
    "verify_tree_greedy_func": ("sglang.srt.speculative.eagle_utils", "verify_tree_greedy_func"),
}

__getattr__, _lazy = make_lazy(_LAZY, globals())


def tree_greedy_walk(tree, predicted, path_width: int):
    """SGLang's ``verify_tree_greedy`` over our tree: (accept_len, accepted_nodes, bonus)."""
    return _tree_greedy_walk(tree, predicted, path_width, _lazy("verify_tree_greedy_func"))


# whether this release computes speculative logprobs (``return_logprob``): 0.5.17 has no helper
# for it and its DFLASH admission check refuses such requests before DDTREE sees them
SPEC_LOGPROBS = False


def spec_logprobs(batch, logits_output, predicted, accept_index) -> None:
    raise RuntimeError("DDTREE on SGLang 0.5.17 computes no logprobs (its DFLASH admission "
                       "check refuses return_logprob requests)")


def handle_dflash_server_args(server_args) -> None:
    from sglang.srt.arg_groups.speculative_hook import _handle_dflash

    _handle_dflash(server_args)


def resolved_arg(server_args, name: str):
    """The resolved value of a ServerArgs field (0.5.17 resolves into the fields themselves)."""
    return getattr(server_args, name)


def deterministic_prefill_align(server_args):
    """The prefill-chunk alignment 0.5.17's scheduler enforces under
    ``--enable-deterministic-inference`` (None: none). It never schedules a chunk shorter than
    this, so with a smaller ``--chunked-prefill-size`` a longer prompt waits forever (the AR
    server too; measured on the H200). 0.5.23 refuses that setup itself."""
    import os

    if not getattr(server_args, "enable_deterministic_inference", False):
        return None
    env = {"flashinfer": "SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE",
           "triton": "SGLANG_TRITON_PREFILL_TRUNCATION_ALIGN_SIZE"}.get(
        getattr(server_args, "attention_backend", None))
    return int(os.environ.get(env, 4096)) if env else None


def decode_graphs_enabled(server_args) -> bool:
    return not server_args.disable_cuda_graph


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


