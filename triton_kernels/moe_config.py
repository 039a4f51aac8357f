"""The fused W4A16 MoE's launch configs: tile sizes per GEMM (``GemmConfig``), per M band
(``MoeConfig``), the band table (``moe_w4a16_configs.json``, or ``SGLANG_DDTREE_MOE_CONFIG``),
its check against a model's shapes at weight loading, and the host mirrors of the live choices
the kernels make on the GPU (``live_split``, ``live_grid``). ``docs/fused_moe.md`` describes
the table's fields and how its bands were picked."""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

_CONFIG_PATH = os.path.join(os.path.dirname(__file__), "moe_w4a16_configs.json")


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes of one GEMM launch (BLOCK_K counts unpacked input rows)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # down GEMM only: > 0 selects _down_loop_kernel (each program walks n_per_cta output columns;
    # needs block_k == intermediate size); 0 keeps one [block_n, block_k] tile per program.
    n_per_cta: int = 0
    # gate-up GEMM only: 1 dequantizes nibbles 0-3, then 4-7 (fewer live registers, so more
    # programs per SM: 168 -> 128 registers at block_n 32 / 2 warps on sm_90).
    split_dq: int = 0
    # gate-up GEMM only: > 1 splits K over that many programs per tile (more programs in flight
    # when few experts are touched); a small reduce kernel adds the fp32 partials in fixed order.
    split_k: int = 1
    # gate-up GEMM with split_k > 1: > 0 makes split_k the most a call splits K; each call
    # takes the smallest split (a divisor of the K steps) that gives its used row blocks at least
    # split_target programs, read on the GPU from moe_align's block count (so one band serves
    # calls on few experts, which want a deep split, and calls on many, which want none).
    # Looped down GEMM (n_per_cta > 0): the same rule splits each n_per_cta column range
    # into the fewest parts (a divisor of its block_n steps) that give the used blocks at least
    # split_target programs (_down_loop_kernel's SPLIT_TARGET).
    split_target: int = 0
    # 1 sums nibble planes 0-3 and 4-7 into separate accumulators: the gate-up adds the two
    # once after its K loop (_mma8 PAR_ACC), the looped down (n_per_cta > 0; not the per-tile
    # down) per column step. Each dependent MMA chain on one accumulator is then 8 long
    # instead of 16 (sm_90, the M = 8 band's gate-up tile: 168 registers against 127, the
    # same 689 instructions a K step). Session 52; served since session 55 (timed on the
    # H200 then).
    par_acc: int = 0
    # 1 loads a K step's scales once per group of 32 input rows ([N, K / 32]) and repeats each
    # over its 4 packed words in registers, instead of loading a [N, K / 8] tile that holds
    # every scale 4 times: the same values, less shared memory (sm_90, the M = 8 gate-up tile:
    # 26 against 32 KB, 673 against 689 instructions a K step). The gate-up and the looped
    # down (not the per-tile down). Session 52; served since session 55 (timed on the H200
    # then).
    scale_once: int = 0
    # > 0: ptxas's register limit per thread for this launch (Triton's ``maxnreg``), a multiple
    # of 8 from 64 to 248; 0 leaves it to the compiler. For a tile whose programs an SM are
    # bound by registers just past a step: sm_90 has 65,536 a SM, a thread's count rounded up
    # to 8, so a 4-warp tile fits 4 programs at 128 and 3 at 130 (MoeConfig.wide_halves'
    # gate-up on 16-row blocks: 130, and 128 with no spill under this limit). Session 53, not
    # yet timed.
    max_regs: int = 0


@dataclass(frozen=True)
class MoeConfig:
    """Launch configuration for one M band; ``block_m`` is shared by both GEMMs (same alignment)."""

    # rows of an expert block, >= 8: the MMAs' n side (the GEMMs compute W^T @ A, so a block's
    # rows are the n of m16n8k16). 8 (session 45, the bands of M 2-16) halves a 16-row
    # block's activation tile, MMAs and shared memory where experts hold 1-8 rows of a call;
    # an expert with more rows takes several blocks, each dequantizing its weights again
    # (bench_results/fused_moe_bm8_{wide,small}_grid_h200_s45.json)
    block_m: int
    gate_up: GemmConfig
    down: GemmConfig
    # 1 (block_m 16, 32 or 64): both GEMMs run a block whose second half holds no real row as
    # a block_m / 2-row tile, and with block_m 32 / 64 one whose last three quarters hold none
    # as an 8- / 16-row tile (the 32-row blocks' quarter since session 68; wide_halves' gate-up
    # runs either as its half). An expert with up to block_m rows in a call then
    # dequantizes each weight tile once for all of them, while blocks of few rows pay for
    # narrow tiles only (timed in session 26 with block_m 32 / 64, before 32-row blocks had
    # a quarter, slower on random routing,
    # bench_results/fused_moe_half_m{32,64}_grid_h200_s26.json; in session 46 with block_m 16,
    # 8-row tiles for experts of 1-8 rows: the M 17-48 bands,
    # bench_results/fused_moe_half_m16_*grid_h200_s46.json). 2: the gate-up only (the down runs
    # full blocks): the M 49-128 bands (session 46, fused_moe_half_m16_gu_m49_*_s46.json).
    half_m: int = 0
    # 1 (half_m 1 or 2, block_m 16 or 32): the gate-up gives each block twice the programs, and
    # a block with rows in its second half runs as two tiles of block_n / 2 columns over all
    # block_m rows instead of one full-width tile; a block that narrows runs as with half_m
    # alone. Both tiles then hold the same accumulators, so the kernel needs the narrow tile's
    # registers and shared memory (sm_90, the M 9-16 band's 64 x 256 / 4-warp tile on 16-row
    # blocks: 130 registers and 56 KB against 167 and 72 KB; 8-row blocks: 128 and 56 KB),
    # while an expert with more than block_m / 2 rows of a call still has each weight tile
    # dequantized once for all of them (session 53; no faster than plain half_m on an H100,
    # session 55)
    wide_halves: int = 0
    # 1 (a gate-up without half_m): each gate-up program loads its block's expert and row ids
    # in one round trip after its wait (under a live split, the block of every split the call
    # may take, beside the used-block count) instead of count, then expert, then rows
    # (_gate_up_kernel EARLY_ROWS). The same bits. Session 60: on an H100, M = 8 on random
    # routing 76.4 against 76.8 us a call, 0.2 us faster on 8 shared experts; the M 2 band's
    # tile took 167 registers against 127 with it (slower there), the M 9-16 band's mixed
    # (bench_results/fused_moe_rows_*_h100_s60d.json): the M = 8 band only
    early_rows: int = 0

    @property
    def narrow_gate_up(self) -> bool:
        """Whether the gate-up runs HALF_M (half_m 1 or 2)."""
        return self.half_m in (1, 2)

    @property
    def narrow_down(self) -> bool:
        """Whether the down GEMM runs HALF_M (half_m 1 only)."""
        return self.half_m == 1


# Band options that were removed, and why: a table band that still sets one is refused rather
# than served without it.
_REMOVED = {
    "pairs": "session 47 (no band of the shipped table used it)",  # (session 45)
    "run_m": "session 47 (no band of the shipped table used it)",  # (session 28)
    "prefetch_down": ("session 55 (slower on the H200 on random routing at every M timed: "
                      "71.6-73.9 us against 69.6 at M = 8)"),  # (session 54)
    "self_route": ("session 58 (slower on the H200 at every M of 3-16 on every routing "
                   "timed: 92.0 / 99.4 us for levels 1 / 2 against 66.5 at M = 8 on random "
                   "routing)"),  # (session 57, last in 544abff)
}
# Tile options (GemmConfig fields) that were removed, and why: a band whose gate_up or down
# still sets one is refused as above; 0 (off, as the configs of the runs before the removal
# carry it) is dropped.
_REMOVED_GEMM = {
    "prefetch_ahead": ("session 56 (slower on the H200 at every M and routing timed: "
                       "74.4-84.2 us against 66.6 at M = 8 on random routing)"),  # (session 54)
    "col_parts": ("session 56 (slower on an H100 at M = 8 on random routing in every tile "
                  "timed: down and combine 30.2-42.7 us against the looped down's "
                  "29.2-29.3)"),  # (session 56, 6e734b4)
}


def _refuse_removed(fields: dict, removed: dict, where: str) -> None:
    """ValueError, naming ``where``, if ``fields`` sets an option of ``removed`` (_REMOVED or
    _REMOVED_GEMM), with the reason it was removed."""
    for gone, why in removed.items():
        if fields.get(gone):
            raise ValueError(f"{where}: {gone!r} was removed in {why}; drop it")


def gemm_config(fields: dict, where: str = "GemmConfig") -> GemmConfig:
    """A GemmConfig from its fields as a table band (``gate_up`` / ``down``) or a run's JSON
    holds them: a removed option (_REMOVED_GEMM) that is 0 is dropped; ValueError, naming
    ``where``, for one that is set."""
    _refuse_removed(fields, _REMOVED_GEMM, where)
    return GemmConfig(**{k: v for k, v in fields.items() if k not in _REMOVED_GEMM})


# A table's per-device overrides: {"devices": {NAME: {"why": ..., "bands": [{"max_m": M,
# "down": {...}, ...}]}}}. NAME is torch.cuda.get_device_name()'s, matched exactly; each
# override band names a band of the table by max_m and replaces the fields it gives (inside
# gate_up / down, field by field). An override band with "split": 1 adds a band the table
# lacks for that card: a copy of the band that serves its max_m as written (the next larger
# band, before any of the card's overrides), then its own fields; the band it was cut from
# keeps the M above it (session 70: the H100's M 17-32 band cut at 27). The bands themselves
# are the default for any other device.
DEVICES = "devices"
SPLIT = "split"
_AUTO = object()  # select_config's device_name default: the current CUDA device's name


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    import torch
    return torch.cuda.get_device_name(index)


def cuda_device_name(device=None) -> str | None:
    """The name the table's ``devices`` overrides are keyed by: ``device``'s (a torch device;
    None: the current CUDA device's), or None for a CPU tensor or without CUDA."""
    import torch
    if device is None:
        if not torch.cuda.is_available():
            return None
        return _cuda_name(torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


def table_json(path: str | None = None, device_name=_AUTO) -> dict:
    """The config table file's JSON (``path``, else ``SGLANG_DDTREE_MOE_CONFIG``, else the
    shipped one) as it serves ``device_name`` (default, as ``select_config``: the current CUDA
    device's; None: the bands as written): its overrides for that device merged into the
    bands and the ``devices`` section dropped (what scripts edit to time a variant of the
    served table). ValueError for an override of a band the table lacks (without ``split``),
    and for a ``split`` of a band it has or past its last band."""
    if device_name is _AUTO:
        device_name = cuda_device_name()
    path = path or os.environ.get("SGLANG_DDTREE_MOE_CONFIG", _CONFIG_PATH)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"fused MoE config table {path} is missing: the package must ship "
            "sglang_ddtree/triton_kernels/*.json (setuptools package-data), or set "
            "SGLANG_DDTREE_MOE_CONFIG to a table")
    with open(path) as f:
        raw = json.load(f)
    devices = raw.pop(DEVICES, {})
    over = devices.get(device_name, {}) if device_name else {}
    written = sorted(raw["bands"], key=lambda b: b["max_m"])
    for ob in over.get("bands", []):  # the split bands first, copies of the bands as written
        if not ob.get(SPLIT):
            continue
        m = ob.get("max_m")
        if not isinstance(m, int) or any(b["max_m"] == m for b in raw["bands"]):
            raise ValueError(f"fused MoE config table {path}: the override for {device_name!r} "
                             f"splits off band max_m={m!r}, which the table already has (or "
                             "is no integer); fix the override: drop 'split' to change that band")
        src = next((b for b in written if b["max_m"] > m), None)
        if src is None:
            raise ValueError(f"fused MoE config table {path}: the override for {device_name!r} "
                             f"splits off band max_m={m}, past the table's last band "
                             f"(max_m={written[-1]['max_m']}, which serves every larger M); "
                             "fix the override's max_m")
        copy = {k: v for k, v in json.loads(json.dumps(src)).items() if k != "us"}
        raw["bands"].append(dict(copy, max_m=m))  # ("us": the source band's tuning time)
        raw["bands"].sort(key=lambda b: b["max_m"])
    for ob in over.get("bands", []):
        band = next((b for b in raw["bands"] if b["max_m"] == ob.get("max_m")), None)
        if band is None:
            raise ValueError(f"fused MoE config table {path}: the override for "
                             f"{device_name!r} names band max_m={ob.get('max_m')}, which "
                             "the table does not have; fix the override's max_m (or give it "
                             f"\"{SPLIT}\": 1 to add that band for this card)")
        for key, value in ob.items():
            if key in ("gate_up", "down"):
                band[key] = dict(band[key], **value)
            elif key not in ("max_m", SPLIT):
                band[key] = value
    return raw


def device_overrides(path: str | None = None) -> list[str]:
    """The device names the table (as ``table_json`` finds it) has overrides for."""
    path = path or os.environ.get("SGLANG_DDTREE_MOE_CONFIG", _CONFIG_PATH)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return sorted(json.load(f).get(DEVICES, {}))


@functools.lru_cache(maxsize=None)
def _config_table(path: str, device_name: str | None = None) -> tuple[tuple[int, MoeConfig], ...]:
    raw = table_json(path, device_name)
    table = []
    for band in raw["bands"]:
        where = f"band max_m={band.get('max_m')}"
        _refuse_removed(band, _REMOVED, where)
        table.append((int(band["max_m"]), MoeConfig(
            block_m=int(band["block_m"]),
            gate_up=gemm_config(band["gate_up"], f"{where} gate_up"),
            down=gemm_config(band["down"], f"{where} down"), half_m=int(band.get("half_m", 0)),
            wide_halves=int(band.get("wide_halves", 0)),
            early_rows=int(band.get("early_rows", 0)))))
    return tuple(sorted(table, key=lambda b: b[0]))


def select_config(m: int, path: str | None = None, device_name=_AUTO) -> MoeConfig:
    """Config of the smallest M band holding ``m`` (the largest band for bigger ``m``).

    The table is ``path``, else the file named by the env variable
    ``SGLANG_DDTREE_MOE_CONFIG`` (for tuning runs), else ``moe_w4a16_configs.json`` beside
    this module; with its ``devices`` overrides for ``device_name`` (default: the current CUDA
    device's, ``cuda_device_name()``; None: the bands as written).
    """
    if device_name is _AUTO:
        device_name = cuda_device_name()
    table = _config_table(path or os.environ.get("SGLANG_DDTREE_MOE_CONFIG", _CONFIG_PATH),
                          device_name)
    for max_m, cfg in table:
        if m <= max_m:
            return cfg
    return table[-1][1]


def _split_candidates(k_steps: int, split_k: int) -> list[int]:
    """The splits ``_live_split`` chooses among, ascending: divisors of the K steps below
    ``split_k``, then ``split_k`` (its answer where none reaches the target)."""
    return [c for c in range(1, split_k) if k_steps % c == 0] + [split_k]


def live_split(used_blocks: int, num_n: int, k_steps: int, split_k: int,
               split_target: int) -> int:
    """The K split ``_live_split`` takes on the GPU for a call with ``used_blocks`` row blocks
    (host mirror, for tests and benchmarks; the kernel never asks the host)."""
    if split_target <= 0:
        return split_k
    cands = _split_candidates(k_steps, split_k)
    return next((c for c in cands[:-1] if used_blocks * num_n * c >= split_target), split_k)


def live_grid(max_tiles: int, k_steps: int, split_k: int, split_target: int) -> int:
    """Programs a live-split gate-up launch needs for any call of at most ``max_tiles`` used
    tiles: a call takes split ``c`` only while ``tiles x p < split_target`` for the candidate
    ``p`` below ``c``, so its ``tiles x c`` programs stay below the target times ``c / p``; at
    split 1, ``max_tiles``. (Far below ``max_tiles x split_k`` when few tiles can be used.)"""
    cands = _split_candidates(k_steps, split_k)
    need = max_tiles
    for p, c in zip(cands, cands[1:]):
        need = max(need, min(max_tiles, -(-split_target // p) - 1) * c)
    return need


def _fit(cfg: GemmConfig, n: int, k: int) -> GemmConfig:
    """Fit a table config to the problem: shrink tiles that exceed a small problem (tests use tiny
    hidden / FFN sizes), and drop the shape-bound options where the shape rules them out (the
    looped down kernel needs the whole K in one tile; split-K needs the K steps to divide), so
    that one table serves any hidden / intermediate size. A live target stays with a K split
    or a looped down kernel (GemmConfig.split_target)."""
    block_n = min(cfg.block_n, n)
    block_k = min(cfg.block_k, k)
    n_per_cta = min(cfg.n_per_cta, n) if block_k == k else 0
    split_k = cfg.split_k if k % block_k == 0 and (k // block_k) % cfg.split_k == 0 else 1
    # par_acc / scale_once on a down config exist only in the looped kernel: where the shape
    # rules that kernel out they go with it (a gate-up's n_per_cta is 0 and they stay)
    looped_only = n_per_cta or not cfg.n_per_cta
    return GemmConfig(block_n, block_k, cfg.num_warps, cfg.num_stages, n_per_cta, cfg.split_dq,
                      split_k, cfg.split_target if split_k > 1 or n_per_cta else 0,
                      cfg.par_acc if looped_only else 0, cfg.scale_once if looped_only else 0,
                      cfg.max_regs)


def _fitted(cfg: MoeConfig, hidden: int, inter: int) -> tuple[GemmConfig, GemmConfig]:
    """``cfg``'s gate-up and down configs fitted to the shapes (_fit); ValueError where they do
    not tile them or the config's options do not go together."""
    gu = _fit(cfg.gate_up, inter, hidden)
    dn = _fit(cfg.down, hidden, inter)
    bm = cfg.block_m
    if (inter % gu.block_n or hidden % gu.block_k or hidden % dn.block_n or inter % dn.block_k
            or gu.block_k % 128 or dn.block_k % 128 or bm < 8 or gu.split_k < 1
            or cfg.half_m not in (0, 1, 2) or (cfg.half_m and bm not in (16, 32, 64))
            or (dn.n_per_cta and (dn.n_per_cta % dn.block_n or hidden % dn.n_per_cta))
            or dn.split_target < 0 or gu.par_acc not in (0, 1) or dn.par_acc not in (0, 1)
            or gu.scale_once not in (0, 1) or dn.scale_once not in (0, 1)
            or ((dn.par_acc or dn.scale_once) and not dn.n_per_cta)
            or any(g.max_regs and (g.max_regs % 8 or not 64 <= g.max_regs <= 248)
                   for g in (gu, dn))
            or cfg.wide_halves not in (0, 1) or cfg.early_rows not in (0, 1)
            or (cfg.early_rows and cfg.narrow_gate_up)
            or (cfg.wide_halves and (cfg.half_m not in (1, 2) or bm not in (16, 32)
                                     or gu.block_n % 32))):
        # block_k >= 128 keeps each nibble-plane dot at depth >= 16, the MMA minimum (and
        # block_m >= 8 its n side, see MoeConfig.block_m; wide_halves' half-width tiles keep
        # block_n / 2 >= 16, its m side); _fit has
        # already dropped split-K and the looped down kernel where the shape rules them out.
        raise ValueError(f"config {cfg} does not tile hidden {hidden} / intermediate {inter}")
    return gu, dn


def check_config_table(hidden: int, inter: int, path: str | None = None) -> str:
    """Check every band of the config table that ``select_config`` reads (``path``, else
    ``SGLANG_DDTREE_MOE_CONFIG``, else the shipped one) against these shapes, so that a table
    that cannot serve some M fails when a server loads its weights rather than at the first
    call of that size. Returns the table's path; ValueError naming the band and the fix."""
    path = path or os.environ.get("SGLANG_DDTREE_MOE_CONFIG", _CONFIG_PATH)
    # the bands as written and as each device with overrides gets them
    for name in [None] + device_overrides(path):
        on = f" (as overridden for {name!r})" if name else ""
        try:
            table = _config_table(path, name)
        except (KeyError, TypeError, ValueError) as exc:  # a band without a field, or a bad one
            raise ValueError(f"fused MoE config table {path}{on}: unreadable band ({exc!r}); "
                             "fix it or unset SGLANG_DDTREE_MOE_CONFIG for the shipped "
                             "table") from exc
        for max_m, cfg in table:
            try:
                _fitted(cfg, hidden, inter)
            except ValueError as exc:
                raise ValueError(f"fused MoE config table {path}{on}, band max_m={max_m}: "
                                 f"{exc}; fix that band or unset SGLANG_DDTREE_MOE_CONFIG for "
                                 "the shipped table") from None
    return path
