"""FULL_MASK layout, positions and KV slot gathering for the verify forward."""

import os
import subprocess
import sys

import pytest
import torch

from sglang_ddtree.tree import full_mask_layout, full_mask_offsets
from sglang_ddtree.verify import full_mask_numel_bound, gather_slots, tree_positions, write_full_mask


def full_mask_reference(anc, lens):
    n = anc.shape[1]
    out = torch.zeros(int((n * (lens + n)).sum()), dtype=torch.bool)
    return full_mask_layout(anc, lens, out, full_mask_offsets(lens, n))


def _anc(bs, n, seed):
    g = torch.Generator().manual_seed(seed)
    parents = [[-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
               for _ in range(bs)]
    anc = torch.zeros(bs, n, n, dtype=torch.bool)
    for b in range(bs):
        for i in range(n):
            j = i
            while j >= 0:
                anc[b, i, j] = True
                j = parents[b][j]
    return anc


def test_reference_layout_by_hand():
    anc = torch.tensor([[[1, 0], [1, 1]]], dtype=torch.bool)
    out = full_mask_reference(anc, torch.tensor([3]))
    assert out.tolist() == [True, True, True, True, False, True, True, True, True, True]


def test_write_full_mask_cpu_matches_reference():
    anc = _anc(3, 5, 0)
    lens = torch.tensor([0, 7, 2])
    out = torch.zeros(full_mask_numel_bound(5, int(lens.sum()), 3) + 11, dtype=torch.bool)
    write_full_mask(anc, lens, out)
    ref = full_mask_reference(anc, lens)
    assert torch.equal(out[: ref.numel()], ref)


_INTERP = r"""
import torch
from sglang_ddtree import verify
from tests.test_verify import full_mask_reference
torch.manual_seed(0)
for bs, n in [(1, 1), (2, 9), (3, 33)]:
    anc = torch.rand(bs, n, n) < 0.5
    lens = torch.randint(0, 700, (bs,))
    ref = full_mask_reference(anc, lens)
    out = torch.zeros(ref.numel() + 5, dtype=torch.bool)
    verify._launch_full_mask(anc, lens, out)
    assert torch.equal(out[: ref.numel()], ref), (bs, n)
    assert not out[ref.numel():].any()
print("ok")
"""


def test_full_mask_triton_kernel_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _INTERP], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_positions_and_slots():
    depths = torch.tensor([[0, 1, 1, 2], [0, 1, 2, 3]])
    lens = torch.tensor([10, 3])
    assert tree_positions(depths, lens).tolist() == [[10, 11, 11, 12], [3, 4, 5, 6]]
    req_to_token = torch.arange(4 * 20).view(4, 20)
    slots = gather_slots(req_to_token, torch.tensor([2, 0]), lens, 4)
    assert slots.tolist() == [[50, 51, 52, 53], [3, 4, 5, 6]]


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="ancestor_mask"):
        write_full_mask(torch.zeros(2, 3, 4, dtype=torch.bool), torch.zeros(2),
                        torch.zeros(10, dtype=torch.bool))
