"""Model card (``README.md``) for the tiny code pair, generated from ``train_log.json``.

Every number in the card comes from the run's own log. The SGLang DFLASH accept length is not
something this script can measure; the card carries a marked placeholder line that
``scripts/bench_e2e.py`` replaces after a real SGLang run (see :data:`SGLANG_ACCEPT_MARKER`).
"""
from __future__ import annotations

import pathlib

# bench_e2e.py replaces the whole line that carries this marker.
SGLANG_ACCEPT_MARKER = "<!-- sglang-dflash-accept-length -->"
SGLANG_ACCEPT_PLACEHOLDER = (
    f"- SGLang DFLASH accept length: not measured yet (filled in by `scripts/bench_e2e.py` from a "
    f"real SGLang run) {SGLANG_ACCEPT_MARKER}"
)


def _fmt_list(xs, digits=3):
    return ", ".join(f"{x:.{digits}f}" for x in xs)


def render_model_card(r: dict) -> str:
    d, t, dr, est = r["data"], r["target"], r["drafter"], r["offline_accept_estimate"]
    tc, dc = t["config"], dr["config"]
    a = r["args"]
    smoke = " (SMOKE RUN: toy sizes, not the benchmark asset)" if a.get("smoke") else ""
    hist = est["accept_length_histogram"]
    lines = [
        f"# tiny-code: a trained Qwen3-architecture target and its DFlash drafter{smoke}",
        "",
        "Trained from scratch by `scripts/train_tiny_pair.py` so that speculative decoding can be",
        "measured with real acceptance on a machine that cannot download weights. Not a useful code",
        "model; a benchmark fixture. All numbers below are copied from `train_log.json` of the run",
        "that produced these files.",
        "",
        "## Run",
        "",
        f"- date: {r['date']}; device: {r['device']}; wall time {r['wall_seconds']} s",
        f"- versions: python {r['versions']['python']}, torch {r['versions']['torch']}, "
        f"transformers {r['versions']['transformers']}, tokenizers {r['versions']['tokenizers']}",
        f"- command: `{r['command']}`",
        "",
        "## Data",
        "",
        f"- corpus: every `*.py` under `{d['root']}` (the interpreter's standard library, without "
        f"site-packages), {d['train_files']} training files ({d['train_bytes'] / 1e6:.1f} MB, "
        f"{d['train_tokens']:,} tokens)",
        f"- held out: {d['heldout_files']} files ({d['heldout_bytes'] / 1e6:.2f} MB, "
        f"{d['heldout_tokens']:,} tokens), chosen by SHA-1 of the relative path modulo "
        f"{a['eval_modulus']}; the {d['eval_prompts']} prompts in `eval_prompts.jsonl` "
        f"({a['prompt_tokens']}-{int(1.5 * a['prompt_tokens'])} tokens each, whole lines) come only "
        "from these files",
        f"- tokenizer: byte-level BPE trained on the training files, vocab {d['vocab_size']}; "
        "`<|endoftext|>` = 0 (file separator, eos), `<|MASK|>` = 1 (DFlash mask token)",
        "",
        "## Target (`target/`)",
        "",
        f"- Qwen3ForCausalLM, {t['params'] / 1e6:.2f} M parameters: hidden {tc['hidden_size']}, "
        f"{tc['num_hidden_layers']} layers, {tc['num_attention_heads']} heads / "
        f"{tc['num_key_value_heads']} KV heads x {tc['head_dim']}, MLP {tc['intermediate_size']}, "
        f"tied embeddings, bf16 weights",
        f"- training: {t['steps']:,} steps of {a['batch']} x {a['seq_len']} tokens "
        f"({t['tokens'] / 1e6:.0f} M tokens) in {t['seconds']} s, AdamW lr {a['lr']} cosine",
        f"- final training loss {t['final_train_loss']} (mean over the last logged window of up "
        f"to {r['log_every']} steps); held-out loss "
        f"{t['heldout_loss']} nats/token (bf16 weights as saved)",
        "",
        "## DFlash drafter (`dflash-draft/`)",
        "",
        f"- `DFlashDraftModel` layout for SGLang 0.5.17: {dr['params'] / 1e6:.2f} M parameters, "
        f"{dc['num_hidden_layers']} layer(s), MLP {dc['intermediate_size']}, no embedding / lm_head "
        f"(uses the target's), block size {dc['block_size']}, target layer ids "
        f"{dc['dflash_config']['target_layer_ids']} of {dc['num_target_layers']}, mask token id "
        f"{dc['dflash_config']['mask_token_id']}",
        f"- data: {dr['generated_sequences']:,} continuations by the saved target "
        f"({dr['generated_sequences'] - dr['sampled_sequences']:,} greedy, {dr['sampled_sequences']:,} "
        "sampled at T=1) "
        f"({a['gen_prompt_min']}-{a['gen_prompt_max']}-token prompt windows from the training files, "
        f"one length per generation batch, + {a['gen_len']} "
        "generated tokens); context = the target's own hidden states",
        f"- training: {dr['steps']:,} steps of {a['draft_batch']} sequences x "
        f"{dr['anchors_per_seq']} blocks in {dr['seconds']} s, AdamW lr {a['draft_lr']} cosine, "
        f"loss weight exp(-(k-1)/{a['gamma']}) at draft position k",
        f"- final training loss {dr['final_train_loss']} (mean over the last logged window of up "
        f"to {r['log_every']} steps); held-out loss "
        f"{dr['heldout_loss']} (continuations of the eval prompts)",
        f"- held-out top-1 accuracy by draft position 1..{dc['block_size'] - 1}: "
        f"{_fmt_list(dr['heldout_top1_acc_by_position'], 2)}",
        "",
        "## Acceptance",
        "",
        f"- offline estimate by this script (its own PyTorch replay of greedy DFlash block drafting "
        f"against the target's greedy output, fp32, {est['prompts']} held-out prompts x "
        f"{est['gen_tokens_per_prompt']} tokens): mean accept length "
        f"**{est['mean_accept_length']:.2f}** tokens per draft step (accepted drafts + 1) over "
        f"{est['steps']} steps",
        f"- tokens-per-step histogram (1..{len(hist) - 1}): {hist[1:]}",
        "- draft-tree headroom (same replay): fraction of depths 1..B-1 where the target's token is "
        "in the drafter's top-k: "
        + "; ".join(f"top-{k}: {_fmt_list(v[:4], 2)} ... {v[-1]:.2f}"
                    for k, v in est["topk_hit_rate_by_depth"].items()),
        SGLANG_ACCEPT_PLACEHOLDER,
        "",
        "## Files",
        "",
    ]
    lines += [f"- `{name}`: {size:,} bytes" for name, size in r["file_bytes"].items()]
    return "\n".join(lines) + "\n"


def write_model_card(path: pathlib.Path, report: dict) -> None:
    path.write_text(render_model_card(report))
