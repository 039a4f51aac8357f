"""Programmatic dependent launch (PDL) for the fused MoE's launches (sm_90+, on by default).

A kernel launched with ``launch_pdl=True`` may start while the kernel before it in the stream
still runs: it is launched once every program of that kernel has called
``griddepcontrol.launch_dependents`` or ended, and ``griddepcontrol.wait`` holds it until that
kernel has completed with its writes visible. ``SGLANG_DDTREE_MOE_PDL`` (read per call) picks
how the MoE's launches (four, five with the split-K reduce, six with the two-pass grouping)
use it:

* ``0``: plain launches (the default off sm_90+ and in the interpreter).
* ``1``: every launch waits first thing, and the next launch comes at its programs' exit
  (no launch gap).
* ``1:LETTERS``: as 1, and the launches named let the next one start early, their programs
  then sitting in free slots of the GPU, waiting, instead of being launched after the last
  program ends: ``a`` the grouping (at once, after its wait), ``g`` the gate-up (after its K
  loop, its epilogue still to run), ``r`` the split-K reduce and ``d`` the down (at once).
* ``2``: ``1:agrd``.
* ``e``, ``c`` (after 1 or 2, e.g. ``1:gde``, ``2:c``): loads before the wait, of what does
  not depend on the launch before. ``e``: the looped down's programs read their block's expert
  and rows and the routing weights (the activations and the weights after the wait); ``c``:
  the combine's programs read their token's expert ids.

Unset, a call on an sm_90+ GPU takes ``1:gdec`` (``DEFAULT_SPEC``). Session 60 added ``ec`` to
session 59's ``1:gd`` (on an H100 only, ``bench_results/fused_moe_early_*_h100_s60b.json``:
0.2-0.7 us less a call at most M on random routing and on 8 shared experts, none at M = 8 on
random routing). ``1:gd`` was the fastest choice timed in session 59
(``bench_results/fused_moe_pdl_*_s59{a,b}.json``): with the grouping's x copy per
chunk, on an H100 whole calls 1.1-3.1 us faster than plain launches at M 1-64 on random
routing and on 8 shared experts (M = 8 on random routing 81.7 -> 78.9 us); on the H200
(``fused_moe_pdl_ab_*_h200_s59c.json``) 63.9 against 66.7 us at M = 8 on random routing,
1.5-3.1 us less a call at M 1-32 on both routings. Releasing the
gate-up early from the grouping (``a``) was slower at M = 8 on random routing on both cards
(H100: 79.6 -> 84.5 us with the copy per chunk; H200 mode 2: 65.3 -> 67.2 against waits
only), where the early gate-up programs take slots while the grouping runs.

The combine never releases early: its successor is the caller's next operation (as after a
plain launch, and as the benchmark's back-to-back calls then time it: the next call's
grouping starts at the combine's exit).

Every program waits before it returns and before it reads anything the launch before it
writes (with ``e`` / ``c`` it reads other inputs first), whatever its work: a launch's
completion then implies its predecessor's, so a kernel after the MoE that waits only for the
last launch (SGLang's next operation, a plain launch) finds every MoE buffer written and free.

Session 19 (``bench_results/README.md``) timed an earlier form (every kernel releasing the next
at once, or waiting only) and dropped it; this one is timed by ``bench_fused_moe.py
--ours-variants`` (``gpu_session.sh moepdl``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

PDL_ENV = "SGLANG_DDTREE_MOE_PDL"
RELEASE_POINTS = "agrd"  # grouping, gate-up, split-K reduce, down
EARLY = "ec"  # loads before the wait: the looped down's, the combine's (module docstring)
DEFAULT_SPEC = "1:gdec"  # unset, on sm_90+ (module docstring)


@dataclass(frozen=True)
class Pdl:
    """A call's PDL choice: ``on`` (every launch waits), the launches that release their
    successor early (letters of RELEASE_POINTS) and those that read, before their wait, what
    the launch before them does not write (``early``, letters of EARLY)."""
    on: bool = False
    release: str = ""
    early: str = ""  # letters of EARLY (without ``on``, as the tests run them: no wait)

    def launch(self, point: str) -> dict:
        """Launch options of the kernel at ``point`` (a RELEASE_POINTS letter, or ``c`` for the
        combine): its ``PDL`` constexpr (1: wait; 2: wait and release early) and Triton's
        ``launch_pdl``; none when off, so plain launches compile and run as without PDL."""
        if not self.on:
            return {}
        return {"PDL": 2 if point in self.release else 1, "launch_pdl": True}

    def down_loop(self) -> dict:
        """The looped down's launch options: ``launch("d")`` and, with ``early``, its
        ``EARLY`` constexpr."""
        return {**self.launch("d"), **({"EARLY": True} if "e" in self.early else {})}

    def combine(self) -> dict:
        """The combine's launch options: ``launch("c")`` and, with ``c`` in ``early``, its
        ``EARLY`` constexpr (the expert ids read before the wait)."""
        return {**self.launch("c"), **({"EARLY": True} if "c" in self.early else {})}


def parse_pdl(spec) -> Pdl:
    """``0``, ``1``, ``2``, ``2:LOADS`` or ``1:LETTERS`` (module docstring) -> Pdl; ValueError
    otherwise."""
    spec = str(spec).strip()
    mode, colon, letters = spec.partition(":")
    if spec == "0":
        return Pdl()
    early = "".join(c for c in EARLY if c in letters)
    once = len(set(letters)) == len(letters)
    if mode == "2" and once and set(letters) <= set(EARLY) and (letters or not colon):
        return Pdl(True, RELEASE_POINTS, early)
    if mode == "1" and once and set(letters) <= set(RELEASE_POINTS + EARLY):
        return Pdl(True, "".join(c for c in RELEASE_POINTS if c in letters), early)
    raise ValueError(f"{PDL_ENV}: 0, 1, 2, 2:LOADS or 1:LETTERS (LETTERS from "
                     f"{RELEASE_POINTS + EARLY!r}, LOADS from {EARLY!r}, each once), got {spec!r}")


def pdl_mode(device: torch.device, portable_path: bool, mode=None) -> Pdl:
    """The PDL choice of a call: ``mode`` (a Pdl, or a spec as parse_pdl takes) if given, else
    ``SGLANG_DDTREE_MOE_PDL``, else DEFAULT_SPEC on an sm_90+ GPU and plain launches elsewhere.
    Raises ValueError for an unknown spec, or PDL asked for where the device cannot run it
    (the portable path, a GPU before sm_90)."""
    able = not portable_path and torch.cuda.get_device_capability(device) >= (9, 0)
    if mode is None:
        mode = os.environ.get(PDL_ENV) or (DEFAULT_SPEC if able else "0")
    if not isinstance(mode, Pdl):
        mode = parse_pdl(mode)
    if mode.on and not able:
        raise ValueError(f"{PDL_ENV} needs an sm_90+ GPU outside the Triton interpreter; "
                         f"unset it (or 0) here")
    return mode


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """Under PDL, wait until the previous launch has completed (its writes visible)."""
    if PDL > 0:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _pdl_release(PDL: tl.constexpr):
    """Under PDL 2, let the next launch start now (once every program has said so)."""
    if PDL >= 2:
        tl.extra.cuda.gdc_launch_dependents()
