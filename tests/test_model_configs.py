"""CPU tests for scripts/make_model_configs.py: shapes, DFlash capture rules, parsing by
transformers' AutoConfig and (in a subprocess, skipped without SGLang) by SGLang's own ModelConfig,
DFlash config parser and DFlashDraftModel (built on the meta device)."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import make_model_configs as mmc  # noqa: E402


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    d = tmp_path_factory.mktemp("configs")
    assert mmc.main(["--out", str(d), "--kimi-layers", "4", "8", "--kimi-int4-layers", "61"]) == 0
    return d


def _cfg(d, name):
    return json.loads((d / name / "config.json").read_text())


def test_pairs_written(out):
    pairs = json.loads((out / "pairs.json").read_text())
    assert set(pairs) == {"qwen3-8b", "qwen3-30b-a3b", "kimi-k2.6-tp8rank-l4", "kimi-k2.6-tp8rank-l8",
                          "kimi-k2.6-tp8rank-l61-int4", "kimi-k2.6-tp8rank-l61-int4-rankvocab"}
    for target, draft in pairs.items():
        assert (out / target / "config.json").is_file() and (out / draft / "config.json").is_file()
        assert sorted(p.name for p in (out / target).iterdir()) == ["config.json"]


def test_kimi_rank_shapes(out):
    c = _cfg(out, "kimi-k2.6-tp8rank-l8")
    assert c["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"], c["q_lora_rank"],
            c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]) == (7168, 8, 512, 1536, 64, 128, 128)
    assert (c["n_routed_experts"], c["num_experts_per_tok"], c["n_shared_experts"]) == (384, 8, 1)
    assert c["moe_intermediate_size"] == 2048 // 8 and c["intermediate_size"] == 18432 // 8
    assert c["vocab_size"] == 163840 and c["first_k_dense_replace"] == 1 and c["num_hidden_layers"] == 8
    notes = c["notes"]
    assert "TP8" in notes["what"] and "8 of its 61 layers" in notes["what"]
    assert notes["weight_bytes"]["total"] == mmc.kimi_rank_weight_bytes(8, 163840)["total"]
    assert "quantization_config" not in c
    q = _cfg(out, "kimi-k2.6-tp8rank-l61-int4")
    assert q["num_hidden_layers"] == 61 and q["quantization_config"]["quant_method"] == "compressed-tensors"
    w = q["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["group_size"], w["type"], w["symmetric"]) == (4, 32, "int", True)
    # every K dimension the int4 experts see is a multiple of the group size
    assert c["hidden_size"] % 32 == 0 and c["moe_intermediate_size"] % 32 == 0
    assert {k: v for k, v in q.items() if k not in ("quantization_config", "notes", "num_hidden_layers")} \
        == {k: v for k, v in c.items() if k not in ("notes", "num_hidden_layers")}


def test_kimi_rank_vocab_variant(out):
    full, rank = _cfg(out, "kimi-k2.6-tp8rank-l61-int4"), _cfg(out, "kimi-k2.6-tp8rank-l61-int4-rankvocab")
    assert rank["vocab_size"] == 163840 // 8
    # every id the server or the drafter uses lies inside the smaller vocabulary
    draft = _cfg(out, "kimi-k2.6-tp8rank-l61-int4-rankvocab-dflash-draft")
    ids = (rank["bos_token_id"], rank["eos_token_id"], draft["dflash_config"]["mask_token_id"])
    assert len(set(ids)) == 3 and all(0 <= i < rank["vocab_size"] for i in ids)
    assert draft["vocab_size"] == rank["vocab_size"]
    # the vocabulary (and what follows from it) is the only difference from the full-vocab rank
    differ = {k for k in full if full[k] != rank[k]}
    assert differ == {"vocab_size", "bos_token_id", "eos_token_id", "notes"}
    assert rank["notes"]["weight_bytes"] == mmc.kimi_rank_weight_bytes(61, 20480, int4=True)
    assert "all-gather of logits" in rank["notes"]["not_emulated"]
    with pytest.raises(ValueError):
        mmc.kimi_rank(8, 163840 + 1)


def test_kimi_weight_bytes_by_hand():
    wb = mmc.kimi_rank_weight_bytes(2, 163840)
    attn = 7168 * 1536 + 1536 * 8 * 192 + 7168 * 576 + 512 * 8 * 256 + 8 * 128 * 7168
    assert wb["attention_per_layer"] == 2 * attn
    moe = 385 * 3 * 7168 * 256 + 7168 * 384
    assert wb["total"] == 2 * (2 * attn + moe + 3 * 7168 * 2304 + 2 * 163840 * 7168)
    n = mmc.kimi_layers_for_budget(40.0, 163840)
    assert mmc.kimi_rank_weight_bytes(n, 163840)["total"] <= 40e9 < mmc.kimi_rank_weight_bytes(n + 1, 163840)["total"]
    routed = 384 * 3 * 7168 * 256
    q = mmc.kimi_rank_weight_bytes(2, 163840, int4=True)
    assert q["moe_layer_ffn"] == routed // 2 + 2 * (routed // 32) + 2 * (3 * 7168 * 256 + 7168 * 384)
    assert mmc.kimi_rank_weight_bytes(61, 163840, int4=True)["total"] < 100e9  # whole rank fits an H200


@pytest.mark.parametrize("target", ["qwen3-8b", "qwen3-30b-a3b", "kimi-k2.6-tp8rank-l4",
                                    "kimi-k2.6-tp8rank-l8", "kimi-k2.6-tp8rank-l61-int4",
                                    "kimi-k2.6-tp8rank-l61-int4-rankvocab"])
def test_drafter_matches_target_and_capture_rule(out, target):
    t, d = _cfg(out, target), _cfg(out, target + "-dflash-draft")
    assert d["architectures"] == ["DFlashDraftModel"]
    assert d["hidden_size"] == t["hidden_size"] and d["vocab_size"] == t["vocab_size"]
    assert d["num_target_layers"] == t["num_hidden_layers"]
    ids = d["dflash_config"]["target_layer_ids"]
    assert len(set(ids)) == len(ids) and 0 <= min(ids) and max(ids) < t["num_hidden_layers"] - 1
    assert 0 <= d["dflash_config"]["mask_token_id"] < t["vocab_size"]
    assert d["block_size"] == (8 if target.startswith("kimi") else 16)
    if target.startswith("kimi"):
        assert d["num_hidden_layers"] == 6 and d["num_attention_heads"] == 8


def test_default_layer_rule_known_values():
    assert mmc.dflash_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert mmc.dflash_target_layer_ids(48, 5) == [1, 12, 23, 34, 45]
    assert mmc.capturable_layer_ids(8, 6) == [1, 2, 3, 4, 5, 6]
    assert mmc.capturable_layer_ids(4, 3) == [0, 1, 2]
    with pytest.raises(ValueError):
        mmc.capturable_layer_ids(4, 4)


def test_committed_configs_are_current(out, tmp_path):
    committed = ROOT / "bench_assets" / "model-configs"
    if not committed.is_dir():
        pytest.skip("bench_assets/model-configs not generated in this checkout")
    fresh = tmp_path / "fresh"
    mmc.main(["--out", str(fresh)])  # the defaults the committed tree was made with
    for cfg in sorted(fresh.rglob("*.json")):
        rel = cfg.relative_to(fresh)
        assert (committed / rel).is_file(), f"missing committed {rel}; rerun make_model_configs.py"
        assert json.loads(cfg.read_text()) == json.loads((committed / rel).read_text()), f"stale {rel}"


def test_autoconfig_parses_everything(out):
    for d in sorted(p for p in out.iterdir() if p.is_dir()):
        mmc.check_dir(d)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang importable")
def test_sglang_parses_configs(out):
    proc = subprocess.run([sys.executable, str(pathlib.Path(__file__)), "--sglang-check", str(out)],
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0 and "SGLANG-CONFIG-CHECK-OK" in proc.stdout, \
        proc.stdout[-3000:] + proc.stderr[-3000:]


def _sglang_check(out: pathlib.Path) -> None:
    """SGLang's ModelConfig on every dir; its DFlash parser and layer rule and a meta-device
    DFlashDraftModel (parameter shapes) on every drafter."""
    import torch
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.dflash_utils import build_target_layer_ids, parse_dflash_draft_config

    for n_layers, k in [(36, 5), (48, 5), (61, 6), (8, 3), (5, 2)]:
        assert mmc.dflash_target_layer_ids(n_layers, k) == build_target_layer_ids(n_layers, k)
    pairs = json.loads((out / "pairs.json").read_text())
    publish(ServerArgs(model_path=str(out / "qwen3-8b"), device="cpu", skip_tokenizer_init=True,
                       load_format="dummy"), role="test")
    import sglang.srt.layers.rotary_embedding.base as rope_base

    rope_base._is_cpu = True  # native RoPE path on a CPU-only machine
    from sglang.srt.models.dflash import DFlashDraftModel

    for target, draft in pairs.items():
        tm = ModelConfig(str(out / target))
        dm = ModelConfig(str(out / draft), is_draft_model=True)
        if target.startswith("kimi"):
            assert tm.attention_arch == AttentionArch.MLA, tm.attention_arch
        if target.endswith("-int4"):
            assert tm.quantization == "compressed-tensors", tm.quantization
        assert tm.num_hidden_layers == json.loads((out / target / "config.json").read_text())["num_hidden_layers"]
        parsed = parse_dflash_draft_config(draft_hf_config=dm.hf_config)
        ids = parsed.resolve_target_layer_ids(target_num_layers=tm.num_hidden_layers)
        assert max(ids) < tm.num_hidden_layers - 1
        with get_parallel().override(tp_size=1, tp_rank=0, world_size=1, world_rank=0), torch.device("meta"):
            model = DFlashDraftModel(dm.hf_config)
        h = dm.hf_config.hidden_size
        assert tuple(model.fc.weight.shape) == (h, len(ids) * h)
        assert model.block_size == parsed.block_size
        print(f"{target}: {tm.hf_config.architectures[0]} L={tm.num_hidden_layers}; {draft}: "
              f"block {model.block_size}, ids {ids}")
    print("SGLANG-CONFIG-CHECK-OK")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--sglang-check":
        _sglang_check(pathlib.Path(sys.argv[2]))
    else:
        sys.exit("usage: test_model_configs.py --sglang-check OUT_DIR")
