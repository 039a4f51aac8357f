"""What the prefix kernels of a tree verify (FlashMLA for MLA, ``mla_prefix.py``; FA3 for MHA,
``mha_prefix.py``) need of the machine: a CUDA device of the arch they are built for, and the
kernel importable."""
from __future__ import annotations

from typing import Callable

import torch


def machine_problems(device: torch.device, kernel: str, built_for: str,
                     arch_ok: Callable[[tuple], bool], load: Callable) -> list:
    """Why ``kernel`` cannot run on ``device`` (empty: it can). ``arch_ok`` takes the device's
    (major, minor) compute capability; ``load`` imports the kernel (any exception is the
    reason); ``built_for`` names the arch in the message."""
    if device.type != "cuda":
        return [f"device {device} ({kernel} runs on CUDA)"]
    capability = torch.cuda.get_device_capability(device)
    if not arch_ok(capability):
        return [f"a GPU of compute capability {capability[0]}.{capability[1]} ({kernel} is "
                f"built for {built_for})"]
    try:
        load()
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        return [f"{kernel} not importable ({type(e).__name__}: {e})"]
    return []
