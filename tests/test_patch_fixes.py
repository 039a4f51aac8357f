"""What each shipped patch does, exercised in the patched upstream code (CPU).

Fix 1 loads the patched ``triton/runtime/build.py`` as a module of the installed triton package and
points sysconfig, the prefixes and CPATH at fake include dirs. Fixes 2 and 3 unpack the whole
SGLang wheel, apply the patches with the patch command, and run probes in a subprocess that imports
that tree (the probes are this file's ``__main__``); SGLang 0.5.17 unpatched runs the same probes
to show the failures the patches remove.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest

PY_VER = f"{sys.version_info.major}.{sys.version_info.minor}"
BUILD_PY = "triton/runtime/build.py"


# ------------------------------------------------------------------------------------------------
# fix 1: triton finds Python.h or names the package to install


@pytest.fixture(scope="module", params=["3.6.0", "3.8.0"])
def build_sources(request, tmp_path_factory):
    """(patched, upstream) build.py paths for one triton release."""
    from tests import test_patcher as tp

    version = request.param
    root = tmp_path_factory.mktemp(f"triton-{version}")
    site = tp.make_site(root, "triton", version)
    assert tp.patcher.main(["apply", "--site-packages", str(site)]) == 0
    upstream = root / "upstream_build.py"
    upstream.write_bytes(tp.wheel_bytes("triton", version, BUILD_PY))
    return site / BUILD_PY, upstream


def import_build_module(path: Path):
    """Import ``path`` as a module of the installed triton.runtime package (its relative imports
    of ``.cache`` and ``..knobs`` resolve there; both exist in every release we patch)."""
    import triton.runtime  # noqa: F401  (SGLang depends on triton: present wherever SGLang is)

    name = f"triton.runtime._ddtree_build_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_build_module(path: Path, monkeypatch, *, include, includepy, prefix, base_prefix):
    """``import_build_module`` with its sysconfig and sys seeing the given include dir,
    INCLUDEPY and prefixes, and a recording stand-in for the compiler call."""
    mod = import_build_module(path)

    def get_paths(*args, **kwargs):
        return {**sysconfig.get_paths(*args, **kwargs), "include": str(include)}

    def get_config_var(key):
        return str(includepy) if key == "INCLUDEPY" else sysconfig.get_config_var(key)

    mod.sysconfig = SimpleNamespace(get_paths=get_paths, get_config_var=get_config_var,
                                    get_default_scheme=sysconfig.get_default_scheme)
    mod.sys = SimpleNamespace(version_info=sys.version_info, abiflags=getattr(sys, "abiflags", ""),
                              prefix=str(prefix), base_prefix=str(base_prefix))
    for var in ("CPATH", "C_INCLUDE_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CC", "fake-cc")  # never run: subprocess is replaced below
    calls = []
    mod.subprocess = SimpleNamespace(check_call=lambda cmd, **kw: calls.append(cmd),
                                     DEVNULL=subprocess.DEVNULL)
    return mod, calls


@pytest.fixture
def dirs(tmp_path):
    names = ["sys_include", "includepy", "venv", "base", "cpath", "c_include", "cuda"]
    out = SimpleNamespace(**{n: tmp_path / n for n in names})
    for n in names:
        getattr(out, n).mkdir()
    return out


def _load(path, monkeypatch, d):
    return load_build_module(path, monkeypatch, include=d.sys_include, includepy=d.includepy,
                             prefix=d.venv, base_prefix=d.base)


def _call_build(mod, tmp_path, include_dirs):
    return mod._build("launcher", str(tmp_path / "launcher.c"), str(tmp_path), [], include_dirs,
                      ["cuda"], [])


def test_fix1_no_headers_anywhere_names_the_dev_package(build_sources, dirs, monkeypatch, tmp_path):
    patched, _ = build_sources
    mod, calls = _load(patched, monkeypatch, dirs)
    monkeypatch.setenv("CPATH", str(dirs.cpath))
    monkeypatch.setenv("C_INCLUDE_PATH", str(dirs.c_include))
    with pytest.raises(RuntimeError) as e:
        _call_build(mod, tmp_path, [str(dirs.cuda)])
    msg = str(e.value)
    assert f"python{PY_VER}-dev" in msg and "Python.h" in msg
    for d in (dirs.sys_include, dirs.includepy, dirs.venv / "include" / f"python{PY_VER}",
              dirs.base / "include" / f"python{PY_VER}", dirs.cpath, dirs.c_include, dirs.cuda):
        assert str(d) in msg, d
    assert calls == []  # failed before invoking the compiler


@pytest.mark.parametrize("where", ["sys_include", "includepy", "venv", "venv_site", "cpath",
                                   "c_include_sub", "caller"])
def test_fix1_headers_found_where_they_are(build_sources, dirs, monkeypatch, tmp_path, where):
    patched, _ = build_sources
    mod, calls = _load(patched, monkeypatch, dirs)
    monkeypatch.setenv("CPATH", os.pathsep.join(["", str(dirs.cpath)]))
    monkeypatch.setenv("C_INCLUDE_PATH", str(dirs.c_include))
    home = {
        "sys_include": dirs.sys_include,
        "includepy": dirs.includepy,
        "venv": dirs.venv / "include" / f"python{PY_VER}",
        "venv_site": dirs.venv / "include" / "site" / f"python{PY_VER}",
        "cpath": dirs.cpath,
        "c_include_sub": dirs.c_include / f"python{PY_VER}",
        "caller": dirs.cuda,
    }[where]
    home.mkdir(parents=True, exist_ok=True)
    (home / "Python.h").write_text("/* fake */\n")
    _call_build(mod, tmp_path, [str(dirs.cuda)])
    (cmd,) = calls
    assert f"-I{home}" in cmd
    assert cmd[0] == "fake-cc"


def test_fix1_sysconfig_dir_still_wins_when_it_has_the_headers(build_sources, dirs, monkeypatch):
    patched, _ = build_sources
    mod, _ = _load(patched, monkeypatch, dirs)
    for d in (dirs.sys_include, dirs.includepy, dirs.cpath):
        (d / "Python.h").write_text("")
    monkeypatch.setenv("CPATH", str(dirs.cpath))
    assert mod._find_python_include_dir("posix_prefix", []) == str(dirs.sys_include)


def test_fix1_real_build_on_this_host(build_sources, tmp_path, monkeypatch):
    # The normal case end to end: real sysconfig, real compiler, a C extension that includes
    # Python.h, built by the patched _build and imported.
    if shutil.which("gcc") is None and shutil.which("clang") is None:
        pytest.skip("no C compiler on this host")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        pytest.skip("this interpreter's own Python.h is missing (the case fix 1 reports)")
    monkeypatch.delenv("CC", raising=False)
    mod = import_build_module(build_sources[0])
    src = tmp_path / "ddtree_probe.c"
    src.write_text(
        "#include <Python.h>\n"
        "static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, \"ddtree_probe\", 0, -1, 0};\n"
        "PyMODINIT_FUNC PyInit_ddtree_probe(void) {\n"
        "  PyObject *m = PyModule_Create(&def);\n"
        "  PyModule_AddIntConstant(m, \"answer\", 42);\n"
        "  return m;\n}\n")
    so = mod._build("ddtree_probe", str(src), str(tmp_path), [], [], [], [])
    assert mod._load_module_from_path("ddtree_probe", so).answer == 42


def test_fix1_upstream_compiles_blindly_without_headers(build_sources, dirs, monkeypatch, tmp_path):
    # The unpatched build step hands the compiler an include dir with no Python.h, and the
    # user gets a bare "Python.h: No such file or directory" from gcc instead of advice.
    _, upstream = build_sources
    mod, calls = _load(upstream, monkeypatch, dirs)
    _call_build(mod, tmp_path, [str(dirs.cuda)])
    (cmd,) = calls
    assert f"-I{dirs.sys_include}" in cmd


# ------------------------------------------------------------------------------------------------
# fixes 2 and 3 in the real SGLang trees


@pytest.fixture(scope="module")
def probe_results(tmp_path_factory):
    """Probe output per tree: 0.5.17 and 0.5.23 patched, 0.5.17 upstream (run concurrently)."""
    from tests import test_patcher as tp

    procs = {}
    for version, patched in (("0.5.17", True), ("0.5.23", True), ("0.5.17", False)):
        key = f"{version}{'' if patched else '-upstream'}"
        site = tp.make_site(tmp_path_factory.mktemp(key), "sglang", version, members=["*"])
        if patched:
            assert tp.patcher.main(["apply", "--site-packages", str(site)]) == 0
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
        procs[key] = (site, subprocess.Popen(
            [sys.executable, __file__, "fix2", "fix3"], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env, cwd=site))
    results = {}
    for key, (site, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        lines = [x for x in stdout.splitlines() if x.startswith("PROBE ")]
        assert proc.returncode == 0 and lines, f"{key} probe failed:\n{stderr[-4000:]}"
        results[key] = json.loads(lines[-1][len("PROBE "):])
        assert results[key]["sglang_file"].startswith(str(site)), results[key]
    return results


@pytest.mark.parametrize("version", ["0.5.17", "0.5.23"])
def test_fix2_vision_backend_falls_back_when_flash_attn_cute_is_missing(probe_results, version):
    r = probe_results[version]["fix2"]
    # Blackwell default (and an explicit fa4 request) resolve to an importable backend ...
    assert r["default"] == "triton_attn" and r["explicit_fa4"] == "triton_attn"
    assert r["backend_class"] == "VisionTritonAttention" and r["construct_error"] is None
    # ... with exactly one log line saying so, although the resolution ran twice.
    assert len(r["log"]) == 1 and "flash_attn.cute" in r["log"][0] and "triton_attn" in r["log"][0]
    # FlashAttention-4 really is unusable in this process: the fa4 path would have raised.
    assert r["fa4_call"] == "ImportError"
    # When FlashAttention-4 imports, fa4 stays the choice and nothing is logged.
    assert r["with_fa4"] == "fa4" and r["log_with_fa4"] == []


def test_fix2_upstream_picks_fa4_and_would_die(probe_results):
    r = probe_results["0.5.17-upstream"]["fix2"]
    assert r["default"] == "fa4" and r["log"] == [] and r["fa4_call"] == "ImportError"


@pytest.mark.parametrize("version", ["0.5.17", "0.5.23"])
def test_fix3_plugin_tree_algorithm_gets_a_custom_mask_verify_input(probe_results, version):
    r = probe_results[version]["fix3"]
    width, max_bs = r["width"], r["max_bs"]
    assert width == 17  # budget 16 + 1, above the 8 that crashed
    # The runner's mask buffer, sized for the plugin's width: per request N x (prefix 1 + N).
    assert r["mask_numel"] == max_bs * width * (1 + width) and r["mask_all_ones"]
    for path in ("runner", "dummy"):  # DecodeCudaGraphRunner.get_spec_info, create_dummy_verify_input
        got = r[path]
        assert got["is_verify_input"] and got["mask_is_buffer"], got
        assert got["draft_token_num"] == width and got["num_tokens_per_req"] == width
        assert got["capture_hidden_mode"] == "FULL"
    assert r["draft_worker"] is None  # the drafter keeps SGLang's own dispatch
    assert r["non_tree_plugin"] is None  # unchanged for plugins that are not trees
    assert r["override"] == "PluginVerifyInput"  # a plugin can supply its own input class


def test_fix3_upstream_gives_the_plugin_no_verify_input(probe_results):
    r = probe_results["0.5.17-upstream"]["fix3"]
    assert r["runner"] is None and r["dummy"] is None


# ------------------------------------------------------------------------------------------------
# probes, run in a subprocess against one SGLang tree: python test_patch_fixes.py fix2 fix3


def _probe_fix2() -> dict:
    import logging

    # flash_attn.cute (pip) and SGLang's vendored copy both fail to import, as on a host without
    # the CUTE DSL; set before anything imports them.
    sys.modules["flash_attn.cute"] = None
    sys.modules["sglang.kernels.ops.attention.flash_attn.cute"] = None
    import sglang.srt.layers.attention.vision as vision

    log = []
    handler = logging.Handler()
    handler.emit = lambda record: log.append(record.getMessage())
    logging.getLogger("sglang.srt.layers.attention.vision").addHandler(handler)
    logging.getLogger("sglang.srt.layers.attention.vision").setLevel(logging.INFO)

    mm = SimpleNamespace(mm_attention_backend=None)
    vision.get_mm = lambda: mm  # no server args: the platform default decides
    vision.is_cuda = lambda: True
    vision.get_device_capability = lambda *a, **k: (10, 0)  # B200: default is fa4
    resolve = vision.VisionAttention._determine_attention_backend
    out = {"default": resolve(SimpleNamespace(), None)}
    mm.mm_attention_backend = "fa4"
    out["explicit_fa4"] = resolve(SimpleNamespace(), None)
    out["log"] = [m for m in log if "fa4" in m]
    out["backend_class"] = vision.QKV_BACKEND_IMPL[out["default"]].__name__
    try:
        vision.QKV_BACKEND_IMPL[out["default"]](use_data_parallel=True, head_dim=16, num_heads=2)
        out["construct_error"] = None
    except Exception as e:  # recorded for the test to judge (upstream fa4 refuses on CPU)
        out["construct_error"] = repr(e)

    import torch
    from sglang.kernels.ops.attention import flash_attention_v4

    try:
        flash_attention_v4.flash_attn_varlen_func(*(torch.zeros(4, 2, 16) for _ in range(3)))
        out["fa4_call"] = "ran"
    except ImportError:
        out["fa4_call"] = "ImportError"

    fallback = getattr(vision, "_fa4_or_importable_fallback", None)
    if fallback is not None:  # patched: with FlashAttention-4 importable, fa4 is kept
        fallback.cache_clear()
        sys.modules["sglang.kernels.ops.attention.flash_attention_v4"] = SimpleNamespace(
            is_flash_attention_v4_available=lambda: True)
        sys.modules["sglang.kernels.ops.attention"].flash_attention_v4 = sys.modules[
            "sglang.kernels.ops.attention.flash_attention_v4"]
        del log[:]
        out["with_fa4"] = resolve(SimpleNamespace(), None)
        out["log_with_fa4"] = [m for m in log if "fa4" in m]
    return out


def _probe_fix3() -> dict:
    import inspect

    import torch
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.model_executor.runner_utils.buffers import DecodeInputBuffers
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm, create_dummy_verify_input
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    budget, max_bs = 16, 3

    class TreeSpec(CustomSpecAlgo):  # what a DDTree-like plugin declares
        def is_tree_verify(self):
            return True

        def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens, is_draft_worker):
            return budget + 1

    class PluginVerifyInput:
        pass

    class OwnInputSpec(TreeSpec):
        def create_dummy_verify_input(self, custom_mask, num_tokens_per_req, is_draft_worker):
            return PluginVerifyInput()

    def register(name, spec_class):
        SpeculativeAlgorithm.register(name, supports_overlap=True, spec_class=spec_class)(
            lambda server_args: None)
        return SpeculativeAlgorithm.from_string(name.lower())

    tree, plain = register("PROBE_TREE", TreeSpec), register("PROBE_PLAIN", CustomSpecAlgo)
    own = register("PROBE_OWN", OwnInputSpec)
    width = tree.get_num_tokens_per_req_for_target_verify(8, False)

    # The runner's buffers, built by SGLang's own code for this width (signature differs by version).
    args = dict(device=torch.device("cpu"), max_bs=max_bs, max_num_token=max_bs * width,
                hidden_size=8, next_token_logits_buffer=torch.zeros(1), dtype=torch.float32,
                dp_size=1, num_dp_ranks=1, pp_size=1, is_encoder_decoder=False,
                require_mlp_tp_gather=False, seq_len_fill_value=1, encoder_len_fill_value=0,
                num_tokens_per_req=width, cache_loc_dtype=torch.int64, enable_mamba_track=False)
    params = inspect.signature(DecodeInputBuffers.create).parameters
    buffers_module = sys.modules[DecodeInputBuffers.__module__]
    if hasattr(buffers_module, "enable_num_token_non_padded"):  # 0.5.23 asks the parallel config
        buffers_module.enable_num_token_non_padded = lambda: False
    buffers = DecodeInputBuffers.create(**{k: v for k, v in args.items() if k in params})
    mask = buffers.custom_mask

    def runner_input(algo, is_draft_worker=False):
        runner = SimpleNamespace(
            model_runner=SimpleNamespace(spec_algorithm=algo, is_draft_worker=is_draft_worker),
            buffers=buffers, captured_req_width=width)
        return DecodeCudaGraphRunner.get_spec_info(runner, max_bs * width)

    def describe(spec_info):
        if spec_info is None:
            return None
        return dict(is_verify_input=spec_info.is_verify_input(),
                    mask_is_buffer=spec_info.custom_mask is mask,
                    draft_token_num=spec_info.draft_token_num,
                    num_tokens_per_req=spec_info.num_tokens_per_req,
                    capture_hidden_mode=spec_info.capture_hidden_mode.name)

    dummy_params = inspect.signature(create_dummy_verify_input).parameters
    dummy_args = dict(spec_algorithm=tree, server_args=None, custom_mask=mask,
                      num_tokens_per_req=width, is_draft_worker=False)
    dummy = create_dummy_verify_input(**{k: v for k, v in dummy_args.items() if k in dummy_params})
    return dict(
        width=width, max_bs=max_bs, mask_numel=mask.numel(), mask_all_ones=bool(mask.all()),
        runner=describe(runner_input(tree)), dummy=describe(dummy),
        draft_worker=describe(runner_input(tree, is_draft_worker=True)),
        non_tree_plugin=describe(runner_input(plain)),
        override=type(runner_input(own)).__name__ if hasattr(CustomSpecAlgo, "is_tree_verify")
        else None)


if __name__ == "__main__":
    # Run from this file, sys.path[0] is tests/, whose triton_kernels/ would shadow sglang-kernel's.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    import sglang

    result = {"sglang_file": sglang.__file__}
    result.update({name: globals()[f"_probe_{name}"]() for name in sys.argv[1:]})
    print("PROBE " + json.dumps(result))
