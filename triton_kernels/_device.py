"""Device helpers the Triton kernels share: whether a device takes the portable path, its SM
count and shared memory, and the per-device arrival counters of one-launch split-K fix-ups
(the last program of a tile sums the partials; see moe_w4a16 and skinny_gemm)."""
from __future__ import annotations

import os

import torch


def portable(device: torch.device) -> bool:
    """True where inline PTX and bf16 dots cannot be used: the interpreter
    (``TRITON_INTERPRET=1``), a CPU, a GPU before Ampere."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) < (8, 0)


def pdl_able(device: torch.device) -> bool:
    """Whether launches on ``device`` may use programmatic dependent launch: an sm_90+ GPU
    outside the Triton interpreter."""
    return not portable(device) and torch.cuda.get_device_capability(device) >= (9, 0)


def parse_switch(env: str, raw, one: str = "") -> int:
    """A 0 / 1 PDL switch's value as given (a string or an int, spaces ignored; empty: 0);
    ValueError naming ``env`` otherwise (``one`` says what 1 does)."""
    text = str(raw).strip()
    if text not in ("", "0", "1"):
        raise ValueError(f"{env}={raw!r}: expected 0 (plain launches) or 1{one}")
    return int(text or 0)


def pdl_switch(env: str, device: torch.device, value=None, one: str = "") -> int:
    """A 0 / 1 PDL switch: ``value`` if given, else the environment variable ``env`` (read per
    call; unset: 0), checked by :func:`parse_switch`; ValueError too for 1 where the device
    cannot run PDL (:func:`pdl_able`)."""
    mode = parse_switch(env, os.environ.get(env, "") if value is None else value, one)
    if mode and not pdl_able(device):
        raise ValueError(f"{env}=1 needs an sm_90+ GPU outside the Triton interpreter; "
                         f"unset it (or 0) here")
    return mode


def num_sms(device: torch.device, off_gpu: int) -> int:
    """The device's SM count; ``off_gpu`` for the interpreter's CPU runs (a small "machine",
    so that the launch planners' splits are exercised by small test shapes)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return off_gpu


# shared memory the hardware keeps per resident block (sm_80 to sm_120): a program of S bytes
# takes S + BLOCK_RESERVE of its SM's
BLOCK_RESERVE = 1024


def shared_memory(device: torch.device) -> tuple[int, int] | None:
    """(bytes one block may opt in to, bytes an SM has) of a CUDA device; None off a GPU or
    where CUDA is not there to ask (the planners then assume a Hopper-sized SM)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    per_block = getattr(props, "shared_memory_per_block_optin", None)
    per_sm = getattr(props, "shared_memory_per_multiprocessor", None)
    if not per_block or not per_sm:
        return None
    return int(per_block), int(per_sm)


def arrival_counters(store: dict, device: torch.device, n: int,
                     min_n: int) -> torch.Tensor | None:
    """At least ``n`` int32 counters of ``device`` from ``store`` (one buffer per device, at
    least ``min_n``, zero between launches: each tile's last program re-arms its counter), or
    None inside CUDA-graph capture when a new buffer would be needed: zeroing it then would
    only happen at the graph's replays. A replaced smaller buffer stays alive (and zero) for
    the graphs captured with it."""
    key = (device.type, device.index)
    buf = store.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if buf is not None:
        store.setdefault(("old",) + key, []).append(buf)
    buf = torch.zeros(max(n, min_n), dtype=torch.int32, device=device)
    store[key] = buf
    return buf
