"""sglang_ddtree.dense_hook: the switch, which calls take the skinny GEMM, per-layer counters,
and the patch on SGLang's UnquantizedLinearMethod (CPU; the kernel itself: tests/gpu)."""
from __future__ import annotations

import pytest
import torch

from sglang_ddtree import dense_hook as dh


@pytest.mark.parametrize("value,want", [("", None), ("0", None), ("off", None), ("1", (17, 32)),
                                        ("on", (17, 32)), ("17-33", (17, 33)), ("1-64", (1, 64)),
                                        (" 9-16 ", (9, 16))])
def test_parse_range(value, want):
    assert dh.parse_range(value) == want


@pytest.mark.parametrize("value", ["65", "0-8", "20-17", "1-65", "x-y", "17-"])
def test_bad_switch_values_name_the_forms(value):
    with pytest.raises(dh.SkinnyGemmHookError, match="LO-HI"):
        dh.parse_range(value)


def _w(n, k, dtype=torch.bfloat16):
    return torch.zeros(n, k, dtype=dtype)


def test_which_calls_fit():
    x = torch.zeros(33, 256, dtype=torch.bfloat16)
    w = _w(128, 256)
    assert dh.shapes_fit(w, x, None, 17, 64)
    assert dh.shapes_fit(w, torch.zeros(40, 512, dtype=torch.bfloat16)[:, :256], None, 17, 64)
    # narrow in K (K < 2 N: the shapes cuBLAS won on in session 32) keep SGLang's path
    assert not dh.shapes_fit(_w(192, 256), x, None, 17, 64)
    assert not dh.shapes_fit(_w(7168, 1024), torch.zeros(24, 1024, dtype=torch.bfloat16), None,
                             17, 64)
    assert dh.shapes_fit(_w(2112, 7168), torch.zeros(24, 7168, dtype=torch.bfloat16), None,
                         17, 32)
    assert not dh.shapes_fit(w, x[:16], None, 17, 64)  # below the range: SGLang's dsv3 / cuBLAS
    assert not dh.shapes_fit(w, torch.zeros(65, 256, dtype=torch.bfloat16), None, 17, 64)
    assert not dh.shapes_fit(w, x, torch.zeros(128, dtype=torch.bfloat16), 17, 64)  # bias
    assert not dh.shapes_fit(w, x.float(), None, 17, 64)
    assert not dh.shapes_fit(_w(128, 256, torch.float16), x, None, 17, 64)
    assert not dh.shapes_fit(_w(100, 256), x, None, 17, 64)  # N not a multiple of 64
    assert not dh.shapes_fit(_w(128, 192), torch.zeros(33, 192, dtype=torch.bfloat16), None,
                             17, 64)  # K not a multiple of 128
    assert not dh.shapes_fit(w.t().contiguous().t(), x, None, 17, 64)  # not contiguous
    assert not dh.shapes_fit(w, torch.zeros(2, 33, 256, dtype=torch.bfloat16), None, 17, 64)
    assert not dh.shapes_fit(None, x, None, 17, 64)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    assert not dh.eligible(layer, x, None, 17, 64)  # a CPU tensor: SGLang's path


def test_each_layer_gets_its_own_counters():
    dh._state.update(buffers={}, next={})
    a, b = torch.nn.Module(), torch.nn.Module()
    dev = torch.device("cpu")
    ca = dh._counters_for_layer(a, dev, 33)
    cb = dh._counters_for_layer(b, dev, 112)
    assert ca.numel() == 33 and cb.numel() == 112
    assert dh._counters_for_layer(a, dev, 33).data_ptr() == ca.data_ptr()
    assert cb.data_ptr() == ca.data_ptr() + 33 * 4  # slices of one zeroed buffer, apart
    assert int(ca.abs().sum() + cb.abs().sum()) == 0
    dh._state.update(buffers={}, next={})


class _FakeMethod:
    def apply(self, layer, x, bias=None):
        return "sglang"


def test_install_routes_only_what_fits_and_uninstall_restores():
    cls = type("M", (_FakeMethod,), {"apply": _FakeMethod.apply})
    original = cls.apply
    assert dh.install((17, 64), cls=cls) is True
    assert dh.install((17, 64), cls=cls) is False  # idempotent
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(_w(128, 256), requires_grad=False)
    x = torch.zeros(33, 256, dtype=torch.bfloat16)  # fits, but on the CPU: SGLang's path
    assert cls().apply(layer, x) == "sglang"
    dh.uninstall(cls=cls)
    assert cls.apply is original and dh._state["range"] is None


def test_sglang_class_is_found_and_patched_in_place():
    pytest.importorskip("sglang")
    cls = dh._linear_method_class()
    original = cls.__dict__["apply"]
    try:
        assert dh.maybe_install({"SGLANG_DDTREE_SKINNY_GEMM": "17-48"}) is True
        assert cls.__dict__["apply"] is dh._apply and dh._state["range"] == (17, 48)
        assert dh.maybe_install({"SGLANG_DDTREE_SKINNY_GEMM": "0"}) is False
    finally:
        dh.uninstall()
    assert cls.__dict__["apply"] is original
