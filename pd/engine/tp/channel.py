"""The messages between a tensor-parallel node's ranks (`pd.engine.tp`), and joining its group.

Rank 0 broadcasts, the workers receive, one message at a time: a call's header is msgpack (its
name, its tensors' shapes and dtypes, the forward context's scalar fields) on the control group
(gloo, host memory), its tensors packed in one buffer on the data group (gloo on CPU, NCCL on
CUDA); a graph replay is three int64 alone. Nothing is pickled.
"""

from __future__ import annotations

import os
from dataclasses import fields
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from pd.model import parallel
from pd.model.context import ForwardContext

INIT_TIMEOUT = timedelta(seconds=300)  # every rank loads its weights before the first collective
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64,
                               torch.int32, torch.bool, torch.uint8)}
_ALIGN = 16  # bytes: each tensor's place in a call's packed buffer


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r's device for a node on `device`: cuda:(i + r), or the CPU."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + rank)


def context_parts(ctx: ForwardContext | None) -> tuple[dict | None, list[torch.Tensor]]:
    """The context's scalar fields and the names of its tensor fields (msgpack-able), and its
    tensors in that order."""
    if ctx is None:
        return None, []
    scalars, names, tensors = {}, [], []
    for f in fields(ctx):
        value = getattr(ctx, f.name)
        if isinstance(value, torch.Tensor):
            names.append(f.name)
            tensors.append(value)
        else:
            scalars[f.name] = value if not isinstance(value, tuple) else [list(v) for v in value]
    return {"scalars": scalars, "tensors": names}, tensors


def context_of(parts: dict | None, tensors: list[torch.Tensor]) -> ForwardContext | None:
    if parts is None:
        return None
    kw = dict(parts["scalars"], **dict(zip(parts["tensors"], tensors)))
    if kw.get("seq_lens_host") is not None:
        kw["seq_lens_host"] = tuple(tuple(v) for v in kw["seq_lens_host"])
    return ForwardContext(**kw)


class Channel:
    """One rank's end of the node's call channel: rank 0 broadcasts, the workers receive. Each
    message opens with three int64 on the control group: (MESSAGE, header bytes, payload bytes)
    then the msgpack header (control group) and the packed tensors (data group), or
    (REPLAY, graph key, 0) alone."""

    MESSAGE, REPLAY = 0, 1

    def __init__(self, control, data, device: torch.device) -> None:
        self.control, self.data, self.device = control, data, device

    def send(self, header: dict, tensors: list[torch.Tensor]) -> None:
        header["tensors"] = [(list(t.shape), str(t.dtype)) for t in tensors]
        raw = msgpack.packb(header)
        payload = self._pack(tensors)
        head = torch.tensor([self.MESSAGE, len(raw), payload.numel()], dtype=torch.int64)
        dist.broadcast(head, 0, group=self.control)
        dist.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8), 0, group=self.control)
        if payload.numel():
            dist.broadcast(payload, 0, group=self.data)

    def send_replay(self, key: int) -> None:
        dist.broadcast(torch.tensor([self.REPLAY, key, 0], dtype=torch.int64), 0,
                       group=self.control)

    def recv(self) -> tuple[dict, list[torch.Tensor]]:
        head = torch.empty(3, dtype=torch.int64)
        dist.broadcast(head, 0, group=self.control)
        kind, a, b = head.tolist()
        if kind == self.REPLAY:
            return {"op": "replay", "key": a}, []
        raw = torch.empty(a, dtype=torch.uint8)
        dist.broadcast(raw, 0, group=self.control)
        header = msgpack.unpackb(raw.numpy().tobytes())
        payload = torch.empty(b, dtype=torch.uint8, device=self.device)
        if payload.numel():
            dist.broadcast(payload, 0, group=self.data)
        tensors, offset = [], 0
        for shape, dtype in header["tensors"]:
            dt = _DTYPES[dtype]
            nbytes = torch.Size(shape).numel() * dt.itemsize
            tensors.append(payload[offset:offset + nbytes].view(dt).view(shape))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        return header, tensors

    def _pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        parts = []
        for t in tensors:
            raw = t.detach().to(self.device).contiguous().reshape(-1).view(torch.uint8)
            pad = -raw.numel() % _ALIGN
            parts += [raw, raw.new_zeros(pad)] if pad else [raw]
        if not parts:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        return torch.cat(parts)


def join(rank: int, size: int, store, device: torch.device) -> Channel:
    """Join the node's process group as `rank`; the layers' group (`pd.model.parallel`) and
    the call channel."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    # NOTE: every rank is on this host: gloo over loopback, not over whatever interface the
    # host name resolves to (none, in some containers)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=INIT_TIMEOUT,
                            device_id=device if device.type == "cuda" else None)
    control = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    parallel.init(rank, size, dist.group.WORLD)
    return Channel(control, dist.group.WORLD, device)
