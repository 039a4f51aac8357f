"""Target-side helpers for the tiny code pair: config dicts in the HF layout SGLang loads, model
construction with ``transformers``' Qwen3ForCausalLM, greedy generation, saving/loading.

Configs are written by hand (same keys as the project's devkit model configs, which SGLang 0.5.17
was seen to serve on the H200) rather than with ``save_pretrained``, so the files do not depend on
the transformers version that trained them.
"""
from __future__ import annotations

import json
import pathlib
from typing import List, Sequence

import torch

from tiny_pair_data import EOT_ID, MASK_ID, MASK_TOKEN


def _qwen3_shape(args, vocab_size: int) -> dict:
    """Keys the target and the drafter share: the drafter has the target's attention shape and
    hidden size (it reads the target's embedding and lm_head)."""
    return {
        "model_type": "qwen3",
        "hidden_size": args.hidden,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": args.max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": args.rope_theta,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "attention_bias": False,
    }


def target_config(args, vocab_size: int) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        **_qwen3_shape(args, vocab_size),
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        # Tied: the embedding is the largest tensor, and the asset must stay small. SGLang's
        # Qwen3ForCausalLM then uses embed_tokens as lm_head, which DFlash reads for draft logits.
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "bos_token_id": EOT_ID,
        "eos_token_id": EOT_ID,
    }


def drafter_config(args, vocab_size: int) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        **_qwen3_shape(args, vocab_size),
        "intermediate_size": args.draft_intermediate,
        "num_hidden_layers": args.draft_layers,
        "tie_word_embeddings": False,
        "block_size": args.block_size,
        "num_target_layers": args.layers,
        "dflash_config": {
            "mask_token": MASK_TOKEN,
            "mask_token_id": MASK_ID,
            "target_layer_ids": list(args.target_layer_ids),
        },
    }


def build_target(cfg: dict):
    """HF Qwen3ForCausalLM for a config dict (sdpa attention)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hf_cfg = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
    hf_cfg._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(hf_cfg)


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


def target_state_dict(model, dtype=torch.bfloat16) -> dict:
    """HF names; ``lm_head.weight`` left out because it is tied to ``model.embed_tokens``."""
    return {k: v.detach().to(dtype).contiguous().cpu()
            for k, v in model.state_dict().items() if k != "lm_head.weight"}


def save_model_dir(out_dir: pathlib.Path, cfg: dict, tensors: dict) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def load_tensors(model_dir: pathlib.Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def load_target(model_dir: pathlib.Path, device, dtype=torch.float32):
    """Rebuild the saved target (bf16 values) as a frozen ``dtype`` model on ``device``."""
    cfg = json.loads((model_dir / "config.json").read_text())
    model = build_target(cfg)
    missing, unexpected = model.load_state_dict(load_tensors(model_dir), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"target checkpoint mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _next_token(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits ``[N, V]`` -> int64 ``[N]``: argmax, or a sample at ``temperature``."""
    if temperature <= 0.0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1)[:, 0]


@torch.no_grad()
def generate_equal(model, prompts: torch.Tensor, gen_len: int, temperature: float = 0.0) -> torch.Tensor:
    """Continue equal-length prompts with a KV cache, greedily (temperature 0) or by sampling.

    prompts: int64 ``[N, P]`` -> int64 ``[N, P + gen_len]``.
    """
    out = model(input_ids=prompts, use_cache=True, logits_to_keep=1)
    past = out.past_key_values
    nxt = _next_token(out.logits[:, -1], temperature)
    toks = [nxt]
    for _ in range(gen_len - 1):
        out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = _next_token(out.logits[:, -1], temperature)
        toks.append(nxt)
    return torch.cat([prompts, torch.stack(toks, dim=1)], dim=1)


@torch.no_grad()
def greedy_generate_ragged(model, prompts: Sequence[Sequence[int]], gen_len: int, device):
    """Greedy continuation of prompts of different lengths, recomputing the whole sequence each
    step. Right padding needs no attention mask (causal), so no padded-row edge cases.

    Returns (seqs int64 ``[N, max_P + gen_len]`` right-padded with EOT, starts ``[N]`` = prompt
    lengths, ends ``[N]`` = prompt length + gen_len).
    """
    n = len(prompts)
    lens = torch.tensor([len(p) for p in prompts], device=device)
    seqs = torch.full((n, int(lens.max()) + gen_len), EOT_ID, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        seqs[i, : len(p)] = torch.tensor(p, dtype=torch.long, device=device)
    rows = torch.arange(n, device=device)
    cur = lens.clone()
    for _ in range(gen_len):
        width = int(cur.max())
        logits = model(input_ids=seqs[:, :width], use_cache=False).logits  # [N, width, V]
        seqs[rows, cur] = logits[rows, cur - 1].argmax(-1)
        cur += 1
    return seqs, lens, cur


def lr_at(progress: float, peak: float, warmup: float = 0.03, floor: float = 0.1) -> float:
    """Linear warmup then cosine decay to ``floor * peak``; progress in [0, 1]."""
    import math

    if progress < warmup:
        return peak * max(progress, 1e-3) / warmup
    p = min(1.0, (progress - warmup) / max(1e-9, 1.0 - warmup))
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p)))


def param_groups(model, weight_decay: float) -> List[dict]:
    """Weight decay on matrices only (not norms)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
