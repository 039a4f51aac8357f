"""Launch planning of the tree-verify attention kernels: tile configs and prefix split counts.

Host-side only (no kernels, no device reads): :class:`~.tree_attention.TreeAttention` asks these
functions, at plan time, which tile a batch size runs (:func:`_default_config`,
:func:`_batch_config`) and how many prefix splits it launches (:func:`split_count` for MLA,
:func:`mha_split_count` for MHA). The rules cite the H200 measurements they came from.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Optional

import torch

from ._device import BLOCK_RESERVE, num_sms, shared_memory

# fewest prefix keys a split covers: the host's split count assumes it (splits <= context / 256)
# and the kernel enforces it against the actual prefix (MIN_CHUNK)
_MIN_SPLIT_KEYS = 256
# the most fp32 partial-output bytes one launch may split into (see TreeAttention._count_splits)
_PARTIAL_BYTES = 128 << 20


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch options of the forward kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # programs per row block, each computing v_head_dim / dv_split output columns (the scores
    # are computed in each): smaller accumulators, so bigger block_m fits (MLA's 512 dims)
    dv_split: int = 1
    # > 0: the QK reduction in slices of this many dims, the query re-read per slice instead of
    # held whole in registers (MLA's 512-dim rows spill otherwise); 0: one full-width dot
    dk_chunk: int = 0
    # fewest prefix keys a live split covers (the kernel's MIN_CHUNK); it also caps the split
    # count at the planned context / min_split_keys
    min_split_keys: int = _MIN_SPLIT_KEYS
    # > 0 (a power of two >= 16): a tree whose rows per KV head are k x block_m plus at most
    # this many (k >= 1) runs k row blocks, the last also attending the leftover rows in a
    # tail tile of this height over the same loaded keys, instead of a (k + 1)-th block that
    # reloads every key for those few rows. MHA only (no rope part, no dk_chunk)
    tail_m: int = 0


# MLA with few query rows in the whole batch (see _batch_config): 16-row tiles and splits
# of at least 128 keys, so a batch of one short tree still spreads over the GPU. Timed on the
# H200 (bench_results/tree_verify_mla_small_h200_s17.json, contexts 512 / 2,048 / 8,192): at batch
# 1 with budget 8 or 16 and batch 2 with budget 8 (up to 144 rows) it is faster than the default
# at every context; at 264 rows (batch 1, budget 32) and more it is up to 1.8x slower at 8,192.
_MLA_SMALL_BATCH = KernelConfig(block_m=16, block_n=64, num_warps=4, num_stages=2,
                                min_split_keys=128)
_MLA_SMALL_BATCH_MAX_ROWS = 144
# MLA trees of 145-264 query rows per KV head (Kimi TP8: budgets 18-32) in a batch of at most 528
# rows: splits of at least 128 keys instead of 256. On the H200
# (bench_results/tree_verify_mla_minsplit_h200_s18.json and tree_verify_mla_rows_h200_s18.json,
# 264 rows per request, same split counts as served): batch 1 33.0 -> 29.1 us at 512 keys and
# 33.7 -> 31.1 at 2,048, batch 2 37.3 -> 29.3 and 39.7 -> 34.8, equal at 8,192; not at 520 rows
# (budget 64, batch 1: 40.5 -> 59.8 at 2,048) nor at batch 8 (equal). On Hopper most of these
# trees, and more, take the 8-warp 64-row tile instead (_mla_hopper_config).
_MLA_FEW_ROWS_MIN_SPLIT = 128
_MLA_FEW_ROWS_MAX_ROWS = 264
_MLA_FEW_ROWS_MAX_BATCH_ROWS = 528
# MHA (head dim <= 128) tiles. A tree's rows per KV head are (budget + 1) x group, a power of
# two plus a group at the usual budgets, so 128-row tiles of 132 rows (budget 32 at 4 query
# heads per KV head) run a second block for 4 rows. On the H200
# (bench_results/tree_verify_mha_rows_h200_s20.json, Qwen3-8B shapes, batch 1 / 8 / 32 x
# 2,048 / 16,384 / 65,536 keys, split counts as served): at 132 rows
# three 64-row blocks beat two 128-row ones at all 9 points, 1.08-1.85x; at 260 rows 128-row
# tiles win at batch 1 and 8 (up to 1.3x) and lose at batch 32 (1.33-1.35x slower).
_MHA_TILE = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
_MHA_WIDE_TILE = KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
_MHA_WIDE_MIN_ROWS = 256
_MHA_WIDE_MAX_GROUPS = 64  # batch x KV heads; Qwen3-8B: batch 8 on one GPU


# MLA latent rows (512 + 64): the shared memory the served tiles (block_n 64, 4 warps, 2
# stages, by block_m) compile to with Triton 3.6 for a bf16 cache (an fp8 cache or a narrower
# latent takes less), the same for sm_80 to sm_120
# (scripts/tree_verify_static.py --arch; tests/test_tree_verify_static.py holds the table to
# the compiler). The 32-row tile does not fit the 99 KB a block may take on sm_86 / sm_89 /
# sm_120 (A10, L40S, RTX 4090 / 5090): there the 16-row tile serves every batch size.
_MLA_TILE_SMEM = {32: 114_688, 16: 94_208}
_MLA_NARROW_TILE = KernelConfig(block_m=16, block_n=64, num_warps=4, num_stages=2)
# MLA trees of more than 264 query rows per request (Kimi TP8: budget 33 and up), or of 264
# (budget 32) in batches of 8 and more, on Hopper: 64-row tiles of 8 warps, whose dots Triton
# 3.6 makes wgmma (the 32-row 4-warp tile's are mma.sync; scripts/tree_verify_static.py
# --arch 90: 255 registers, 256 spilled bytes, 225,280 bytes of shared memory, one program
# per SM). On the H200 (bench_results/tree_verify_wide_mla_h200_s33.json, same call, split
# counts as planned for each): budget 64 at batch 1 / 8 / 32 x 2,048 / 16,384 / 65,536 keys
# 1.10-1.16x faster than the 32-row tile; budget 32 at batch 8 / 32 1.03-1.09x, at batch 1
# 0.96x at 2,048 keys (kept on the 32-row tile); budget 8 0.64-1.12x, mostly below 1.
# Unmeasured elsewhere (Blackwell's tcgen05, Ampere): the 32-row tile stays there. The rule
# reads rows (tree tokens x query heads on the rank), the work a row block does, so a rank of
# 16 heads (DeepSeek V3 on TP8) reaches it at budget 16; measured with Kimi's 8 heads only.
_MLA_WGMMA_TILE = KernelConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)
_MLA_WGMMA_SMEM = 225_280
_MLA_WGMMA_MIN_ROWS = 264
_MLA_WGMMA_MIN_GROUPS_AT_MIN = 4  # batch x KV heads when rows == _MLA_WGMMA_MIN_ROWS
# MLA trees of 64-264 rows per request on Hopper, past the small-batch tile (_mla_hopper_config):
# the 8-warp 64-row tile too. Session 44 timed it beside the served tiles over budgets 7, 8, 13,
# 15, 16, 20, 23, 24, 29, 31, 32 (64-264 rows) x batch 1-16 x 576-65,536 keys, planned for 1,600
# and for 262,144 keys (bench_results/tv_mla_*_s44.json, tv_wide_mla_*_s44.json; Kimi rank
# shapes, one call). Where 64-row blocks pad a tree no more than 32-row blocks do (rows % 64 ==
# 0 or > 32) it was faster at all 146 points it takes over, 0.62-0.97x the served time, median
# 0.86x (budget 15 / batch 4 / 576 keys 38.9 -> 24.2 us, budget 29 / batch 16 / 65,536 keys
# 2,846 -> 2,414), with splits of at least 128 keys up to
# _MLA_HOPPER_SHORT_SPLIT_MAX_BATCH_ROWS rows in the batch and of 256 past it (below it 256-key
# splits were up to 1.41x slower at 576 keys and 128-key ones at most 1.04x slower; past it
# 128-key splits up to 1.57x slower at 2,048 rows, though up to 1.36x faster at 1,024 rows and
# 576 keys). Where they pad more (budgets 8, 16, 24, 32: 72 / 136 / 200 / 264 rows) it loses
# at long contexts (budget 8 / batch 4 / 65,536 keys 293 -> 320 us; budget 24 / batch 4 /
# 2,048 keys 40.5 -> 53.7) but not for trees of 128 rows or more in batches of up to
# _MLA_HOPPER_PADDED_MAX_BATCH_ROWS rows (31 points, median 0.82x, e.g. budget 16 / batch 4 /
# 576 keys 38.2 -> 23.8 us, 462.7 -> 447.8 at 65,536; one slower, budget 24 / batch 2 / 2,048
# keys 31.8 -> 34.0), nor budget 32 at batch 4 with 256-key splits (7 points, 0.85-0.95x:
# hence _MLA_WGMMA_MIN_GROUPS_AT_MIN 4, was 8). Budgets 4-6 (40-56 rows) were not measured and
# keep the 32-row tile; the unmeasured budgets between the measured ones (12, 14, 17-19, 21,
# 22, 25-28, 30) follow the rule of their padding class.
_MLA_HOPPER_MIN_ROWS = 64
_MLA_HOPPER_SHORT_SPLIT_MAX_BATCH_ROWS = 768
_MLA_HOPPER_PADDED_MIN_ROWS = 128
_MLA_HOPPER_PADDED_MAX_BATCH_ROWS = 544
_MLA_PROGRAMS_PER_SM = 2  # 4-warp tiles: registers (255 a thread x 128 threads) allow no more


def _hopper(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.x (not asked off a GPU)."""
    return (device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] == 9)


def _mla_tile_smem(cfg: KernelConfig) -> Optional[int]:
    """Shared memory of a served MLA tile shape, None for other shapes."""
    if replace(cfg, min_split_keys=_MIN_SPLIT_KEYS) == _MLA_WGMMA_TILE:
        return _MLA_WGMMA_SMEM
    if (cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.dv_split, cfg.dk_chunk) != (64, 4, 2, 1, 0):
        return None
    return _MLA_TILE_SMEM.get(cfg.block_m)


def _mla_fits(cfg: KernelConfig, device: torch.device) -> bool:
    """Whether the device grants a block the tile's shared memory (unknown: assumed)."""
    smem, have = _mla_tile_smem(cfg), shared_memory(device)
    return smem is None or have is None or smem <= have[0]


def mla_programs_per_sm(cfg: KernelConfig, device: torch.device) -> int:
    """MLA programs of ``cfg`` an SM holds, as split_count's slots count them: by registers
    (every MLA tile compiles to 255 a thread: 2 programs of 4 warps, 1 of 8), fewer where the
    device's shared memory holds fewer of a known tile (one 16-row program on a 100 KB sm_89 /
    sm_120 SM; two on an H200's 228 KB; one 8-warp 64-row tile's 225 KB)."""
    by_regs = max(1, _MLA_PROGRAMS_PER_SM * 4 // max(cfg.num_warps, 1))
    smem, have = _mla_tile_smem(cfg), shared_memory(device)
    if smem is None or have is None:
        return min(_MLA_PROGRAMS_PER_SM, by_regs)
    return max(1, min(_MLA_PROGRAMS_PER_SM, by_regs, have[1] // (smem + BLOCK_RESERVE)))


def _latent_rows(dk: int, d_pe: int, dv: int) -> bool:
    """Rows as wide as MLA's absorbed latent (512 + 64): they take their own tiles, small-batch
    configs and split counts."""
    return dk + d_pe > 256 or dv > 256


def _default_config(dk: int, d_pe: int, dv: int, rows: int, device: torch.device) -> KernelConfig:
    """Tiles measured on an H200 (scripts/bench_tree_verify.py --config, 16k context, bs 1/8,
    budgets 16/64); ``rows`` = N x query heads per KV head."""
    if device.type != "cuda":
        return KernelConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
    if _latent_rows(dk, d_pe, dv):
        # MLA latent rows (512 + 64): a 32-row fp32 accumulator of 512 dims is what fits;
        # 32x64 beat 32x32, 64x32 and 64x64 at every measured point (H200); 16 rows where a
        # block cannot have its shared memory (_MLA_TILE_SMEM)
        tile = KernelConfig(block_m=32, block_n=64, num_warps=4, num_stages=2)
        return tile if _mla_fits(tile, device) else _MLA_NARROW_TILE
    if dk > 128 or dv > 128:
        return KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if rows >= _MHA_WIDE_MIN_ROWS:  # wide trees / big GQA groups (see _MHA_TILE)
        return _MHA_WIDE_TILE
    return _MHA_TILE


def _batch_config(dk: int, d_pe: int, dv: int, rows: int, groups: int,
                  device: torch.device) -> Optional[KernelConfig]:
    """The config of one batch size where it differs from the default, else None. MLA with
    few query rows: a smaller tile up to _MLA_SMALL_BATCH_MAX_ROWS rows in the whole batch,
    on Hopper the 8-warp 64-row tile (_MLA_WGMMA_TILE) for trees of 64 to
    _MLA_FEW_ROWS_MAX_ROWS rows where it was measured faster (_mla_hopper_config) and for wider
    trees; elsewhere shorter splits for trees of more rows than the small-batch limit but at most
    _MLA_FEW_ROWS_MAX_ROWS, in batches of at most _MLA_FEW_ROWS_MAX_BATCH_ROWS. MHA trees wide
    enough for 128-row tiles: 64-row tiles again in batches of more than _MHA_WIDE_MAX_GROUPS
    KV-head groups.

    ``rows`` = query rows per KV head of one request (N x group); ``groups`` = batch size x KV
    heads."""
    if device.type != "cuda":
        return None
    if not _latent_rows(dk, d_pe, dv):
        wide = _default_config(dk, d_pe, dv, rows, device) is _MHA_WIDE_TILE
        return _MHA_TILE if wide and groups > _MHA_WIDE_MAX_GROUPS else None
    if groups * rows <= _MLA_SMALL_BATCH_MAX_ROWS:
        return _MLA_SMALL_BATCH
    if _hopper(device) and _mla_fits(_MLA_WGMMA_TILE, device):
        cfg = _mla_hopper_config(rows, groups)
        if cfg is not None:
            return cfg
    if (_MLA_SMALL_BATCH_MAX_ROWS < rows <= _MLA_FEW_ROWS_MAX_ROWS
            and groups * rows <= _MLA_FEW_ROWS_MAX_BATCH_ROWS):
        return replace(_default_config(dk, d_pe, dv, rows, device),
                       min_split_keys=_MLA_FEW_ROWS_MIN_SPLIT)
    return None


def _mla_hopper_config(rows: int, groups: int) -> Optional[KernelConfig]:
    """On Hopper, past the small-batch tile: the 8-warp 64-row MLA tile, with its split
    minimum, for trees of more than _MLA_WGMMA_MIN_ROWS rows per request (or of that many in
    batches of _MLA_WGMMA_MIN_GROUPS_AT_MIN and more) and for trees of _MLA_HOPPER_MIN_ROWS to
    _MLA_FEW_ROWS_MAX_ROWS rows where session 44 measured it faster than the 32-row tile;
    else None (the 32-row tile's rules)."""
    if rows > _MLA_WGMMA_MIN_ROWS or (rows == _MLA_WGMMA_MIN_ROWS
                                      and groups >= _MLA_WGMMA_MIN_GROUPS_AT_MIN):
        return _MLA_WGMMA_TILE
    if not _MLA_HOPPER_MIN_ROWS <= rows <= _MLA_FEW_ROWS_MAX_ROWS:
        return None
    batch_rows = groups * rows
    tail = rows % _MLA_WGMMA_TILE.block_m
    if tail == 0 or tail > _MLA_WGMMA_TILE.block_m // 2:  # no more padding than 32-row blocks
        short = batch_rows <= _MLA_HOPPER_SHORT_SPLIT_MAX_BATCH_ROWS
        return replace(_MLA_WGMMA_TILE,
                       min_split_keys=_MLA_FEW_ROWS_MIN_SPLIT if short else _MIN_SPLIT_KEYS)
    if rows >= _MLA_HOPPER_PADDED_MIN_ROWS and batch_rows <= _MLA_HOPPER_PADDED_MAX_BATCH_ROWS:
        return replace(_MLA_WGMMA_TILE, min_split_keys=_MLA_FEW_ROWS_MIN_SPLIT)
    return None


# The launch that attends only the tree keys and merges a prefix part from another kernel
# (FlashMLA's / FA3's, run(prefix_out=)): a few tiles of at most budget + 1 keys per row
# block, so latency, not bandwidth. MLA: 16 x 32 tiles at every batch size. On the H200
# (session 35): with the full launch's tiles (32-row, and the 8-warp 64-row) this launch took
# 23-30 us at budgets 32 / 64 and at batch 8 (every budget), against 9.6-9.9 us on the
# 16-row tile (bench_results/tree_verify_mla_kernel_times_h200_s35.json); over issue 4's MLA points at 2k /
# 16k keys (bench_results/tree_verify_merge_tile_mla_h200_s35.json, whole FlashMLA-prefix
# path, 6 tiles in one call) 16 x 32 / 4 warps / 2 stages is the fastest by geometric mean
# (1.08x the 16 x 64 tile, 1.27x the 32 x 64) and the only one at or above fa3's tree verify
# at all 24 (1.03-1.91x). MHA: the full launch's tile (None): the same call's four other
# candidates were 0.92-1.12x its speed, none faster everywhere (faster at batch 1, slower at
# batch 32; tree_verify_merge_tile_mha_h200_s35.json).
_MLA_MERGE_TILE = KernelConfig(block_m=16, block_n=32, num_warps=4, num_stages=2)


def _merge_config(dk: int, d_pe: int, dv: int, device: torch.device) -> Optional[KernelConfig]:
    """The tile of a merging launch (see _MLA_MERGE_TILE), None where it is the full launch's."""
    if device.type != "cuda" or not _latent_rows(dk, d_pe, dv):
        return None
    return _MLA_MERGE_TILE


def _waves(programs: int, splits: int, slots: int) -> int:
    """Waves of ``programs`` x ``splits`` programs on a GPU running ``slots`` at once."""
    return -(-programs * splits // slots)


def split_count(programs: int, slots: int, cap: int, max_splits: int = 64,
                tolerance: float = 0.05) -> int:
    """Prefix splits for ``programs`` (row blocks x KV heads x column parts) on a GPU that
    runs ``slots`` programs at once, for a long prefix (every split live): a split's time is
    its share of the prefix, so a launch costs about waves(S) / S = ceil(programs x S / slots)
    / S of one unsplit pass. Rounding S x programs up past a wave boundary adds a nearly empty
    wave (the old rule, ceil(slots / programs), did: 30 splits x 9 programs = 270 programs
    on 264 slots); this takes the largest S within ``tolerance`` of the best waves(S) / S,
    among S up to 16 or one full wave of splits (at most ``max_splits`` and ``cap``). On the
    H200 (bench_results/tree_verify_mla_splits_h200_s19.json, MLA, 2 programs per SM) the
    measured times follow waves(S) / S: batch 8 / budget 64 at 32,768 keys, 2 splits (3
    waves of half the prefix) 2,522 us, 14 splits 1,613 us."""
    limit = max(1, min(cap, max_splits, max(16, slots // max(programs, 1))))
    cost = {s: _waves(programs, s, slots) / s for s in range(1, limit + 1)}
    best = min(cost.values())
    return max(s for s, c in cost.items() if c <= best * (1 + tolerance))


def mha_split_count(programs: int, sms: int, num_warps: int, cap: int,
                    max_splits: int = 64) -> int:
    """Prefix splits for an MHA launch of ``programs`` (row blocks x KV heads): the fewest
    splits with the fewest waves per split's share, ceil(programs x S / slots) / S, among S up
    to one more than about two waves of programs at 2 per SM (the rule before session 20).
    ``slots`` counts the programs an SM holds: 2 of the 4-warp tile, 1 of the 8-warp one
    (registers). 288 programs of the 4-warp tile on 132 SMs: 2 splits (3 waves of half the
    prefix, not 2 of all of it). Unlike MLA's split_count, ties go to fewer splits: MLA's
    whole waves up to 16 splits were up to 1.7x slower for MHA at 2,048 keys (session 19).

    On the H200 (bench_results/tree_verify_ab_mha_splits_h200_s20.json, Qwen3-8B shapes,
    batch 1-32 x budget 8-64 x 2,048-65,536 keys, same-call A/B against about two waves with
    a second split for a short last wave): 69 of 120 points changed, 1.17x geometric mean, up
    to 1.64x. Slower: batch 8 / budget 64 by up to 1.43x while the 8-warp tile counted 2
    programs per SM (since then the same split as before,
    tree_verify_mha_wide_splits_h200_s20.json), and 2-6 % at 5 batch / budget pairs past 16k
    keys, where a tie now takes one split instead of two (8-13 % faster at 2,048)."""
    want = -(-2 * sms // max(programs, 1))
    slots = sms * max(1, 8 // num_warps)
    limit = int(max(1, min(want + 1, cap, max_splits)))
    return min(range(1, limit + 1), key=lambda s: (Fraction(_waves(programs, s, slots), s), s))


def _reduce_chunk(v_head_dim: int, num_splits: int = 1) -> int:
    """Splits the reduce kernel sums per step. MLA's 512-dim rows: 8 (H200, same-call A/B,
    bench_results/tree_verify_reduce_ab_h200_s19.json: batch 1 / budget 8, 52 splits, 26.4 ->
    18.9 us at 512 keys and 30.2 -> 21.2 at 2,048, 1.16x at 32,768, equal elsewhere).
    Narrower rows: one split per step up to 32 splits (the chunked tile was up to 1.5x slower
    there, MHA, 128 dims, session 19); beyond 32, all splits in one step, at most 64 and at
    most 8,192 fp32 values a step (a [64, 128] tile: 64 registers a thread at 4 warps). On the
    H200 (bench_results/draft_splits_h200_s25.json, the Kimi drafter's 8:1 heads, 128 dims,
    batch 1, block 8 / 16, 64 splits) one step of all 64 took 21.3 / 28.2-28.5 us at 16k / 32k
    keys against 40.7-41.1 / 47.9-48.3 one split a step; at 32 splits the two within 2 %; at
    8-16 splits one a step was 1-7 % faster. With the rule (draft_rule_h200_s25.json), 33-split
    launches (the Kimi shape at batch 8, Qwen3-8B's 32:8 at batch 1) took 14-21 % less at 16k
    and 32k keys."""
    if v_head_dim > 256:
        return 8
    if num_splits <= 32:
        return 1
    width = 1 << (int(v_head_dim) - 1).bit_length()
    return min(64, 1 << (int(num_splits) - 1).bit_length(), max(1, 8192 // width))


def _num_sms(device: torch.device) -> int:
    return num_sms(device, 4)
