"""CPU tests of ``sglang_ddtree.mla_absorb`` and of the ``mla_split`` wrappers that apply it:
which ``torch.bmm`` calls reach the absorb kernel (a recording stand-in here; the kernel itself
is tested in tests/triton_kernels/mla_absorb_cases.py), that every other use of the weight runs
torch's own op on plain tensors, and that the layer's attribute comes back."""
from __future__ import annotations

import inspect
import types

import pytest
import torch

from sglang_ddtree import mla_absorb

H, T, R = 2, 3, 8  # heads, tokens, a small stand-in for the 512-wide latent rank


@pytest.fixture
def kernel(monkeypatch):
    """absorb_bmm replaced by a recorder computing the fp32 reference; CPU tensors count as
    on the GPU."""
    from sglang_ddtree.triton_kernels import mla_absorb as km

    calls = []

    def fake(a, w, out=None):
        calls.append((tuple(a.shape), tuple(w.shape), out is not None, type(w)))
        res = torch.bmm(a.float(), w.float()).to(a.dtype)
        if out is None:
            return res
        out.copy_(res)
        return out

    monkeypatch.setattr(km, "absorb_bmm", fake)
    monkeypatch.setattr(km, "default_config", lambda k, n: km.AbsorbConfig(block_n=4, block_k=4))
    monkeypatch.setattr(mla_absorb, "_on_gpu", lambda t: True)
    return calls


def _weight(k, n, dtype=torch.bfloat16):
    """K-contiguous, as SGLang's loader keeps w_kc / w_vc."""
    return torch.randn(H, n, k).to(dtype).transpose(1, 2)


def test_bmm_on_the_view_reaches_the_kernel_with_plain_tensors(kernel):
    w = _weight(4, R)
    q = torch.randn(T, H, 6).to(torch.bfloat16)[:, :, :4]  # q_nope of wider rows
    sub = w.as_subclass(mla_absorb.AbsorbWeight)
    got = torch.bmm(q.transpose(0, 1), sub)
    assert kernel == [((H, T, 4), (H, 4, R), False, torch.Tensor)]
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got.float(), torch.bmm(q.transpose(0, 1).float(), w.float()),
                               rtol=1e-2, atol=1e-2)
    out = torch.empty(T, H * 4, dtype=torch.bfloat16).view(T, H, 4).transpose(0, 1)
    torch.bmm(torch.randn(H, T, R).to(torch.bfloat16), _weight(R, 4).as_subclass(
        mla_absorb.AbsorbWeight), out=out)
    assert kernel[-1][2] is True


def test_other_uses_of_the_view_run_torch_on_plain_tensors(kernel):
    w = _weight(4, R)
    sub = w.as_subclass(mla_absorb.AbsorbWeight)
    assert sub.dtype == torch.bfloat16 and tuple(sub.shape) == (H, 4, R)
    scaled = sub.to(torch.float32) * 2.0
    assert type(scaled) is torch.Tensor
    torch.testing.assert_close(scaled, w.float() * 2.0)
    # operands the kernel does not take: cuBLAS's bmm (fp32 activations, too many tokens)
    torch.bmm(torch.randn(H, T, 4), sub.float())
    big = torch.randn(H, mla_absorb.MAX_TOKENS + 1, 4).to(torch.bfloat16)
    assert type(torch.bmm(big, sub)) is torch.Tensor
    assert kernel == []


def test_swapped_restores_the_attribute_and_skips_weights_it_does_not_take(kernel):
    w = _weight(4, R)
    layer = types.SimpleNamespace(w_kc=w, use_deep_gemm_bmm=False)
    with mla_absorb.swapped(layer, "w_kc") as on:
        assert on and type(layer.w_kc) is mla_absorb.AbsorbWeight
        assert layer.w_kc.data_ptr() == w.data_ptr()
    assert layer.w_kc is w
    with pytest.raises(RuntimeError):
        with mla_absorb.swapped(layer, "w_kc"):
            raise RuntimeError("boom")
    assert layer.w_kc is w
    for bad in (w.float(), w.contiguous(), None):
        layer.w_kc = bad
        with mla_absorb.swapped(layer, "w_kc") as on:
            assert not on and layer.w_kc is bad
    layer.w_kc, layer.use_deep_gemm_bmm = w, True
    with mla_absorb.swapped(layer, "w_kc") as on:
        assert not on and layer.w_kc is w


def test_off_the_gpu_nothing_is_swapped():
    layer = types.SimpleNamespace(w_kc=_weight(4, R))
    with mla_absorb.swapped(layer, "w_kc") as on:
        assert not on


# -- through mla_split's wrappers -------------------------------------------------------------

sglang = pytest.importorskip("sglang")

from sglang_ddtree import compat, mla_split  # noqa: E402
from sglang_ddtree import config as cfg  # noqa: E402
from sglang_ddtree.verify_backend import TreeVerifyBackend  # noqa: E402


@pytest.fixture(autouse=False)
def clean():
    mla_split.uninstall()
    yield
    mla_split.uninstall()


class Mode:
    def __init__(self, verify):
        self.verify = verify

    def is_target_verify(self):
        return self.verify


def _backend(mla=True):
    b = object.__new__(TreeVerifyBackend)
    object.__setattr__(b, "_is_mla", mla)
    object.__setattr__(b, "_block_mask", None)
    return b


def _fake_sgl(state):
    """A mixin whose prepare / core multiply as SGLang's bf16 path does."""

    class Mixin:
        def forward_absorb_prepare(self, positions, hidden_states, forward_batch,
                                   zero_allocator, llama_4_scaling=None, prev_topk_indices=None):
            q_nope = hidden_states[:, :, :4]
            return torch.bmm(q_nope.transpose(0, 1), self.w_kc).transpose(0, 1)

        def forward_absorb_core(self, q_pe, k_pe, q_nope_out, k_nope, forward_batch,
                                zero_allocator, positions, topk_indices, llama_4_scaling,
                                fusion_plan=None):
            self.seen_name = self.current_attention_backend
            o = q_nope_out  # [T, H, R] stands in for the attention's output
            y = torch.empty(o.shape[0], H * 4, dtype=o.dtype)
            torch.bmm(o.transpose(0, 1), self.w_vc, out=y.view(-1, H, 4).transpose(0, 1))
            return y

    class Layer(Mixin):
        def __init__(self):
            self.current_attention_backend = "triton"
            self.w_kc = _weight(4, R)
            self.w_vc = _weight(R, 4)
            self.use_deep_gemm_bmm = False

    sgl = types.SimpleNamespace(DeepseekMLAForwardMixin=Mixin,
                                FORWARD_ABSORB_CORE_ATTENTION_BACKENDS=["fa3"],
                                get_attn_backend=lambda: state["now"])
    return sgl, Layer


def _step(layer, verify=True):
    fb = types.SimpleNamespace(forward_mode=Mode(verify))
    x = torch.randn(T, H, 6).to(torch.bfloat16)
    q = layer.forward_absorb_prepare(None, x, fb, None)
    return layer.forward_absorb_core(None, None, q, None, fb, None, None, None, None)


@pytest.mark.parametrize("split", [True, False])
def test_verify_on_our_backend_runs_both_products_on_the_kernel(kernel, clean, split):
    sgl, Layer = _fake_sgl({"now": _backend()})
    assert mla_split.install(sgl, split=split, absorb=True) is True
    layer = Layer()
    w_kc, w_vc = layer.w_kc, layer.w_vc
    _step(layer)
    assert [c[:3] for c in kernel] == [((H, T, 4), (H, 4, R), False), ((H, T, R), (H, R, 4), True)]
    assert layer.w_kc is w_kc and layer.w_vc is w_vc
    assert layer.seen_name == (mla_split.SPLIT_NAME if split else "triton")
    assert layer.current_attention_backend == "triton"


@pytest.mark.parametrize("case", ["decode", "other_backend", "mha", "absorb_off"])
def test_other_calls_keep_cublas(kernel, clean, case):
    state = {"now": _backend(mla=case != "mha")}
    if case == "other_backend":
        state["now"] = object()
    sgl, Layer = _fake_sgl(state)
    mla_split.install(sgl, split=True, absorb=case != "absorb_off")
    _step(Layer(), verify=case != "decode")
    assert kernel == []


def test_uninstall_restores_both_methods(clean):
    sgl, _ = _fake_sgl({"now": _backend()})
    prepare = sgl.DeepseekMLAForwardMixin.__dict__["forward_absorb_prepare"]
    core = sgl.DeepseekMLAForwardMixin.__dict__["forward_absorb_core"]
    mla_split.install(sgl, split=False, absorb=True)
    assert sgl.DeepseekMLAForwardMixin.__dict__["forward_absorb_prepare"] is not prepare
    assert mla_split.SPLIT_NAME not in sgl.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS
    mla_split.uninstall()
    assert sgl.DeepseekMLAForwardMixin.__dict__["forward_absorb_prepare"] is prepare
    assert sgl.DeepseekMLAForwardMixin.__dict__["forward_absorb_core"] is core


def test_installed_sglang_multiplies_as_the_wrappers_expect():
    """The release CI installs has the prepare method the wrapper knows, and both methods
    multiply by the layer's weight attributes through torch.bmm (what the view intercepts)."""
    sgl = compat.load()
    cls = sgl.DeepseekMLAForwardMixin
    assert mla_split._prepare_signature_problem(cls.__dict__["forward_absorb_prepare"]) is None
    prepare = inspect.getsource(cls.__dict__["forward_absorb_prepare"])
    core = inspect.getsource(cls.__dict__["forward_absorb_core"])
    assert "torch.bmm(q_nope.transpose(0, 1), self.w_kc)" in prepare
    assert "torch.bmm(" in core and "self.w_vc," in core


def test_switch_parses():
    assert cfg.mla_absorb_enabled({}) is False
    assert cfg.mla_absorb_enabled({cfg.ENV_MLA_ABSORB: "1"}) is True
    assert cfg.mla_absorb_enabled({cfg.ENV_MLA_ABSORB: "0"}) is False
    with pytest.raises(cfg.DDTreeConfigError, match="SGLANG_DDTREE_MLA_ABSORB"):
        cfg.mla_absorb_enabled({cfg.ENV_MLA_ABSORB: "on"})
