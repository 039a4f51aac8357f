"""GPU test of SGLANG_DDTREE_SKINNY_GEMM (sglang_ddtree.dense_hook) on SGLang's own
UnquantizedLinearMethod: calls in the token range take the skinny GEMM and match F.linear
(relative Frobenius difference <= 1e-2), others (out of range, or a weight narrow in K) stay
F.linear bit for bit, and a CUDA graph
captured after an eager call replays them (two layers, each with its own counters). The MoE
router's fp32-output GEMM (SGLang's ``linear_bf16_fp32``) likewise: fp32 out, within 1e-4 of
SGLang's own (both sum in fp32), untouched outside the range. SGLANG_DDTREE_ROUTER_GEMM: both of
SGLang's router GEMMs (the tiny one up to 16 rows, ``linear_bf16_fp32`` above) take the kernel in
its range with the router's config, fp32 out within 1e-4 of the fp32 reference, and a captured
graph replays them bit for bit; its ``auto`` takes the kernel on sm_90 only."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


def _dense_hook():
    """sglang_ddtree.dense_hook where this process can run its kernel on the GPU, else skip."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("sglang")
    from tests.triton_kernels._moe_kernels import lang_mode_matches

    from sglang_ddtree import dense_hook

    if not lang_mode_matches(interpret=False):
        pytest.skip("triton was imported in interpreter mode in this process")
    return dense_hook


@pytest.fixture()
def hook():
    dense_hook = _dense_hook()
    dense_hook.install((17, 64))
    yield dense_hook
    dense_hook.uninstall()


def _layer(n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(
        (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16),
        requires_grad=False)
    return layer


def test_in_range_calls_take_the_kernel_and_match_f_linear(hook):
    method = hook._linear_method_class()()
    layer = _layer(2112, 7168, 0)
    for m in (8, 16, 17, 33, 64):
        x = torch.randn(m, 7168, device="cuda").to(torch.bfloat16)
        got = method.apply(layer, x)
        want = F.linear(x, layer.weight)
        if m < 17:
            assert torch.equal(got, want)  # SGLang's path untouched
        else:
            assert ((got.float() - want.float()).norm() / want.float().norm()).item() <= 1e-2
    assert getattr(layer, "_ddtree_skinny_counters", None) is not None
    narrow = _layer(7168, 1024, 3)  # o_proj's shape, K < 2 N: cuBLAS's in session 32
    x = torch.randn(24, 1024, device="cuda").to(torch.bfloat16)
    assert torch.equal(method.apply(narrow, x), F.linear(x, narrow.weight))
    assert getattr(narrow, "_ddtree_skinny_counters", None) is None


def test_graph_capture_after_an_eager_call(hook):
    method = hook._linear_method_class()()
    a, b = _layer(2112, 7168, 1), _layer(512, 7168, 2)
    x = torch.randn(33, 7168, device="cuda").to(torch.bfloat16)
    eager = (method.apply(a, x).clone(), method.apply(b, x).clone())
    assert a._ddtree_skinny_counters.data_ptr() != b._ddtree_skinny_counters.data_ptr()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ya, yb = method.apply(a, x), method.apply(b, x)
    graph.replay()
    assert torch.equal(ya, eager[0]) and torch.equal(yb, eager[1])


def test_router_gemm_takes_the_kernel_in_range_and_returns_fp32(hook):
    mod, attr = hook._router_target()
    fn = getattr(mod, attr)
    assert fn is hook._router_linear
    original = hook._state["router"][2]
    w = _layer(384, 7168, 4).weight  # Kimi's router: 384 experts x hidden 7168
    for m in (8, 17, 24, 32):
        x = torch.randn(m, 7168, device="cuda").to(torch.bfloat16)
        got, want = fn(x, w), original(x, w)
        assert got.dtype == torch.float32 and tuple(got.shape) == (m, 384)
        if m < 17:
            assert torch.equal(got, want)  # SGLang's path untouched
        else:
            assert ((got - want).norm() / want.norm()).item() <= 1e-4
            ref = x.float() @ w.float().t()
            assert ((got - ref).norm() / ref.norm()).item() <= 1e-4
    assert getattr(w, "_ddtree_skinny_counters", None) is not None


@pytest.fixture()
def router_hook():
    dense_hook = _dense_hook()
    dense_hook.install_router((2, 32))
    yield dense_hook
    dense_hook.uninstall()


def test_router_switch_takes_both_router_gemms_in_range(router_hook):
    hook = router_hook
    tiny_mod, tiny_attr = hook._tiny_router_target()
    lin_mod, lin_attr = hook._router_target()
    tiny, lin = getattr(tiny_mod, tiny_attr), getattr(lin_mod, lin_attr)
    assert tiny is hook._router_tiny and lin is hook._router_linear
    tiny_orig, lin_orig = hook._state["tiny"][2], hook._state["router"][2]
    w = _layer(384, 7168, 5).weight
    for m in (1, 2, 8, 16, 17, 32, 33):
        x = torch.randn(m, 7168, device="cuda").to(torch.bfloat16)
        ref = x.float() @ w.float().t()
        calls = [(lin, lin_orig, {})]
        if m <= 16:
            calls.append((tiny, tiny_orig, {"out_dtype": torch.float32}))
        for fn, orig, kw in calls:
            got, want = fn(x, w, **kw), orig(x, w, **kw)
            assert got.dtype == torch.float32 and tuple(got.shape) == (m, 384)
            if m in (1, 33):
                assert torch.equal(got, want)  # out of the range: SGLang's path untouched
            else:
                assert ((got - ref).norm() / ref.norm()).item() <= 1e-4, (m, fn)
    assert w._ddtree_skinny_config == hook._state["router_config"]
    x = torch.randn(16, 7168, device="cuda").to(torch.bfloat16)
    got = tiny(x, w)  # SGLang's default bf16 out
    assert got.dtype == torch.bfloat16
    ref = x.float() @ w.float().t()
    assert ((got.float() - ref).norm() / ref.norm()).item() <= 1e-2


def test_router_switch_graph_replay_is_bitwise(router_hook):
    hook = router_hook
    tiny_mod, tiny_attr = hook._tiny_router_target()
    tiny = getattr(tiny_mod, tiny_attr)
    ws = [_layer(384, 7168, 6 + i).weight for i in range(2)]
    x = torch.randn(16, 7168, device="cuda").to(torch.bfloat16)
    eager = [tiny(x, w, out_dtype=torch.float32).clone() for w in ws]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = [tiny(x, w, out_dtype=torch.float32) for w in ws]
    for _ in range(3):
        graph.replay()
        assert all(torch.equal(y, e) for y, e in zip(ys, eager))


def test_router_auto_follows_the_card():
    """SGLANG_DDTREE_ROUTER_GEMM=auto (DDTREE's default): on sm_90 the router's 12-32 rows take
    the kernel under PDL, within 1e-4 of the fp32 reference, and fewer rows stay SGLang's bit for
    bit; on other cards every call stays SGLang's bit for bit."""
    hook = _dense_hook()
    hook.uninstall()
    try:
        assert hook.maybe_install({"SGLANG_DDTREE_ROUTER_GEMM": "auto"}) is True
        assert hook._state["router_auto"] and hook._state["pdl"] == hook.ROUTER_AUTO
        lin_mod, lin_attr = hook._router_target()
        lin, lin_orig = getattr(lin_mod, lin_attr), hook._state["router"][2]
        hopper = torch.cuda.get_device_capability() == (9, 0)
        assert hook.auto_device(torch.device("cuda", torch.cuda.current_device())) == hopper
        w = _layer(384, 7168, 9).weight
        for m in (8, 12, 32):
            x = torch.randn(m, 7168, device="cuda").to(torch.bfloat16)
            got, want = lin(x, w), lin_orig(x, w)
            if hopper and m >= 12:
                ref = x.float() @ w.float().t()
                assert ((got - ref).norm() / ref.norm()).item() <= 1e-4, m
            else:
                assert torch.equal(got, want), m
        assert (getattr(w, "_ddtree_skinny_config", None) is not None) == hopper
    finally:
        hook.uninstall()
