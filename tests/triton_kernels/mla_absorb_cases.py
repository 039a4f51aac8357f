"""CPU cases (Triton interpreter) of the MLA absorb bmm against the fp32 reference.

Run by tests/triton_kernels/test_mla_absorb.py in a fresh process with ``TRITON_INTERPRET=1``
(directly: ``TRITON_INTERPRET=1 pytest tests/triton_kernels/mla_absorb_cases.py``).

Tolerance vs the fp32 reference: max |err| <= 1e-2 * max |ref| + 1e-3 (the interpreter dots in
fp32, so the only error is the output's bf16 rounding; a wrong head, row, column or K step gives
errors of order 1). Outputs are poisoned with NaN to catch unwritten elements. Operands are laid
out as SGLang's DeepSeek attention passes them: ``a`` a head-major view of token-major rows
(``q_nope.transpose(0, 1)`` of ``q [T, H, 192]``), ``w`` K-contiguous (``w_kc`` / ``w_vc`` are
transposed views of row-major ``[H, N, K]`` data).
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_kernels import load_copy

MA = load_copy("absorb", ("mla_absorb",), interpret=True)["mla_absorb"]
REL = 1e-2


def _operands(h, t, k, n, row=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(t, h, row or k, generator=g).to(torch.bfloat16)
    a = rows[:, :, :k].transpose(0, 1)  # [H, T, K], strides (row, H * row, 1)
    w = (torch.randn(h, n, k, generator=g) * 0.05).to(torch.bfloat16).transpose(1, 2)
    return a, w


def _check(a, w, out=None, cfg=None):
    got = MA.absorb_bmm(a, w, out=out, config=cfg)
    ref = MA.absorb_bmm_reference(a, w)
    if out is not None:
        assert got.data_ptr() == out.data_ptr()
    assert tuple(got.shape) == tuple(ref.shape)
    assert torch.isfinite(got.float()).all(), "unwritten output elements"
    err = (got.float() - ref).abs().max().item()
    assert err <= REL * ref.abs().max().item() + 1e-3, (tuple(a.shape), tuple(w.shape), cfg, err)
    return got


@pytest.mark.parametrize("t", [1, 3, 16, 17, 33, 64, 70])
def test_q_absorb_shapes_at_every_token_count(t):
    """``q_nope W_UK``: K 128 from 192-wide rows, N 512; T above 64 takes two T tiles."""
    a, w = _operands(2, t, 128, 512, row=192, seed=t)
    got = _check(a, w)
    # the new output is [T, H, N] memory seen as [H, T, N]: the model's transpose is contiguous
    assert got.transpose(0, 1).is_contiguous()


@pytest.mark.parametrize("t", [2, 16, 40])
def test_v_absorb_writes_into_a_transposed_out_view(t):
    """``o W_UV`` as the model calls it: ``out=`` a head-major view of [T, H * N] rows."""
    h, k, n = 3, 512, 128
    a, w = _operands(h, t, k, n, seed=100 + t)
    flat = torch.full((t, h * n), float("nan"), dtype=torch.bfloat16)
    out = flat.view(t, h, n).transpose(0, 1)
    _check(a, w, out=out)
    assert torch.isfinite(flat.float()).all()


@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("block_n,block_k", [(16, 64), (32, 128), (64, 32)])
def test_every_tile_orientation(swap, block_n, block_k):
    a, w = _operands(2, 9, 128, 256, row=192, seed=7)
    _check(a, w, cfg=MA.AbsorbConfig(block_n=block_n, block_k=block_k, swap=swap))


def test_heads_do_not_mix():
    """One head's weight zero: its output rows are exactly zero, the others are not."""
    a, w = _operands(3, 5, 128, 128, seed=11)
    w = w.clone()
    w[1].zero_()
    got = _check(a, w)
    assert torch.count_nonzero(got[1]) == 0
    assert torch.count_nonzero(got[0]) > 0 and torch.count_nonzero(got[2]) > 0


def test_bad_operands_are_named():
    a, w = _operands(2, 4, 128, 512)
    with pytest.raises(ValueError, match="unit K strides"):
        MA.absorb_bmm(a, w.contiguous())  # N-contiguous weights
    with pytest.raises(ValueError, match="bf16"):
        MA.absorb_bmm(a.float(), w)
    with pytest.raises(ValueError, match=r"w \[2, 128, N\]"):
        MA.absorb_bmm(a, w[:, :64])
    with pytest.raises(ValueError, match="out"):
        MA.absorb_bmm(a, w, out=torch.empty(2, 4, 256, dtype=torch.bfloat16))
    assert MA.check_shapes(a, w) is None
