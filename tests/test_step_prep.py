"""StepPrep: the step's KV slots, drafter block ids and positions in one Triton launch, equal
to the torch ops. Runs the kernel under TRITON_INTERPRET=1 on CPU (conftest), on the GPU where
present."""

import pytest
import torch

from sglang_ddtree.step_prep import StepPrep, prepare_step_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
MASK = 4097


def _kernel_prep(width, block):
    prep = StepPrep(width, block, MASK, DEV)
    prep.use_kernel = True  # on CPU too: the interpreter runs it
    return prep


@pytest.mark.parametrize("width,block,bs", [(33, 16, 3), (16, 16, 1), (1025, 16, 2), (9, 4, 5)])
def test_kernel_equals_the_torch_ops(width, block, bs):
    g = torch.Generator().manual_seed(width + bs)
    rows, cols = 7, width + 300
    req_to_token = torch.randint(0, 1 << 20, (rows, cols), generator=g,
                                 dtype=torch.int32).to(DEV)  # SGLang's pool dtype
    rpi = torch.randperm(rows, generator=g)[:bs].to(DEV)
    prefix = torch.randint(0, cols - width + 1, (bs,), generator=g).to(DEV)
    prefix[0] = cols - width  # the reserved slots end at the row's end
    bonus = torch.randint(0, 4000, (bs,), generator=g).to(DEV)
    prep = _kernel_prep(width, block)
    got = prep(req_to_token, rpi, prefix, bonus)
    want = prepare_step_reference(req_to_token, rpi, prefix, bonus, width, block, MASK)
    assert len(got) == len(want) == 4
    for name, a, b in zip(("slots", "block_ids", "positions", "prefix"), got, want):
        assert a.dtype == torch.int64 and torch.equal(a, b), name
    assert torch.equal(got[3], prefix) and got[3].data_ptr() != prefix.data_ptr()  # a snapshot
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(got, prep.buffers(bs)))
    # per-batch-size buffers: the next step at this size writes the same tensors
    again = prep(req_to_token, rpi, prefix, bonus)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(got, again))


def test_reference_layout():
    req_to_token = torch.arange(40).view(2, 20)
    slots, ids, pos, prefix = prepare_step_reference(
        req_to_token, torch.tensor([1]), torch.tensor([5], dtype=torch.int32), torch.tensor([9]),
        4, 3, MASK)
    assert slots.tolist() == [[25, 26, 27, 28]] and prefix.tolist() == [5]
    assert prefix.dtype == torch.int64
    assert ids.tolist() == [[9, MASK, MASK]] and pos.tolist() == [[5, 6, 7]]


def test_self_check_passes_and_a_broken_kernel_falls_back(monkeypatch):
    req_to_token = torch.randint(0, 1000, (6, 200), dtype=torch.int32).to(DEV)
    prep = _kernel_prep(33, 16)
    assert prep.self_check(req_to_token) and prep.use_kernel

    from sglang_ddtree import step_prep

    def broken(*a, **kw):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(step_prep, "_step_prep_kernel", {(1,): broken, (5,): broken})
    prep = _kernel_prep(33, 16)
    assert not prep.self_check(req_to_token) and not prep.use_kernel
    # the torch ops serve from then on
    assert prep.buffers(1) is None  # no static buffers for the graph to read in place
    slots, _, _, _ = prep(req_to_token, torch.tensor([2]).to(DEV), torch.tensor([3]).to(DEV),
                       torch.tensor([1]).to(DEV))
    assert torch.equal(slots, req_to_token[2, 3:36].to(torch.int64)[None])


def test_buffers_are_zeroed_and_per_batch_size():
    prep = _kernel_prep(9, 4)
    a = prep.buffers(3)
    assert [tuple(t.shape) for t in a] == [(3, 9), (3, 4), (3, 4), (3,)]
    assert all(t.dtype == torch.int64 and not t.any() for t in a)
    assert prep.buffers(3) is a and prep.buffers(2) is not a
