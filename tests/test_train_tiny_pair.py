"""CPU tests for scripts/train_tiny_pair.py: the smoke run's files, their loadability by
transformers and by SGLang 0.5.17's own model classes, and the drafter math.

The SGLang check runs in a subprocess (it needs a published ServerArgs and a gloo process group,
which must not leak into other tests); it is skipped when SGLang is not importable.
"""
from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import subprocess
import sys
import tarfile

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))

import tiny_dflash as td  # noqa: E402
from tiny_pair_card import SGLANG_ACCEPT_MARKER  # noqa: E402


@pytest.fixture(scope="module")
def smoke_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "tiny-code"
    copy = out.parent / "copied"
    import train_tiny_pair

    report = train_tiny_pair.main(["--smoke", "--out", str(out), "--copy-to", str(copy),
                                   "--sampled-fraction", "0.5"])
    return out, copy, report


def _json(path):
    return json.loads(pathlib.Path(path).read_text())


def test_smoke_writes_all_files(smoke_out):
    out, copy, report = smoke_out
    for sub in ("target", "dflash-draft"):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (out / sub / name).is_file(), f"missing {sub}/{name}"
    for name in ("eval_prompts.jsonl", "train_log.json", "README.md"):
        assert (out / name).is_file()
    # --copy-to: one archive of the whole tree + the two readable files (few files for $OUT).
    assert sorted(p.name for p in copy.iterdir()) == ["README.md", "tiny-code.tar.gz", "train_log.json"]
    with tarfile.open(copy / "tiny-code.tar.gz") as tar:
        names = set(tar.getnames())
    want = {f"tiny-code/{p.relative_to(out)}" for p in out.rglob("*") if p.is_file()}
    assert want <= names
    assert report["total_bytes"] < 10_000_000


def test_configs_have_dflash_fields(smoke_out):
    out, _, _ = smoke_out
    t, d = _json(out / "target/config.json"), _json(out / "dflash-draft/config.json")
    assert t["architectures"] == ["Qwen3ForCausalLM"] and t["model_type"] == "qwen3"
    assert d["architectures"] == ["DFlashDraftModel"]
    assert d["block_size"] == 16
    assert d["num_target_layers"] == t["num_hidden_layers"]
    assert d["hidden_size"] == t["hidden_size"] and d["vocab_size"] == t["vocab_size"]
    ids = d["dflash_config"]["target_layer_ids"]
    # SGLang captures layer k's output at layer k+1's input: the last layer cannot be captured.
    assert ids and all(0 <= i < t["num_hidden_layers"] - 1 for i in ids)
    assert t["hidden_size"] % t["num_attention_heads"] == 0


def test_tokenizer_and_prompts(smoke_out):
    out, _, _ = smoke_out
    from transformers import AutoTokenizer

    d = _json(out / "dflash-draft/config.json")
    tok = AutoTokenizer.from_pretrained(str(out / "target"))
    assert tok.convert_tokens_to_ids("<|MASK|>") == d["dflash_config"]["mask_token_id"]
    assert tok.eos_token_id == _json(out / "target/config.json")["eos_token_id"]
    rows = [json.loads(x) for x in (out / "eval_prompts.jsonl").read_text().splitlines()]
    assert len(rows) >= 2
    heldout = set(_json(out / "train_log.json")["data"]["heldout_sources"])
    for r in rows:
        assert r["source"] in heldout
        assert tok(r["text"], add_special_tokens=False)["input_ids"] == r["input_ids"]
        assert tok.decode(r["input_ids"]) == r["text"]


def test_target_loads_in_transformers(smoke_out):
    out, _, _ = smoke_out
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(out / "target"), output_loading_info=True)
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert set(info["missing_keys"]) <= {"lm_head.weight"}  # tied to embed_tokens
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_drafter_names_match_hard_list(smoke_out):
    out, _, _ = smoke_out
    from safetensors.torch import load_file

    d = _json(out / "dflash-draft/config.json")
    names = sorted(load_file(str(out / "dflash-draft/model.safetensors")))
    assert names == td.expected_sglang_param_names(d["num_hidden_layers"])


def test_report_and_card_agree(smoke_out):
    out, _, _ = smoke_out
    log = _json(out / "train_log.json")
    card = (out / "README.md").read_text()
    est = log["offline_accept_estimate"]
    assert 1.0 <= est["mean_accept_length"] <= 16.0
    assert f"**{est['mean_accept_length']:.2f}**" in card
    assert SGLANG_ACCEPT_MARKER in card
    assert str(log["target"]["steps"]) in card and str(log["target"]["heldout_loss"]) in card
    assert math.isfinite(log["drafter"]["heldout_loss"])


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang importable")
def test_sglang_model_classes_load_checkpoints(smoke_out):
    out, _, _ = smoke_out
    proc = subprocess.run([sys.executable, str(pathlib.Path(__file__)), "--sglang-check", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "SGLANG-CHECK-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_eval_prompts_whole_lines_no_overlap():
    import tiny_pair_data as data

    files = [data.SourceFile(f"m{i}.py", "".join(f"x_{i}_{j} = {j} * {i}  # line {j}\n" for j in range(n)))
             for i, n in enumerate([200, 60, 2])]
    tok = data.train_bpe_tokenizer([f.text for f in files], 300)
    prompts = data.make_eval_prompts(tok, files, num_prompts=50, prompt_tokens=40)
    assert prompts and [p["id"] for p in prompts] == list(range(len(prompts)))
    by_file = {}
    for p in prompts:
        assert 40 <= len(p["input_ids"]) <= 60 and p["input_ids"] == tok.encode(p["text"]).ids
        assert p["text"].endswith("\n")  # whole lines
        lines = files[int(p["source"][1:-3])].text.splitlines(keepends=True)
        n = p["text"].count("\n")
        assert "".join(lines[p["start_line"]:p["start_line"] + n]) == p["text"]
        by_file.setdefault(p["source"], []).append((p["start_line"], p["start_line"] + n))
    for spans in by_file.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert "m2.py" not in by_file  # 2 short lines cannot make a 40-token prompt
    assert prompts[0]["source"] != prompts[1]["source"]  # round-robin over files


def test_kv_cache_generation_matches_full_recompute():
    import tiny_pair_target as tgt
    from types import SimpleNamespace

    torch.manual_seed(0)
    args = SimpleNamespace(hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, head_dim=8,
                           max_positions=128, rope_theta=10000.0)
    model = tgt.build_target(tgt.target_config(args, 97)).eval()
    prompts = torch.randint(2, 97, (3, 7))
    cached = tgt.generate_equal(model, prompts, 9)
    full, starts, ends = tgt.greedy_generate_ragged(model, prompts.tolist(), 9, "cpu")
    assert torch.equal(cached, full) and starts.tolist() == [7] * 3 and ends.tolist() == [16] * 3
    # ragged prompts: each row equals its own unpadded greedy run
    rows = [prompts[0, :4].tolist(), prompts[1].tolist()]
    ragged, starts, ends = tgt.greedy_generate_ragged(model, rows, 5, "cpu")
    for r, p in enumerate(rows):
        alone = tgt.generate_equal(model, torch.tensor([p]), 5)[0]
        assert torch.equal(ragged[r, : ends[r]], alone)
    sampled = tgt.generate_equal(model, prompts, 9, temperature=1.0)
    assert sampled.shape == (3, 16) and torch.equal(sampled[:, :7], prompts)
    assert int(sampled.min()) >= 0 and int(sampled.max()) < 97


# --- drafter math ------------------------------------------------------------------------------

def _rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope_naive(x, pos, theta):
    """x: [S, H, D] at positions pos [S]; pairs (i, i + D/2) rotate by pos * theta^(-2i/D)."""
    d = x.shape[-1]
    ang = pos[:, None].double() * theta ** (-2.0 * torch.arange(d // 2).double() / d)  # [S, D/2]
    c, s = ang.cos()[:, None, :].float(), ang.sin()[:, None, :].float()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _naive_draft(w, s: td.DraftShape, feats, embeds_in, anchor: int, block: int):
    """One draft block at `anchor`, written token-by-token from the checkpoint tensors: context
    = rows < anchor of feats [T, K*h]; block inputs embeds_in [B, h]. Returns [B, h]."""
    ctx = _rms(feats[:anchor] @ w["fc.weight"].T, w["hidden_norm.weight"])
    pos_c, pos_b = torch.arange(anchor), torch.arange(anchor, anchor + block)
    x = embeds_in.clone()
    H, KV, D = s.num_heads, s.num_kv_heads, s.head_dim
    for i in range(s.num_layers):
        p = f"layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"])
        q = _rope_naive(_rms((h @ w[p + "self_attn.q_proj.weight"].T).view(block, H, D),
                             w[p + "self_attn.q_norm.weight"]), pos_b, s.rope_theta)

        def kv(src, pos):
            k = (src @ w[p + "self_attn.k_proj.weight"].T).view(len(pos), KV, D)
            k = _rope_naive(_rms(k, w[p + "self_attn.k_norm.weight"]), pos, s.rope_theta)
            return k, (src @ w[p + "self_attn.v_proj.weight"].T).view(len(pos), KV, D)

        kc, vc = kv(ctx, pos_c)
        kb, vb = kv(h, pos_b)
        k, v = torch.cat([kc, kb]), torch.cat([vc, vb])
        o = torch.empty(block, H, D)
        for head in range(H):
            g = head // (H // KV)
            att = torch.softmax(q[:, head] @ k[:, g].T / math.sqrt(D), dim=-1)
            o[:, head] = att @ v[:, g]
        x = x + o.reshape(block, H * D) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T)
        x = x + (gate * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["norm.weight"])


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_multi_block_forward_matches_per_block_naive(kv_heads):
    torch.manual_seed(0)
    s = td.DraftShape(hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=kv_heads, head_dim=8, num_context_features=3, rope_theta=10000.0)
    drafter = td.DFlashDrafter(s)
    with torch.no_grad():
        for prm in drafter.parameters():
            prm.normal_(0.0, 0.3 if prm.ndim >= 2 else 1.0)
    vocab, block, T = 50, 5, 23
    embed = torch.randn(vocab, s.hidden_size)
    seqs = torch.randint(2, vocab, (2, T))
    feats = torch.randn(2, T, 3 * s.hidden_size)
    anchors = torch.tensor([[1, 7, 18], [4, 5, 11]])
    ids, pos, labels = td.make_blocks(seqs, anchors, block, mask_id=1)
    assert torch.equal(labels[0, 1], seqs[0, 8:12])
    mask = td.block_attention_mask(anchors, T, block)
    with torch.no_grad():
        got = drafter(embed[ids], pos, drafter.project_context(feats), mask).view(2, 3, block, -1)
    w = {k: v.detach() for k, v in drafter.state_dict().items()}
    for r in range(2):
        for j in range(3):
            a = int(anchors[r, j])
            want = _naive_draft(w, s, feats[r], embed[ids[r, j * block:(j + 1) * block]], a, block)
            torch.testing.assert_close(got[r, j], want, atol=2e-5, rtol=2e-5)


class _OneHotDrafter(torch.nn.Module):
    """Stub drafter whose hidden state at block position i is one-hot(script[row][L+i]), so with
    an identity embedding it proposes exactly the scripted tokens."""

    def __init__(self, script, vocab):
        super().__init__()
        self.script, self.vocab = script, vocab

    def project_context(self, feats):
        return feats

    def forward(self, embeds, pos, ctx, mask):
        rows = ctx[:, 0, 0].long().tolist()
        last = len(self.script[0]) - 1
        toks = torch.stack([self.script[r][pos[i].clamp(max=last)] for i, r in enumerate(rows)])
        return torch.nn.functional.one_hot(toks, self.vocab).float()


def test_simulate_counts_accepted_prefix():
    vocab, block = 20, 4
    seq = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])
    script = seq.clone()
    script[0, 4] = 0  # draft for position 4 wrong: step at L=2 accepts pos 3 only
    feats = torch.zeros(1, seq.shape[1], 1)  # row id 0 in feats[:, 0, 0]
    drafter = _OneHotDrafter([script[0]], vocab)
    res = td.simulate_dflash_greedy(drafter, torch.eye(vocab), feats, seq, torch.tensor([2]),
                                    torch.tensor([10]), block, mask_id=1, topks=(1,))
    # L=2: drafts pos 3,4,5 -> accept 1 (pos 3), emit 2 -> L=4: drafts 5,6,7 all right -> emit 4 ->
    # L=8: one token left (pos 9) -> emit 1 -> done at L=9 = end-1.
    assert res["steps"] == 3 and res["tokens"] == 7
    assert res["accept_length_histogram"][:5] == [0, 1, 1, 0, 1]
    assert res["mean_accept_length"] == pytest.approx(7 / 3)


def test_block_mask_shape_and_rule():
    m = td.block_attention_mask(torch.tensor([[2, 5]]), ctx_len=6, block_size=3)
    assert m.shape == (1, 6, 12)
    assert m[0, 0, :6].tolist() == [True, True, False, False, False, False]
    assert m[0, 4, :6].tolist() == [True] * 5 + [False]
    assert m[0, 0, 6:].tolist() == [True] * 3 + [False] * 3
    assert m[0, 5, 6:].tolist() == [False] * 3 + [True] * 3


# --- SGLang side (runs in a subprocess) --------------------------------------------------------

def _sglang_check(out: pathlib.Path) -> None:
    """Instantiate SGLang 0.5.17's DFlashDraftModel and Qwen3ForCausalLM on CPU with the saved
    configs, load the saved checkpoints through their own load_weights, and compare."""
    from safetensors.torch import load_file
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.server_args import ServerArgs
    from transformers import AutoConfig

    publish(ServerArgs(model_path=str(out / "target"), device="cpu", skip_tokenizer_init=True), role="test")
    import sglang.srt.layers.rotary_embedding.base as rope_base

    rope_base._is_cpu = True  # use the native RoPE path on a CPU-only machine (no vllm / cuda op)
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    ones = {k: 1 for k in ("tp_size", "world_size", "pp_size", "attn_tp_size", "attn_dp_size",
                           "attn_cp_size", "dcp_size", "attn_dcp_size", "moe_ep_size", "moe_tp_size",
                           "moe_dp_size")}
    zeros = {k.replace("_size", "_rank"): 0 for k in ones}
    zeros["world_rank"] = 0
    with get_parallel().override(dcp_enabled=False, **ones, **zeros):
        dcfg = AutoConfig.from_pretrained(str(out / "dflash-draft"))
        tcfg = AutoConfig.from_pretrained(str(out / "target"))
        parsed = parse_dflash_draft_config(draft_hf_config=dcfg)
        ids = parsed.resolve_target_layer_ids(target_num_layers=tcfg.num_hidden_layers)
        assert all(i < tcfg.num_hidden_layers - 1 for i in ids), ids
        assert parsed.resolve_block_size() == 16 and parsed.mask_token_id == 1
        draft = DFlashDraftModel(dcfg)
        assert draft.num_context_features == len(ids) and draft.block_size == 16
        saved = load_file(str(out / "dflash-draft/model.safetensors"))
        draft.load_weights(iter(saved.items()))
        params = dict(draft.named_parameters())
        consumed = set()
        for name, p in params.items():
            if name.endswith("qkv_proj.weight"):
                parts = [name.replace("qkv_proj", x) for x in ("q_proj", "k_proj", "v_proj")]
            elif name.endswith("gate_up_proj.weight"):
                parts = [name.replace("gate_up_proj", x) for x in ("gate_proj", "up_proj")]
            else:
                parts = [name]
            want = torch.cat([saved[x].float() for x in parts])
            assert torch.equal(p.detach().float(), want), f"SGLang param {name} != checkpoint {parts}"
            consumed.update(parts)
        assert consumed == set(saved), f"checkpoint tensors SGLang ignores: {set(saved) - consumed}"

        # Same math as SGLang for the context projection and RoPE.
        s = td.DraftShape(dcfg.hidden_size, dcfg.intermediate_size, dcfg.num_hidden_layers,
                          dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim, len(ids),
                          float(_json(out / "dflash-draft/config.json")["rope_theta"]))
        mine = td.DFlashDrafter(s)
        mine.load_state_dict({k: v.float() for k, v in saved.items()})
        draft.float()
        x = torch.randn(7, len(ids) * s.hidden_size)
        with torch.no_grad():
            theirs = draft.hidden_norm.forward_native(draft.fc(x))
            torch.testing.assert_close(mine.project_context(x[None])[0], theirs, atol=1e-5, rtol=1e-5)
            pos = torch.tensor([0, 3, 17, 40, 41, 99, 100])
            q = torch.randn(7, s.num_heads * s.head_dim)
            k = torch.randn(7, s.num_kv_heads * s.head_dim)
            q_s, k_s = draft.layers[0].self_attn.rotary_emb.forward_native(pos, q.clone(), k.clone())
            cos, sin = td.rope_cos_sin(pos[None], s.head_dim, s.rope_theta)
            q_m = td.apply_rope(q.view(1, 7, s.num_heads, s.head_dim), cos, sin).reshape(7, -1)
            k_m = td.apply_rope(k.view(1, 7, s.num_kv_heads, s.head_dim), cos, sin).reshape(7, -1)
            torch.testing.assert_close(q_m, q_s, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(k_m, k_s, atol=1e-5, rtol=1e-5)

        # The target through SGLang's own Qwen3 class (needs a 1-process gloo group).
        ps.init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                        distributed_init_method="tcp://127.0.0.1:0")
        ps.initialize_model_parallel(1, 1)
        from sglang.srt.models.qwen3 import Qwen3ForCausalLM

        target = Qwen3ForCausalLM(tcfg)
        tsaved = load_file(str(out / "target/model.safetensors"))
        target.load_weights(iter(tsaved.items()))
        assert target.lm_head is target.model.embed_tokens  # tied: DFlash reads lm_head.weight
        assert torch.equal(target.model.embed_tokens.weight.detach().float(),
                           tsaved["model.embed_tokens.weight"].float())
        qkv = target.model.layers[0].self_attn.qkv_proj.weight.detach().float()
        want = torch.cat([tsaved[f"model.layers.0.self_attn.{x}.weight"].float()
                          for x in ("q_proj", "k_proj", "v_proj")])
        assert torch.equal(qkv, want)
        assert hasattr(target, "set_dflash_layers_to_capture")
    print("SGLANG-CHECK-OK")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--sglang-check":
        _sglang_check(pathlib.Path(sys.argv[2]))
    else:
        sys.exit("usage: test_train_tiny_pair.py --sglang-check OUT_DIR")
