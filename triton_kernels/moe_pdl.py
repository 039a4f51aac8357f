"""Programmatic dependent launch (PDL) for the fused MoE's launches (sm_90+, opt-in).

A kernel launched with ``launch_pdl=True`` may start while the kernel before it in the stream
still runs: it is launched once every program of that kernel has called
``griddepcontrol.launch_dependents`` or ended, and ``griddepcontrol.wait`` holds it until that
kernel has completed with its writes visible. ``SGLANG_DDTREE_MOE_PDL`` (read per call) picks
how far the MoE's four launches (five with the split-K reduce) use it:

* ``0`` (default): plain launches.
* ``1``: every launch waits first thing, and the next launch comes at its programs' exit
  (no launch gap).
* ``2``: as 1, and each launch but the combine lets the next one start early: the grouping
  and the down at once (after their wait), the gate-up after its K loop (its epilogue still
  to run). The next launch's programs then sit in free slots of the GPU, waiting, instead of
  being launched after the last program ends. The combine's successor is the caller's next
  operation, so it is left to the combine's exit (as after a plain launch, and as the
  benchmark's back-to-back calls then time it: the next call's grouping starts at the exit).
* ``3``: as 2, and a looped down program asks the L2 (``prefetch.global.L2``) for the weight
  and scale lines of its column range before it waits, so that they arrive while the gate-up
  finishes.

Every program waits before it returns, whatever its work: a launch's completion then implies
its predecessor's, so a kernel after the MoE that waits only for the last launch (SGLang's
next operation, which is a plain launch) finds every MoE buffer written and free. What a
program reads before its wait (the down's block labels and weights under 3) was written by
the grouping, which completed before any gate-up program passed its own wait, and so before
the down was launched.

Session 19 (``bench_results/README.md``) timed an earlier form (every kernel releasing the next
at once, or waiting only) and dropped it; this one is timed by ``bench_fused_moe.py
--ours-variants``.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

PDL_ENV = "SGLANG_DDTREE_MOE_PDL"
PDL_MODES = (0, 1, 2, 3)


def pdl_mode(device: torch.device, portable_path: bool, mode: int | None = None) -> int:
    """The PDL mode of a call: ``mode`` if given, else ``SGLANG_DDTREE_MOE_PDL`` (0 unset).
    Raises ValueError for an unknown mode, or a mode > 0 where the device cannot (the portable
    path, a GPU before sm_90)."""
    if mode is None:
        env = os.environ.get(PDL_ENV, "0")
        if env not in ("0", "1", "2", "3"):
            raise ValueError(f"{PDL_ENV}: 0, 1, 2 or 3, got {env!r}")
        mode = int(env)
    if mode not in PDL_MODES:
        raise ValueError(f"pdl: one of {PDL_MODES}, got {mode!r}")
    if mode and (portable_path or torch.cuda.get_device_capability(device) < (9, 0)):
        raise ValueError(f"{PDL_ENV}={mode} needs an sm_90+ GPU outside the Triton interpreter; "
                         f"unset it (or 0) here")
    return mode


def pdl_launch(mode: int) -> dict:
    """The launch options of a kernel under ``mode``: its ``PDL`` constexpr and Triton's
    ``launch_pdl`` (none at 0, so plain launches compile and run as without this module)."""
    return {"PDL": mode, "launch_pdl": True} if mode else {}


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """Under PDL, wait until the previous launch has completed (its writes visible)."""
    if PDL > 0:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _pdl_release(PDL: tl.constexpr):
    """Under PDL 2 or 3, let the next launch start now (once every program has said so)."""
    if PDL >= 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _prefetch_l2(ptrs):
    """Ask the L2 for the 128-byte lines at ``ptrs`` (PTX ``prefetch.global.L2``; no register
    result, nothing waits for it)."""
    tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_rows(row_ptrs, length, MAX_LEN: tl.constexpr, WIDTH: tl.constexpr):
    """Ask the L2 for the lines of ``length`` (<= MAX_LEN) elements at each of ``row_ptrs``
    ([rows] pointers), ``WIDTH`` elements a 128-byte line; pointers past ``length`` repeat the
    last element's line."""
    cols = tl.minimum(tl.arange(0, (MAX_LEN + WIDTH - 1) // WIDTH) * WIDTH, length - 1)
    _prefetch_l2(row_ptrs[:, None] + cols[None, :])
