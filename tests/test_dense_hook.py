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


def _fake_router_module(name="_ddtree_fake_router"):
    import sys
    import types

    mod = types.ModuleType(name)

    def linear_bf16_fp32(x, y, *, hpc_kernel_min_m=None):
        return "sglang-router"

    mod.linear_bf16_fp32 = linear_bf16_fp32
    sys.modules[name] = mod
    return mod


def test_router_gemm_is_patched_and_restored():
    cls = type("M", (_FakeMethod,), {"apply": _FakeMethod.apply})
    mod = _fake_router_module()
    original = mod.linear_bf16_fp32
    try:
        assert dh.install((17, 32), cls=cls, router_target=(mod, "linear_bf16_fp32")) is True
        assert mod.linear_bf16_fp32 is dh._router_linear
        w = _w(384, 7168)
        x = torch.zeros(24, 7168, dtype=torch.bfloat16)  # fits, but on the CPU
        assert mod.linear_bf16_fp32(x, w) == "sglang-router"
        assert mod.linear_bf16_fp32(x, w, hpc_kernel_min_m=8) == "sglang-router"
        # a second install keeps the first original (no wrapper around the wrapper)
        dh.install((17, 32), cls=cls, router_target=(mod, "linear_bf16_fp32"))
        assert dh._state["router"][2] is original
    finally:
        dh.uninstall(cls=cls)
    assert mod.linear_bf16_fp32 is original and dh._state["router"] is None


def test_router_target_checks_the_gemm_it_patches():
    mod = _fake_router_module("_ddtree_fake_router2")
    assert dh._router_target(("_ddtree_fake_router2", "linear_bf16_fp32")) == (
        mod, "linear_bf16_fp32")
    with pytest.raises(dh.SkinnyGemmHookError, match="cannot find"):
        dh._router_target(("_ddtree_fake_router2", "missing"))
    with pytest.raises(dh.SkinnyGemmHookError, match="cannot find"):
        dh._router_target(("_ddtree_no_such_module", "linear_bf16_fp32"))
    mod.other = lambda a, b, c: None
    with pytest.raises(dh.SkinnyGemmHookError, match=r"expected \(x, y, \*, \.\.\.\)"):
        dh._router_target(("_ddtree_fake_router2", "other"))


def test_the_installed_sglangs_router_gemm_is_found():
    """compat.<release>.ROUTER_GEMM names the function DeepseekV2's MoEGate imports at call
    time in the installed release (0.5.17: attention.dsv4; 0.5.23: gemm.bf16_fp32)."""
    pytest.importorskip("sglang")
    from sglang_ddtree import compat

    mod, attr = dh._router_target()
    assert (mod.__name__, attr) == compat.load().ROUTER_GEMM
    import inspect

    import sglang.srt.models.deepseek_v2 as dsv2

    src = inspect.getsource(dsv2.MoEGate.forward)
    assert f"from {mod.__name__} import {attr}" in src


@pytest.mark.parametrize("value,want", [("1", (12, 32)), ("9-16", (9, 16)), ("0", None)])
def test_router_switch_range(value, want):
    assert dh.parse_range(value, dh.ROUTER_ENV, dh.DEFAULT_ROUTER_RANGE) == want
    with pytest.raises(dh.SkinnyGemmHookError, match="SGLANG_DDTREE_ROUTER_GEMM=.*LO-HI"):
        dh.parse_range("2-99", dh.ROUTER_ENV, dh.DEFAULT_ROUTER_RANGE)


def test_router_config_parses_and_names_the_form():
    cfg = dh.parse_router_config("")
    assert (cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.num_stages) == \
        dh.ROUTER_CONFIG
    cfg = dh.parse_router_config("32,64,28")
    assert (cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps) == (32, 64, 28, 4)
    assert dh.parse_router_config(" 64,128,28,8,2 ").num_stages == 2
    for bad in ("64,128", "64,x,2", "48,128,2", "64,128,0", "64,128,2,3", "1,2,3,4,5,6"):
        with pytest.raises(dh.SkinnyGemmHookError, match="SGLANG_DDTREE_ROUTER_GEMM_CONFIG"):
            dh.parse_router_config(bad)


def test_router_fits_follows_the_config():
    cfg = dh.parse_router_config("64,128,14")
    w = _w(384, 7168)
    x = torch.zeros(16, 7168, dtype=torch.bfloat16)
    assert dh.router_fits(w, x, 2, 32, cfg)
    assert not dh.router_fits(w, x[:1], 2, 32, cfg)  # below the range: SGLang's
    assert not dh.router_fits(w, torch.zeros(33, 7168, dtype=torch.bfloat16), 2, 32, cfg)
    assert not dh.router_fits(w, x, 2, 32, dh.parse_router_config("64,128,16"))  # K split
    assert not dh.router_fits(_w(320, 7168), x, 2, 32, dh.parse_router_config("128,128,14"))
    assert dh.router_fits(_w(320, 7168), x, 2, 32, dh.parse_router_config("64,128,14"))
    assert not dh.router_fits(w, x.float(), 2, 32, cfg)
    assert not dh.router_fits(w.t().contiguous().t(), x, 2, 32, cfg)


def _fake_tiny_module(name="_ddtree_fake_tiny"):
    import sys
    import types

    mod = types.ModuleType(name)

    def dsv3_router_gemm(hidden_states, router_weights, out_dtype=torch.bfloat16, output=None):
        return "sglang-tiny"

    mod.dsv3_router_gemm = dsv3_router_gemm
    sys.modules[name] = mod
    return mod


def test_router_switch_patches_both_router_gemms_and_restores():
    tiny, lin = _fake_tiny_module(), _fake_router_module("_ddtree_fake_router3")
    orig_tiny, orig_lin = tiny.dsv3_router_gemm, lin.linear_bf16_fp32
    try:
        assert dh.install_router((2, 32), tiny_target=(tiny, "dsv3_router_gemm"),
                                 router_target=(lin, "linear_bf16_fp32")) is True
        assert tiny.dsv3_router_gemm is dh._router_tiny
        assert lin.linear_bf16_fp32 is dh._router_linear
        assert dh.install_router((2, 32), tiny_target=(tiny, "dsv3_router_gemm"),
                                 router_target=(lin, "linear_bf16_fp32")) is False
        w = _w(384, 7168)
        x = torch.zeros(16, 7168, dtype=torch.bfloat16)  # fits, but on the CPU: SGLang's
        assert tiny.dsv3_router_gemm(x, w, out_dtype=torch.float32) == "sglang-tiny"
        assert tiny.dsv3_router_gemm(x, w, out_dtype=torch.float32, output=x) == "sglang-tiny"
        assert lin.linear_bf16_fp32(x, w) == "sglang-router"
        assert dh._state["tiny"][2] is orig_tiny and dh._state["router"][2] is orig_lin
    finally:
        dh.uninstall()
    assert tiny.dsv3_router_gemm is orig_tiny and lin.linear_bf16_fp32 is orig_lin
    assert dh._state["tiny"] is None and dh._state["router_range"] is None


def test_tiny_router_target_checks_what_it_patches():
    mod = _fake_tiny_module("_ddtree_fake_tiny2")
    assert dh._tiny_router_target(("_ddtree_fake_tiny2", "dsv3_router_gemm")) == (
        mod, "dsv3_router_gemm")
    with pytest.raises(dh.SkinnyGemmHookError, match="SGLANG_DDTREE_ROUTER_GEMM: cannot find"):
        dh._tiny_router_target(("_ddtree_fake_tiny2", "missing"))
    mod.other = lambda a, b: None
    with pytest.raises(dh.SkinnyGemmHookError, match="out_dtype"):
        dh._tiny_router_target(("_ddtree_fake_tiny2", "other"))


def test_maybe_install_checks_the_router_values_first():
    with pytest.raises(dh.SkinnyGemmHookError, match="ROUTER_GEMM_CONFIG"):
        dh.maybe_install({"SGLANG_DDTREE_ROUTER_GEMM": "1",
                          "SGLANG_DDTREE_ROUTER_GEMM_CONFIG": "64"})
    assert dh._state["tiny"] is None and dh._state["router_range"] is None
    assert dh.maybe_install({}) is False


def test_skinny_pdl_is_checked_at_install():
    """SGLANG_DDTREE_SKINNY_PDL: 0 / 1 with a switch; another value (session 68's removed 2
    among them), or 1 without either switch (it would do nothing), refused before anything is
    patched."""
    for value in ("2", "on", "1:g"):
        with pytest.raises(dh.SkinnyGemmHookError, match="expected 0 \\(plain launches\\)"):
            dh.maybe_install({"SGLANG_DDTREE_ROUTER_GEMM": "1",
                              "SGLANG_DDTREE_SKINNY_PDL": value})
    for value in ("1", " 1 "):
        with pytest.raises(dh.SkinnyGemmHookError, match="skinny GEMM only: set"):
            dh.maybe_install({"SGLANG_DDTREE_SKINNY_PDL": value})
    assert dh._state["router_range"] is None and dh._state["range"] is None
    assert dh.maybe_install({"SGLANG_DDTREE_SKINNY_PDL": "0"}) is False
    assert dh.check_pdl({"SGLANG_DDTREE_SKINNY_PDL": " 1 "}, True) == 1
    assert dh.check_pdl({}, False) == 0


def test_the_checked_pdl_mode_goes_with_every_call(monkeypatch):
    """maybe_install's checked SGLANG_DDTREE_SKINNY_PDL is what each hooked call launches with
    (the kernel then reads no environment per call); before it, None (the kernel's own)."""
    from sglang_ddtree.triton_kernels import skinny_gemm as sg

    dh.uninstall()  # another test's maybe_install may have left its mode
    seen = []
    monkeypatch.setattr(sg, "skinny_gemm", lambda *a, **kw: seen.append(kw["pdl"]))
    layer = torch.nn.Linear(256, 128, bias=False)
    layer._ddtree_skinny_counters = torch.zeros(2, dtype=torch.int32)  # no device buffer
    x = torch.zeros(3, 256)
    dh._skinny(layer, layer.weight, x)
    monkeypatch.setattr(dh, "install_router", lambda *a, **kw: True)
    try:
        dh.maybe_install({"SGLANG_DDTREE_ROUTER_GEMM": "1", "SGLANG_DDTREE_SKINNY_PDL": "1"})
        dh._skinny(layer, layer.weight, x)
    finally:
        dh.uninstall()
    assert seen == [None, 1] and dh._state["pdl"] is None


def test_the_installed_sglangs_tiny_router_gemm_is_named_in_moegate():
    """compat.<release>.ROUTER_TINY_GEMM is the name DeepseekV2's MoEGate calls for few rows
    (0.5.17: dsv3_router_gemm; 0.5.23: tiny_gemm_bf16), imported into the model module on CUDA
    builds (on this CPU-only machine the attribute may be absent, so the source is checked)."""
    pytest.importorskip("sglang")
    import inspect

    from sglang_ddtree import compat

    import sglang.srt.models.deepseek_v2 as dsv2

    mod_name, attr = compat.load().ROUTER_TINY_GEMM
    assert mod_name == dsv2.__name__
    assert f"logits = {attr}(" in inspect.getsource(dsv2.MoEGate.forward)
    assert f"import {attr}" in inspect.getsource(dsv2) or f"{attr} as {attr}" in \
        inspect.getsource(dsv2)


def test_router_auto_installs_the_router_with_pdl_by_card(monkeypatch):
    """SGLANG_DDTREE_ROUTER_GEMM=auto (what DDTREE servers get where it is unset): the router
    switch's default range and tiles, PDL decided per card unless SGLANG_DDTREE_SKINNY_PDL is
    set; where SGLang's router GEMMs are not found, a warning and SGLang's path, no error."""
    dh.uninstall()
    got = []
    monkeypatch.setattr(dh, "install_router", lambda rng, cfg: got.append((rng, cfg)) or True)
    try:
        assert dh.maybe_install({"SGLANG_DDTREE_ROUTER_GEMM": " Auto "}) is True
        assert got == [(dh.DEFAULT_ROUTER_RANGE, dh.parse_router_config(""))]
        assert dh._state["router_auto"] is True and dh._state["pdl"] == dh.ROUTER_AUTO
        dh.uninstall()
        assert dh.maybe_install({"SGLANG_DDTREE_ROUTER_GEMM": "auto",
                                 "SGLANG_DDTREE_SKINNY_PDL": "0"}) is True
        assert dh._state["pdl"] == 0
    finally:
        dh.uninstall()

    def missing(*a, **kw):
        raise dh.SkinnyGemmHookError("SGLANG_DDTREE_ROUTER_GEMM: cannot find it")

    monkeypatch.setattr(dh, "install_router", missing)
    try:
        assert dh.maybe_install({"SGLANG_DDTREE_ROUTER_GEMM": "auto"}) is False
        assert dh._state["router_auto"] is False and dh._state["pdl"] == 0
        with pytest.raises(dh.SkinnyGemmHookError, match="cannot find"):  # asked for: refused
            dh.maybe_install({"SGLANG_DDTREE_ROUTER_GEMM": "1"})
    finally:
        dh.uninstall()
    with pytest.raises(dh.SkinnyGemmHookError, match="auto \\(DDTREE's default\\)"):
        dh.parse_range("x", dh.ROUTER_ENV, dh.DEFAULT_ROUTER_RANGE)
    with pytest.raises(dh.SkinnyGemmHookError, match="LO-HI"):  # the skinny switch has no auto
        dh.maybe_install({"SGLANG_DDTREE_SKINNY_GEMM": "auto"})


class _FakeCudaRows:
    """Stands in for a CUDA bf16 activation of ``m`` rows (what _router_call reads of it)."""

    is_cuda = True
    dtype = torch.bfloat16
    device = torch.device("cuda", 3)

    def __init__(self, m, k):
        self.shape = (m, k)

    def dim(self):
        return 2

    def stride(self, i):
        return (self.shape[1], 1)[i]


def test_router_auto_takes_the_kernel_only_where_the_card_is_sm90(monkeypatch):
    """Under auto the router's 12-32 rows take the kernel on cards auto_device accepts, and
    keep SGLang's path (or the skinny switch's, where it is set) on others."""
    dh.uninstall()
    taken = []
    monkeypatch.setattr(dh, "_skinny", lambda holder, w, x, out=None, config=None:
                        taken.append((x.shape[0], config)) or "kernel")
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: None)  # no CUDA output buffer here
    w = _w(384, 7168)
    dh._state.update(router_range=dh.DEFAULT_ROUTER_RANGE, router_auto=True,
                     router_config=dh.parse_router_config(""))
    try:
        for sm90 in (True, False):
            monkeypatch.setattr(dh, "auto_device", lambda device, ok=sm90: ok)
            assert dh._router_call(_FakeCudaRows(32, 7168), w, torch.float32) == (
                "kernel" if sm90 else None)
            assert dh._router_call(_FakeCudaRows(8, 7168), w, torch.float32) is None
        assert taken == [(32, dh._state["router_config"])]
        dh._state["range"] = (17, 32)  # the skinny switch too: it decides off sm_90
        assert dh._router_call(_FakeCudaRows(32, 7168), w, torch.float32) == "kernel"
        assert taken[-1] == (32, None)
    finally:
        dh.uninstall()


def test_router_auto_pdl_follows_the_card(monkeypatch):
    from sglang_ddtree.triton_kernels import skinny_gemm as sg

    seen = []
    monkeypatch.setattr(sg, "skinny_gemm", lambda *a, **kw: seen.append(kw["pdl"]))
    layer = torch.nn.Linear(256, 128, bias=False)
    layer._ddtree_skinny_counters = torch.zeros(2, dtype=torch.int32)
    dh._state["pdl"] = dh.ROUTER_AUTO
    try:
        for sm90 in (True, False):
            monkeypatch.setattr(dh, "auto_device", lambda device, ok=sm90: ok)
            dh._skinny(layer, layer.weight, torch.zeros(3, 256))
    finally:
        dh.uninstall()
    assert seen == [1, 0]


def test_auto_device_asks_each_card_once(monkeypatch):
    from sglang_ddtree.triton_kernels import _device

    asked = []
    caps = {0: (9, 0), 1: (10, 0), 2: (8, 0)}
    monkeypatch.setattr(_device, "portable", lambda device: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda i: asked.append(i) or caps[i])
    monkeypatch.setattr(dh, "_auto_devices", {})
    assert [dh.auto_device(torch.device("cuda", i)) for i in (0, 1, 2)] == [True, False, False]
    n = len(asked)
    assert dh.auto_device(torch.device("cuda", 0)) and len(asked) == n  # cached
    monkeypatch.setattr(_device, "portable", lambda device: True)  # the interpreter: never
    monkeypatch.setattr(dh, "_auto_devices", {})
    assert not dh.auto_device(torch.device("cuda", 0))


def test_describe_router_says_what_ddtree_servers_do():
    assert dh.describe_router("", (9, 0)) == (
        "auto (DDTREE's default): 12-32 rows on the skinny Triton GEMM under PDL (sm_90)")
    assert dh.describe_router(" AUTO ", (10, 0)) == (
        "auto (DDTREE's default): SGLang's router GEMMs (sm_100: not sm_90)")
    assert dh.describe_router("", None).startswith("auto (DDTREE's default): no GPU here")
    assert dh.describe_router("0", (9, 0)) == "off: SGLang's router GEMMs"
    assert dh.describe_router("2-16", (8, 0)) == (
        "2-16 rows on the skinny Triton GEMM (asked for, any card)")
    assert dh.describe_router("bogus", (9, 0)).startswith("error: SGLANG_DDTREE_ROUTER_GEMM=")
