"""Rank 0's side of a tensor-parallel node (`pd.engine.tp`): each model call, each graph capture
and replay, and each KV move across the node's edge, told to the workers before rank 0 runs its
own part."""

from __future__ import annotations

import itertools
import threading
import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist

from pd.engine.tp.channel import Channel, context_parts
from pd.model import parallel
from pd.model.context import get_context


class Mirror:
    """Rank 0's side: each model call, and each KV move across the node's edge, is sent to the
    workers before rank 0 runs its own part (one at a time, in one order on every rank: the
    ranks' collectives must pair up)."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.size = parallel.group().size
        self.lock = threading.RLock()
        self.graph_keys = itertools.count()
        self.capturing: tuple[int, bool] | None = None  # the graph being captured: key, begun
        # every graph captured here, whose collectives must be released before the group's
        # (`release_graphs`)
        self.graphs: weakref.WeakSet = weakref.WeakSet()

    @contextmanager
    def mirrored(self, op: str, *tensors: torch.Tensor):
        """Send call `op` with its inputs and the current forward context, then run the body
        (rank 0's part) before any other call may be sent."""
        try:
            ctx = get_context()
        except RuntimeError:
            ctx = None
        scalars, ctx_tensors = context_parts(ctx)
        with self.lock:
            if self.capturing is not None and not self.capturing[1]:
                # the twin's capture starts with the graph's first call
                self.channel.send({"op": "capture_begin", "key": self.capturing[0],
                                   "num_args": 0, "ctx": None}, [])
                self.capturing = (self.capturing[0], True)
            self.channel.send({"op": op, "num_args": len(tensors), "ctx": scalars},
                              [*tensors, *ctx_tensors])
            yield

    def begin_capture(self) -> int:
        """A graph (`pd.engine.graph.Graph`) is being captured here: the workers capture
        its twin from its first call to `end_capture`. Holds the lock meanwhile: no other
        thread's call may land in the twin."""
        self.lock.acquire()
        self.capturing = (next(self.graph_keys), False)  # (key, twin begun)
        return self.capturing[0]

    def end_capture(self, key: int, graph: torch.cuda.CUDAGraph) -> int | None:
        """The twin is captured; returns its key, or None where the graph held no call (no
        twin, nothing for the workers to replay)."""
        self.graphs.add(graph)
        try:
            begun, self.capturing = self.capturing[1], None
            if begun:
                self.channel.send({"op": "capture_end", "key": key, "num_args": 0, "ctx": None},
                                  [])
            return key if begun else None
        finally:
            self.lock.release()

    def replay(self, key: int) -> None:
        with self.lock:
            self.channel.send_replay(key)

    def release_graphs(self) -> None:
        """Free every graph captured on this rank: a graph holding NCCL work keeps the
        communicator from being destroyed (its destroy waits forever)."""
        for graph in list(self.graphs):
            graph.reset()

    def gather_kv(self, kv: torch.Tensor, block_ids) -> torch.Tensor:
        """Blocks `block_ids` of every rank's cache joined by KV head: [L, 2, n, B, H, D] with
        all the model's KV heads, on rank 0 (what the transport sends)."""
        ids = torch.as_tensor(block_ids, dtype=torch.int64)
        with self.mirrored("gather_kv", ids):
            return gather_kv(kv, ids, self.channel.data)

    def install_kv(self, kv: torch.Tensor, chunk: torch.Tensor, l0: int, l1: int,
                   block_ids) -> torch.cuda.Event | None:
        """A received chunk with all KV heads [l1 - l0, 2, n, B, H, D] into blocks `block_ids`
        of layers l0..l1-1: each rank takes its heads. On CUDA nothing waits: the chunk goes
        to the device once (by DMA where its memory is page-locked), is broadcast from there
        and installed, all in the current stream's order, and the event returned completes once
        the chunk's host memory is read and rank 0's heads are written (the workers' installs
        precede their next calls); the caller keeps the chunk until then, and a step launched
        later on another stream must wait for this one. On the CPU done on return (None)."""
        ids = torch.as_tensor(block_ids, dtype=torch.int64)
        cuda = kv.device.type == "cuda"
        if cuda:
            chunk = chunk.to(kv.device, non_blocking=True)
        with self.mirrored("install_kv", chunk, ids, torch.tensor([l0, l1])):
            install_kv(kv, chunk, ids, l0, l1)
        if not cuda:
            return None
        done = torch.cuda.Event()
        done.record()
        return done


def gather_kv(kv: torch.Tensor, ids: torch.Tensor, pg) -> torch.Tensor:
    tp = parallel.group()
    local = kv[:, :, ids.to(kv.device)].contiguous()  # [L, 2, n, B, H / N, D]
    parts = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(parts, local, group=pg)
    return torch.cat(parts, dim=4)


def install_kv(kv: torch.Tensor, chunk: torch.Tensor, ids: torch.Tensor, l0: int, l1: int) -> None:
    tp = parallel.group()
    heads = kv.shape[4]
    mine = chunk[..., tp.rank * heads:(tp.rank + 1) * heads, :].to(kv.device, kv.dtype)
    kv[l0:l1, :, ids.to(kv.device)] = mine


_ACTIVE: Mirror | None = None


def active() -> Mirror | None:
    """Rank 0's mirror while this process runs a tensor-parallel node, else None (what the
    CUDA graphs of `pd.engine.cuda_graph` ask)."""
    return _ACTIVE


def set_active(mirror: Mirror | None) -> None:
    global _ACTIVE
    _ACTIVE = mirror
