"""The triton verify backend (``--speculative-ddtree-verify-backend triton``) on CPU.

- the flag parses in SGLang's own parser, reaches the environment (CLI and ``Engine`` keyword),
  and the startup checks (launcher and worker) allow / refuse the right backend combinations;
- :class:`TreeVerifyBackend` hands every non-verify call to the wrapped backend untouched;
- a TARGET_VERIFY layer call through SGLang's real ``RadixAttention.forward`` into a real
  ``MHATokenToKVPool`` / ``MLATokenToKVPool`` writes the new K/V (latent rows) at
  ``out_cache_loc`` and returns the fp32 reference's output (``triton_kernels/reference.py``),
  eagerly and through the CUDA-graph metadata path (padded batch, snapshot of ``req_to_token``),
  for both MLA call conventions and with the rope the trtllm_mla path leaves to the backend.

Kernels run in Triton's interpreter (tests/conftest.py). Tolerance as
tests/triton_kernels/test_tree_attention.py: max |out - ref| / max |ref| < 1e-2 for bf16.
Unused cache slots hold NaN, so a read outside a request's keys fails.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import types

import pytest
import torch

sglang = pytest.importorskip("sglang")

from sglang_ddtree import compat  # noqa: E402
from sglang_ddtree import config as cfg  # noqa: E402
from sglang_ddtree import draft_attention, hooks, spec_algo, verify_backend  # noqa: E402
from tests.triton_kernels import load_kernels  # noqa: E402

K = load_kernels(interpret=True)
REF = K.reference
KERNELS = (K.tree_attention.TreeAttention, K.tree_attention_mla.TreeAttentionMLA)
TOL = 1e-2  # bf16 output rounding (the interpreter's dots run in fp32)


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
    from sglang_ddtree import mla_split

    mla_split.uninstall()  # an MLA wrapper's install patched SGLang's model class


@pytest.fixture(scope="module")
def loaded():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang_ddtree import plugin

    assert plugin.registration_error() is None
    return plugin


def rel_err(out, ref):
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


# --- the flag -----------------------------------------------------------------------------

def test_flag_parses_and_is_exported(loaded, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    base = ["--model-path", "m", "--speculative-algorithm", "DDTREE"]
    ns = parser.parse_args(base + ["--speculative-ddtree-verify-backend", "triton"])
    assert ns.speculative_ddtree_verify_backend == "triton"
    assert parser.parse_args(base).speculative_ddtree_verify_backend is None
    with pytest.raises(SystemExit), contextlib.redirect_stderr(open(os.devnull, "w")):
        parser.parse_args(base + ["--speculative-ddtree-verify-backend", "flashinfer"])
    assert "--speculative-ddtree-verify-backend" in parser.format_help()

    env = {}
    hooks.export_cli_args(ns, environ=env)
    assert env == {cfg.ENV_VERIFY_BACKEND: "triton"}
    assert cfg.read_verify_backend(env) == "triton"
    assert cfg.read_verify_backend({}) == cfg.DEFAULT_VERIFY_BACKEND == "auto"
    with pytest.raises(cfg.DDTreeConfigError, match="speculative-ddtree-verify-backend"):
        cfg.read_verify_backend({cfg.ENV_VERIFY_BACKEND: "fa3"})

    # sglang.Engine(speculative_ddtree_verify_backend=...): taken out before ServerArgs sees it
    assert "speculative_ddtree_verify_backend" in hooks.ENGINE_KWARGS
    # the hook writes os.environ: registering the variable makes monkeypatch restore it
    monkeypatch.setenv(cfg.ENV_VERIFY_BACKEND, "")
    seen = {}

    def original(self, *args, **kwargs):
        seen.update(kwargs)

    hooks.server_args_init_hook(original, object(), model_path="m",
                                speculative_ddtree_verify_backend="triton")
    assert seen == {"model_path": "m"}
    assert os.environ[cfg.ENV_VERIFY_BACKEND] == "triton"


def _server_args(backend, decode=None):
    return types.SimpleNamespace(speculative_draft_model_path="d", pp_size=1,
                                 attention_backend=backend, decode_attention_backend=decode)


@pytest.mark.parametrize("backend", ["trtllm_mla", "flashmla", "cutlass_mla", "fa3"])
def test_launcher_allows_non_tree_backends_only_with_triton_verify(backend, monkeypatch):
    monkeypatch.setenv(cfg.ENV_VERIFY_BACKEND, "native")
    with pytest.raises(cfg.DDTreeConfigError,
                       match="add --speculative-ddtree-verify-backend triton"):
        spec_algo.check_server_args(_server_args(backend))
    monkeypatch.setenv(cfg.ENV_VERIFY_BACKEND, "triton")
    spec_algo.check_server_args(_server_args(backend))  # allowed
    spec_algo.check_server_args(_server_args("triton", decode=backend))
    monkeypatch.delenv(cfg.ENV_VERIFY_BACKEND)  # auto, the default: ours behind it
    spec_algo.check_server_args(_server_args(backend))


def test_launcher_refusals_name_the_flag(monkeypatch):
    monkeypatch.setenv(cfg.ENV_VERIFY_BACKEND, "triton")
    with pytest.raises(cfg.DDTreeConfigError,
                       match="speculative-ddtree-verify-backend triton.*torch_native"):
        spec_algo.check_server_args(_server_args("torch_native"))
    monkeypatch.setenv(cfg.ENV_VERIFY_BACKEND, "native")
    for ok in ("triton", "flashinfer"):
        spec_algo.check_server_args(_server_args(ok))
    with pytest.raises(cfg.DDTreeConfigError) as info:
        spec_algo.check_server_args(_server_args("torch_native"))
    assert "verify-backend" not in str(info.value)  # no false hint: triton verify refuses it too


# --- the worker's check and install ---------------------------------------------------------

def _attn_backend(class_name):
    return type(class_name, (), {})()


def _bare_worker(worker_class, arch, backend_class, draft_backend="FlashInferAttnBackend"):
    """A DDTreeWorker instance with just what init_attention_backends reads (no constructor).
    The drafter's backend defaults to one SGLANG_DDTREE_DRAFT_ATTENTION=auto leaves alone."""
    from sglang.srt.configs.model_config import AttentionArch

    w = object.__new__(worker_class)
    mc = types.SimpleNamespace(attention_arch=AttentionArch.MLA if arch == "mla"
                               else AttentionArch.MHA)
    w.model_runner = types.SimpleNamespace(model_config=mc, kv_index_translator=None,
                                           attn_backend=_attn_backend(backend_class))
    w.draft_model_runner = types.SimpleNamespace(kv_index_translator=None,
                                                 attn_backend=_attn_backend(draft_backend))
    w.tree_cfg = cfg.DDTreeConfig(budget=7, topk=4, block_size=8)
    w.block_size = 8
    return w


@pytest.fixture
def worker_class(loaded, monkeypatch):
    from sglang_ddtree import worker

    sgl = compat.load()
    monkeypatch.setattr(sgl.DFlashWorkerV2, "init_attention_backends", lambda self: None)
    return worker.get_worker_class()


@pytest.mark.parametrize("arch,backend_class,name", [
    ("mla", "TRTLLMMLABackend", "trtllm_mla"),
    ("mla", "FlashInferMLAAttnBackend", "flashinfer_mla"),
    ("mla", "FlashMLABackend", "flashmla"),
    ("mha", "FlashAttentionBackend", "fa3"),
])
def test_worker_installs_triton_verify_behind_non_tree_backends(worker_class, monkeypatch, arch,
                                                                 backend_class, name):
    installed = []
    monkeypatch.setattr(verify_backend, "install",
                        lambda mr, n, sgl: installed.append((mr, n)) or "wrapper")
    monkeypatch.setenv(cfg.ENV_VERIFY_BACKEND, "native")
    w = _bare_worker(worker_class, arch, backend_class)
    with pytest.raises(cfg.DDTreeConfigError,
                       match=f"'{name}'.*add --speculative-ddtree-verify-backend triton"):
        w.init_attention_backends()
    assert installed == []
    monkeypatch.setenv(cfg.ENV_VERIFY_BACKEND, "triton")
    w.init_attention_backends()
    assert installed == [(w.model_runner, 8)] and w._tree_verify == "wrapper"
    # auto (the default) picks ours behind a backend that cannot express a tree...
    monkeypatch.delenv(cfg.ENV_VERIFY_BACKEND)
    w = _bare_worker(worker_class, arch, backend_class)
    w.init_attention_backends()
    assert len(installed) == 2 and w._tree_verify == "wrapper"
    # ...and with --speculative-ddtree-budget auto too: the widest tree's backend is wrapped
    # here, each smaller width's when its verify state is built (test_compat_worker)
    w = _bare_worker(worker_class, arch, backend_class)
    w.tree_cfg = cfg.DDTreeConfig(budget=7, topk=4, block_size=8, auto_table=((1, 7), (99, 3)))
    w.init_attention_backends()
    assert installed[-1] == (w.model_runner, 8) and w._tree_verify == "wrapper"


@pytest.mark.parametrize("arch", ["mla", "mha"])
def test_worker_refuses_a_bad_mla_split_value_on_any_target(worker_class, monkeypatch, arch):
    monkeypatch.setattr(verify_backend, "install", lambda *a: pytest.fail("installed"))
    monkeypatch.setenv(cfg.ENV_MLA_SPLIT, "yes")
    w = _bare_worker(worker_class, arch, "TritonAttnBackend")
    with pytest.raises(cfg.DDTreeConfigError, match="SGLANG_DDTREE_MLA_SPLIT: expected 0 or 1"):
        w.init_attention_backends()


def test_resolve_verify_backend_table():
    native, ours = ("triton", "flashinfer"), ("triton", "flashinfer", "fa3")
    assert cfg.resolve_verify_backend("native", "fa3", native, ours) == "native"
    assert cfg.resolve_verify_backend("triton", "triton", native, ours) == "triton"
    assert cfg.resolve_verify_backend("auto", "triton", native, ours) == "native"
    assert cfg.resolve_verify_backend("auto", "fa3", native, ours) == "triton"
    assert cfg.resolve_verify_backend("auto", "torch_native", native, ours) == "native"
    assert cfg.resolve_verify_backend("auto", "triton", native, ours, ("triton",)) == "triton"
    # a preference never picks ours where it cannot sit
    assert cfg.resolve_verify_backend("auto", "x", ("x",), ours, ("x",)) == "native"
    assert cfg.AUTO_PREFERS_TRITON_VERIFY["mla"] == ("triton",)
    assert cfg.AUTO_PREFERS_TRITON_VERIFY["mha"] == ()


def test_worker_refuses_unsupported_backend_naming_the_flag(worker_class, monkeypatch):
    monkeypatch.setattr(verify_backend, "install", lambda *a: pytest.fail("installed"))
    monkeypatch.setenv(cfg.ENV_VERIFY_BACKEND, "triton")
    w = _bare_worker(worker_class, "mha", "TorchNativeAttnBackend")
    with pytest.raises(cfg.DDTreeConfigError,
                       match="--speculative-ddtree-verify-backend triton.*TorchNativeAttnBackend"):
        w.init_attention_backends()
    # native verifies with tree-capable target backends themselves: nothing wrapped; so does
    # auto for MHA ...
    for requested in ("native", "auto"):
        monkeypatch.setenv(cfg.ENV_VERIFY_BACKEND, requested)
        for arch, cls in (("mha", "TritonAttnBackend"), ("mha", "FlashInferAttnBackend"),
                          ("mla", "TritonAttnBackend")):
            if requested == "auto" and arch == "mla":
                continue
            w = _bare_worker(worker_class, arch, cls)
            w.init_attention_backends()
            assert w._tree_verify is None
    # ... but auto prefers our kernels behind SGLang's triton MLA backend (measured faster)
    installed = []
    monkeypatch.setattr(verify_backend, "install",
                        lambda mr, n, sgl: installed.append(n) or "wrapper")
    w = _bare_worker(worker_class, "mla", "TritonAttnBackend")
    w.init_attention_backends()
    assert installed and w._tree_verify == "wrapper"
    # auto behind a backend neither path can serve: the native refusal, naming what works
    monkeypatch.setenv(cfg.ENV_VERIFY_BACKEND, "auto")
    w = _bare_worker(worker_class, "mha", "TorchNativeAttnBackend")
    with pytest.raises(cfg.DDTreeConfigError, match="Use --attention-backend triton or "
                                                    "flashinfer"):
        w.init_attention_backends()


# --- fixtures for the wrapper ---------------------------------------------------------------

class RecordingBackend:
    """A stand-in for the user's backend: records calls, returns a per-call sentinel."""

    def __init__(self):
        self.calls = []
        self.forward_metadata = "inner-meta"
        self.decode_attention_backend_str = "trtllm_mla"

    def _rec(self, name, *args, **kwargs):
        self.calls.append((name, args, kwargs))
        return (name, len(self.calls))

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **k: self._rec(name, *a, **k)


def _mode(name):
    return compat.load().ForwardMode[name]


def _runner(pool, req_to_token, layers, attn_backend, mla=False):
    from sglang.srt.configs.model_config import AttentionArch

    model = torch.nn.ModuleList(layers)
    mc = types.SimpleNamespace(attention_arch=AttentionArch.MLA if mla else AttentionArch.MHA)
    return types.SimpleNamespace(
        token_to_kv_pool=pool, model=model, model_config=mc, device="cpu",
        attn_backend=attn_backend,
        req_to_token_pool=types.SimpleNamespace(size=req_to_token.shape[0],
                                                req_to_token=req_to_token))


@pytest.fixture
def sgl():
    """The compat module, with SGLang's parallel context saying "no DCP" (0.5.23 publishes
    nothing outside a server; 0.5.17 defaults to it)."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    # (0.5.23's MLA pool reads the DCP width where it writes split latent parts)
    scope = (parallel.override(dcp_enabled=False, attn_dcp_size=1, attn_dcp_rank=0)
             if hasattr(parallel, "override") else contextlib.nullcontext())
    with scope:
        s = compat.load()
        assert s.dcp_enabled() is False
        yield s


def _mha_setup(seed=0, seq_lens=(7, 23), n=4, hq=4, hkv=2, d=16, page=2):
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    g = torch.Generator().manual_seed(seed)
    layout = REF.random_paged_layout(list(seq_lens), n, page, g, max_ctx=600)
    mask = REF.random_tree_mask(len(seq_lens), n, g)
    layer = RadixAttention(hq, d, 0.3, hkv, layer_id=1)
    pool = MHATokenToKVPool(size=layout.num_slots, page_size=page, dtype=torch.bfloat16,
                            head_num=hkv, head_dim=d, layer_num=2, device="cpu",
                            enable_memory_saver=False)
    used = _used_slots(pool.get_key_buffer(1).shape[0], layout)
    for buf in (pool.get_key_buffer(1), pool.get_value_buffer(1)):
        buf.copy_(torch.randn(buf.shape, generator=g))
        buf[~used] = float("nan")
        buf[0] = 0.5  # slot 0: SGLang's padding sink, finite
    return g, layout, mask, layer, pool


def _used_slots(num_slots, layout):
    """Slots holding some request's prefix (the tree slots are written by the forward)."""
    used = torch.zeros(num_slots, dtype=torch.bool)
    for b in range(layout.seq_lens.numel()):
        row = layout.req_to_token[layout.req_pool_indices[b], : int(layout.seq_lens[b])]
        used[row.long()] = True
    return used


def _verify_batch(layout, mask, n, spec=True):
    sgl = compat.load()
    bs = layout.seq_lens.numel()
    spec_info = None
    if spec:
        spec_info = types.SimpleNamespace(draft_token=torch.zeros(bs * n, dtype=torch.long))
        verify_backend.attach_tree_mask(spec_info, mask)
    return sgl.ForwardBatch(
        forward_mode=_mode("TARGET_VERIFY"), batch_size=bs,
        input_ids=torch.zeros(bs * n, dtype=torch.long),
        req_pool_indices=layout.req_pool_indices, seq_lens=layout.seq_lens,
        out_cache_loc=layout.out_cache_loc, seq_lens_sum=int(layout.seq_lens.sum()),
        positions=(layout.seq_lens[:, None] + torch.arange(n)).reshape(-1),
        spec_info=spec_info)


@contextlib.contextmanager
def _attn_context(backend):
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    with forward_context(ForwardContext(attn_backend=backend)):
        yield


# --- delegation --------------------------------------------------------------------------------

def test_non_verify_calls_go_to_the_wrapped_backend_untouched(sgl, monkeypatch):
    from sglang.srt.layers.radix_attention import RadixAttention

    inner = RecordingBackend()
    layer = RadixAttention(2, 16, 0.25, 1, layer_id=0)
    pool = types.SimpleNamespace()
    req_to_token = torch.zeros(3, 32, dtype=torch.int32)
    mr = _runner(pool, req_to_token, [layer], inner)
    monkeypatch.setattr(verify_backend, "blockers", lambda *a: [])  # stand-in pool
    w = verify_backend.install(mr, 3, sgl, kernels=KERNELS)
    assert mr.attn_backend is w and w.wrapped_backend is inner
    q, k, v = (torch.randn(4, 2, 16) for _ in range(3))
    for mode in ("DECODE", "EXTEND", "DRAFT_EXTEND_V2", "IDLE"):
        fb = types.SimpleNamespace(forward_mode=_mode(mode))
        inner.calls.clear()
        results = [
            w.init_forward_metadata(fb),
            w.init_forward_metadata_out_graph(fb, in_capture=True),
            w.init_forward_metadata_in_graph(fb),
            w.forward(q, k, v, layer, fb, False, sinks="s"),
            w.forward_extend(q, k, v, layer, fb, True),
            w.forward_decode(q, k, v, layer, fb),
        ]
        names = ["init_forward_metadata", "init_forward_metadata_out_graph",
                 "init_forward_metadata_in_graph", "forward", "forward_extend", "forward_decode"]
        assert [c[0] for c in inner.calls] == names
        assert results == [(name, i + 1) for i, name in enumerate(names)]  # returned as is
        assert inner.calls[1][2] == {"in_capture": True}
        assert inner.calls[3][1] == (q, k, v, layer, fb, False) and inner.calls[3][2] == {
            "sinks": "s"}
    # attributes read and written through to the wrapped backend
    assert w.decode_attention_backend_str == "trtllm_mla"
    assert w.forward_metadata == "inner-meta"
    w.forward_metadata = None
    assert inner.forward_metadata is None and "forward_metadata" not in vars(w)
    assert w.get_cuda_graph_seq_len_fill_value() == ("get_cuda_graph_seq_len_fill_value",
                                                     len(inner.calls))
    inner.calls.clear()
    w.init_cuda_graph_state(4, 12, kv_indices_buf="buf")
    assert inner.calls == [("init_cuda_graph_state", (4, 12), {"kv_indices_buf": "buf"})]
    assert w.supports_ragged_verify_graph is False
    fb = types.SimpleNamespace(forward_mode=_mode("DECODE"))
    assert w.get_fused_kv_write_buffers(layer, fb)[0] == "get_fused_kv_write_buffers"
    n_calls = len(inner.calls)
    assert w.get_fused_kv_write_buffers(
        layer, types.SimpleNamespace(forward_mode=_mode("TARGET_VERIFY"))) is None
    assert len(inner.calls) == n_calls
    assert w.glue_target_verify_metadata()  # non-empty: never glue-captured (0.5.23)


# --- MHA through SGLang's RadixAttention --------------------------------------------------------

def _expected_mha(layout, mask, layer, k_cache, v_cache, q):
    return REF.tree_attention_reference(q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
                                        k_cache, v_cache, layout.out_cache_loc, mask,
                                        sm_scale=layer.scaling, **layout.table_kwargs())


def _step_qkv(g, pool, layout, tokens, hq, hkv, d):
    """Random q / k / v of a verify step and layer 1's caches as they must look after it
    wrote k / v at ``out_cache_loc``."""
    q = torch.randn(tokens, hq * d, generator=g).bfloat16()
    k = torch.randn(tokens, hkv * d, generator=g).bfloat16()
    v = torch.randn(tokens, hkv * d, generator=g).bfloat16()
    want_k, want_v = pool.get_key_buffer(1).clone(), pool.get_value_buffer(1).clone()
    want_k[layout.out_cache_loc] = k.view(-1, hkv, d)
    want_v[layout.out_cache_loc] = v.view(-1, hkv, d)
    return q, k, v, want_k, want_v


def test_mha_verify_eager_writes_kv_and_matches_reference(sgl):
    n, hq, hkv, d = 4, 4, 2, 16
    g, layout, mask, layer, pool = _mha_setup(n=n, hq=hq, hkv=hkv, d=d)
    inner = RecordingBackend()
    mr = _runner(pool, layout.req_to_token, [layer], inner)
    w = verify_backend.install(mr, n, sgl, kernels=KERNELS)
    tokens = layout.out_cache_loc.numel()
    q, k, v, want_k, want_v = _step_qkv(g, pool, layout, tokens, hq, hkv, d)

    fb = _verify_batch(layout, mask, n)
    w.init_forward_metadata(fb)
    with _attn_context(w):
        out = layer(q, k, v, fb)  # SGLang's RadixAttention.forward -> get_attn_backend()
    assert inner.calls == []  # the user's backend saw nothing of the verify
    assert out.shape == q.shape and out.dtype == q.dtype
    # exactly the new K/V at out_cache_loc, nothing else touched (NaN slots stay NaN)
    torch.testing.assert_close(pool.get_key_buffer(1), want_k, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(pool.get_value_buffer(1), want_v, equal_nan=True, rtol=0, atol=0)
    ref = _expected_mha(layout, mask, layer, want_k, want_v, q)
    assert not out.isnan().any()
    assert rel_err(out.view(ref.shape), ref) < TOL

    # save_kv_cache=False (the model wrote KV itself): cache untouched, same output
    before = pool.get_key_buffer(1).clone()
    with _attn_context(w):
        again = layer(q, k * 3, v * 3, fb, save_kv_cache=False)
    torch.testing.assert_close(pool.get_key_buffer(1), before, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(again, out)


def test_mha_verify_graph_path_padded_batch_reads_its_snapshot(sgl):
    """Capture-style prep: static buffers, the batch padded by one request (seq len 1, zero
    out_cache_loc, no mask rows), and req_to_token rewritten after the prep (what the scheduler
    may do once the read-done event fired) must not change the result."""
    n, hq, hkv, d = 3, 2, 1, 16
    g, layout, mask, layer, pool = _mha_setup(seed=3, seq_lens=(31, 1), n=n, hq=hq, hkv=hkv, d=d,
                                              page=4)
    inner = RecordingBackend()
    mr = _runner(pool, layout.req_to_token, [layer], inner)
    w = verify_backend.install(mr, n, sgl, kernels=KERNELS)
    bs, pad_bs = 2, 3
    w.init_cuda_graph_state(pad_bs + 1, (pad_bs + 1) * n)
    assert inner.calls[-1][0] == "init_cuda_graph_state"
    tokens = pad_bs * n
    q = torch.randn(tokens, hq * d, generator=g).bfloat16()
    k = torch.randn(tokens, hkv * d, generator=g).bfloat16()
    v = torch.randn(tokens, hkv * d, generator=g).bfloat16()
    loc = torch.cat([layout.out_cache_loc, torch.zeros(n, dtype=torch.int64)])  # pad -> slot 0
    fb_view = types.SimpleNamespace(
        forward_mode=_mode("TARGET_VERIFY"), batch_size=pad_bs,
        req_pool_indices=torch.cat([layout.req_pool_indices, torch.zeros(1, dtype=torch.int64)]),
        seq_lens=torch.cat([layout.seq_lens, torch.ones(1, dtype=torch.int64)]),
        out_cache_loc=loc, positions=torch.zeros(tokens, dtype=torch.int64),
        out_cache_loc_is_physical=False,
        spec_info=types.SimpleNamespace(draft_token=torch.zeros(bs * n)))
    verify_backend.attach_tree_mask(fb_view.spec_info, mask)
    w.init_forward_metadata_out_graph(fb_view)
    want_k, want_v = pool.get_key_buffer(1).clone(), pool.get_value_buffer(1).clone()
    want_k[layout.out_cache_loc] = k[: bs * n].view(-1, hkv, d)
    want_v[layout.out_cache_loc] = v[: bs * n].view(-1, hkv, d)
    ref = _expected_mha(layout, mask, layer, want_k, want_v, q[: bs * n])
    layout.req_to_token.fill_(0)  # after the snapshot: the kernels must not see this
    with _attn_context(w):
        out = layer(q, k, v, fb_view)
    assert inner.calls[-1][0] == "init_cuda_graph_state"  # nothing else reached the inner
    assert rel_err(out[: bs * n].view(ref.shape), ref) < TOL
    assert torch.isfinite(out[bs * n:].float()).all()
    torch.testing.assert_close(pool.get_key_buffer(1)[layout.out_cache_loc],
                               want_k[layout.out_cache_loc], rtol=0, atol=0)
    # a capture-time dummy verify input (no draft tokens, no mask) gives an all-false tree
    for dummy in (None, torch.zeros(0)):  # capture-time / idle verify inputs carry no tree
        fb_view.spec_info = types.SimpleNamespace(draft_token=dummy)
        w.init_forward_metadata_out_graph(fb_view, in_capture=True)
        assert not w._meta.mask.any() and w._meta.mask.shape == (pad_bs, n, n)


def test_verify_refusals(sgl):
    n = 3
    g, layout, mask, layer, pool = _mha_setup(n=n)
    w = verify_backend.install(_runner(pool, layout.req_to_token, [layer], RecordingBackend()),
                               n, sgl, kernels=KERNELS)
    fb = _verify_batch(layout, mask, n)
    fb.spec_info = types.SimpleNamespace(draft_token=torch.zeros(1))  # real input, mask missing
    with pytest.raises(RuntimeError, match="attach_tree_mask"):
        w.init_forward_metadata(fb)
    fb = _verify_batch(layout, mask[:1], n)
    with pytest.raises(ValueError, match="tree mask shape"):
        w.init_forward_metadata(fb)
    fb = _verify_batch(layout, mask, n)
    w.init_forward_metadata(fb)
    q = torch.zeros(layout.out_cache_loc.numel(), 4, 16).bfloat16()
    with pytest.raises(NotImplementedError, match="sinks.*verify-backend native"):
        w.forward(q, None, None, layer, fb, sinks=torch.zeros(4))
    with pytest.raises(RuntimeError, match="query tokens"):
        w.forward(q[:-1], None, None, layer, fb)


def test_install_refusals(sgl, monkeypatch):
    from sglang.srt.layers.radix_attention import RadixAttention

    n = 3
    _, layout, _, layer, pool = _mha_setup(n=n)

    def refusal(runner):
        with pytest.raises(cfg.DDTreeConfigError,
                           match="verify-backend triton cannot serve") as info:
            verify_backend.install(runner, n, sgl, kernels=KERNELS)
        return str(info.value)

    swa = type("SWAKVPool", (), {})()
    assert "KV pool SWAKVPool" in refusal(_runner(swa, layout.req_to_token, [layer],
                                                  RecordingBackend()))
    windowed = RadixAttention(4, 16, 0.3, 2, layer_id=1, sliding_window_size=64)
    assert "sliding window" in refusal(_runner(pool, layout.req_to_token, [windowed],
                                               RecordingBackend()))
    tbo = _runner(pool, layout.req_to_token, [layer], _attn_backend("TboAttnBackend"))
    assert "two-batch overlap" in refusal(tbo)
    monkeypatch.setattr(sgl, "dcp_enabled", lambda: True)
    assert "context parallel" in refusal(_runner(pool, layout.req_to_token, [layer],
                                                 RecordingBackend()))


@pytest.mark.parametrize("cap,dtype,refused", [((8, 0), torch.float8_e4m3fn, True),
                                               ((8, 6), torch.float8_e4m3fn, True),
                                               ((8, 9), torch.float8_e4m3fn, False),
                                               ((8, 0), torch.float8_e5m2, False),
                                               ((8, 0), torch.bfloat16, False)])
def test_fp8_e4m3_kv_cache_before_sm89_is_refused(sgl, monkeypatch, cap, dtype, refused):
    """Triton compiles e4m3 loads from sm_89 on (on sm_80 / sm_86 it offers e5m2 and
    e4b15 only), so an e4m3 KV cache there is refused at install, naming the fix, instead of
    the kernel's compile failing at the first verify launch."""
    _, layout, _, layer, pool = _mha_setup(n=3)
    pool = type("MHATokenToKVPool", (), {"dtype": dtype})()
    runner = _runner(pool, layout.req_to_token, [layer], RecordingBackend())
    runner.device = "cuda:0"
    monkeypatch.setattr(verify_backend, "_capability", lambda device: cap)
    problems = verify_backend.blockers(runner, sgl, False)
    assert bool(problems) == refused, problems
    if refused:
        assert "fp8 e4m3 KV cache on compute capability" in problems[0]
        assert "fp8_e5m2" in problems[0]


# --- the drafter's block attention (SGLANG_DDTREE_DRAFT_ATTENTION) ---------------------------

def _draft_layers(kinds, hq=4, hkv=1, d=16, **kw):
    from sglang.srt.layers.radix_attention import AttentionType, RadixAttention

    return [RadixAttention(hq, d, 0.3, hkv, layer_id=i, attn_type=AttentionType[kind], **kw)
            for i, kind in enumerate(kinds)]


def test_draft_attention_env_parses():
    assert cfg.read_draft_attention({}) == "auto"
    assert cfg.read_draft_attention({cfg.ENV_DRAFT_ATTENTION: "native"}) == "native"
    assert cfg.read_draft_attention({cfg.ENV_DRAFT_ATTENTION: " Triton "}) == "triton"
    with pytest.raises(cfg.DDTreeConfigError, match=cfg.ENV_DRAFT_ATTENTION):
        cfg.read_draft_attention({cfg.ENV_DRAFT_ATTENTION: "fa3"})


def test_draft_block_mask_follows_the_layers():
    mask, problems = draft_attention.draft_block_mask(_draft_layers(["ENCODER_ONLY"] * 2), 4)
    assert problems == [] and mask.dtype == torch.bool and mask.all()
    mask, problems = draft_attention.draft_block_mask(_draft_layers(["DECODER"] * 2), 4)
    assert problems == [] and torch.equal(mask, torch.ones(4, 4, dtype=torch.bool).tril())
    _, problems = draft_attention.draft_block_mask(_draft_layers(["ENCODER_ONLY", "DECODER"]), 4)
    assert problems == ["layers of different attention types ['decoder', 'encoder_only']"]
    _, problems = draft_attention.draft_block_mask(
        _draft_layers(["DECODER"], sliding_window_size=64), 4)
    assert problems == ["layer 0: sliding window 64"]
    _, problems = draft_attention.draft_block_mask(_draft_layers(["DECODER_BIDIRECTIONAL"]), 4)
    assert problems == ["layer 0: attention type decoder_bidirectional"]


@pytest.mark.parametrize("kind,n", [("ENCODER_ONLY", 5), ("DECODER", 5), ("ENCODER_ONLY", 21)])
def test_drafter_block_attention_eager_and_graph_match_reference(sgl, kind, n):
    """A drafter layer (GQA 4:1) in TARGET_VERIFY through the wrapper install_draft puts on the
    draft runner: eager and graph-style prep both give the reference with the block mask for
    every request (padded graph rows included, finite), whatever tree the spec info carries.
    A block wider than the kernel's key tile (21 > 16 keys here) needs every row block to read
    keys past its own tokens (session 24's doctor found block 128 wrong on the H200)."""
    hq, hkv, d = 4, 1, 16
    g, layout, _, _, pool = _mha_setup(seed=5, seq_lens=(9, 40), n=n, hq=hq, hkv=hkv, d=d,
                                       page=4)
    layer = _draft_layers([kind, kind], hq=hq, hkv=hkv, d=d)[1]
    inner = RecordingBackend()
    mr = _runner(pool, layout.req_to_token, [layer], inner)
    w = draft_attention.install_draft(mr, n, sgl, kernels=KERNELS)
    assert mr.attn_backend is w and w.wrapped_backend is inner
    block = torch.ones(n, n, dtype=torch.bool)
    block = block if kind == "ENCODER_ONLY" else block.tril()
    bs = layout.seq_lens.numel()
    mask = block.expand(bs, n, n)
    tokens = bs * n
    q, k, v, want_k, want_v = _step_qkv(g, pool, layout, tokens, hq, hkv, d)
    ref = _expected_mha(layout, mask, layer, want_k, want_v, q)

    # eager: DFLASH's block spec info (empty draft tokens, no tree attached)
    fb = _verify_batch(layout, None, n, spec=False)
    fb.spec_info = types.SimpleNamespace(draft_token=torch.empty(0, dtype=torch.long))
    w.init_forward_metadata(fb)
    with _attn_context(w):
        out = layer(q, k, v, fb)
    assert inner.calls == []
    assert rel_err(out.view(ref.shape), ref) < TOL
    torch.testing.assert_close(pool.get_key_buffer(1), want_k, equal_nan=True, rtol=0, atol=0)

    # graph-style: static buffers, one padded request, a capture-time spec info
    pad_bs = bs + 1
    w.init_cuda_graph_state(pad_bs, pad_bs * n)
    assert w._graph["mask"].bool().equal(block.expand(pad_bs, n, n))
    qp = torch.cat([q, torch.randn(n, hq * d, generator=g).bfloat16()])
    kp = torch.cat([k, torch.zeros(n, hkv * d).bfloat16()])
    vp = torch.cat([v, torch.zeros(n, hkv * d).bfloat16()])
    fb_view = types.SimpleNamespace(
        forward_mode=_mode("TARGET_VERIFY"), batch_size=pad_bs,
        req_pool_indices=torch.cat([layout.req_pool_indices, torch.zeros(1, dtype=torch.int64)]),
        seq_lens=torch.cat([layout.seq_lens, torch.ones(1, dtype=torch.int64)]),
        out_cache_loc=torch.cat([layout.out_cache_loc, torch.zeros(n, dtype=torch.int64)]),
        positions=torch.zeros(pad_bs * n, dtype=torch.int64), out_cache_loc_is_physical=False,
        spec_info=types.SimpleNamespace(draft_token=None))
    w.init_forward_metadata_out_graph(fb_view, in_capture=True)
    assert w._meta.mask.bool().equal(block.expand(pad_bs, n, n))  # no tree needed, not zeroed
    with _attn_context(w):
        out2 = layer(qp, kp, vp, fb_view)
    assert rel_err(out2[:tokens].view(ref.shape), ref) < TOL
    assert torch.isfinite(out2[tokens:].float()).all()
    assert [c[0] for c in inner.calls] == ["init_cuda_graph_state"]


def test_install_draft_refusals_name_the_variable(sgl):
    n = 4
    _, layout, _, _, pool = _mha_setup(n=n)

    def refusal(runner):
        with pytest.raises(cfg.DDTreeConfigError,
                           match=f"{cfg.ENV_DRAFT_ATTENTION}=triton cannot run this drafter"
                           ) as info:
            draft_attention.install_draft(runner, n, sgl, kernels=KERNELS)
        assert "Set it to native" in str(info.value)
        return str(info.value)

    mixed = _draft_layers(["ENCODER_ONLY", "DECODER"], hq=4, hkv=2)
    assert "different attention types" in refusal(
        _runner(pool, layout.req_to_token, mixed, RecordingBackend()))
    assert "MLA drafter" in refusal(_runner(pool, layout.req_to_token, mixed[:1],
                                            RecordingBackend(), mla=True))
    swa = type("SWAKVPool", (), {})()
    assert "KV pool SWAKVPool" in refusal(_runner(swa, layout.req_to_token, mixed[:1],
                                                  RecordingBackend()))


def test_worker_wraps_the_drafter_only_when_asked(worker_class, monkeypatch):
    installed = []
    monkeypatch.setattr(draft_attention, "install_draft",
                        lambda mr, block, sgl, kernels=None: installed.append((mr, block))
                        or "draft-wrapper")
    monkeypatch.setattr(verify_backend, "install", lambda mr, n, sgl: "wrapper")
    w = _bare_worker(worker_class, "mla", "FlashMLABackend")  # drafter on flashinfer
    w.block_size = 8
    w.init_attention_backends()  # auto: not on a flashinfer drafter
    assert installed == [] and w._draft_attention is None
    monkeypatch.setenv(cfg.ENV_DRAFT_ATTENTION, "triton")
    w.init_attention_backends()
    assert installed == [(w.draft_model_runner, 8)] and w._draft_attention == "draft-wrapper"
    monkeypatch.setenv(cfg.ENV_DRAFT_ATTENTION, "bogus")
    with pytest.raises(cfg.DDTreeConfigError, match=cfg.ENV_DRAFT_ATTENTION):
        w.init_attention_backends()
    installed.clear()
    monkeypatch.delenv(cfg.ENV_DRAFT_ATTENTION)
    w = _bare_worker(worker_class, "mla", "FlashMLABackend", draft_backend="TritonAttnBackend")
    w.block_size = 8
    w.init_attention_backends()  # auto: a triton drafter moves onto our kernel
    assert installed == [(w.draft_model_runner, 8)] and w._draft_attention == "draft-wrapper"
    monkeypatch.setenv(cfg.ENV_DRAFT_ATTENTION, "native")
    w.init_attention_backends()
    assert w._draft_attention is None and len(installed) == 1


def test_auto_keeps_a_drafter_our_kernel_cannot_run_and_triton_refuses_it(sgl, caplog):
    """auto: a triton drafter whose layers mix attention types stays on SGLang's backend (the
    log says why); triton: the same drafter fails start-up. A qualifying triton drafter is
    wrapped under auto; a flashinfer one only under triton."""
    g, layout, _, _, pool = _mha_setup(seed=2, seq_lens=(6,), n=4, hq=4, hkv=2, d=16, page=1)
    mixed = _draft_layers(["ENCODER_ONLY", "DECODER"], hq=4, hkv=2)
    inner = _attn_backend("TritonAttnBackend")
    mr = _runner(pool, layout.req_to_token, mixed, inner)
    with caplog.at_level("INFO", logger=draft_attention.__name__):
        assert draft_attention.choose_draft_attention("auto", mr, 4, sgl, KERNELS) is None
    assert mr.attn_backend is inner and "different attention types" in caplog.text
    with pytest.raises(cfg.DDTreeConfigError, match="different attention types"):
        draft_attention.choose_draft_attention("triton", mr, 4, sgl, KERNELS)
    assert draft_attention.choose_draft_attention("native", mr, 4, sgl, KERNELS) is None
    good = _draft_layers(["ENCODER_ONLY"] * 2, hq=4, hkv=2)
    mr = _runner(pool, layout.req_to_token, good, inner)
    w = draft_attention.choose_draft_attention("auto", mr, 4, sgl, KERNELS)
    assert mr.attn_backend is w and w.wrapped_backend is inner
    fi = _attn_backend("FlashInferAttnBackend")
    mr = _runner(pool, layout.req_to_token, good, fi)
    assert draft_attention.choose_draft_attention("auto", mr, 4, sgl, KERNELS) is None
    assert mr.attn_backend is fi
    w = draft_attention.choose_draft_attention("triton", mr, 4, sgl, KERNELS)
    assert mr.attn_backend is w and w.wrapped_backend is fi


def test_auto_keeps_a_drafter_whose_shape_the_kernel_plan_refuses(sgl, monkeypatch):
    """A shape the kernel's plan rejects (its ValueError) leaves an auto drafter on SGLang's
    backend; triton lets the error stop start-up."""
    def refuse(*args, **kwargs):
        raise ValueError("tree attention: rope_dim: expected 0 or a power of two >= 16, got 3")

    g, layout, _, _, pool = _mha_setup(seed=2, seq_lens=(6,), n=4, hq=4, hkv=2, d=16, page=1)
    inner = _attn_backend("TritonAttnBackend")
    mr = _runner(pool, layout.req_to_token, _draft_layers(["ENCODER_ONLY"], hq=4, hkv=2), inner)
    monkeypatch.setattr(draft_attention, "install_draft", refuse)
    assert draft_attention.choose_draft_attention("auto", mr, 4, sgl, KERNELS) is None
    assert mr.attn_backend is inner
    with pytest.raises(ValueError, match="rope_dim"):
        draft_attention.choose_draft_attention("triton", mr, 4, sgl, KERNELS)


# --- MLA ---------------------------------------------------------------------------------------

RANK, ROPE, HEADS = 32, 16, 3


def _mla_setup(seed, kv_dtype, seq_lens=(5, 19), n=4, page=1):
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    g = torch.Generator().manual_seed(seed)
    layout = REF.random_paged_layout(list(seq_lens), n, page, g, max_ctx=600)
    mask = REF.random_tree_mask(len(seq_lens), n, g)
    layer = RadixAttention(HEADS, RANK + ROPE, 0.17, 1, layer_id=0, v_head_dim=RANK)
    prefill_path = RadixAttention(HEADS, 24, 0.2, HEADS, layer_id=0, v_head_dim=16)  # attn_mha
    pool = MLATokenToKVPool(size=layout.num_slots, page_size=page, dtype=kv_dtype,
                            kv_lora_rank=RANK, qk_rope_head_dim=ROPE, layer_num=1,
                            device="cpu", enable_memory_saver=False)
    buf = pool.kv_buffer[0]  # raw storage (uint8 for fp8)
    rows = torch.randn(buf.shape, generator=g)
    rows[0] = 0.5  # slot 0: the padding sink, finite
    raw = rows.to(kv_dtype).view(buf.dtype)
    used = _used_slots(buf.shape[0], layout)
    used[0] = True
    if kv_dtype == torch.bfloat16:
        raw[~used] = float("nan")
    else:
        raw[~used] = 0x7F  # e4m3 NaN
    buf.copy_(raw)
    return g, layout, mask, layer, prefill_path, pool


def _mla_split_parts(g, tokens):
    """Random bf16 ``q_nope``, ``q_pe``, ``k_nope``, ``k_pe`` of a verify batch's tokens (the
    split MLA convention's four parts)."""
    return (torch.randn(tokens, HEADS, RANK, generator=g).bfloat16(),
            torch.randn(tokens, HEADS, ROPE, generator=g).bfloat16(),
            torch.randn(tokens, 1, RANK, generator=g).bfloat16(),
            torch.randn(tokens, 1, ROPE, generator=g).bfloat16())


@pytest.mark.parametrize("convention", ["concat", "split", "split_rope_in_backend"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_mla_verify_matches_reference(sgl, convention, kv_dtype):
    from sglang.srt.layers.rotary_embedding.utils import apply_rotary_emb

    n = 4
    g, layout, mask, layer, prefill_path, pool = _mla_setup(7, kv_dtype, n=n)
    inner = RecordingBackend()
    mr = _runner(pool, layout.req_to_token, [layer, prefill_path], inner, mla=True)
    w = verify_backend.install(mr, n, sgl, kernels=KERNELS)
    assert list(w._plans) == [verify_backend.layer_key(layer)]  # the MQA layer only
    tokens = layout.out_cache_loc.numel()
    fb = _verify_batch(layout, mask, n)
    q_nope, q_pe, k_nope, k_pe = _mla_split_parts(g, tokens)
    kwargs = {}
    q_pe_used, k_pe_used = q_pe, k_pe
    if convention == "split_rope_in_backend":  # trtllm_mla fp8: rope left to the backend
        pos = fb.positions
        theta = 1.0 / (10000 ** (torch.arange(0, ROPE, 2).float() / ROPE))
        freqs = torch.arange(64).float()[:, None] * theta[None, :]
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_pos, ROPE]
        kwargs = dict(cos_sin_cache=cos_sin, is_neox=False,
                      llama_4_scaling=torch.full((tokens, 1, 1), 1.25))
        cos, sin = cos_sin[pos].chunk(2, dim=-1)
        q_pe_used = apply_rotary_emb(q_pe.float(), cos, sin, False)
        k_pe_used = apply_rotary_emb(k_pe.float(), cos, sin, False)
    want_q = torch.cat([q_nope, q_pe_used.bfloat16()], dim=-1)
    if "llama_4_scaling" in kwargs:
        want_q = (want_q * 1.25).bfloat16()
    latent = torch.cat([k_nope, k_pe_used.bfloat16()], dim=-1)  # [T, 1, RANK + ROPE]
    raw = pool.kv_buffer[0].clone()  # index writes on the storage dtype (fp8 is uint8)
    raw[layout.out_cache_loc] = latent.to(kv_dtype).view(raw.dtype)
    want_cache = raw.view(kv_dtype)

    w.init_forward_metadata(fb)
    # what reaches the kernel and the pool: split parts stay split (no concat copies) unless
    # Llama-4 scaling takes the whole query row
    plan = w._plans[verify_backend.layer_key(layer)]
    runs, writes = [], []
    run = plan.run
    plan.run = lambda q, *a, **kw: runs.append((q.shape[-1], kw["q_pe"] is not None)) \
        or run(q, *a, **kw)
    for name in ("set_kv_buffer", "set_mla_kv_buffer"):
        method = getattr(pool, name)
        setattr(pool, name, functools.partial(
            lambda method, name, *a, **kw: writes.append(name) or method(*a, **kw),
            method, name))
    with _attn_context(w):
        if convention == "concat":  # triton / flashmla targets
            q = torch.cat([q_nope, q_pe], dim=-1)
            out = layer(q, torch.cat([k_nope, k_pe], dim=-1), k_nope, fb)
        else:  # fa3 / flashinfer / cutlass_mla / trtllm_mla targets
            out = layer(q_nope, k_nope, k_nope, fb, q_rope=q_pe, k_rope=k_pe, **kwargs)
    assert inner.calls == []
    if convention == "split":
        assert runs == [(RANK, True)] and writes == ["set_mla_kv_buffer"]
    else:
        assert runs == [(RANK + ROPE, False)]
        assert writes == ["set_kv_buffer" if convention == "concat" else "set_mla_kv_buffer"]
    got_cache = pool.get_key_buffer(0)
    torch.testing.assert_close(got_cache.float(), want_cache.float(), equal_nan=True, rtol=0,
                               atol=0)
    ref = REF.mla_tree_attention_reference(want_q, want_cache, layout.out_cache_loc, mask,
                                           kv_lora_rank=RANK, sm_scale=layer.scaling,
                                           **layout.table_kwargs())
    assert out.shape == (tokens, HEADS * RANK)
    assert not out.isnan().any()
    assert rel_err(out.view(ref.shape), ref) < TOL


@pytest.mark.parametrize("is_neox", [True, False])
def test_apply_rope_matches_sglang(is_neox):
    from sglang.srt.layers.rotary_embedding.utils import apply_rotary_emb

    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 16, generator=g)
    cos_sin = torch.randn(40, 16, generator=g)
    pos = torch.tensor([0, 7, 39, 3, 3])
    cos, sin = cos_sin[pos].chunk(2, dim=-1)
    torch.testing.assert_close(verify_backend.apply_rope(x, pos, cos_sin, is_neox),
                               apply_rotary_emb(x, cos, sin, is_neox), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="partial rotary"):
        verify_backend.apply_rope(x, pos, cos_sin[:, :8], is_neox)


# --- SGLANG_DDTREE_MLA_PREFIX=flashmla: the prefix on FlashMLA (a stand-in here) ---------------

def _fake_flashmla(clean_cache, pool_buffer, calls):
    """FlashMLA's two functions with its documented contract, in fp32 torch: metadata of any
    shape (the kernel alone reads it), and a non-causal decode over 64-token pages returning
    the normalised output and the natural-log LSE [b, h, s]. It attends over ``clean_cache``
    (the pool's rows before the test poisoned its prefix slots for our kernel) after checking
    that it was handed the pool's own buffer."""

    def get_metadata(seq_lens, rows_per_kv_head, kv_heads):
        calls.append(("metadata", seq_lens.clone(), rows_per_kv_head, kv_heads))
        return (torch.full((4, 8), 7, dtype=torch.int32),
                torch.arange(seq_lens.numel() + 1, dtype=torch.int32))

    def attend(q, k_cache, block_table, cache_seqlens, head_dim_v, sched, splits, *,
               softmax_scale, causal):
        calls.append(("attend", block_table.clone(), cache_seqlens.clone(), sched.clone(),
                      splits.clone()))
        assert not causal and k_cache.shape[1:3] == (64, 1)
        assert k_cache.data_ptr() == pool_buffer.data_ptr()
        b, s, h, d = q.shape
        pages = clean_cache.view(-1, 64, 1, d)
        out = torch.zeros(b, s, h, head_dim_v)
        lse = torch.full((b, h, s), float("-inf"))
        for i in range(b):
            length = int(cache_seqlens[i])
            kv = pages[block_table[i, :-(-length // 64)].long()].reshape(-1, d)[:length].float()
            sc = torch.einsum("shd,ld->hsl", q[i].float(), kv) * softmax_scale
            lse[i] = torch.logsumexp(sc, dim=-1)
            out[i] = torch.einsum("hsl,ld->shd", torch.softmax(sc, -1), kv[:, :head_dim_v])
        return out.to(q.dtype), lse

    return get_metadata, attend


def _mla_prefix_backend(sgl, monkeypatch, seed, seq_lens, n, setting="flashmla"):
    """The MLA target on 64-token pages behind our verify backend with the prefix on the
    FlashMLA stand-in; returns the case and the stand-in's call log."""
    monkeypatch.setenv("SGLANG_DDTREE_MLA_PREFIX", setting)
    g, layout, mask, layer, prefill_path, pool = _mla_setup(seed, torch.bfloat16,
                                                            seq_lens=seq_lens, n=n, page=64)
    clean = pool.kv_buffer[0].clone()
    # our kernel must not read a prefix row: NaN them in the pool (FlashMLA's stand-in reads
    # the clean copy)
    for b in range(len(seq_lens)):
        row = layout.req_to_token[layout.req_pool_indices[b], : int(layout.seq_lens[b])]
        pool.kv_buffer[0][row.long()] = float("nan")
    mr = _runner(pool, layout.req_to_token, [layer, prefill_path], RecordingBackend(), mla=True)
    mr.page_size = 64
    calls = []
    w = verify_backend.install(mr, n, sgl, kernels=KERNELS,
                               prefix_fns=_fake_flashmla(clean, pool.kv_buffer[0], calls))
    assert w._prefix is not None
    return g, layout, mask, layer, clean, w, calls


def _mla_tokens(g, tokens):
    q = torch.randn(tokens, HEADS, RANK + ROPE, generator=g).bfloat16()
    latent = torch.randn(tokens, 1, RANK + ROPE, generator=g).bfloat16()
    return q, latent


def test_mla_prefix_on_flashmla_eager_matches_reference(sgl, monkeypatch):
    n = 5
    g, layout, mask, layer, clean, w, calls = _mla_prefix_backend(sgl, monkeypatch, 11,
                                                                  (70, 130), n)
    fb = _verify_batch(layout, mask, n)
    q, latent = _mla_tokens(g, layout.out_cache_loc.numel())
    w.init_forward_metadata(fb)
    assert calls[0][0] == "metadata" and calls[0][2:] == (n * HEADS, 1)
    with _attn_context(w):
        out = layer(q, latent, latent[..., :RANK], fb)
    kind, block_table, lens, _, _ = calls[-1]
    assert kind == "attend" and torch.equal(lens, layout.seq_lens.int())
    for b in range(2):  # each request's pages, in order
        row = layout.req_to_token[layout.req_pool_indices[b]]
        want = row[: -(-int(layout.seq_lens[b]) // 64) * 64:64] // 64
        assert torch.equal(block_table[b, :want.numel()], want)
    clean[layout.out_cache_loc] = latent
    ref = REF.mla_tree_attention_reference(q, clean, layout.out_cache_loc, mask,
                                           kv_lora_rank=RANK, sm_scale=layer.scaling,
                                           **layout.table_kwargs())
    assert not out.isnan().any()
    assert rel_err(out.view(ref.shape), ref) < TOL


def _padded_by_one(layout, mask, n):
    """A graph-style verify batch of the layout's requests plus one padding request (row 0,
    prefix 1, slots 0), the tree mask attached for the real ones."""
    bs = layout.req_pool_indices.numel()
    view = types.SimpleNamespace(
        forward_mode=_mode("TARGET_VERIFY"), batch_size=bs + 1,
        req_pool_indices=torch.cat([layout.req_pool_indices, torch.zeros(1, dtype=torch.int64)]),
        seq_lens=torch.cat([layout.seq_lens, torch.ones(1, dtype=torch.int64)]),
        out_cache_loc=torch.cat([layout.out_cache_loc, torch.zeros(n, dtype=torch.int64)]),
        positions=torch.zeros((bs + 1) * n, dtype=torch.int64), out_cache_loc_is_physical=False,
        spec_info=types.SimpleNamespace(draft_token=torch.zeros(bs * n)))
    verify_backend.attach_tree_mask(view.spec_info, mask)
    return view


def test_mla_prefix_on_flashmla_graph_path_uses_static_buffers(sgl, monkeypatch):
    """Capture-style prep of a padded batch: the page table, lengths and metadata land in the
    static buffers a captured graph reads (metadata copied in, not rebound), and the output of
    the real requests matches the reference."""
    n = 3
    g, layout, mask, layer, clean, w, calls = _mla_prefix_backend(sgl, monkeypatch, 12, (64, 9), n)
    w.init_cuda_graph_state(4, 4 * n)
    buffers = (w._prefix.block_table, w._prefix.seq_lens, w._prefix.sched, w._prefix.splits)
    bs, pad_bs = 2, 3
    tokens = pad_bs * n
    q, latent = _mla_tokens(g, tokens)
    fb_view = _padded_by_one(layout, mask, n)
    w.init_forward_metadata_out_graph(fb_view)
    assert all(a is b for a, b in zip(buffers, (w._prefix.block_table, w._prefix.seq_lens,
                                                w._prefix.sched, w._prefix.splits)))
    assert torch.equal(w._prefix.seq_lens[:pad_bs], fb_view.seq_lens.int())
    assert (w._prefix.sched == 7).all()  # the metadata was copied into the static buffer
    clean[layout.out_cache_loc] = latent[: bs * n]
    ref = REF.mla_tree_attention_reference(q[: bs * n], clean, layout.out_cache_loc, mask,
                                           kv_lora_rank=RANK, sm_scale=layer.scaling,
                                           **layout.table_kwargs())
    with _attn_context(w):
        out = layer(q, latent, latent[..., :RANK], fb_view)
    _, block_table, lens, _, splits = calls[-1]
    assert block_table.shape[0] == pad_bs and lens.shape == (pad_bs,)
    assert splits.shape == (pad_bs + 1,)
    assert rel_err(out[: bs * n].view(ref.shape), ref) < TOL


def test_mla_prefix_from_a_batch_size(sgl, monkeypatch):
    """SGLANG_DDTREE_MLA_PREFIX=flashmla:3: a verify batch of 2 runs our kernel alone over the
    whole prefix (FlashMLA neither prepared nor called; the pool's prefix rows are read, so
    they are clean here), a padded graph batch of 3 takes the prefix on FlashMLA."""
    n = 3
    g, layout, mask, layer, clean, w, calls = _mla_prefix_backend(sgl, monkeypatch, 13, (64, 9),
                                                                  n, setting="flashmla:3")
    assert w._prefix_min_bs == 3
    pool_rows = w._runner.token_to_kv_pool.kv_buffer[0]
    pool_rows.copy_(clean)
    fb = _verify_batch(layout, mask, n)
    q, latent = _mla_tokens(g, layout.out_cache_loc.numel())
    w.init_forward_metadata(fb)
    with _attn_context(w):
        out = layer(q, latent, latent[..., :RANK], fb)
    assert calls == []
    ref_cache = clean.clone()
    ref_cache[layout.out_cache_loc] = latent
    ref = REF.mla_tree_attention_reference(q, ref_cache, layout.out_cache_loc, mask,
                                           kv_lora_rank=RANK, sm_scale=layer.scaling,
                                           **layout.table_kwargs())
    assert rel_err(out.view(ref.shape), ref) < TOL
    # a graph batch padded to 3 requests: FlashMLA prepares and attends
    w.init_cuda_graph_state(4, 4 * n)
    calls.clear()
    q3, latent3 = _mla_tokens(g, 3 * n)
    fb_view = _padded_by_one(layout, mask, n)
    w.init_forward_metadata_out_graph(fb_view)
    with _attn_context(w):
        layer(q3, latent3, latent3[..., :RANK], fb_view)
    assert [c[0] for c in calls] == ["metadata", "attend"]
    monkeypatch.setenv("SGLANG_DDTREE_MLA_PREFIX", "flashmla")
    assert cfg.read_mla_prefix_min_batch() == 1


def test_mla_prefix_on_flashmla_refusals(sgl, monkeypatch):
    """Start-up refusals name the fix: pages other than 64, an fp8 KV cache, an MHA target, a
    bad value; without the stand-in the real kernel's needs (its dims, a Hopper GPU) are
    checked too."""
    monkeypatch.setenv("SGLANG_DDTREE_MLA_PREFIX", "flashmla")
    n = 3
    fns = (lambda *a: None, lambda *a, **k: None)
    _, layout, _, layer, prefill_path, pool = _mla_setup(1, torch.bfloat16, n=n, page=1)
    mr = _runner(pool, layout.req_to_token, [layer, prefill_path], RecordingBackend(), mla=True)

    def capture_install(runner, prefix_fns):
        verify_backend.install(runner, n, sgl, kernels=KERNELS, prefix_fns=prefix_fns)

    with pytest.raises(cfg.DDTreeConfigError, match="MLA_PREFIX=flashmla cannot serve") as info:
        capture_install(mr, fns)
    assert "--page-size 64" in str(info.value)
    mr.page_size, mr.kv_cache_dtype = 64, torch.float8_e4m3fn
    with pytest.raises(cfg.DDTreeConfigError) as info:
        capture_install(mr, fns)
    assert "bf16 KV cache" in str(info.value) and "--page-size" not in str(info.value)
    mr.kv_cache_dtype = torch.bfloat16
    with pytest.raises(cfg.DDTreeConfigError) as info:  # the real kernel: dims and the GPU
        capture_install(mr, None)
    assert "576" in str(info.value) and "device cpu" in str(info.value)
    _, mlayout, _, mlayer, mpool = _mha_setup(n=n)
    mha = _runner(mpool, mlayout.req_to_token, [mlayer], RecordingBackend())
    with pytest.raises(cfg.DDTreeConfigError) as info:
        capture_install(mha, fns)
    assert "non-MLA target" in str(info.value)
    for bad in ("fa3", "flashmla:0", "flashmla:x", "triton:8", "flashmla:"):
        monkeypatch.setenv("SGLANG_DDTREE_MLA_PREFIX", bad)
        with pytest.raises(cfg.DDTreeConfigError, match="expected one of triton, flashmla"):
            cfg.read_mla_prefix()
    monkeypatch.setenv("SGLANG_DDTREE_MLA_PREFIX", " FlashMLA:8 ")
    assert (cfg.read_mla_prefix(), cfg.read_mla_prefix_min_batch()) == ("flashmla", 8)


# --- SGLANG_DDTREE_MHA_PREFIX=fa3: the prefix on FA3 (a stand-in here) ------------------------

def _fake_fa3(clean_k, clean_v, pool_k, calls):
    """FA3's prefix call (tests/_fa3_standin.py) over the clean caches, after checking it was
    handed the pool's own key buffer and int32 page table and lengths; calls logged."""
    from tests._fa3_standin import torch_fa3

    def attend(q, k_cache, v_cache, page_table, cache_seqlens, softmax_scale):
        calls.append(("attend", page_table.clone(), cache_seqlens.clone(), k_cache.shape))
        assert page_table.dtype == torch.int32 and cache_seqlens.dtype == torch.int32
        assert k_cache.data_ptr() == pool_k.data_ptr()
        page, hkv, d = k_cache.shape[1:]
        return torch_fa3(q, clean_k.view(-1, page, hkv, d),
                         clean_v.view(-1, page, hkv, clean_v.shape[-1]), page_table,
                         cache_seqlens, softmax_scale)

    return (attend,)


def _mha_prefix_backend(sgl, monkeypatch, seed, seq_lens, n, page, setting="fa3", hq=4, hkv=2,
                        d=16):
    """The MHA target behind our verify backend with the prefix on the FA3 stand-in; every
    prefix slot NaN in the pool our kernel reads (the stand-in reads clean copies)."""
    monkeypatch.setenv("SGLANG_DDTREE_MHA_PREFIX", setting)
    g, layout, mask, layer, pool = _mha_setup(seed=seed, seq_lens=seq_lens, n=n, hq=hq,
                                              hkv=hkv, d=d, page=page)
    kb, vb = pool.get_key_buffer(1), pool.get_value_buffer(1)
    clean_k, clean_v = kb.clone(), vb.clone()
    prefix = _used_slots(kb.shape[0], layout)
    kb[prefix] = float("nan")
    vb[prefix] = float("nan")
    mr = _runner(pool, layout.req_to_token, [layer], RecordingBackend())
    mr.page_size = page
    calls = []
    w = verify_backend.install(mr, n, sgl, kernels=KERNELS,
                               prefix_fns=_fake_fa3(clean_k, clean_v, kb, calls))
    assert w._prefix is not None
    return g, layout, mask, layer, pool, (clean_k, clean_v), w, calls


def _eager_step(w, g, pool, layout, mask, layer, n, hq, hkv, d):
    """One eager verify step of random q / k / v through layer 1 behind ``w``: returns
    _step_qkv's five and the layer's output."""
    q, k, v, want_k, want_v = _step_qkv(g, pool, layout, layout.out_cache_loc.numel(), hq, hkv,
                                        d)
    fb = _verify_batch(layout, mask, n)
    w.init_forward_metadata(fb)
    with _attn_context(w):
        out = layer(q, k, v, fb)
    return q, k, v, want_k, want_v, out


@pytest.mark.parametrize("page", [1, 4])
def test_mha_prefix_on_fa3_eager_matches_reference(sgl, monkeypatch, page):
    n, hq, hkv, d = 5, 4, 2, 16
    g, layout, mask, layer, pool, (ck, cv), w, calls = _mha_prefix_backend(
        sgl, monkeypatch, 21, (37, 9), n, page)
    q, k, v, _, _, out = _eager_step(w, g, pool, layout, mask, layer, n, hq, hkv, d)
    kind, table, lens, kshape = calls[-1]
    assert kind == "attend" and torch.equal(lens, layout.seq_lens.int())
    assert kshape[1:] == (page, hkv, d)
    for b in range(2):  # each request's pages, in order
        row = layout.req_to_token[layout.req_pool_indices[b]]
        want = row[: -(-int(layout.seq_lens[b]) // page) * page:page] // page
        assert torch.equal(table[b, :want.numel()], want)
    ck[layout.out_cache_loc] = k.view(-1, hkv, d)
    cv[layout.out_cache_loc] = v.view(-1, hkv, d)
    ref = _expected_mha(layout, mask, layer, ck, cv, q)
    assert not out.isnan().any()
    assert rel_err(out.view(ref.shape), ref) < TOL


@pytest.mark.parametrize("page", [1, 4])
def test_mha_prefix_on_fa3_graph_path_reads_static_buffers(sgl, monkeypatch, page):
    """Capture-style prep of a padded batch: FA3 is handed the backend's req_to_token snapshot
    itself (pages of one token) or the static page-table buffer, and the static lengths; the
    real requests match the reference and the padding row stays finite."""
    n, hq, hkv, d = 3, 4, 2, 16
    g, layout, mask, layer, pool, (ck, cv), w, calls = _mha_prefix_backend(
        sgl, monkeypatch, 22, (64, 9), n, page)
    w.init_cuda_graph_state(4, 4 * n)
    bs, pad_bs = 2, 3
    tokens = pad_bs * n
    q = torch.randn(tokens, hq * d, generator=g).bfloat16()
    k = torch.randn(tokens, hkv * d, generator=g).bfloat16()
    v = torch.randn(tokens, hkv * d, generator=g).bfloat16()
    fb_view = _padded_by_one(layout, mask, n)
    w.init_forward_metadata_out_graph(fb_view)
    lens_buffer = w._prefix.seq_lens
    with _attn_context(w):
        out = layer(q, k, v, fb_view)
    _, table, lens, _ = calls[-1]
    assert table.shape[0] == pad_bs and torch.equal(lens, fb_view.seq_lens.int())
    assert w._prefix.seq_lens is lens_buffer
    pages = w._prefix._batch[0]
    if page == 1:  # no copy: the snapshot the tree kernel reads too
        assert pages.data_ptr() == w._graph["table"].data_ptr()
    else:
        assert pages.data_ptr() == w._prefix.page_table.data_ptr()
    ck[layout.out_cache_loc] = k[: bs * n].view(-1, hkv, d)
    cv[layout.out_cache_loc] = v[: bs * n].view(-1, hkv, d)
    ref = _expected_mha(layout, mask, layer, ck, cv, q[: bs * n])
    assert rel_err(out[: bs * n].view(ref.shape), ref) < TOL
    assert torch.isfinite(out[bs * n:].float()).all()


def test_mha_prefix_empty_prefix_and_from_a_batch_size(sgl, monkeypatch):
    """fa3:3: a verify batch of 2 runs our kernel alone (FA3 not called); a padded graph batch
    of 3 takes the prefix on FA3, a request with an empty prefix (FA3's +inf LSE) included."""
    n, hq, hkv, d = 3, 4, 2, 16
    g, layout, mask, layer, pool, (ck, cv), w, calls = _mha_prefix_backend(
        sgl, monkeypatch, 23, (40, 0), n, 1, setting="fa3:3")
    assert w._prefix_min_bs == 3
    pool.get_key_buffer(1).copy_(ck)
    pool.get_value_buffer(1).copy_(cv)
    q, k, v, want_k, want_v, out = _eager_step(w, g, pool, layout, mask, layer, n, hq, hkv, d)
    tokens = q.shape[0]
    assert calls == []
    ref = _expected_mha(layout, mask, layer, want_k, want_v, q)
    assert rel_err(out.view(ref.shape), ref) < TOL
    w.init_cuda_graph_state(4, 4 * n)
    q3 = torch.cat([q, torch.randn(n, hq * d, generator=g).bfloat16()])
    k3 = torch.cat([k, torch.randn(n, hkv * d, generator=g).bfloat16()])
    v3 = torch.cat([v, torch.randn(n, hkv * d, generator=g).bfloat16()])
    fb_view = _padded_by_one(layout, mask, n)
    w.init_forward_metadata_out_graph(fb_view)
    with _attn_context(w):
        out3 = layer(q3, k3, v3, fb_view)
    assert [c[0] for c in calls] == ["attend"] and int(calls[0][2][1]) == 0
    assert not out3[:tokens].isnan().any()
    assert rel_err(out3[:tokens].view(ref.shape), ref) < TOL
    monkeypatch.setenv("SGLANG_DDTREE_MHA_PREFIX", "fa3")
    assert cfg.read_mha_prefix_min_batch() == 1


def test_mha_prefix_on_fa3_refusals(sgl, monkeypatch):
    """Start-up refusals name the fix: an fp8 KV cache, a logit cap, an MLA target, a bad
    value; without the stand-in the machine is checked too (no GPU here)."""
    monkeypatch.setenv("SGLANG_DDTREE_MHA_PREFIX", "fa3")
    n = 3
    fns = (lambda *a: None,)
    _, layout, _, layer, pool = _mha_setup(n=n)
    mr = _runner(pool, layout.req_to_token, [layer], RecordingBackend())

    def install(runner, prefix_fns):
        verify_backend.install(runner, n, sgl, kernels=KERNELS, prefix_fns=prefix_fns)

    with pytest.raises(cfg.DDTreeConfigError, match="MHA_PREFIX=fa3 cannot serve") as info:
        install(mr, None)
    assert "device cpu" in str(info.value)
    mr.kv_cache_dtype = torch.float8_e4m3fn
    with pytest.raises(cfg.DDTreeConfigError, match="bf16 or fp16 KV cache"):
        install(mr, fns)
    mr.kv_cache_dtype = torch.bfloat16
    layer.logit_cap = 30.0
    with pytest.raises(cfg.DDTreeConfigError, match="logit cap"):
        install(mr, fns)
    layer.logit_cap = 0.0
    _, mlayout, _, mlayer, prefill_path, mpool = _mla_setup(1, torch.bfloat16, n=n)
    mla = _runner(mpool, mlayout.req_to_token, [mlayer, prefill_path], RecordingBackend(),
                  mla=True)
    with pytest.raises(cfg.DDTreeConfigError, match="an MLA target"):
        install(mla, fns)
    for bad in ("flashmla", "fa3:0", "fa3:x", "triton:2", "fa3:"):
        monkeypatch.setenv("SGLANG_DDTREE_MHA_PREFIX", bad)
        with pytest.raises(cfg.DDTreeConfigError, match="expected one of triton, fa3"):
            cfg.read_mha_prefix()


def test_prefix_auto_takes_the_kernel_where_it_can_serve(sgl, monkeypatch, caplog):
    """The default (auto): the prefix kernel where nothing stops it (here a stand-in, so the
    machine is not checked), our kernel alone otherwise with the reason logged at start-up;
    triton keeps our kernel alone."""
    for env in ("SGLANG_DDTREE_MHA_PREFIX", "SGLANG_DDTREE_MLA_PREFIX"):
        monkeypatch.delenv(env, raising=False)
    assert (cfg.read_mha_prefix(), cfg.read_mla_prefix()) == ("auto", "auto")
    n = 3
    _, layout, _, layer, pool = _mha_setup(n=n)
    mr = _runner(pool, layout.req_to_token, [layer], RecordingBackend())
    fns = (lambda *a: None,)
    w = verify_backend.install(mr, n, sgl, kernels=KERNELS, prefix_fns=fns)
    assert type(w._prefix).__name__ == "FA3Prefix" and w._prefix_min_bs == 1
    mr.kv_cache_dtype = torch.float8_e4m3fn  # FA3 cannot serve it: our kernel alone, logged
    with caplog.at_level("INFO", logger=verify_backend.__name__):
        w = verify_backend.install(mr, n, sgl, kernels=KERNELS, prefix_fns=fns)
    assert w._prefix is None and "MHA_PREFIX=auto" in caplog.text
    assert "bf16 or fp16 KV cache" in caplog.text
    mr.kv_cache_dtype = torch.bfloat16
    monkeypatch.setenv("SGLANG_DDTREE_MHA_PREFIX", "triton")
    assert verify_backend.install(mr, n, sgl, kernels=KERNELS, prefix_fns=fns)._prefix is None
    # MLA: FlashMLA needs 64-token pages
    _, mlayout, _, mlayer, prefill_path, mpool = _mla_setup(1, torch.bfloat16, n=n, page=64)
    mla = _runner(mpool, mlayout.req_to_token, [mlayer, prefill_path], RecordingBackend(),
                  mla=True)
    mfns = (lambda *a: None, lambda *a, **k: None)
    caplog.clear()
    with caplog.at_level("INFO", logger=verify_backend.__name__):
        assert verify_backend.install(mla, n, sgl, kernels=KERNELS, prefix_fns=mfns)._prefix \
            is None
    assert "MLA_PREFIX=auto" in caplog.text and "--page-size 64" in caplog.text
    mla.page_size = 64
    w = verify_backend.install(mla, n, sgl, kernels=KERNELS, prefix_fns=mfns)
    assert type(w._prefix).__name__ == "FlashMLAPrefix"
    # without a stand-in the machine counts: no GPU here, so our kernel alone
    assert verify_backend.install(mla, n, sgl, kernels=KERNELS)._prefix is None
