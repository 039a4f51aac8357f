"""Capture a CUDA graph mid-serving without ``torch.cuda.graph``'s process-wide side effects.

The plugin's own graphs (tree build with the torch-op builder, accept/commit) are captured
lazily, the first time a batch size shows up, while SGLang is serving. ``torch.cuda.graph``
synchronizes the device, empties the caching allocator (every later allocation then goes back to
cudaMalloc) and, on older torch, runs ``gc.collect()`` over the whole scheduler process, at every
capture. Here only the capture itself happens: on a side stream ordered after the current one,
in ``thread_local`` mode (SGLang's other threads keep issuing CUDA work meanwhile), into the
graph's private memory pool.
"""

from __future__ import annotations

from typing import Any, Callable, Tuple

import torch


def capture(fn: Callable[[], Any], device) -> Tuple[torch.cuda.CUDAGraph, Any]:
    """(graph, fn's return value recorded during capture). Warm ``fn`` up beforehand (first
    calls may allocate index tables or compile kernels, which capture cannot do)."""
    device = torch.device(device)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(device=device)
    current = torch.cuda.current_stream(device)
    side.wait_stream(current)  # inputs written on the current stream are visible to the graph
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            out = fn()
        finally:
            graph.capture_end()
    current.wait_stream(side)
    return graph, out


def warm_up(fn: Callable[[], Any], device) -> Any:
    """Run ``fn`` once on a side stream ordered after (and before) the current one."""
    device = torch.device(device)
    side = torch.cuda.Stream(device=device)
    current = torch.cuda.current_stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        out = fn()
    current.wait_stream(side)
    return out
