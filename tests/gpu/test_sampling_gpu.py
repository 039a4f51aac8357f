"""T > 0 node draws through SGLang's flashinfer sampling kernels, on the GPU: the start-up
check passes, and the draws follow the row's filtered distribution (top-k 3, top-p 0.8)."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def _draw():
    from sglang.srt.layers import sampler

    from sglang_ddtree.sampling import checked_row_draw, make_flashinfer_row_draw

    draw = checked_row_draw(make_flashinfer_row_draw(sampler), "cuda")
    if draw is None:
        pytest.skip("SGLang's flashinfer sampling kernels are not available here")
    return draw


@pytest.mark.parametrize("top_k,top_p,want", [
    (3, 1.0, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0.0, 0.0]),
    (5, 0.65, [0.4 / 0.7, 0.3 / 0.7, 0.0, 0.0, 0.0]),  # joint: the 0.4 + 0.3 prefix covers 0.65
])
def test_draws_follow_the_filtered_distribution(top_k, top_p, want):
    import types

    draw = _draw()
    n = 40000
    p = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05], device="cuda")
    probs = p.repeat(n, 1)
    out = draw(probs, torch.full((n,), top_k, dtype=torch.int32, device="cuda"),
               torch.full((n,), top_p, device="cuda"), torch.zeros(n, device="cuda"),
               types.SimpleNamespace(need_min_p_sampling=False))
    freq = torch.bincount(out, minlength=5).float().cpu() / n
    # 4 sigma of a binomial proportion at n = 40000 is < 0.011
    assert torch.allclose(freq, torch.tensor(want), atol=0.011), freq
