"""Plugin registration and CLI against the real SGLang package imported on CPU."""

import argparse
import os
import types

import pytest

sglang = pytest.importorskip("sglang")

from sglang_ddtree import compat  # noqa: E402
from sglang_ddtree import config as cfg  # noqa: E402
from sglang_ddtree import hooks  # noqa: E402

SGLANG_VERSION = compat.installed_sglang_version()
only_0_5_17 = pytest.mark.skipif(SGLANG_VERSION != "0.5.17", reason="SGLang 0.5.17 behaviour")
only_0_5_23 = pytest.mark.skipif(SGLANG_VERSION != "0.5.23", reason="SGLang 0.5.23 behaviour")


@pytest.fixture(scope="module")
def loaded():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang_ddtree import plugin

    assert plugin.registration_error() is None
    return plugin


def test_entry_point_registers_ddtree(loaded):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algo = SpeculativeAlgorithm.from_string("DDTREE")
    assert algo.name == "DDTREE"
    assert algo.supports_overlap
    assert algo.is_dflash_family() and not algo.is_dflash() and not algo.is_eagle()
    assert algo.is_speculative() and algo.is_some()
    assert not algo.need_topk() and not algo.carries_draft_hidden_states()
    # lower case resolves too (SGLang upper-cases the CLI value)
    assert SpeculativeAlgorithm.from_string("ddtree") is algo


def test_spec_class_passes_sglang_conformance(loaded):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import _assert_custom_spec_algo_conforms

    _assert_custom_spec_algo_conforms(type(SpeculativeAlgorithm.from_string("DDTREE")))


def test_grammar_batches_keep_the_overlap_scheduler(loaded):
    """As DFLASH: the worker runs the scheduler's grammar barrier inside its step, so SGLang
    hands it one and does not force grammar batches onto the synchronous path."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algo = SpeculativeAlgorithm.from_string("DDTREE")
    assert algo.supports_grammar_overlap()
    assert algo.supports_grammar_overlap() == SpeculativeAlgorithm.DFLASH.supports_grammar_overlap()


def test_all_hooks_applied(loaded):
    assert loaded.check_hooks_applied() == []


def test_cli_flags_parse_and_show_in_help(loaded):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "m", "--speculative-algorithm", "DDTREE",
                            "--speculative-ddtree-budget", "64", "--speculative-ddtree-topk", "8"])
    assert ns.speculative_ddtree_budget == 64 and ns.speculative_ddtree_topk == 8
    text = parser.format_help()
    i = text.index("\n  --speculative-ddtree-budget SPECULATIVE")
    # listed among SGLang's speculative flags
    assert "--speculative-" in text[max(0, i - 400):i]


def test_from_cli_args_exports_budget(loaded, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    monkeypatch.delenv(cfg.ENV_BUDGET, raising=False)
    seen = {}

    def fake_original(cls, args):
        seen["budget"] = os.environ.get(cfg.ENV_BUDGET)
        return "built"

    ns = argparse.Namespace(speculative_ddtree_budget=48, speculative_ddtree_topk=None)
    assert hooks.from_cli_args_hook(fake_original, ServerArgs, ns) == "built"
    assert seen["budget"] == "48"


@pytest.mark.parametrize("budget", [0, -3, 1025, 5000])
def test_budget_out_of_range_is_refused(budget):
    with pytest.raises(cfg.DDTreeConfigError, match="speculative-ddtree-budget"):
        hooks.export_cli_args(argparse.Namespace(speculative_ddtree_budget=budget,
                                                 speculative_ddtree_topk=None), environ={})


def test_widths_for_target_and_draft(loaded, monkeypatch):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algo = SpeculativeAlgorithm.from_string("DDTREE")
    monkeypatch.setenv(cfg.ENV_BUDGET, "32")
    monkeypatch.setenv(cfg.ENV_BLOCK_SIZE, "16")
    assert algo.get_num_tokens_per_req_for_target_verify(33, False) == 33
    assert algo.get_num_tokens_per_req_for_target_verify(33, True) == 16
    monkeypatch.setenv(cfg.ENV_BUDGET, "8")
    assert algo.get_num_tokens_per_req_for_target_verify(16, False) == 9
    assert algo.get_num_tokens_per_req_for_target_verify(16, True) == 16
    with pytest.raises(RuntimeError, match="budget changed"):
        algo.get_num_tokens_per_req_for_target_verify(40, False)


def _server_args(**kw):
    base = dict(speculative_draft_model_path=None, pp_size=1, attention_backend="triton",
                decode_attention_backend=None, speculative_num_draft_tokens=None,
                speculative_dflash_block_size=None, speculative_draft_attention_backend=None)
    base.update(kw)
    return types.SimpleNamespace(**base)


def _write_draft(tmp_path, **overrides):
    import json

    data = {"architectures": ["DFlashDraftModel"], "num_hidden_layers": 2, "vocab_size": 1000,
            "block_size": 16, "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 2]}}
    data.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(data))
    return str(tmp_path)


def test_handle_server_args_sets_widths(loaded, tmp_path, monkeypatch):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algo = SpeculativeAlgorithm.from_string("DDTREE")
    monkeypatch.setenv(cfg.ENV_BUDGET, "40")
    monkeypatch.setenv("SGLANG_DDTREE_ROUTER_GEMM", "")  # unset by the operator
    calls = []
    monkeypatch.setattr(type(algo), "handle_server_args", type(algo).handle_server_args)
    sa = _server_args(speculative_draft_model_path=_write_draft(tmp_path))
    # SGLang's DFLASH handler needs a full ServerArgs; record the call instead
    from sglang_ddtree import spec_algo

    cls = spec_algo.make_spec_class(type(algo).__mro__[1], lambda s: calls.append(s))
    inst = cls(name="DDTREE", factory=lambda s: None, supports_overlap=True)
    inst.handle_server_args(sa)
    assert calls == [sa]
    assert sa.speculative_num_draft_tokens == 41  # max(40 + 1, 16)
    assert sa.speculative_draft_attention_backend == "triton"
    assert os.environ[cfg.ENV_BLOCK_SIZE] == "16"
    assert os.environ["SGLANG_DDTREE_ROUTER_GEMM"] == "auto"  # restored after the test


@pytest.mark.parametrize("value,want", [(None, "auto"), ("", "auto"), (" ", "auto"),
                                        ("0", "0"), ("1", "1"), ("2-16", "2-16")])
def test_ddtree_servers_get_the_router_default_unless_set(value, want):
    """DDTREE's handler exports SGLANG_DDTREE_ROUTER_GEMM=auto for its schedulers where the
    operator left it unset or empty; a value given is kept (0 turns the router's kernel off)."""
    from sglang_ddtree import spec_algo

    env = {} if value is None else {"SGLANG_DDTREE_ROUTER_GEMM": value}
    assert spec_algo.export_router_default(env) is (want == "auto")
    assert env == {"SGLANG_DDTREE_ROUTER_GEMM": want}


def test_a_bad_router_value_stops_the_launcher():
    from sglang_ddtree import dense_hook, spec_algo

    for value in ("bogus", "40-80", "ato"):
        with pytest.raises(dense_hook.SkinnyGemmHookError, match="auto \\(DDTREE's default\\)"):
            spec_algo.export_router_default({"SGLANG_DDTREE_ROUTER_GEMM": value})
    assert spec_algo.export_router_default({"SGLANG_DDTREE_ROUTER_GEMM": "AUTO"}) is False


@pytest.mark.parametrize("field", ["block_size", "num_hidden_layers"])
def test_missing_drafter_fields_are_refused(tmp_path, field):
    from sglang_ddtree import spec_algo

    path = _write_draft(tmp_path, **{field: None})
    with pytest.raises(cfg.DDTreeConfigError, match=field):
        spec_algo.read_draft_config(path)


def test_missing_dflash_config_is_refused(tmp_path):
    from sglang_ddtree import spec_algo

    path = _write_draft(tmp_path, dflash_config={})
    with pytest.raises(cfg.DDTreeConfigError, match="target_layer_ids"):
        spec_algo.read_draft_config(path)


def test_startup_refusals():
    from sglang_ddtree import spec_algo

    with pytest.raises(cfg.DDTreeConfigError, match="draft-model-path"):
        spec_algo.check_server_args(_server_args())
    with pytest.raises(cfg.DDTreeConfigError, match="pipeline"):
        spec_algo.check_server_args(_server_args(speculative_draft_model_path="x", pp_size=2))
    # a backend neither the native nor DDTREE's Triton verify can serve; the message names
    # the ones that work (trtllm_mla is served by default: the Triton verify sits behind it)
    with pytest.raises(cfg.DDTreeConfigError, match="triton"):
        spec_algo.check_server_args(_server_args(speculative_draft_model_path="x",
                                                 attention_backend="torch_native"))
    spec_algo.check_server_args(_server_args(speculative_draft_model_path="x",
                                             attention_backend="trtllm_mla"))


def test_deterministic_mode_with_small_prefill_chunks_is_refused_on_0_5_17(monkeypatch):
    """0.5.17 never schedules a prefill chunk under its deterministic-mode alignment: a small
    --chunked-prefill-size would hang every long prompt (measured on the H200)."""
    pytest.importorskip("sglang")
    from sglang_ddtree import compat, spec_algo

    args = lambda **kw: _server_args(speculative_draft_model_path="x",  # noqa: E731
                                     enable_deterministic_inference=True, **kw)
    if compat.installed_sglang_version() != "0.5.17":
        spec_algo.check_server_args(args(chunked_prefill_size=128))  # SGLang checks it itself
        return
    with pytest.raises(cfg.DDTreeConfigError, match="chunked-prefill-size 4096"):
        spec_algo.check_server_args(args(chunked_prefill_size=128))
    spec_algo.check_server_args(args(chunked_prefill_size=4096))
    spec_algo.check_server_args(args(chunked_prefill_size=-1))  # chunking off
    spec_algo.check_server_args(args(chunked_prefill_size=None))  # SGLang's default later
    monkeypatch.setenv("SGLANG_TRITON_PREFILL_TRUNCATION_ALIGN_SIZE", "128")
    spec_algo.check_server_args(args(chunked_prefill_size=128))


def test_unknown_sglang_version_is_refused():
    from sglang_ddtree import compat

    with pytest.raises(compat.UnsupportedSGLangVersion, match="0.5.17"):
        compat.check_version("0.4.0")
    with pytest.raises(compat.UnsupportedSGLangVersion, match="not installed"):
        compat.check_version(None)


def test_cli_info_reports_registration(loaded, capsys):
    from sglang_ddtree import cli

    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "ddtree_registers       True" in out
    assert "tree_verify_backends" in out
    # no GPU here: the FlashMLA prefix says why it cannot run
    assert "mla_prefix_flashmla    not usable: device cpu" in out
    assert "mha_prefix_fa3         not usable: device cpu" in out
    assert "'mla_prefix': 'auto'" in out and "'mha_prefix': 'auto'" in out  # the defaults
    assert "'draft_attention': 'auto'" in out  # SGLANG_DDTREE_DRAFT_ATTENTION's default
    assert "'router_gemm': \"auto (DDTREE's default): no GPU here" in out
    # per-request features with this release: grammar served, logprobs where SGLang has them
    from sglang_ddtree import compat

    req = cli.request_support()
    assert req["grammar"].startswith("served")
    assert req["return_logprob"].startswith(
        "served" if compat.load().SPEC_LOGPROBS else "refused")
    assert "'grammar': 'served" in out


def test_request_validation_admits_grammar_and_logprob_where_sglang_computes_it(loaded):
    from sglang_ddtree.hooks import make_validate_request_hook

    def original(req, enable_overlap):
        return "logprob refused" if req.return_logprob else None

    req = types.SimpleNamespace(return_logprob=False,
                                sampling_params=types.SimpleNamespace(json_schema='{"a":1}'))
    hook = make_validate_request_hook(lambda: True)
    assert hook(original, req, True) is None  # grammar-constrained requests are served
    assert hook(original, types.SimpleNamespace(return_logprob=True, sampling_params=None),
                True) == "logprob refused"
    assert make_validate_request_hook(lambda: False)(original, req, True) is None
    # SGLang 0.5.23's DFLASH check admits logprob requests: DDTREE computes them there (its
    # compat module says so); a release without speculative logprobs refuses them
    logprob = types.SimpleNamespace(return_logprob=True)
    plain = types.SimpleNamespace(return_logprob=False, sampling_params=types.SimpleNamespace())
    without = make_validate_request_hook(lambda: True, spec_logprobs=False)
    assert without(lambda r, o: None, plain, True) is None
    assert "return_logprob" in without(lambda r, o: None, logprob, True)
    assert make_validate_request_hook(lambda: True, spec_logprobs=True)(
        lambda r, o: None, logprob, True) is None
    from sglang_ddtree import compat

    sgl = compat.load()
    assert sgl.SPEC_LOGPROBS == (sgl.VERSION != "0.5.17")
    import sglang.srt.speculative.dflash_utils as du
    served = du.validate_dflash_request(types.SimpleNamespace(
        return_logprob=True, return_hidden_states=False,
        sampling_params=types.SimpleNamespace()), False)  # the installed chain, hooks included
    assert (served is None) == sgl.SPEC_LOGPROBS
    # the scheduler imports the function by name: its binding must be the wrapped one too
    import sglang.srt.managers.scheduler as sched
    import sglang.srt.speculative.dflash_utils as dutils

    assert sched.validate_dflash_request is dutils.validate_dflash_request
    assert getattr(dutils.validate_dflash_request, "__wrapped__", None) is not None


@only_0_5_17
def test_engine_keywords_reach_the_environment(loaded, monkeypatch):
    """sglang.Engine(**kwargs) builds ServerArgs(**kwargs): our keywords are taken out first."""
    from sglang.srt.server_args import ServerArgs

    monkeypatch.delenv(cfg.ENV_BUDGET, raising=False)
    with pytest.raises(Exception) as info:  # no model at this path: fails later, inside SGLang
        ServerArgs(model_path="/nonexistent-model", speculative_ddtree_budget=24)
    assert "speculative_ddtree_budget" not in str(info.value)
    assert os.environ[cfg.ENV_BUDGET] == "24"
    with pytest.raises(cfg.DDTreeConfigError):
        ServerArgs(model_path="/nonexistent-model", speculative_ddtree_budget=0)


@only_0_5_23
def test_engine_keywords_reach_the_environment_0_5_23(loaded, monkeypatch):
    """0.5.23's ServerArgs is a msgspec Struct (no Python __init__ to hook): Engine.__init__
    takes our keywords out before it builds ServerArgs(**kwargs)."""
    from sglang.srt.entrypoints.engine import Engine

    class Built(Exception):
        pass

    def server_args_class(**kwargs):
        raise Built(kwargs)

    class Probe(Engine):  # stops where Engine would build ServerArgs: nothing is launched
        def __del__(self):
            pass

    Probe.server_args_class = staticmethod(server_args_class)
    monkeypatch.delenv(cfg.ENV_BUDGET, raising=False)
    with pytest.raises(Built) as info:
        Probe(model_path="/nonexistent-model", speculative_ddtree_budget=24)
    kwargs = info.value.args[0]
    assert kwargs["model_path"] == "/nonexistent-model"
    assert "speculative_ddtree_budget" not in kwargs
    assert os.environ[cfg.ENV_BUDGET] == "24"
    with pytest.raises(cfg.DDTreeConfigError):
        Probe(model_path="/nonexistent-model", speculative_ddtree_budget=0)


@only_0_5_23
def test_handle_server_args_declares_on_the_0_5_23_record(loaded, tmp_path, monkeypatch):
    """The real path: SGLang hands DDTREE's handler a stand-in whose writes it declares, and
    SGLang's own DFLASH handler runs inside it on the record."""
    from sglang.srt.arg_groups.overrides import (
        declare_resolution,
        record_foreign_defaults,
        resolution_result,
    )
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    monkeypatch.setenv(cfg.ENV_BUDGET, "40")
    monkeypatch.setenv(cfg.ENV_BLOCK_SIZE, "")  # restored after the test
    monkeypatch.setenv("SGLANG_DDTREE_ROUTER_GEMM", "")
    record = ServerArgs(model_path="m", device="cuda", attention_backend="triton",
                        speculative_draft_model_path=_write_draft(tmp_path),
                        speculative_num_draft_tokens=7)
    declare_resolution(record, "test", speculative_algorithm="DDTREE")
    algo = SpeculativeAlgorithm.from_string("DDTREE")
    record_foreign_defaults(record, "handle_speculative_decoding.custom_algo",
                            algo.handle_server_args)
    decided = {f: resolution_result(record, f) for f in (
        "speculative_num_draft_tokens", "speculative_num_steps", "speculative_eagle_topk",
        "speculative_draft_attention_backend", "max_running_requests")}
    assert decided == {"speculative_num_draft_tokens": 41,  # max(40 + 1, 16), not 7
                       "speculative_num_steps": 1, "speculative_eagle_topk": 1,  # DFLASH's
                       "speculative_draft_attention_backend": "triton",
                       "max_running_requests": 48}
    assert record.speculative_num_draft_tokens == 7  # the operator's input stays as given
    assert os.environ[cfg.ENV_BLOCK_SIZE] == "16"
    assert os.environ["SGLANG_DDTREE_ROUTER_GEMM"] == "auto"
    # SGLang's own upper bound on the draft width follows the resolved value
    assert algo.resolve_max_speculative_num_draft_tokens(record) == 41


def test_dummy_verify_input_hook_reads_arguments_by_name(loaded):
    sgl = compat.load()
    made = []

    def verify_input(**kw):
        made.append(kw)
        return kw

    hook = hooks.make_dummy_verify_input_hook(verify_input, "FULL", "NULL",
                                              params=sgl.DUMMY_VERIFY_INPUT_PARAMS)
    ddtree = types.SimpleNamespace(name="DDTREE")
    values = {"spec_algorithm": ddtree, "server_args": object(), "custom_mask": "mask",
              "num_tokens_per_req": 33, "is_draft_worker": False}
    args = [values[p] for p in sgl.DUMMY_VERIFY_INPUT_PARAMS]
    out = hook(lambda *a, **k: "original", *args)
    assert out["draft_token_num"] == 33 and out["custom_mask"] == "mask"
    assert out["capture_hidden_mode"] == "FULL"
    args[sgl.DUMMY_VERIFY_INPUT_PARAMS.index("is_draft_worker")] = True
    out = hook(lambda *a, **k: "original", *args)
    assert out["custom_mask"] is None and out["capture_hidden_mode"] == "NULL"
    args[0] = types.SimpleNamespace(name="DFLASH")
    assert hook(lambda *a, **k: ("original", a), *args) == ("original", tuple(args))
    # the hooked function really takes these parameters, in this order
    import inspect

    from sglang.srt.speculative import spec_info

    original = inspect.unwrap(spec_info.create_dummy_verify_input)
    assert tuple(inspect.signature(original).parameters) == sgl.DUMMY_VERIFY_INPUT_PARAMS


@only_0_5_23
def test_launch_command_line_parses_on_0_5_23(loaded, monkeypatch):
    """The launcher's own parser (prepare_server_args): 0.5.23 builds the record without resolving
    it, so the whole command line can be checked here, DDTree flags included."""
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.delenv(cfg.ENV_BUDGET, raising=False)
    monkeypatch.delenv(cfg.ENV_TOPK, raising=False)
    monkeypatch.setattr("logging.basicConfig", lambda **kw: None)  # keep pytest's log handlers
    record = prepare_server_args([
        "--model-path", "m", "--speculative-algorithm", "DDTREE",
        "--speculative-draft-model-path", "d", "--speculative-ddtree-budget", "48",
        "--speculative-ddtree-topk", "6", "--attention-backend", "triton"])
    assert record.speculative_algorithm == "DDTREE" and record.speculative_draft_model_path == "d"
    assert os.environ[cfg.ENV_BUDGET] == "48" and os.environ[cfg.ENV_TOPK] == "6"
    assert not hasattr(record, "speculative_ddtree_budget")  # not a ServerArgs field


def test_source_checkout_resolves_the_mapped_subpackages():
    """From the repo root (``python -m sglang.launch_server`` run there) the repo's package
    shadows the installed one; its mapped subpackages must still import, from the checkout."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import sglang_ddtree, sglang_ddtree.triton_kernels as t, sglang_ddtree.cuda_ext as c;"
            "print(sglang_ddtree.__file__); print(t.__file__); print(c.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": root}, check=True).stdout.split()
    assert out == [os.path.join(root, "sglang_ddtree", "__init__.py"),
                   os.path.join(root, "triton_kernels", "__init__.py"),
                   os.path.join(root, "cuda_ext", "__init__.py")]


def test_cli_info_lists_backends_behind_the_triton_verify(loaded):
    from sglang_ddtree import cli

    behind = cli.triton_verify_backends()
    assert "fa3" in behind["mha"] and "trtllm_mla" in behind["mla"]
    assert "triton" not in behind["mha"]  # native there
