"""GPU tests of the MLA absorb bmm at the DeepSeek-family shapes, and of the weight view that
sends SGLang's ``torch.bmm`` to it (``sglang_ddtree.mla_absorb``).

Tolerances: vs the fp32 reference, max |err| <= 1e-2 * max |ref| (bf16 inputs, fp32
accumulation, one bf16 rounding: about 4e-3 expected); vs cuBLAS's ``torch.bmm`` relative
Frobenius difference <= 1e-2. A CUDA-graph replay with new inputs equals an eager call bit for
bit.

If another test module imported triton in interpreter mode first, these tests skip and
``test_rerun_in_clean_process`` runs this file in a fresh process.
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_kernels import load_copy
from tests.triton_kernels._moe_kernels import lang_mode_matches, run_isolated

pytestmark = pytest.mark.gpu


def _ma():
    return load_copy("absorb", ("mla_absorb",), interpret=False)["mla_absorb"]


def _mode_ok() -> bool:
    _ma()
    return lang_mode_matches(interpret=False)


@pytest.fixture(scope="module")
def MA():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not _mode_ok():
        pytest.skip("triton was imported in interpreter mode here; see test_rerun_in_clean_process")
    return _ma()


def _operands(h, t, k, n, row, seed):
    """As the model passes them: a head-major view of token-major rows, K-contiguous w."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = torch.randn(t, h, row, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(h, n, k, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    return rows[:, :, :k].transpose(0, 1), w.transpose(1, 2)


@pytest.mark.parametrize("h", [8, 16, 128])
@pytest.mark.parametrize("t", [1, 2, 9, 16, 32, 33, 64, 264, 512])
@pytest.mark.parametrize("proj", ["q", "v"])
def test_deepseek_shapes_vs_reference_and_cublas(MA, proj, t, h):
    k, n, row = (128, 512, 192) if proj == "q" else (512, 128, 512)
    a, w = _operands(h, t, k, n, row, seed=t * 3 + h)
    flat = torch.full((t, h * n), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = flat.view(t, h, n).transpose(0, 1)
    MA.absorb_bmm(a, w, out=out)
    assert not flat.isnan().any(), "unwritten output elements"
    ref = MA.absorb_bmm_reference(a, w)
    err = (out.float() - ref).abs().max() / ref.abs().max()
    assert err <= 1e-2, err.item()
    cublas = torch.bmm(a, w).float()
    assert ((out.float() - cublas).norm() / cublas.norm()).item() <= 1e-2
    new = MA.absorb_bmm(a, w)
    assert torch.equal(new, out)  # the new-tensor path computes the same bits


def test_graph_replay_is_bitwise_the_eager_call(MA):
    a, w = _operands(8, 33, 128, 512, 192, seed=1)
    eager = MA.absorb_bmm(a, w).clone()
    a_in = a.clone()
    out = torch.empty(33, 8, 512, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        MA.absorb_bmm(a_in, w, out=out)
    a2, _ = _operands(8, 33, 128, 512, 192, seed=2)
    a_in.copy_(a2)
    graph.replay()
    assert torch.equal(out, MA.absorb_bmm(a2, w))
    a_in.copy_(a)
    graph.replay()
    assert torch.equal(out, eager)


def test_the_weight_view_runs_the_kernel_in_sglangs_calls(MA):
    """``torch.bmm`` as SGLang's prepare / core call it, on the view: our kernel's bits
    (the package's own copy of the kernel), cuBLAS's on the plain weight."""
    from sglang_ddtree import mla_absorb
    from sglang_ddtree.triton_kernels import mla_absorb as km

    a, w = _operands(8, 16, 128, 512, 192, seed=5)
    view = w.as_subclass(mla_absorb.AbsorbWeight)
    got = torch.bmm(a, view).transpose(0, 1)
    assert type(got) is torch.Tensor
    assert torch.equal(got, km.absorb_bmm(a, w).transpose(0, 1))
    o, wv = _operands(8, 16, 512, 128, 512, seed=6)
    y = torch.empty(16, 8 * 128, device="cuda", dtype=torch.bfloat16)
    torch.bmm(o, wv.as_subclass(mla_absorb.AbsorbWeight), out=y.view(16, 8, 128).transpose(0, 1))
    assert torch.equal(y.view(16, 8, 128).transpose(0, 1), km.absorb_bmm(o, wv))


def test_rerun_in_clean_process():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if _mode_ok():
        pytest.skip("ran in this process")
    run_isolated(__file__, interpret=False)
