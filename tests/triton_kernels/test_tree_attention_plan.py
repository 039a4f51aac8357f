"""Launch planning of the tree-verify kernels (triton_kernels/tree_attention_plan.py): tile
rules and split counts at H200-measured points. Host-side only: nothing runs on a device."""
from __future__ import annotations

import torch

from tests.triton_kernels import load_kernels

PLAN = load_kernels(interpret=True).tree_attention_plan


def test_split_count_fills_whole_waves():
    """H200 MLA cases (264 program slots: 2 per SM) from
    bench_results/tree_verify_mla_splits_h200_s19.json: the split count does not spill a few
    programs into an extra wave, and programs that fill several waves split further."""
    sc = PLAN.split_count
    assert sc(9, 264, 10**6) == 29  # batch 1 / budget 32: 261 programs (the old rule: 30, 270)
    assert sc(10, 264, 10**6) == 26  # 260 (old 27: 270; at 32,768 keys 177 us vs 24's 122)
    assert sc(12, 264, 10**6) == 22  # 264 exactly, as before
    assert sc(136, 264, 10**6) == 15  # batch 8 / budget 64 (old 2: three waves of half the keys)
    assert sc(5, 264, 10**6) == 52  # one full wave of splits may exceed 16
    for programs in range(1, 600):
        s = sc(programs, 264, 10**6)
        limit = min(64, max(16, 264 // programs))
        cost = lambda n: -(-programs * n // 264) / n  # noqa: E731 - waves per unit of prefix
        # the largest count within 5 % of the best of 1..limit (16, or one wave of splits)
        assert s <= limit and cost(s) <= 1.05 * min(map(cost, range(1, limit + 1)))
        assert all(cost(n) > 1.05 * min(map(cost, range(1, limit + 1)))
                   for n in range(s + 1, limit + 1)), programs
    assert sc(9, 264, 7) == 7 and sc(9, 264, 10**6, max_splits=3) == 3  # caps win
    assert sc(400, 264, 10**6, max_splits=1) == 1


def test_mha_split_count_evens_out_waves():
    """MHA split counts at H200-measured points (132 SMs): a short last wave takes a second
    split, equal waves keep the fewer splits, the 8-warp tile counts one program per SM."""
    f = PLAN.mha_split_count
    assert f(288, 132, 4, 512) == 2  # batch 12, budget 32: 2 waves -> 3 half-length ones
    assert f(768, 132, 4, 512) == 1  # batch 32, budget 32: 3 waves either way
    assert f(16, 132, 4, 512) == 16  # batch 2, budget 8: 16 x 16 = 256 <= 264 slots
    assert f(80, 132, 4, 512) == 3   # batch 10, budget 8: 240 programs, one wave
    assert f(192, 132, 8, 512) == 2  # batch 8, budget 64, 128-row tiles on 132 slots
    assert f(192, 132, 4, 512) == 1  # the same count of 4-warp programs fits 264 slots
    assert f(24, 132, 8, 512) == 11  # batch 1, budget 64
    assert f(8, 132, 4, 4) == 4 and f(8, 132, 4, 512, max_splits=2) == 2  # caps


def test_small_batch_mla_tile_rule(monkeypatch):
    """Off Hopper (the Hopper rules: the next tests) the small-batch MLA tile serves a whole
    batch of at most 144 query rows per KV head, the default tile with 128-key splits trees of
    at most 264 rows in batches of at most 528, on CUDA only; MHA shapes and bigger batches
    keep the default tile."""
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    monkeypatch.setattr(PLAN, "_hopper", lambda device: False)  # the same answer on an H200
    small = PLAN._batch_config(512, 64, 512, 17 * 8, 1, cuda)  # Kimi TP8: budget 16, batch 1
    assert small is not None and small.block_m == 16 and small.min_split_keys == 128
    assert PLAN._batch_config(512, 64, 512, 9 * 8, 2, cuda) == small  # budget 8, batch 2
    # budget 32 at batch 1 and 2: the default tile with splits of at least 128 keys
    few = PLAN._batch_config(512, 64, 512, 33 * 8, 1, cuda)
    default = PLAN._default_config(512, 64, 512, 33 * 8, cuda)
    assert few is not None and few.min_split_keys == 128 and default.min_split_keys == 256
    assert few.block_m == default.block_m and few.block_n == default.block_n
    assert PLAN._batch_config(512, 64, 512, 33 * 8, 2, cuda) == few
    assert PLAN._batch_config(512, 64, 512, 33 * 8, 3, cuda) is None  # budget 32, batch 3
    assert PLAN._batch_config(512, 64, 512, 65 * 8, 1, cuda) is None  # budget 64
    assert PLAN._batch_config(512, 64, 512, 9 * 8, 3, cuda) is None  # budget 8, batch 3
    assert PLAN._batch_config(128, 0, 128, 9, 1, cuda) is None  # MHA
    assert PLAN._batch_config(512, 64, 512, 9 * 8, 1, torch.device("cpu")) is None


def test_mha_tile_rule():
    """MHA: 64-row tiles below 256 rows per KV head (a 132-row tree is three 64-row blocks, not
    two 128-row ones), 128-row tiles from 256 rows unless the batch has more than 64 KV-head
    groups; head dims above 128 and CPU keep their own tiles."""
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    for rows in (36, 68, 132, 255):  # Qwen3-8B (4 query heads per KV head): budgets 8 / 16 / 32
        cfg = PLAN._default_config(128, 0, 128, rows, cuda)
        assert (cfg.block_m, cfg.num_warps) == (64, 4), rows
        assert PLAN._batch_config(128, 0, 128, rows, 32 * 8, cuda) is None
    wide = PLAN._default_config(128, 0, 128, 65 * 4, cuda)  # budget 64
    assert (wide.block_m, wide.num_warps) == (128, 8)
    assert PLAN._batch_config(128, 0, 128, 65 * 4, 8 * 8, cuda) is None  # batch 8: 64 groups
    tile = PLAN._batch_config(128, 0, 128, 65 * 4, 9 * 8, cuda)  # batch 9: 72 groups
    assert tile is not None and (tile.block_m, tile.num_warps) == (64, 4)
    assert PLAN._default_config(128, 0, 128, 132, cuda) == tile
    assert PLAN._batch_config(256, 0, 256, 65 * 4, 32 * 8, cuda) is None  # head dim 256
    assert PLAN._default_config(128, 0, 128, 132, torch.device("cpu")).block_m == 16


def test_mla_tiles_follow_the_devices_shared_memory(monkeypatch):
    """MLA: where a block may not take the 32-row tile's 114,688 bytes (sm_86 / sm_89 /
    sm_120: 99 KB, 100 KB an SM) the 16-row tile serves every batch size, one program per SM
    in split_count's slots; on an H200 (227 KB a block, 228 KB an SM) nothing changes: the
    32-row tile, two programs per SM. Off a GPU, or where CUDA cannot be asked, the H200's."""
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    monkeypatch.setattr(PLAN, "_hopper", lambda device: False)  # the 32-row tile's rules
    rows = 33 * 8  # Kimi TP8, budget 32
    for have, block_m, per_sm in (((232448, 233472), 32, 2), ((166912, 167936), 32, 1),
                                  ((101376, 102400), 16, 1), (None, 32, 2)):
        monkeypatch.setattr(PLAN, "shared_memory", lambda device, have=have: have)
        cfg = PLAN._default_config(512, 64, 512, rows, cuda)
        assert cfg.block_m == block_m, have
        assert PLAN.mla_programs_per_sm(cfg, cuda) == per_sm, have
        few = PLAN._batch_config(512, 64, 512, rows, 1, cuda)  # batch 1: 128-key splits
        assert few.block_m == block_m and few.min_split_keys == 128
        small = PLAN._batch_config(512, 64, 512, 17 * 8, 1, cuda)  # the small-batch tile
        assert small.block_m == 16
        assert PLAN.mla_programs_per_sm(small, cuda) == (1 if have and have[1] < 190464 else 2)
    # a tile of another shape: the planner's assumption (registers: two programs)
    odd = PLAN.KernelConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)
    assert PLAN.mla_programs_per_sm(odd, cuda) == 2
    # 8 warps at 255 registers a thread: one program per SM whatever the shared memory
    wide = PLAN.KernelConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)
    assert PLAN.mla_programs_per_sm(wide, cuda) == 1
    assert PLAN._default_config(128, 0, 128, 36, cuda).block_m == 64  # MHA untouched


def test_mla_split_count_uses_the_devices_slots(monkeypatch):
    """TreeAttention's MLA split count takes its slots from mla_programs_per_sm (one program
    per SM here: whole waves of half the H200's slots)."""
    from tests.triton_kernels import load_kernels

    k = load_kernels(interpret=True)
    ta, mla = k.tree_attention, k.tree_attention_mla
    seen = []
    monkeypatch.setattr(ta, "mla_programs_per_sm", lambda cfg, device: seen.append(cfg) or 1)
    monkeypatch.setattr(ta, "_num_sms", lambda device: 132)  # an H200's SM count
    attn = mla.TreeAttentionMLA.plan(max_batch_size=2, num_tree_tokens=9, num_heads=8,
                                     max_context_len=1 << 17, device="cpu", sm_scale=0.1)
    # batch 1 / 2 (5 / 10 row blocks of the CPU tile): 26 / 13 splits on 132 slots, where
    # two programs per SM (264 slots) would take 52 / 26
    assert [attn.num_splits(bs) for bs in (1, 2)] == [26, 13]
    assert seen and set(seen) == {attn.config_for(1), attn.config_for(2)}


def test_wide_mla_trees_take_the_8_warp_tile_on_hopper_only(monkeypatch):
    """On Hopper the 8-warp 64-row MLA tile (wgmma; one program per SM in the split planner's
    slots) serves trees of more than 264 rows per request (Kimi TP8: budget 33 and up), of 264
    in batches of 4 and more, and, past the small-batch tile, trees of 64-264 rows that 64-row
    blocks pad no more than 32-row blocks (rows % 64 == 0 or > 32; 128-key splits up to 768
    rows in the batch, 256-key past it) and padded trees of 128-264 rows in batches of up to
    544 rows (128-key splits): session 44's H200 measurements. Elsewhere, on other archs and on
    a device whose blocks cannot take 225,280 bytes, the 32-row tile (128-key splits for
    145-264 rows in batches of up to 528 rows) or the small-batch tile."""
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    assert not PLAN._hopper(torch.device("cpu"))
    monkeypatch.setattr(PLAN, "shared_memory", lambda device: (232448, 233472))
    shape = lambda c: (c.block_m, c.block_n, c.num_warps, c.num_stages, c.dv_split,  # noqa: E731
                       c.dk_chunk)
    # (budget, batch): (8-warp tile, split minimum) on Hopper, the same on other archs
    cases = {
        (64, 1): ((True, 256), (False, 256)), (33, 2): ((True, 256), (False, 256)),
        (32, 8): ((True, 256), (False, 256)), (32, 32): ((True, 256), (False, 256)),
        (32, 4): ((True, 256), (False, 256)), (32, 3): ((False, 256), (False, 256)),
        (32, 1): ((True, 128), (False, 128)), (32, 2): ((True, 128), (False, 128)),
        (31, 1): ((True, 128), (False, 128)), (31, 2): ((True, 128), (False, 128)),
        (31, 8): ((True, 256), (False, 256)), (30, 1): ((True, 128), (False, 128)),
        (29, 4): ((True, 256), (False, 256)), (23, 4): ((True, 128), (False, 256)),
        (24, 1): ((True, 128), (False, 128)), (24, 4): ((False, 256), (False, 256)),
        (18, 2): ((True, 128), (False, 128)), (16, 4): ((True, 128), (False, 256)),
        (16, 8): ((False, 256), (False, 256)), (15, 4): ((True, 128), (False, 256)),
        (15, 8): ((True, 256), (False, 256)), (13, 2): ((True, 128), (False, 256)),
        (7, 4): ((True, 128), (False, 256)), (7, 16): ((True, 256), (False, 256)),
        (8, 4): ((False, 256), (False, 256)), (8, 32): ((False, 256), (False, 256)),
        (6, 8): ((False, 256), (False, 256)),
    }
    for major in (9, 10, 8):
        monkeypatch.setattr(PLAN, "_hopper", lambda device, major=major: major == 9)
        for (budget, bs), (hopper, other) in cases.items():
            want, min_split = hopper if major == 9 else other
            cfg = PLAN._batch_config(512, 64, 512, (budget + 1) * 8, bs, cuda)
            got = cfg is not None and shape(cfg) == shape(PLAN._MLA_WGMMA_TILE)
            assert got == want, (major, budget, bs, cfg)
            assert (cfg.min_split_keys if cfg else 256) == min_split, (major, budget, bs, cfg)
            if got:
                assert PLAN.mla_programs_per_sm(cfg, cuda) == 1
                assert PLAN._mla_tile_smem(cfg) == PLAN._MLA_WGMMA_SMEM
        # the small-batch tile keeps batches of at most 144 rows, Hopper or not
        small = PLAN._batch_config(512, 64, 512, 16 * 8, 1, cuda)  # budget 15, batch 1
        assert small.block_m == 16 and small.min_split_keys == 128
    monkeypatch.setattr(PLAN, "_hopper", lambda device: True)
    monkeypatch.setattr(PLAN, "shared_memory", lambda device: (166912, 167936))  # sm_80's
    assert PLAN._batch_config(512, 64, 512, 65 * 8, 1, cuda) is None
    assert PLAN._batch_config(512, 64, 512, 16 * 8, 4, cuda) is None
    assert PLAN._batch_config(128, 0, 128, 65 * 4, 1, cuda) is None  # MHA untouched


def test_merging_launch_tile():
    """The launch that merges a prefix part from FlashMLA / FA3 (tree keys only): MLA's latent
    rows take the 16 x 32 tile measured on the H200 at every batch size, MHA keeps the full
    launch's tile (None), and off a GPU nothing changes."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    mla = PLAN._merge_config(512, 64, 512, cuda)
    assert (mla.block_m, mla.block_n, mla.num_warps, mla.num_stages, mla.dv_split) == \
        (16, 32, 4, 2, 1)
    assert PLAN._merge_config(128, 0, 128, cuda) is None
    assert PLAN._merge_config(512, 64, 512, cpu) is None
