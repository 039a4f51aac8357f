"""A failed registration turns --speculative-algorithm DDTREE into a refusal naming the reason.

Runs in a fresh interpreter: it patches SGLang's algorithm lookup process-wide.
"""

import subprocess
import sys

import pytest

pytest.importorskip("sglang")

_PROBE = r"""
from sglang_ddtree import compat, plugin

def boom(ver=None):
    raise compat.UnsupportedSGLangVersion("sglang-ddtree does not support SGLang 9.9.9")

compat.load = boom
try:
    plugin.register()
except compat.UnsupportedSGLangVersion:
    pass
else:
    raise SystemExit("register() did not raise")
from sglang.srt.plugins.hook_registry import HookRegistry
HookRegistry.apply_hooks()
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
try:
    SpeculativeAlgorithm.from_string("DDTREE")
except ValueError as e:
    assert "9.9.9" in str(e) and "unavailable" in str(e), e
else:
    raise SystemExit("DDTREE resolved after a failed registration")
assert SpeculativeAlgorithm.from_string("DFLASH").name == "DFLASH"
print("ok")
"""


def test_failed_registration_gives_a_clear_refusal():
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def test_backend_name_follows_what_runs_target_verify():
    """The startup backend check names the backend that runs TARGET_VERIFY: through SGLang's
    prefill/decode hybrid (by its speculative attention mode) and hybrid-linear wrappers, never
    into a leaf backend's own fields (flashinfer keeps the string "fa2" in ``decode_backend``)."""
    import types

    from sglang_ddtree.compat._common import attention_backend_name

    FlashInferAttnBackend = type("FlashInferAttnBackend", (), {})
    TritonAttnBackend = type("TritonAttnBackend", (), {})
    HybridAttnBackend = type("HybridAttnBackend", (), {})
    Wrapper = type("HybridLinearAttnBackend", (), {})
    runner = lambda b: types.SimpleNamespace(attn_backend=b)  # noqa: E731

    fi = FlashInferAttnBackend()
    fi.decode_backend = "fa2"
    assert attention_backend_name(runner(fi)) == "flashinfer"

    hybrid = HybridAttnBackend()
    hybrid.prefill_backend, hybrid.decode_backend = TritonAttnBackend(), fi
    hybrid.spec_attn_is_decode = False  # verify runs on the prefill backend
    assert attention_backend_name(runner(hybrid)) == "triton"
    hybrid.spec_attn_is_decode = True
    assert attention_backend_name(runner(hybrid)) == "flashinfer"

    outer = Wrapper()
    outer.full_attn_backend = hybrid
    assert attention_backend_name(runner(outer)) == "flashinfer"
