"""Write config-only HF model directories (``config.json`` only) for cost curves with
``--load-format dummy``: real shapes, random weights, nothing to download.

Pairs written under ``--out`` (default ``bench_assets/model-configs``), each a target plus the
DFlash drafter config SGLang 0.5.17's ``DFlashDraftModel`` reads:

- ``kimi-k2.6-tp8rank-l{N}``: one tensor-parallel rank (of 8) of Kimi K2.6's text model
  (DeepseekV3 architecture, MLA + 384-expert MoE), ``N`` of its 61 layers, bf16 experts. See the
  ``notes`` field written into the config for exactly what is and is not the rank's share.
- ``kimi-k2.6-tp8rank-l{N}-int4``: the same with K2.6's own int4 routed experts
  (compressed-tensors W4A16, group 32); at int4 all 61 layers of a rank fit one H200 (~80 GB
  of weights); with the rank's vocabulary (next) also an 80 GB H100, at
  ``--mem-fraction-static 0.95`` (~76 GB; session 62).
- ``kimi-k2.6-tp8rank-l{N}-int4-rankvocab``: the int4 rank with one TP8 rank's share of the
  vocabulary (20,480 of 163,840 rows) for its embedding and lm_head: a rank's own lm_head GEMM,
  not the whole vocabulary's (about 0.5 ms of weight reads a step on an H200) in every step.
- ``qwen3-8b`` (dense, GQA) and ``qwen3-30b-a3b`` (128-expert MoE), full models at TP1.

Shapes are those of the public model configs. Drafter shapes follow the target's attention shape
(the public DFlash drafters for Qwen3 do the same); target layer ids use SGLang's default DFlash
rule (:func:`dflash_target_layer_ids`), restricted to ids below ``num_hidden_layers - 1``,
because SGLang captures layer k's output at layer k+1's input and so cannot capture the last layer.

    python scripts/make_model_configs.py                       # default: Kimi bf16 L8 + int4 L8, L61,
                                                               # + int4 L61 with the rank's vocab
    python scripts/make_model_configs.py --kimi-layers 4 8 16  # several depths, for a per-layer fit
    python scripts/make_model_configs.py --kimi-layers auto --kimi-weight-budget-gb 100
    python scripts/make_model_configs.py --check               # also parse every config
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Dict, List

KIMI_FULL_LAYERS = 61
KIMI_TP = 8
BF16 = 2  # bytes per weight
INT4_GROUP = 32  # K2-Thinking / K2.5 / K2.6 routed experts: symmetric int4, one bf16 scale per 32

# The quantization_config Kimi K2-Thinking ships (compressed-tensors W4A16, routed experts only).
KIMI_INT4_QUANTIZATION = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                    "group_size": INT4_GROUP, "num_bits": 4, "observer": "minmax", "observer_kwargs": {},
                    "strategy": "group", "symmetric": True, "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}

KIMI_TEXT = dict(  # Kimi K2.5 / K2.6 text model (DeepseekV3ForCausalLM), full model, public config
    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=64,
    kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1,
    vocab_size=163840, num_hidden_layers=KIMI_FULL_LAYERS,
)


def dflash_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """SGLang 0.5.17's default rule (``dflash_utils.build_target_layer_ids``): evenly spaced in
    [1, L-3]; one draft layer reads the middle layer."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(f"DFlash default layer rule needs >= 4 target layers, got {num_target_layers}")
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def capturable_layer_ids(num_target_layers: int, k: int) -> List[int]:
    """k distinct ids < L-1, spread evenly (the default rule, or a spread over [1, L-2] / [0, L-2]
    when the default would repeat ids in a shallow emulated target)."""
    ids = dflash_target_layer_ids(num_target_layers, k) if num_target_layers >= 4 else []
    if len(set(ids)) == k and max(ids) < num_target_layers - 1:
        return ids
    lo = 1 if num_target_layers - 2 >= k else 0
    hi = num_target_layers - 2
    if hi - lo + 1 < k:
        raise ValueError(f"cannot pick {k} distinct capturable layers out of {num_target_layers}")
    return sorted({int(round(lo + i * (hi - lo) / max(k - 1, 1))) for i in range(k)})


def qwen3_8b() -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151645,
    }


def qwen3_30b_a3b() -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False,
        "use_sliding_window": False, "bos_token_id": 151643, "eos_token_id": 151645,
    }


def kimi_rank_weight_bytes(num_layers: int, vocab: int, int4: bool = False) -> Dict[str, int]:
    """Weight bytes of one emulated rank (what dummy loading allocates): bf16 everywhere, or with
    int4 routed experts (half a byte per weight + a bf16 scale per 32 weights)."""
    k = KIMI_TEXT
    h, heads = k["hidden_size"], k["num_attention_heads"] // KIMI_TP
    attn = (h * k["q_lora_rank"] + k["q_lora_rank"] * heads * (k["qk_nope_head_dim"] + k["qk_rope_head_dim"])
            + h * (k["kv_lora_rank"] + k["qk_rope_head_dim"])
            + k["kv_lora_rank"] * heads * (k["qk_nope_head_dim"] + k["v_head_dim"])
            + heads * k["v_head_dim"] * h)
    ffn = k["moe_intermediate_size"] // KIMI_TP
    routed = k["n_routed_experts"] * 3 * h * ffn
    routed_bytes = routed // 2 + (routed // INT4_GROUP) * BF16 if int4 else routed * BF16
    moe_bytes = routed_bytes + (k["n_shared_experts"] * 3 * h * ffn + h * k["n_routed_experts"]) * BF16
    dense = 3 * h * (k["intermediate_size"] // KIMI_TP) * BF16
    n_moe = max(0, num_layers - k["first_k_dense_replace"])
    embed = 2 * vocab * h * BF16
    return {"attention_per_layer": attn * BF16, "moe_layer_ffn": moe_bytes, "dense_layer_ffn": dense,
            "embed_plus_lm_head": embed,
            "total": num_layers * attn * BF16 + n_moe * moe_bytes + (num_layers - n_moe) * dense + embed}


def kimi_rank(num_layers: int, vocab: int, int4: bool = False) -> dict:
    k = KIMI_TEXT
    if not 16 <= vocab <= k["vocab_size"]:
        raise ValueError(f"vocab {vocab} must be in [16, {k['vocab_size']}]")
    wb = kimi_rank_weight_bytes(num_layers, vocab, int4)
    per_moe_layer = wb["attention_per_layer"] + wb["moe_layer_ffn"]
    experts = ("int4 routed experts (compressed-tensors W4A16, group 32, as K2.6 ships them); "
               "SGLang's dummy loader leaves the packed int tensors unfilled: serve with "
               "SGLANG_DDTREE_MOE_DUMMY_INT4_SEED set for seeded random int4 words" if int4 else
               "experts are bf16 (K2.6 ships INT4 routed experts: about 1/4 of these expert bytes)")
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": k["hidden_size"],
        "intermediate_size": k["intermediate_size"] // KIMI_TP,  # dense layer 0, TP-split
        "moe_intermediate_size": k["moe_intermediate_size"] // KIMI_TP,
        "num_hidden_layers": num_layers,
        "num_attention_heads": k["num_attention_heads"] // KIMI_TP,
        "num_key_value_heads": k["num_attention_heads"] // KIMI_TP,
        "kv_lora_rank": k["kv_lora_rank"], "q_lora_rank": k["q_lora_rank"],
        "qk_nope_head_dim": k["qk_nope_head_dim"], "qk_rope_head_dim": k["qk_rope_head_dim"],
        "v_head_dim": k["v_head_dim"],
        "n_routed_experts": k["n_routed_experts"], "num_experts_per_tok": k["num_experts_per_tok"],
        "n_shared_experts": k["n_shared_experts"], "first_k_dense_replace": k["first_k_dense_replace"],
        "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.827,
        "num_nextn_predict_layers": 0, "vocab_size": vocab, "max_position_embeddings": 262144,
        "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "hidden_act": "silu", "attention_bias": False,
        # K2.6's ids where the vocabulary holds them; inside a rank's share otherwise (the
        # drafter's mask token takes the last id)
        "bos_token_id": 163584 if vocab == k["vocab_size"] else vocab - 3,
        "eos_token_id": 163585 if vocab == k["vocab_size"] else vocab - 2,
        "notes": {
            "what": f"One rank of Kimi K2.6's text model (DeepseekV3 architecture) under TP{KIMI_TP}, "
                    f"run as a TP1 model: {num_layers} of its {KIMI_FULL_LAYERS} layers.",
            "rank_share": f"attention heads {k['num_attention_heads']}/{KIMI_TP}; routed and shared expert "
                          f"FFN {k['moe_intermediate_size']}/{KIMI_TP}; dense FFN "
                          f"{k['intermediate_size']}/{KIMI_TP}; all {k['n_routed_experts']} experts "
                          "on the rank (TP, not EP); MLA latent (kv_lora_rank 512, q_lora_rank 1536) "
                          "is replicated on every rank, as in SGLang's TP MLA.",
            "not_emulated": "no all-reduce after attention and MoE (2 per layer at TP8); " + (
                f"vocab is the full {vocab} for embedding and lm_head, while one TP8 rank "
                f"computes {k['vocab_size'] // KIMI_TP} lm_head rows then all-gathers "
                "full logits (so lm_head weight reads are overstated, logits handling is "
                "not)" if vocab == k["vocab_size"] else
                f"vocab is {vocab} rows for embedding and lm_head (one TP{KIMI_TP} rank's share "
                f"is {k['vocab_size'] // KIMI_TP}), so the rank's lm_head weight reads are "
                f"emulated; the all-gather of logits to the full {k['vocab_size']} and the "
                "argmax / sampling over them are not (they run over this vocab)") + "; no vision tower.",
            "scaling_to_61_layers": "step time is (per-layer time x layers) + fixed time (embedding, "
                                    "lm_head, sampling, scheduling); measure two depths (e.g. "
                                    "--kimi-layers 4 8), fit the line, evaluate at 61 (60 MoE + 1 "
                                    "dense). Report measured and extrapolated numbers separately.",
            "experts": experts,
            "weight_bytes": wb,
            "weight_bytes_per_moe_layer": per_moe_layer,
            "full_model_drafter_target_layer_ids": dflash_target_layer_ids(KIMI_FULL_LAYERS, 6),
        },
    }
    if int4:
        cfg["quantization_config"] = KIMI_INT4_QUANTIZATION
    return cfg


def drafter(target: dict, *, layers: int, block: int, heads: int, kv_heads: int, head_dim: int,
            intermediate: int, mask_token_id: int, target_layer_ids: List[int], notes: str) -> dict:
    n = target["num_hidden_layers"]
    if max(target_layer_ids) >= n - 1:
        raise ValueError(f"target_layer_ids {target_layer_ids} must be < {n - 1} (last layer not capturable)")
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": target["hidden_size"], "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "vocab_size": target["vocab_size"],
        "max_position_embeddings": target["max_position_embeddings"], "rms_norm_eps": 1e-6,
        "rope_theta": target["rope_theta"], "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "hidden_act": "silu", "attention_bias": False,
        "block_size": block, "num_target_layers": n,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
        "notes": notes,
    }


def kimi_layers_for_budget(budget_gb: float, vocab: int, int4: bool = False) -> int:
    n = 1
    while n < KIMI_FULL_LAYERS and kimi_rank_weight_bytes(n + 1, vocab, int4)["total"] <= budget_gb * 1e9:
        n += 1
    return n


def build_all(kimi_layers: List[int], kimi_vocab: int, kimi_int4_layers: List[int] = (),
              kimi_rank_vocab_layers: List[int] = ()) -> Dict[str, dict]:
    out: Dict[str, dict] = {}
    q8 = qwen3_8b()
    out["qwen3-8b"] = q8
    out["qwen3-8b-dflash-draft"] = drafter(
        q8, layers=5, block=16, heads=32, kv_heads=8, head_dim=128, intermediate=12288,
        mask_token_id=151669, target_layer_ids=dflash_target_layer_ids(36, 5),
        notes="Shape of the public 5-layer, block-16 DFlash drafter for Qwen3-8B (same attention as "
              "the target); random weights under --load-format dummy.")
    q30 = qwen3_30b_a3b()
    out["qwen3-30b-a3b"] = q30
    out["qwen3-30b-a3b-dflash-draft"] = drafter(
        q30, layers=5, block=16, heads=32, kv_heads=4, head_dim=128, intermediate=6144,
        mask_token_id=151669, target_layer_ids=dflash_target_layer_ids(48, 5),
        notes="5-layer dense drafter with the target's attention shape and MLP 6144 (the target's "
              "dense intermediate_size), block 16; random weights under --load-format dummy.")
    rank_vocab = KIMI_TEXT["vocab_size"] // KIMI_TP
    variants = ([(n, False, kimi_vocab, "") for n in kimi_layers]
                + [(n, True, kimi_vocab, "") for n in kimi_int4_layers]
                + [(n, True, rank_vocab, "-rankvocab") for n in kimi_rank_vocab_layers])
    for n, int4, vocab, suffix in variants:
        name = f"kimi-k2.6-tp8rank-l{n}" + ("-int4" if int4 else "") + suffix
        tgt = kimi_rank(n, vocab, int4)
        out[name] = tgt
        k = min(6, n - 1)
        out[name + "-dflash-draft"] = drafter(
            tgt, layers=6, block=8, heads=64 // KIMI_TP, kv_heads=8 // KIMI_TP, head_dim=128,
            intermediate=KIMI_TEXT["intermediate_size"] // KIMI_TP, mask_token_id=vocab - 1,
            target_layer_ids=capturable_layer_ids(n, k),
            notes=f"6-layer DFlash drafter, block 8, for the TP{KIMI_TP}-rank emulation: one rank's share "
                  f"of a 64-head / 8-KV-head (head_dim 128), MLP-18432 drafter (8 heads, 1 KV head, MLP "
                  f"2304); fc reads {k} captured target layers (replicated on every rank, as SGLang's "
                  f"fc is not TP-split). On the full 61-layer model the default rule would capture "
                  f"{dflash_target_layer_ids(KIMI_FULL_LAYERS, 6)}.")
    return out


def write_all(configs: Dict[str, dict], out_dir: pathlib.Path) -> None:
    for name, cfg in configs.items():
        d = out_dir / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    pairs = {n: n + "-dflash-draft" for n in configs if not n.endswith("-dflash-draft")}
    (out_dir / "pairs.json").write_text(json.dumps(pairs, indent=2) + "\n")


def check_dir(model_dir: pathlib.Path) -> str:
    """Parse with transformers' AutoConfig; return a one-line summary or raise."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir))
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ValueError(f"{model_dir.name}: hidden_size {cfg.hidden_size} not a multiple of "
                         f"num_attention_heads {cfg.num_attention_heads}")
    return f"{model_dir.name}: {type(cfg).__name__}, {cfg.num_hidden_layers} layers"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_assets/model-configs")
    p.add_argument("--kimi-layers", nargs="+", default=["8"],
                   help="bf16-expert variants: ints, or 'auto' (fit the budget)")
    p.add_argument("--kimi-int4-layers", nargs="*", default=["8", "61"],
                   help="int4-expert variants (K2.6's own format); 61 = the whole model fits one "
                        "H200, 8 = a quick one for step profiles")
    p.add_argument("--kimi-rank-vocab-layers", nargs="*", default=["61"],
                   help="int4 variants with one TP8 rank's 20480-row share of the vocabulary "
                        "(named ...-int4-rankvocab): the rank's own lm_head cost per step")
    p.add_argument("--kimi-weight-budget-gb", type=float, default=100.0,
                   help="weight budget for 'auto' (H200: 141 GB; leave room for KV cache and graphs)")
    p.add_argument("--kimi-vocab", type=int, default=KIMI_TEXT["vocab_size"],
                   help="163840 = full vocab (default); 20480 = one TP8 rank's lm_head rows")
    p.add_argument("--check", action="store_true", help="parse every written config with AutoConfig")
    args = p.parse_args(argv)
    def resolve(values, int4):
        return [kimi_layers_for_budget(args.kimi_weight_budget_gb, args.kimi_vocab, int4) if x == "auto"
                else int(x) for x in values]

    layers, int4_layers = resolve(args.kimi_layers, False), resolve(args.kimi_int4_layers, True)
    rank_vocab_layers = [int(x) for x in args.kimi_rank_vocab_layers]
    if any(n < 2 or n > KIMI_FULL_LAYERS for n in layers + int4_layers + rank_vocab_layers):
        p.error(f"Kimi layer counts must be in [2, {KIMI_FULL_LAYERS}], got {layers} / {int4_layers}"
                f" / {rank_vocab_layers}")
    configs = build_all(layers, args.kimi_vocab, int4_layers, rank_vocab_layers)
    out = pathlib.Path(args.out)
    write_all(configs, out)
    for name, cfg in configs.items():
        line = f"{name:40s} layers {cfg['num_hidden_layers']:3d}"
        if "block_size" in cfg:
            line += f"  block {cfg['block_size']}  target_layer_ids {cfg['dflash_config']['target_layer_ids']}"
        elif "notes" in cfg:
            line += f"  weights {cfg['notes']['weight_bytes']['total'] / 1e9:.1f} GB"
        print(line)
        if args.check:
            print("   ", check_dir(out / name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
