"""GPU tests of the skinny bf16 GEMM at the Kimi K2.6 TP8 rank's dense shapes.

Tolerances: vs the fp32 reference, max |err| <= 1e-2 * max |ref| (bf16 inputs, fp32
accumulation, one bf16 rounding of the output: about 4e-3 expected); vs cuBLAS (``x @ w.T``,
what SGLang's unquantized linear runs) relative Frobenius difference <= 1e-2. A CUDA-graph
replay with new inputs written into the captured ones equals an eager call bit for bit, and
repeated calls are bitwise equal (the split-K partials are summed in split order).

If another test module imported triton in interpreter mode first, these tests skip and
``test_rerun_in_clean_process`` runs this file in a fresh process.
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_kernels import load_copy
from tests.triton_kernels._moe_kernels import lang_mode_matches, run_isolated

pytestmark = pytest.mark.gpu

# (N, K) of the rank's dense GEMMs: q / kv down-projection, q up-projection (8 heads x 192),
# o_proj, the shared expert's gate-up and down, the router, the dense layer's down
KIMI_SHAPES = [(2112, 7168), (1536, 1536), (7168, 1024), (512, 7168), (7168, 256), (384, 7168),
               (7168, 2304)]


def _sg():
    return load_copy("skinny", ("skinny_gemm",), interpret=False)["skinny_gemm"]


def _mode_ok() -> bool:
    _sg()  # lazily: importing triton at collection would fix its mode
    return lang_mode_matches(interpret=False)


@pytest.fixture(scope="module")
def SG():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not _mode_ok():
        pytest.skip("triton was imported in interpreter mode here; see test_rerun_in_clean_process")
    return _sg()


def _inputs(m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    return x, w


@pytest.mark.parametrize("n,k", KIMI_SHAPES)
@pytest.mark.parametrize("m", [1, 8, 16, 17, 33, 64])
def test_kimi_shapes_vs_reference_and_cublas(SG, m, n, k):
    x, w = _inputs(m, n, k, seed=m * 7 + n)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    SG.skinny_gemm(x, w, out=out)
    assert not out.isnan().any(), "unwritten output elements"
    ref = SG.skinny_gemm_reference(x, w)
    err = (out.float() - ref).abs().max() / ref.abs().max()
    assert err <= 1e-2, err.item()
    cublas = (x @ w.t()).float()
    assert ((out.float() - cublas).norm() / cublas.norm()).item() <= 1e-2


def test_graph_replay_and_repeats_are_bitwise_equal(SG):
    n, k = 2112, 7168  # split 8 on an H200
    x, w = _inputs(33, n, k, seed=1)
    eager = SG.skinny_gemm(x, w).clone()
    for _ in range(3):
        assert torch.equal(SG.skinny_gemm(x, w), eager)
    x_in = x.clone()
    out = torch.empty_like(eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        SG.skinny_gemm(x_in, w, out=out)
    x2, _ = _inputs(33, n, k, seed=2)
    x_in.copy_(x2)
    graph.replay()
    assert torch.equal(out, SG.skinny_gemm(x2, w))
    x_in.copy_(x)
    for _ in range(3):
        graph.replay()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("n,k,m", [(384, 7168, 17), (512, 7168, 32), (7168, 1024, 33),
                                   (7168, 256, 24)])
def test_pdl_gives_the_same_bits_eager_and_in_a_graph(SG, n, k, m):
    """PDL mode 1 (sm_90+): the same bits as plain launches, eagerly and in a CUDA graph
    of three chained calls, each reading what the call before it wrote (a program that read
    it before its wait would see stale or NaN rows), replayed with new inputs."""
    if torch.cuda.get_device_capability() < (9, 0):
        with pytest.raises(ValueError, match="sm_90"):
            SG.skinny_gemm(*_inputs(m, n, k, seed=0), pdl=1)
        return
    x, w = _inputs(m, n, k, seed=3)
    w2 = (torch.randn(k, n, device="cuda") * 0.02).to(torch.bfloat16)  # [k, n]: back to K
    assert torch.equal(SG.skinny_gemm(x, w, pdl=1), SG.skinny_gemm(x, w, pdl=0))

    def buffers():
        return [torch.empty(m, n, device="cuda", dtype=torch.bfloat16),
                torch.empty(m, k, device="cuda", dtype=torch.bfloat16),
                torch.empty(m, n, device="cuda", dtype=torch.bfloat16)]

    def chain(x_in, mode, bufs):  # x @ w.T -> @ w2.T -> @ w.T
        SG.skinny_gemm(x_in, w, out=bufs[0], pdl=mode)
        SG.skinny_gemm(bufs[0], w2, out=bufs[1], pdl=mode)
        SG.skinny_gemm(bufs[1], w, out=bufs[2], pdl=mode)

    x_in, outs = x.clone(), buffers()
    chain(x_in, 1, outs)  # eager first: the counters are allocated outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(x_in, 1, outs)
    for seed in (4, 5):
        x_new, _ = _inputs(m, n, k, seed=seed)
        x_in.copy_(x_new)
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        want = buffers()
        chain(x_new, 0, want)
        for got, exp in zip(outs, want):
            assert torch.equal(got, exp)


def test_rerun_in_clean_process():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if _mode_ok():
        pytest.skip("ran in this process")
    run_isolated(__file__, interpret=False)
