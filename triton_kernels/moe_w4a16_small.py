"""Small-M path of the fused W4A16 MoE: the gate-up and down GEMMs as CUDA ``mma.sync`` kernels.

For calls of a few tokens (a verify of a small tree, decode) the Triton GEMMs of
``moe_w4a16`` read DRAM at about half the copy bandwidth: few programs fit an SM and each keeps
little in flight (Nsight Compute, ``bench_results/ncu_fused_moe_summary_h200_s36.json``). The
kernels in ``cuda_ext/moe_w4a16_small.cuh`` give each lane one 16-byte load of packed weights per
32-row K group, feed the words straight into the MMA's A operand (no shared memory, no repack) and
keep several groups in flight through registers. Between them and around them nothing changes:
``moe_w4a16``'s Triton prologue groups the pairs by expert (in blocks of 8 or 16 rows) and its
combine kernel sums the top-k slots.

Selection (read per call, so benchmarks can switch it): ``SGLANG_DDTREE_MOE_SMALL=<max M>``
serves calls of up to that many tokens here (0, the default: off). ``SGLANG_DDTREE_MOE_SMALL_CFG``
overrides the launch settings for tuning, e.g. ``u=3,du=8,split=8,target=264``. Where the
library cannot be built or loaded (no nvcc, no GPU) the Triton kernels serve every call and
the loader logs why, once. Off the GPU (``TRITON_INTERPRET=1``, CPU) it is never used.

Numerics: the same rounding points as the Triton path (bf16 ``q * scale``, fp32 accumulation,
bf16 ``h`` and per-slot ``y``); only the fp32 summation order differs.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, replace

import torch

from ._device import arrival_counters

ENV = "SGLANG_DDTREE_MOE_SMALL"
ENV_CFG = "SGLANG_DDTREE_MOE_SMALL_CFG"
COLS_PER_CTA = 256  # 8 warps x 32 columns (gate-up: of gate and of up)
GROUP = 32  # K rows per scale and per pipelined load


@dataclass(frozen=True)
class SmallConfig:
    """Launch settings of one small-M call."""

    n_tiles: int  # 8-token MMA n-tiles per block: blocks of 8 * n_tiles rows (1 or 2)
    u_gate_up: int  # K groups in flight per lane in the gate-up (2-4; 2-3 with 2 n-tiles)
    u_down: int  # ... in the down (4 or 8)
    split_max: int  # most CTAs one gate-up tile's K is split over (a divisor of K / 32)
    split_target: int  # CTAs a call's split aims for (0: never split)

    def validate(self) -> None:
        ok_gu = {1: (2, 3, 4), 2: (2, 3)}
        if self.n_tiles not in ok_gu or self.u_gate_up not in ok_gu[self.n_tiles]:
            raise ValueError(f"{ENV_CFG}: n_tiles 1 with u 2/3/4 or n_tiles 2 with u 2/3, got "
                             f"{self.n_tiles} / {self.u_gate_up}")
        if self.u_down not in (4, 8) or self.split_max < 1 or self.split_target < 0:
            raise ValueError(f"{ENV_CFG}: du 4 or 8, split >= 1, target >= 0, got {self}")


def max_m() -> int:
    """The largest token count served here (``SGLANG_DDTREE_MOE_SMALL``; 0 = off)."""
    raw = os.environ.get(ENV, "0").strip() or "0"
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ENV}: the largest M to serve with the CUDA kernels (an integer, 0 = "
                         f"off), got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{ENV}: expected >= 0, got {value}")
    return value


def config_for(m: int) -> SmallConfig:
    """Settings for an M-token call: blocks of 8 rows up to M = 8 (an expert then holds at most 8
    of the call's tokens, so one block), 16 above; env overrides after."""
    cfg = SmallConfig(n_tiles=1 if m <= 8 else 2, u_gate_up=3 if m <= 8 else 2, u_down=8,
                      split_max=8, split_target=264)
    raw = os.environ.get(ENV_CFG, "").strip()
    if raw:
        keys = {"nt": "n_tiles", "u": "u_gate_up", "du": "u_down", "split": "split_max",
                "target": "split_target"}
        changes = {}
        for item in raw.split(","):
            k, _, v = item.partition("=")
            if k.strip() not in keys or not v.strip().isdigit():
                raise ValueError(f"{ENV_CFG}: comma-separated nt|u|du|split|target=<int>, got "
                                 f"{item!r}")
            changes[keys[k.strip()]] = int(v)
        cfg = replace(cfg, **changes)
    cfg.validate()
    return cfg


def live_split_small(used_blocks: int, col_ctas: int, groups: int, split_max: int,
                     target: int) -> int:
    """Host mirror of the kernel's per-call split (``live_split`` in the .cuh), for tests."""
    for c in range(1, split_max):
        if groups % c == 0 and used_blocks * col_ctas * c >= target:
            return c
    return split_max


def _loader():
    try:
        from sglang_ddtree.cuda_ext import loader
        return loader
    except ModuleNotFoundError:  # a source checkout without install: the same file by path
        name = "_sglang_ddtree_cuda_ext_loader"
        if name not in sys.modules:
            path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "cuda_ext", "loader.py")
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        return sys.modules[name]


def library():
    """The loaded ctypes library, or None (built on first use; the loader logs a failure once)."""
    return _loader().load_moe_small_lib(required=False)


def usable(hidden_states: torch.Tensor, m: int) -> bool:
    """Whether this call goes to the CUDA kernels: enabled for its M, on a GPU of sm_80 or newer,
    16-byte aligned rows, and the library loads."""
    if m > max_m() or hidden_states.device.type != "cuda":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    if torch.cuda.get_device_capability(hidden_states.device) < (8, 0):
        return False
    if hidden_states.data_ptr() % 16 or hidden_states.stride(0) % 8:
        return False
    return library() is not None


_counters: dict = {}


def gate_up_down(hidden_states, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights,
                 sorted_ids, block_expert, topk: int, cfg: SmallConfig,
                 upto: int = 4) -> torch.Tensor:
    """``y [M * topk, H]`` bf16 (row = pair id; slots with invalid ids unwritten) for blocks of
    ``8 * cfg.n_tiles`` rows from ``moe_align``. ``upto`` < 3 stops after the gate-up (benchmark
    breakdowns). CUDA-graph safe: no allocation outside the caching allocator, no host sync."""
    dev = hidden_states.device
    lib = _loader().load_moe_small_lib(required=True)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    _loader().moe_probe(index)  # loads the kernels once, outside any capture
    m, hidden = hidden_states.shape
    inter = w2_packed.shape[1] * 8
    bm = 8 * cfg.n_tiles
    max_padded = sorted_ids.numel()
    max_blocks = max_padded // bm
    col_ctas = -(-inter // COLS_PER_CTA)
    groups = hidden // GROUP
    split_max = cfg.split_max if groups % cfg.split_max == 0 else 1
    t = m * topk
    h = torch.empty(max_padded, inter, dtype=torch.bfloat16, device=dev)
    y = torch.empty(t, hidden, dtype=torch.bfloat16, device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream
    if split_max > 1 and cfg.split_target > 0:
        # a call splits only while used_blocks * col_ctas < split_target: fewer rows than this
        part_rows = min(max_padded, -(-cfg.split_target // col_ctas) * bm)
        part = torch.empty(split_max, part_rows, 2 * inter, dtype=torch.float32, device=dev)
        counters = arrival_counters(_counters, dev, max_blocks * col_ctas, 1 << 14)
        if counters is None:  # first call inside a capture: no counters, no split
            split_max, part_rows, part = 1, 0, h
    else:
        split_max, part_rows, part, counters = 1, 0, h, None
    rc = lib.ddtree_moe_small_gate_up(
        hidden_states.data_ptr(), hidden_states.stride(0), w13_packed.data_ptr(),
        w13_scale.data_ptr(), sorted_ids.data_ptr(), block_expert.data_ptr(), part.data_ptr(),
        None if counters is None else counters.data_ptr(), h.data_ptr(), max_blocks, t, topk,
        hidden, inter, part_rows, split_max, cfg.split_target if split_max > 1 else 0,
        cfg.n_tiles, cfg.u_gate_up, index, stream)
    if rc:
        raise RuntimeError(f"ddtree_moe_small_gate_up: CUDA error {rc} ({cfg})")
    if upto < 3:
        return y
    rc = lib.ddtree_moe_small_down(
        h.data_ptr(), w2_packed.data_ptr(), w2_scale.data_ptr(), sorted_ids.data_ptr(),
        block_expert.data_ptr(), topk_weights.data_ptr(), int(topk_weights.dtype == torch.bfloat16),
        y.data_ptr(), max_blocks, t, hidden, inter, cfg.n_tiles, cfg.u_down, index, stream)
    if rc:
        raise RuntimeError(f"ddtree_moe_small_down: CUDA error {rc} ({cfg})")
    return y
