"""One-launch KV relocation (kv_move.py) == SGLang-style per-column moves; pool detection.

Runs the Triton kernel under TRITON_INTERPRET=1 on CPU (conftest), on the GPU where present.
"""

import random

import pytest
import torch

from sglang_ddtree.accept import accept_walk_reference
from sglang_ddtree.commit import commit_from_path, kv_moves
from sglang_ddtree.kv_move import PathKVMover, path_kv_mover
from tests.test_commit import _predict_path, _random_tree

DEV = "cuda" if torch.cuda.is_available() else "cpu"


class MHATokenToKVPool:  # the names path_kv_mover recognises
    def __init__(self, slots, layers, heads, dim, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        mk = lambda: (torch.randn(slots, heads, dim, generator=g) * 8).to(dtype).to(DEV)  # noqa
        self.k_buffer = [mk() for _ in range(layers)]
        self.v_buffer = [mk() for _ in range(layers)]
        self.k_scale_buffer = None

    def buffers(self):
        return self.k_buffer + self.v_buffer


class MLATokenToKVPool:
    def __init__(self, slots, layers, width, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = [(torch.randn(slots, 1, width, generator=g) * 8).to(dtype).to(DEV)
                          for _ in range(layers)]

    def buffers(self):
        return self.kv_buffer


def _reference_moves(buffers, dst, src):
    """What SGLang's move_kv_cache does, one column at a time."""
    for j in range(dst.shape[1]):
        for buf in buffers:
            buf[dst[:, j]] = buf[src[:, j]].clone()


def _moves(bs, seed, width_extra=3):
    depth, k, budget = 7, 3, 20
    tree = _random_tree(bs, depth, k, budget, seed)
    pred = _predict_path(tree, random.Random(seed))
    accept_len, nodes, bonus = accept_walk_reference(tree, pred, depth)
    step = commit_from_path(tree, nodes, accept_len, bonus, torch.zeros(bs, dtype=torch.int64))
    n = tree.tokens.shape[1]
    # each request owns a disjoint, shuffled set of slots (slot 0 stays SGLang's padding slot)
    perm = torch.randperm(bs * (n + width_extra), generator=torch.Generator().manual_seed(seed))
    slots = (perm + 1).view(bs, n + width_extra)
    dst, src = kv_moves(slots, step.path_nodes, accept_len)
    return dst.to(DEV), src.to(DEV), int(slots.max()) + 1, accept_len


@pytest.mark.parametrize("kind,dtype,shape", [
    ("mha", torch.bfloat16, (2, 16)),   # 64-byte rows: int32 words
    ("mha", torch.float16, (1, 3)),     # 6-byte rows: int16 words
    ("mla", torch.bfloat16, (40,)),     # MLA latent (512 + 64 at real size)
    ("mla", torch.uint8, (37,)),        # fp8-like bytes, odd width: int8 words
    ("mla", torch.float32, (1100,)),    # a row longer than one block (loops over the row)
])
def test_one_launch_equals_column_by_column(kind, dtype, shape):
    for seed in range(3):
        bs = 4
        dst, src, slots, accept_len = _moves(bs, seed)
        if kind == "mha":
            a = MHATokenToKVPool(slots, 3, *shape, dtype=dtype, seed=seed)
            b = MHATokenToKVPool(slots, 3, *shape, dtype=dtype, seed=seed)
        else:
            a = MLATokenToKVPool(slots, 3, *shape, dtype=dtype, seed=seed)
            b = MLATokenToKVPool(slots, 3, *shape, dtype=dtype, seed=seed)
        before = [t.clone() for t in a.buffers()]
        PathKVMover(a.buffers())(dst, src)
        _reference_moves(b.buffers(), dst, src)
        for x, y in zip(a.buffers(), b.buffers()):
            assert torch.equal(x, y)
        if int(accept_len.max()) > 0:  # the move did something
            assert any(not torch.equal(x, y) for x, y in zip(a.buffers(), before))


def test_source_slots_overwritten_later_are_read_first():
    """Column 1 reads slot 12, which column 2 then overwrites: the order must hold."""
    pool = MLATokenToKVPool(16, 2, 8, torch.float32)
    ref = MLATokenToKVPool(16, 2, 8, torch.float32)
    dst = torch.tensor([[11, 12, 13]], device=DEV)
    src = torch.tensor([[12, 14, 13]], device=DEV)  # path nodes 2, 4 -> slots 12, 14; then no-op
    PathKVMover(pool.buffers())(dst, src)
    _reference_moves(ref.buffers(), dst, src)
    for x, y in zip(pool.buffers(), ref.buffers()):
        assert torch.equal(x, y)


def test_pool_detection():
    mha = MHATokenToKVPool(8, 2, 2, 4, torch.bfloat16)
    assert isinstance(path_kv_mover(mha), PathKVMover)
    assert path_kv_mover(mha) is path_kv_mover(mha)  # cached on the pool
    scaled = MHATokenToKVPool(8, 2, 2, 4, torch.bfloat16)
    scaled.k_scale_buffer = [torch.ones(8)]
    assert path_kv_mover(scaled) is None
    hnd = MHATokenToKVPool(8, 2, 2, 4, torch.bfloat16)
    hnd.use_hnd = True
    assert path_kv_mover(hnd) is None
    paged = MHATokenToKVPool(8, 2, 2, 4, torch.bfloat16)
    paged.kv_cache_layout = "vectorized_5d"  # SGLang 0.5.23 layouts that index pages
    assert path_kv_mover(paged) is None
    five_d = MHATokenToKVPool(8, 2, 2, 4, torch.bfloat16)
    five_d.k_buffer = [torch.zeros(2, 2, 1, 4, 2)]
    assert path_kv_mover(five_d) is None

    class SWAKVPool:
        k_buffer = [torch.zeros(4, 1, 2)]

    assert path_kv_mover(SWAKVPool()) is None
    strided = MLATokenToKVPool(8, 1, 6, torch.bfloat16)
    strided.kv_buffer = [torch.zeros(8, 1, 12, dtype=torch.bfloat16)[..., :6]]
    assert path_kv_mover(strided) is None


def test_empty_batch_is_a_no_op():
    pool = MLATokenToKVPool(4, 1, 8, torch.float32)
    before = pool.kv_buffer[0].clone()
    PathKVMover(pool.buffers())(torch.zeros(0, 3, dtype=torch.int64, device=DEV),
                                torch.zeros(0, 3, dtype=torch.int64, device=DEV))
    assert torch.equal(pool.kv_buffer[0], before)


def test_fused_path_is_the_default(monkeypatch):
    from sglang_ddtree import config as cfg

    monkeypatch.delenv(cfg.ENV_KV_MOVE, raising=False)
    assert cfg.kv_move_fused() is True
    monkeypatch.setenv(cfg.ENV_KV_MOVE, "sglang")
    assert cfg.kv_move_fused() is False
    monkeypatch.setenv(cfg.ENV_KV_MOVE, " Fused ")
    assert cfg.kv_move_fused() is True
    monkeypatch.setenv(cfg.ENV_KV_MOVE, "fast")
    with pytest.raises(cfg.DDTreeConfigError, match="expected sglang or fused"):
        cfg.kv_move_fused()
