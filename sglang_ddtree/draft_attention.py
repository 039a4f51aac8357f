"""The DFlash drafter's block attention on our tree kernel (SGLANG_DDTREE_DRAFT_ATTENTION).

Every step runs the drafter once: ``block`` query tokens a request (root, masks) attend the
drafter's whole prefix KV (materialized from the target's hidden states) and the block itself.
SGLang runs that forward in TARGET_VERIFY mode on the drafter's attention backend. On its triton
backend (DDTREE's default for the drafter wherever the target's backend is neither triton nor
flashinfer: ``spec_algo.py``) the extend kernel gives each (request, q head) one program that
walks the prefix serially, which at long contexts costs more than the target's verify (session
23: 14.3 ms a step at 32k prompt tokens on the Kimi TP8-rank emulation). :func:`install_draft` puts
:class:`~sglang_ddtree.verify_backend.TreeVerifyBackend` in front of the drafter's backend with
one constant mask for every request and step, so the block forward runs on our split-K kernel;
prefill, decode and anything else still reach the drafter's own backend.

:func:`choose_draft_attention` applies the setting: ``auto`` (default) installs it where the
drafter's backend is SGLang's triton backend (session 24 on the H200: the draft stage of that
Kimi rank at 32k prompt tokens 14.3 -> 0.90 ms, flashinfer's 1.86; lossless on the tiny pair and
an MLA target; the tiny pair 1.11x tokens/s at concurrency 1) and the drafter qualifies;
``triton`` installs it on any backend or fails start-up; ``native`` never.
"""
from __future__ import annotations

import logging

import torch

from . import config as cfg
from .verify_backend import (TreeVerifyBackend, attn_type_of, blockers, unsupported_reason,
                             verify_layers)

logger = logging.getLogger(__name__)


def draft_block_mask(layers, block_size: int):
    """([block, block] bool mask, problems) for the DFlash drafter's attention layers: a block
    query sees every block key where the layers are bidirectional (SGLang's DFlash drafter
    marks them ``encoder_only``), the keys up to itself where they are causal (``decoder``, a
    drafter config with ``is_causal``). Layers of both kinds, or sliding-window layers, cannot
    share one mask: they come back as problems."""
    problems = sorted({f"layer {m.layer_id}: {why}" for m in layers
                       if (why := unsupported_reason(m, ("decoder", "encoder_only"))) is not None})
    kinds = sorted({attn_type_of(m) for m in layers})
    if len(kinds) > 1:
        problems.append(f"layers of different attention types {kinds}")
    ones = torch.ones((block_size, block_size), dtype=torch.bool)
    mask = ones if kinds == ["encoder_only"] else torch.tril(ones)
    return mask, problems


def install_draft(draft_runner, block_size: int, sgl, kernels=None) -> TreeVerifyBackend:
    """Wrap the drafter runner's attention backend so that its block forward (SGLang runs it in
    TARGET_VERIFY mode: ``block_size`` queries a request over the drafter's prefix KV and the
    block) runs on our tree-attention kernel with :func:`draft_block_mask`. Everything else
    (there is nothing else in DFLASH's drafter today) goes to the drafter's own backend.

    Call before SGLang captures the drafter's CUDA graphs (``init_cuda_graphs``). Raises
    :class:`~sglang_ddtree.config.DDTreeConfigError` naming what blocks it."""
    if sgl.is_mla(draft_runner.model_config):
        problems = ["an MLA drafter (DFlash drafters are MHA / GQA)"]
    else:
        problems = blockers(draft_runner, sgl, is_mla=False)
    layers = verify_layers(draft_runner.model, False, sgl.RadixAttention)
    if not layers:
        problems.append("no attention layer the tree-attention kernels recognise")
    mask, layer_problems = draft_block_mask(layers, block_size)
    problems += layer_problems
    if problems:
        raise cfg.DDTreeConfigError(
            f"DDTREE: {cfg.ENV_DRAFT_ATTENTION}=triton cannot run this drafter: "
            f"{'; '.join(problems)}. Set it to native (or auto) to keep the drafter on its "
            "SGLang backend.")
    wrapper = TreeVerifyBackend(draft_runner.attn_backend, draft_runner,
                                num_tree_tokens=block_size, is_mla=False, layers=layers,
                                sgl=sgl, kernels=kernels, block_mask=mask)
    draft_runner.attn_backend = wrapper
    logger.info("DDTREE drafter attention: triton (block %d, %s, %d kernel plan(s)) behind %s",
                block_size, "bidirectional" if bool(mask.all()) else "causal",
                len(wrapper._plans), type(wrapper.wrapped_backend).__name__)
    return wrapper


def choose_draft_attention(mode: str, draft_runner, block_size: int, sgl, kernels=None):
    """Apply ``SGLANG_DDTREE_DRAFT_ATTENTION`` (``mode``, as ``config.read_draft_attention``
    returns it) to the drafter runner: the installed wrapper, or None where the drafter stays on
    its SGLang backend. ``auto`` keeps the drafter's backend, saying why in the log, where that
    backend is not one ``DRAFT_ATTENTION_AUTO_BACKENDS`` names or our kernel cannot run the
    drafter (a refusal of ``install_draft`` or of the kernel's plan); ``triton`` raises then."""
    if mode == "native":
        return None
    backend = sgl.attention_backend_name(draft_runner)
    if mode == "auto" and backend not in cfg.DRAFT_ATTENTION_AUTO_BACKENDS:
        logger.info("DDTREE drafter attention: %s (SGLang's; %s=auto moves only %s drafters "
                    "onto our kernel, =triton forces it)", backend, cfg.ENV_DRAFT_ATTENTION,
                    "/".join(cfg.DRAFT_ATTENTION_AUTO_BACKENDS))
        return None
    try:
        return install_draft(draft_runner, block_size, sgl, kernels=kernels)
    except (cfg.DDTreeConfigError, ValueError) as err:  # ValueError: a shape the kernel's plan
        if mode == "triton":                           # refuses (tree_attention._check)
            raise
        logger.info("DDTREE drafter attention: %s (SGLang's), ours cannot run it: %s",
                    backend, err)
        return None
