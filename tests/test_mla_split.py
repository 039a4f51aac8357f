"""CPU tests of ``sglang_ddtree.mla_split``: which forward_absorb_core calls take SGLang's split
branch under DDTREE's name, that everything else runs untouched, and that the installed SGLang's
method is the one the wrapper knows."""
from __future__ import annotations

import logging
import types

import pytest

sglang = pytest.importorskip("sglang")

from sglang_ddtree import compat, mla_split  # noqa: E402
from sglang_ddtree import config as cfg  # noqa: E402
from sglang_ddtree.verify_backend import TreeVerifyBackend  # noqa: E402


@pytest.fixture(autouse=True)
def _clean():
    mla_split.uninstall()
    yield
    mla_split.uninstall()


class Mode:
    def __init__(self, verify):
        self.verify = verify

    def is_target_verify(self):
        return self.verify


def _batch(verify=True):
    return types.SimpleNamespace(forward_mode=Mode(verify))


def _backend(mla=True, block_mask=None):
    """A TreeVerifyBackend without a runner (only what the wrapper reads)."""
    b = object.__new__(TreeVerifyBackend)
    object.__setattr__(b, "_is_mla", mla)
    object.__setattr__(b, "_block_mask", block_mask)
    return b


def _fake_sgl(backend, backends=None):
    """A compat stand-in: a mixin whose forward_absorb_core records the branch it would take."""
    names = backends if backends is not None else ["fa3", "flashinfer"]

    class Mixin:
        def forward_absorb_core(self, q_pe, k_pe, q_nope_out, k_nope, forward_batch,
                                zero_allocator, positions, topk_indices, llama_4_scaling,
                                fusion_plan=None):
            if self.fail:
                raise RuntimeError("boom")
            split = self.current_attention_backend in names
            self.seen.append((self.current_attention_backend, split))
            return "split" if split else "concat"

    class Layer(Mixin):
        def __init__(self, name="triton"):
            self.current_attention_backend = name
            self.seen = []
            self.fail = False

    sgl = types.SimpleNamespace(DeepseekMLAForwardMixin=Mixin,
                                FORWARD_ABSORB_CORE_ATTENTION_BACKENDS=names,
                                get_attn_backend=lambda: backend["now"])
    return sgl, Layer


def _call(layer, fb, **kw):
    args = dict(zero_allocator=None, positions=None, topk_indices=None, llama_4_scaling=None)
    args.update(kw)
    return layer.forward_absorb_core("q_pe", "k_pe", "q_nope", "k_nope", fb, *args.values())


def test_installed_sglang_forward_absorb_core_is_the_known_one():
    """The release CI installs has the method and the list the wrapper relies on (a release
    that renames or reorders them makes install() warn and keep the copies)."""
    sgl = compat.load()
    assert mla_split._signature_problem(
        sgl.DeepseekMLAForwardMixin.__dict__["forward_absorb_core"]) is None
    assert isinstance(sgl.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS, list)
    assert "triton" not in sgl.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS  # the case it is for


def test_verify_on_our_mla_backend_takes_the_split_branch_and_restores_the_name():
    state = {"now": _backend()}
    sgl, Layer = _fake_sgl(state)
    assert mla_split.install(sgl) is True
    assert mla_split.install(sgl) is False  # idempotent
    layer = Layer()
    assert _call(layer, _batch()) == "split"
    assert layer.seen == [(mla_split.SPLIT_NAME, True)]
    assert layer.current_attention_backend == "triton"
    # keyword forward_batch too
    layer.forward_absorb_core("q_pe", "k_pe", "q_nope", "k_nope", forward_batch=_batch(),
                              zero_allocator=None, positions=None, topk_indices=None,
                              llama_4_scaling=None)
    assert layer.seen[-1] == (mla_split.SPLIT_NAME, True)
    layer.fail = True  # the name comes back when the call raises
    with pytest.raises(RuntimeError, match="boom"):
        _call(layer, _batch())
    assert layer.current_attention_backend == "triton"


@pytest.mark.parametrize("case", ["decode", "other_backend", "drafter_block", "mha", "topk",
                                  "llama4", "fusion_plan", "sink", "already_split"])
def test_everything_else_runs_untouched(case):
    state = {"now": _backend()}
    sgl, Layer = _fake_sgl(state)
    mla_split.install(sgl)
    layer = Layer("fa3" if case == "already_split" else "triton")
    fb = _batch(verify=case != "decode")
    kw = {}
    if case == "other_backend":
        state["now"] = object()
    elif case == "drafter_block":
        state["now"] = _backend(block_mask="a block")
    elif case == "mha":
        state["now"] = _backend(mla=False)
    elif case == "topk":
        kw["topk_indices"] = "dsa"
    elif case == "llama4":
        kw["llama_4_scaling"] = 1.25
    elif case == "fusion_plan":
        kw["fusion_plan"] = "plan"
    elif case == "sink":
        layer.learnable_sink_param = "sink"
    _call(layer, fb, **kw)
    assert layer.seen == [(layer.current_attention_backend, case == "already_split")]


def test_torch_compile_tracing_keeps_the_models_convention(monkeypatch):
    import torch

    sgl, Layer = _fake_sgl({"now": _backend()})
    mla_split.install(sgl)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    layer = Layer()
    assert _call(layer, _batch()) == "concat"
    assert layer.seen == [("triton", False)]


def test_uninstall_restores_the_method_and_the_list():
    sgl, Layer = _fake_sgl({"now": _backend()})
    original = sgl.DeepseekMLAForwardMixin.__dict__["forward_absorb_core"]
    mla_split.install(sgl)
    assert mla_split.SPLIT_NAME in sgl.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS
    mla_split.uninstall()
    assert sgl.DeepseekMLAForwardMixin.__dict__["forward_absorb_core"] is original
    assert mla_split.SPLIT_NAME not in sgl.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS


def test_an_unknown_method_keeps_the_copies_with_a_warning(caplog):
    class Mixin:
        def forward_absorb_core(self, q, k, forward_batch):
            return None

    sgl = types.SimpleNamespace(DeepseekMLAForwardMixin=Mixin,
                                FORWARD_ABSORB_CORE_ATTENTION_BACKENDS=[],
                                get_attn_backend=lambda: None)
    with caplog.at_level(logging.WARNING, logger="sglang_ddtree.mla_split"):
        assert mla_split.install(sgl) is False
    assert "keeps the model's query / latent copies" in caplog.text
    assert Mixin.__dict__["forward_absorb_core"].__name__ == "forward_absorb_core"
    assert mla_split._state["cls"] is None


def test_switch_parses():
    assert cfg.mla_split_enabled({}) is True
    assert cfg.mla_split_enabled({cfg.ENV_MLA_SPLIT: "0"}) is False
    with pytest.raises(cfg.DDTreeConfigError, match="SGLANG_DDTREE_MLA_SPLIT"):
        cfg.mla_split_enabled({cfg.ENV_MLA_SPLIT: "yes"})
