"""Small-M path of the fused W4A16 MoE: the gate-up and down GEMMs as CUDA ``mma.sync`` kernels.

For calls of a few tokens (a verify of a small tree, decode) the Triton GEMMs of
``moe_w4a16`` read DRAM at about half the copy bandwidth: few programs fit an SM and each keeps
little in flight (Nsight Compute, ``bench_results/ncu_fused_moe_summary_h200_s36.json``). The
kernels in ``cuda_ext/moe_w4a16_small.cuh`` give each lane one 16-byte copy of packed weights per
32-row K group, feed the words straight into the MMA's A operand (no repack, no shuffle between
lanes) and keep 4-8 groups per warp in flight through a cp.async ring in shared memory, in grids
of one wave whatever the routing. Between them and around them nothing changes:
``moe_w4a16``'s Triton prologue groups the pairs by expert (in blocks of 8 or 16 rows) and its
combine kernel sums the top-k slots.

Selection (read per call, so benchmarks can switch it): ``SGLANG_DDTREE_MOE_SMALL=<max M>``
serves calls of up to that many tokens here (0, the default: off). ``SGLANG_DDTREE_MOE_SMALL_CFG``
overrides the launch settings for tuning, e.g. ``nt=1,s=6,ds=8,dw=1``. Where the
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

from ._device import arrival_counters, num_sms

ENV = "SGLANG_DDTREE_MOE_SMALL"
ENV_CFG = "SGLANG_DDTREE_MOE_SMALL_CFG"
COLS_PER_CTA = 256  # 8 warps x 32 columns (gate-up: of gate and of up)
GROUP = 32  # K rows per scale and per pipelined load


@dataclass(frozen=True)
class SmallConfig:
    """Launch settings of one small-M call."""

    n_tiles: int  # 8-token MMA n-tiles per block: blocks of 8 * n_tiles rows (1 or 2)
    stages_gate_up: int  # cp.async ring stages per warp in the gate-up (4 / 6 / 8; 4 at 2 tiles)
    stages_down: int  # ... in the down (4 / 8 at 1 tile, 4 / 6 at 2)
    waves_down: int  # down grid: this many waves of resident CTAs (over its column CTAs)

    def validate(self) -> None:
        gu = {1: (4, 6, 8), 2: (4,)}
        dn = {1: (4, 8), 2: (4, 6)}
        if (self.n_tiles not in gu or self.stages_gate_up not in gu[self.n_tiles]
                or self.stages_down not in dn[self.n_tiles] or self.waves_down < 1):
            raise ValueError(f"{ENV_CFG}: n_tiles 1 (gate-up stages 4/6/8, down 4/8) or 2 "
                             f"(gate-up 4, down 4/6), down waves >= 1; got {self}")


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
    of the call's tokens, so one block), 16 above; ``SGLANG_DDTREE_MOE_SMALL_CFG`` overrides
    (stages not given take the defaults of the n-tiles chosen)."""
    keys = {"nt": "n_tiles", "s": "stages_gate_up", "ds": "stages_down", "dw": "waves_down"}
    given = {}
    raw = os.environ.get(ENV_CFG, "").strip()
    for item in raw.split(",") if raw else ():
        k, _, v = item.partition("=")
        if k.strip() not in keys or not v.strip().isdigit():
            raise ValueError(f"{ENV_CFG}: comma-separated nt|s|ds|dw=<int>, got {item!r}")
        given[keys[k.strip()]] = int(v)
    nt = given.get("n_tiles", 1 if m <= 8 else 2)
    cfg = SmallConfig(n_tiles=nt, stages_gate_up=6 if nt == 1 else 4,
                      stages_down=8 if nt == 1 else 6, waves_down=1)
    cfg = replace(cfg, **given)
    cfg.validate()
    return cfg


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
    breakdowns). CUDA-graph safe: no allocation outside the caching allocator, no host sync.

    Both grids are one wave of the SMs' resident CTAs (from the probe's occupancy), whatever the
    routing: the gate-up splits the call's used blocks x K groups evenly over its CTAs
    (stream-K), the down deals the used blocks round-robin to its CTAs."""
    dev = hidden_states.device
    loader = _loader()
    lib = loader.load_moe_small_lib(required=True)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    probe = loader.moe_probe(index)  # loads the kernels once, outside any capture
    m, hidden = hidden_states.shape
    inter = w2_packed.shape[1] * 8
    bm = 8 * cfg.n_tiles
    max_padded = sorted_ids.numel()
    max_blocks = max_padded // bm
    sms = num_sms(dev, 1)
    t = m * topk
    h = torch.empty(max_padded, inter, dtype=torch.bfloat16, device=dev)
    y = torch.empty(t, hidden, dtype=torch.bfloat16, device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream
    gu_cols = -(-inter // COLS_PER_CTA)
    gu_ctas = max(1, sms * probe[("gate_up", cfg.n_tiles, cfg.stages_gate_up)][2] // gu_cols)
    part = torch.empty(2 * gu_ctas * bm, 2 * inter, dtype=torch.float32, device=dev)
    counters = arrival_counters(_counters, dev, max_blocks * gu_cols, 1 << 14)
    if counters is None:
        raise RuntimeError("the small-M MoE path's first call on a device ran inside a CUDA-graph "
                           "capture: run one call eagerly first (SGLang's warm-up does)")
    rc = lib.ddtree_moe_small_gate_up(
        hidden_states.data_ptr(), hidden_states.stride(0), w13_packed.data_ptr(),
        w13_scale.data_ptr(), sorted_ids.data_ptr(), block_expert.data_ptr(), part.data_ptr(),
        counters.data_ptr(), h.data_ptr(), max_blocks, t, topk, hidden, inter, gu_ctas,
        cfg.n_tiles, cfg.stages_gate_up, index, stream)
    if rc:
        raise RuntimeError(f"ddtree_moe_small_gate_up: CUDA error {rc} ({cfg})")
    if upto < 3:
        return y
    dn_cols = -(-hidden // COLS_PER_CTA)
    dn_occ = probe[("down", cfg.n_tiles, cfg.stages_down)][2]
    dn_ctas = max(1, -(-sms * dn_occ * cfg.waves_down // dn_cols))
    rc = lib.ddtree_moe_small_down(
        h.data_ptr(), w2_packed.data_ptr(), w2_scale.data_ptr(), sorted_ids.data_ptr(),
        block_expert.data_ptr(), topk_weights.data_ptr(), int(topk_weights.dtype == torch.bfloat16),
        y.data_ptr(), max_blocks, t, hidden, inter, dn_ctas, cfg.n_tiles, cfg.stages_down, index,
        stream)
    if rc:
        raise RuntimeError(f"ddtree_moe_small_down: CUDA error {rc} ({cfg})")
    return y
