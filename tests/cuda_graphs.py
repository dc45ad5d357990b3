"""CUDA-graph capture for the GPU tests."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(step: Callable[[], object], warmup: int = 1) -> tuple[torch.cuda.CUDAGraph, object]:
    """Run `step` `warmup` times on a side stream (kernels compile outside the capture), then capture one
    call of it; returns the graph and the captured call's output (rewritten by every replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
