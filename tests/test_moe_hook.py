"""CPU tests of the opt-in fused-MoE hook against the real SGLang 0.5.17 package in the venv.

* ``install`` finds and patches both compressed-tensors WNA16 MoE classes, is idempotent and
  reversible, and raises a clear :class:`FusedMoeHookError` when the classes or the layout
  contract (``create_weights`` shapes, transposed loading) are not what it was written against.
* The opt-in dummy fill gives the packed int32 experts seeded random words (SGLang's dummy loader
  leaves them uninitialized).
* End to end on CPU (a subprocess, so the kernel module is imported in Triton interpreter mode):
  SGLang's own ``create_weights`` builds the layer's parameters, the patched
  ``process_weights_after_loading`` keeps the layout, the patched ``apply_weights`` matches the
  fp32 reference (relative Frobenius error <= 2e-2, see tests/triton_kernels/test_moe_w4a16.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang")
from sglang_ddtree import moe_hook  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def classes():
    marlin, triton_cls = moe_hook.find_classes()
    yield marlin, triton_cls
    moe_hook.uninstall()


def test_install_patches_both_classes_and_uninstalls(classes):
    marlin, triton_cls = classes
    originals = {(c, n): c.__dict__[n] for c in classes for n in moe_hook._PATCHED}
    patched = moe_hook.install(None)
    assert sorted(patched) == sorted(f"{c.__name__}.{n}" for c in classes for n in moe_hook._PATCHED)
    assert marlin.apply_weights is moe_hook._apply_weights
    assert triton_cls.process_weights_after_loading is moe_hook._process_weights_after_loading
    assert moe_hook.install(None) == []  # idempotent
    moe_hook.uninstall()
    for (c, n), fn in originals.items():
        assert c.__dict__[n] is fn


def test_maybe_install_follows_env(classes):
    marlin, _ = classes
    original = marlin.__dict__["apply_weights"]
    assert not moe_hook.maybe_install(None, environ={})
    assert marlin.__dict__["apply_weights"] is original
    assert moe_hook.maybe_install(None, environ={moe_hook.ENV_SWITCH: "1"})
    assert marlin.__dict__["apply_weights"] is moe_hook._apply_weights


def test_missing_class_is_a_clear_error(monkeypatch):
    import importlib

    mod = importlib.import_module(moe_hook._SCHEME_MODULE)
    monkeypatch.delattr(mod, moe_hook._TRITON_CLASS)
    with pytest.raises(moe_hook.FusedMoeHookError, match="CompressedTensorsWNA16TritonMoE missing"):
        moe_hook.install(None)


def test_changed_layout_is_a_clear_error(monkeypatch):
    marlin, _ = moe_hook.find_classes()

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra):  # a layout the hook does not know
        layer.register_parameter("w13_weight", None)

    monkeypatch.setattr(marlin, "create_weights", create_weights)
    with pytest.raises(moe_hook.FusedMoeHookError, match="create_weights lacks"):
        moe_hook.install(None)
    monkeypatch.undo()
    marlin2, _ = moe_hook.find_classes()

    def apply_weights(self, layer, x, topk):  # a signature the hook does not know
        return None

    monkeypatch.setattr(marlin2, "apply_weights", apply_weights)
    with pytest.raises(moe_hook.FusedMoeHookError, match="apply_weights takes"):
        moe_hook.install(None)


def test_dummy_int4_fill_is_seeded_and_keeps_layout_check(classes):
    import types

    import torch

    marlin, _ = classes
    assert moe_hook.maybe_install_dummy_int4_fill({moe_hook.ENV_DUMMY_SEED: "7"})
    assert not moe_hook.install_dummy_int4_fill(7)  # idempotent
    moe_hook.find_classes()  # the source-fragment check still sees SGLang's create_weights

    def layer():
        wq = types.SimpleNamespace(num_bits=4, strategy="group", group_size=32, actorder=None,
                                   symmetric=True)
        lyr = torch.nn.Module()
        lyr.moe_tp_size = 1
        marlin(types.SimpleNamespace(quant_format="pack-quantized"), wq).create_weights(
            lyr, 3, 256, 128, torch.bfloat16)
        return lyr

    a, b = layer(), layer()
    assert torch.equal(a.w13_weight_packed, b.w13_weight_packed)
    assert torch.equal(a.w2_weight_packed, b.w2_weight_packed)
    assert a.w13_weight_packed.unique().numel() > 1000  # random words, not a constant fill
    with pytest.raises(ValueError, match="integer seed"):
        moe_hook.maybe_install_dummy_int4_fill({moe_hook.ENV_DUMMY_SEED: "x"})
    assert not moe_hook.maybe_install_dummy_int4_fill({})


_E2E = textwrap.dedent("""
    import os, types, torch
    assert os.environ["TRITON_INTERPRET"] == "1"
    from sglang_ddtree import moe_hook
    from sglang_ddtree.triton_kernels.moe_reference import make_random_moe, moe_w4a16_reference
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    marlin, _ = moe_hook.find_classes()
    moe_hook.install(None)
    E, H, I, TOPK, M = 6, 256, 128, 2, 5

    def scheme(group_size=32, sym=True):
        wq = types.SimpleNamespace(num_bits=4, strategy="group", group_size=group_size,
                                   actorder=None, symmetric=sym)
        return marlin(types.SimpleNamespace(quant_format="pack-quantized"), wq)

    s = scheme()
    layer = torch.nn.Module()
    layer.moe_tp_size = 1
    s.create_weights(layer, E, H, I, torch.bfloat16)  # SGLang's own parameter shapes
    w = make_random_moe(E, H, I, seed=3)
    for name, key in (("w13_weight_packed", "w13_packed"), ("w13_weight_scale", "w13_scale"),
                      ("w2_weight_packed", "w2_packed"), ("w2_weight_scale", "w2_scale")):
        getattr(layer, name).data.copy_(w[key])  # copy_ also checks the shapes match
    s.process_weights_after_loading(layer)
    assert layer.w13_weight_packed.shape == (E, H // 8, 2 * I)  # no Marlin repack
    assert layer.w13_weight_g_idx.shape == (E, 0)
    s.moe_runner_config = MoeRunnerConfig(num_experts=E, top_k=TOPK, activation="silu",
                                          routed_scaling_factor=2.5)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, H, generator=g).bfloat16()
    logits = torch.randn(M, E, generator=g)
    tw, ti = torch.topk(logits.softmax(-1), TOPK)
    ti = ti.to(torch.int32)
    out = s.apply_weights(layer, StandardDispatchOutput(
        hidden_states=x, hidden_states_scale=None, topk_output=StandardTopKOutput(tw, ti, logits)))
    ref = moe_w4a16_reference(x, w["w13_packed"], w["w13_scale"], w["w2_packed"], w["w2_scale"],
                              tw, ti, 2.5)
    rel = ((out.hidden_states.float() - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, rel

    s.moe_runner_config = MoeRunnerConfig(activation="gelu")
    try:
        s.apply_weights(layer, None)
        raise SystemExit("gelu accepted")
    except NotImplementedError as exc:
        assert "activation" in str(exc), exc
    other = torch.nn.Module()
    other.moe_tp_size = 1
    s128 = scheme(group_size=128)
    s128.create_weights(other, E, H, I, torch.bfloat16)
    try:
        s128.process_weights_after_loading(other)
        raise SystemExit("group 128 accepted")
    except NotImplementedError as exc:
        assert "group_size=128" in str(exc), exc
    # a config table that cannot serve some M: refused while weights load, naming the band
    import json, tempfile
    from sglang_ddtree.triton_kernels import moe_w4a16
    table = json.load(open(moe_w4a16._CONFIG_PATH))
    next(b for b in table["bands"] if b["max_m"] == 512)["half_m"] = 3
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(table, f)
    os.environ["SGLANG_DDTREE_MOE_CONFIG"] = f.name
    bad = torch.nn.Module()
    bad.moe_tp_size = 1
    s.create_weights(bad, E, H, I, torch.bfloat16)
    try:
        s.process_weights_after_loading(bad)
        raise SystemExit("bad config table accepted")
    except moe_hook.FusedMoeHookError as exc:
        assert "band max_m=512" in str(exc) and "SGLANG_DDTREE_MOE_CONFIG" in str(exc), exc
    del os.environ["SGLANG_DDTREE_MOE_CONFIG"]
    # programmatic dependent launch: a bad spec, or PDL asked for where it cannot run (the
    # interpreter here), refused while weights load; unset it is off here
    for spec, words in (("4", "1:LETTERS"), ("1:gd", "sm_90")):
        os.environ["SGLANG_DDTREE_MOE_PDL"] = spec
        try:
            s.process_weights_after_loading(bad)
            raise SystemExit(f"PDL spec {spec} accepted")
        except moe_hook.FusedMoeHookError as exc:
            assert words in str(exc) and "SGLANG_DDTREE_MOE_PDL" in str(exc), exc
    del os.environ["SGLANG_DDTREE_MOE_PDL"]
    s.process_weights_after_loading(bad)
    print("E2E_OK", rel)
""")


def test_end_to_end_layer_on_cpu():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _E2E], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "E2E_OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    # one visible line per process says the fused kernel took over (first layer only)
    assert proc.stderr.count("MoE layers run the fused W4A16 Triton kernel") == 1, proc.stderr[-4000:]


def test_dummy_init_range_gives_a_non_degenerate_model(monkeypatch):
    """SGLANG_DDTREE_DUMMY_INIT_RANGE: float weights uniform in +-bound (seeded as SGLang's),
    norm weights 1; int tensors untouched; a bad value is a clear error."""
    loader = pytest.importorskip("sglang.srt.model_loader.loader")
    monkeypatch.setattr(loader, "initialize_dummy_weights", loader.initialize_dummy_weights)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 64, bias=False)
            self.input_layernorm = torch.nn.LayerNorm(64)
            self.packed = torch.nn.Parameter(torch.zeros(4, dtype=torch.int32), requires_grad=False)

    assert not moe_hook.maybe_install_dummy_init_range({})
    with pytest.raises(ValueError, match="SGLANG_DDTREE_DUMMY_INIT_RANGE must be a positive"):
        moe_hook.maybe_install_dummy_init_range({"SGLANG_DDTREE_DUMMY_INIT_RANGE": "-1"})
    assert moe_hook.maybe_install_dummy_init_range({"SGLANG_DDTREE_DUMMY_INIT_RANGE": "0.05"})
    assert not moe_hook.install_dummy_init_range(0.05)  # idempotent
    a, b = Block(), Block()
    loader.initialize_dummy_weights(a)
    loader.initialize_dummy_weights(b)
    w = a.proj.weight
    assert float(w.abs().max()) <= 0.05 and float(w.abs().max()) > 0.04  # not SGLang's 1e-3
    assert torch.equal(w, b.proj.weight)  # seeded: two servers get the same weights
    assert bool((a.input_layernorm.weight == 1).all())
    assert bool((a.packed == 0).all())


def _toy_moe_model(layers=2, experts=64, hidden=256):
    """DeepSeek-V3-like names: model.layers.i.{post_attention_layernorm, mlp.gate}."""

    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(experts, hidden))
            self.e_score_correction_bias = torch.nn.Parameter(torch.empty(experts))

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.post_attention_layernorm = torch.nn.Module()
            self.post_attention_layernorm.weight = torch.nn.Parameter(torch.empty(hidden))
            self.mlp = torch.nn.Module()
            self.mlp.gate = Gate()

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList(Layer() for _ in range(layers))
    return model


def _distinct_experts(layer, tokens, topk=8):
    """Distinct experts the tokens pick, noaux_tc style: sigmoid(logits) + bias, top-k."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, layer.mlp.gate.weight.shape[1], generator=g)
    h = x / x.pow(2).mean(-1, keepdim=True).sqrt() * layer.post_attention_layernorm.weight
    logits = h @ layer.mlp.gate.weight.t()
    scores = logits.sigmoid() + layer.mlp.gate.e_score_correction_bias
    return scores.topk(topk, dim=-1).indices.unique().numel(), logits


def test_dummy_router_spread_makes_tokens_route_independently(monkeypatch):
    """SGLANG_DDTREE_DUMMY_ROUTER_LOGIT_STD: under SGLang's stock dummy fill every token picks
    the same experts (the correction bias outweighs the logits); after the spread the logits
    have the asked standard deviation, the bias is 0, layers differ, and 32 tokens touch about
    as many experts as independent routing would."""
    loader = pytest.importorskip("sglang.srt.model_loader.loader")
    monkeypatch.setattr(loader, "initialize_dummy_weights", loader.initialize_dummy_weights)
    stock = _toy_moe_model()
    loader.initialize_dummy_weights(stock)
    assert _distinct_experts(stock.model.layers[0], 32)[0] == 8  # one expert set for all

    assert not moe_hook.maybe_install_dummy_router_spread({})
    with pytest.raises(ValueError, match="ROUTER_LOGIT_STD must be a positive"):
        moe_hook.maybe_install_dummy_router_spread({moe_hook.ENV_DUMMY_ROUTER: "0"})
    assert moe_hook.maybe_install_dummy_router_spread({moe_hook.ENV_DUMMY_ROUTER: "1.0"})
    assert not moe_hook.install_dummy_router_spread(1.0)  # idempotent
    model = _toy_moe_model()
    loader.initialize_dummy_weights(model)
    l0, l1 = model.model.layers
    assert bool((l0.mlp.gate.e_score_correction_bias == 0).all())
    assert not torch.equal(l0.mlp.gate.weight, l1.mlp.gate.weight)  # a seed per layer
    distinct, logits = _distinct_experts(l0, 32)
    assert 0.85 < float(logits.std()) < 1.15
    # 32 tokens x 8 of 64 experts drawn independently: 64 * (1 - (56/64)^32) = 63.3 expected
    assert distinct >= 56, distinct
    model2 = _toy_moe_model()
    loader.initialize_dummy_weights(model2)
    assert torch.equal(model2.model.layers[1].mlp.gate.weight, l1.mlp.gate.weight)  # seeded

    orphan = torch.nn.Module()
    orphan.mlp = torch.nn.Module()
    orphan.mlp.gate = torch.nn.Linear(8, 4, bias=False)
    wrapped = torch.nn.Module()
    wrapped.layer = orphan
    with pytest.raises(moe_hook.FusedMoeHookError, match="no post_attention_layernorm"):
        moe_hook.spread_router_logits_(wrapped, 1.0)


def test_distinct_expert_counts_by_token_count(monkeypatch):
    """SGLANG_DDTREE_MOE_STATS: per call, the distinct experts of its top-k ids (negative ids not
    counted), summed by the call's token count M; the summary is the mean per call."""
    monkeypatch.setitem(moe_hook._stats, "buf", None)
    assert moe_hook.moe_stats_summary() == {}
    assert not moe_hook.maybe_enable_stats({})
    moe_hook.record_distinct_experts(torch.tensor([[0, 1], [1, 2], [-1, 2]]), 4)  # 3 distinct
    moe_hook.record_distinct_experts(torch.tensor([[3, 3], [3, -1], [3, 3]]), 4)  # 1
    moe_hook.record_distinct_experts(torch.tensor([[0, 1]], dtype=torch.int32), 4)  # 2, M = 1
    assert moe_hook.moe_stats_summary() == {1: [2.0, 1], 3: [2.0, 2]}
    big = torch.zeros((9000, 1), dtype=torch.int64)
    moe_hook.record_distinct_experts(big, 4)  # M past the table: counted in its last row
    assert moe_hook.moe_stats_summary()[moe_hook._STATS_MAX_M] == [1.0, 1]
    monkeypatch.setitem(moe_hook._stats, "on", False)
    installed = []
    monkeypatch.setattr(moe_hook, "install_topk_stats", lambda: installed.append(1))
    assert moe_hook.maybe_enable_stats({moe_hook.ENV_STATS: "1"}) and installed == [1]


def test_topk_stats_count_every_moe_routing_call(monkeypatch):
    """SGLANG_DDTREE_MOE_STATS wraps SGLang's TopK forwards (every MoE layer's routing): the
    wrapped forward returns the original's output and adds its top-k ids' distinct experts to
    the buffer. The originals are stand-ins here (0.5.23's native top-k needs a published
    runtime config); that SGLang's TopK has both methods is checked on the real class."""
    import types

    from sglang.srt.layers.moe import topk as topk_mod

    assert {"forward_cuda", "forward_native"} <= set(topk_mod.TopK.__dict__)
    seen = []

    def fake(self, hidden_states, router_logits, *, num_token_non_padded=None):
        seen.append(num_token_non_padded)
        ids = router_logits.topk(2, dim=-1).indices.to(torch.int32)
        return types.SimpleNamespace(topk_ids=ids)

    for name in ("forward_cuda", "forward_native"):
        monkeypatch.setattr(topk_mod.TopK, name, fake)
    monkeypatch.setitem(moe_hook._stats, "buf", None)
    assert moe_hook.install_topk_stats()
    assert not moe_hook.install_topk_stats()  # idempotent
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 4.0, 5.0],
                           [5.0, 0.0, 0.0, 0.0, 4.0]])
    out = topk_mod.TopK.forward_native(None, torch.zeros(3, 8), logits, num_token_non_padded=3)
    assert sorted(out.topk_ids[0].tolist()) == [0, 1] and seen == [3]
    assert moe_hook.moe_stats_summary() == {3: [4.0, 1]}  # experts 0, 1, 3, 4
    topk_mod.TopK.forward_cuda(None, torch.zeros(3, 8), logits)
    assert moe_hook.moe_stats_summary() == {3: [4.0, 2]}
    # an output without top-k ids (SGLang's bypassed format) is not counted
    monkeypatch.setattr(topk_mod.TopK, "forward_cuda",
                        lambda self, h, r: types.SimpleNamespace(router_logits=r))
    assert moe_hook.install_topk_stats()
    topk_mod.TopK.forward_cuda(None, torch.zeros(3, 8), logits)
    assert moe_hook.moe_stats_summary() == {3: [4.0, 2]}
    # out-of-range ids (a fused shared expert) and padding (-1) are not counted
    moe_hook.record_distinct_experts(torch.tensor([[5, 0], [-1, 0]]), 5)
    assert moe_hook.moe_stats_summary()[2] == [1.0, 1]
