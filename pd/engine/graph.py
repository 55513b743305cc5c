"""A CUDA graph as pd captures it: in a memory pool shared by a family of graphs, after a
warm-up run (`capture`), and, in a tensor-parallel node, with twins on the worker ranks
(`Graph`). The graphs themselves (decode, prefill, MTP steps) are `pd.engine.cuda_graph`'s and
`pd.spec.graphs`'."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from pd.engine import tp


class Graph:
    """A CUDA graph whose capture and replays the worker ranks of a tensor-parallel node
    follow (`pd.engine.tp`): a capture of model calls there captures the same calls on every
    rank, with the collectives that pair them up, and each replay here replays the twins. With
    one rank (or no model call in it), a plain CUDA graph."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.key: int | None = None  # the workers' twin, where they hold one

    @contextmanager
    def capturing(self, owner):
        """Capture into this graph, in `owner.pool` (set by the first capture)."""
        mirror = tp.active()
        key = mirror.begin_capture() if mirror is not None else None
        try:
            with torch.cuda.graph(self.graph, pool=owner.pool):
                yield
        finally:
            if mirror is not None:
                self.key = mirror.end_capture(key, self.graph)
        if owner.pool is None:
            owner.pool = self.graph.pool()

    def replay(self) -> None:
        if self.key is not None:
            tp.active().replay(self.key)
        self.graph.replay()


def capture(forward, owner, device: torch.device):
    """A CUDA graph (`Graph`) of `forward()` in `owner.pool` (the pool of its family, made by
    the first capture: `pd.engine.cuda_graph.DecodeGraphs`), after one warm-up run on a side
    stream (the allocator's and kernels' lazy set-up stays out of the graph); returns the graph
    and its output."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = Graph()
    with graph.capturing(owner):
        out = forward()
    return graph, out
