"""CUDA-graph capture as the kernel tests of every family do it, shared by their folders."""
from __future__ import annotations

import torch


def capture(fn, warmup: int = 2):
    """Run fn `warmup` times on a side stream (as torch asks before a capture: lazy init, JIT,
    allocator pools), then capture one call; returns (graph, the captured call's outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
