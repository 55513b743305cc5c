"""Tensor parallelism inside a node: the worker ranks, and how they follow rank 0.

A node (or `pd generate`) with `tensor_parallel_size` N > 1 is N processes. Rank 0 is the node
itself: its scheduler, sampler, decode loop and transport run once, there. Ranks 1..N-1 are
worker processes (`python -m pd.engine.tp`, started by `Workers`), each holding its slice
of the weights and of the KV cache (`pd.model.parallel`) and no scheduler. They follow rank 0 by
mirroring its model's calls: each call of rank 0's model (`forward`, `head_logits`,
`mtp_forward`) first sends the call's name, its inputs and the forward context (the step's
batch metadata) to every worker (`Mirror`), then runs; each worker runs the same call on its
slice, meeting rank 0 in the call's collectives (two all-reduces per layer, the vocabulary
gather). What rank 0 samples from the gathered logits is the step's token; the workers keep
nothing of a call but their KV cache writes. Two more calls move KV across the node's edge,
where it travels with all KV heads whatever either side's size: `gather_kv` joins the ranks'
heads of some blocks on rank 0 (before a prefill node sends them), `install_kv` hands each rank
its heads of a received record (on a decode node).

Messages: a call's header is msgpack (op, shapes and dtypes, the context's scalar fields) on the
control group (gloo, host memory); its tensors go packed in one buffer on the data group (gloo
on CPU, NCCL on CUDA). Nothing is pickled; the workers' command lines carry the engine config
as JSON. Rank r runs on `cuda:(i + r)` for a node on `cuda:i`, on the CPU for a CPU node.

A worker that dies takes the node down (`Workers` watches them, logs which one ended, and stops
rank 0's process as Ctrl-C would, ending it outright if that has not within EXIT_GRACE_S): a
node missing a rank cannot compute, and its router routes around a node that is gone. A
worker whose rank 0 dies ends too (its next receive fails; on Linux the kernel also kills it
with its parent).

CUDA graphs: rank 0's graphs (`pd.engine.cuda_graph.Graph`) tell the workers when a capture
begins and ends; the calls between are captured there too, each opening with the broadcast of
its packed inputs, so a replay on rank 0 (one REPLAY message to the workers) moves the step's
inputs and meets the twins' collectives on the device, with no other host message.

Not yet: the CUDA IPC KV tier (KV crosses by the ring or ZMQ).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, fields
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from pd.config import EngineConfig
from pd.engine.kv_cache import KVCache
from pd.model import parallel
from pd.model.context import ForwardContext, forward_context, get_context
from pd.model.loader import load_model

log = logging.getLogger(__name__)

INIT_TIMEOUT = timedelta(seconds=300)  # every rank loads its weights before the first collective
EXIT_GRACE_S = 10.0  # a node whose worker died has this long to stop before it exits
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64,
                               torch.int32, torch.bool, torch.uint8)}
_ALIGN = 16  # bytes: each tensor's place in a call's packed buffer


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r's device for a node on `device`: cuda:(i + r), or the CPU."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + rank)


def _context_parts(ctx: ForwardContext | None) -> tuple[dict | None, list[torch.Tensor]]:
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


def _context(parts: dict | None, tensors: list[torch.Tensor]) -> ForwardContext | None:
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
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
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


class Mirror:
    """Rank 0's side: each model call, and each KV move across the node's edge, is sent to the
    workers before rank 0 runs its own part (one at a time, in one order on every rank: the
    ranks' collectives must pair up)."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.size = parallel.group().size
        self.lock = threading.RLock()
        self.graph_keys = itertools.count()
        self.calls = 0  # calls sent (a capture with none has no twin)
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
        scalars, ctx_tensors = _context_parts(ctx)
        with self.lock:
            self.channel.send({"op": op, "num_args": len(tensors), "ctx": scalars},
                              [*tensors, *ctx_tensors])
            self.calls += 1
            yield

    def begin_capture(self) -> int:
        """The workers start capturing a graph's twin (`pd.engine.cuda_graph.Graph`): the
        calls sent until `end_capture` are captured there. Holds the lock meanwhile: no other
        thread's call may land in the twin."""
        self.lock.acquire()
        key = next(self.graph_keys)
        self.channel.send({"op": "capture_begin", "key": key, "num_args": 0, "ctx": None}, [])
        self.captured_from = self.calls
        return key

    def end_capture(self, key: int, graph: torch.cuda.CUDAGraph) -> int | None:
        """The twin is captured; returns its key, or None where it holds no call (nothing
        for the workers to replay)."""
        self.graphs.add(graph)
        try:
            keep = self.calls > self.captured_from
            self.channel.send({"op": "capture_end", "key": key, "keep": keep, "num_args": 0,
                               "ctx": None}, [])
            return key if keep else None
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
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
        with self.mirrored("gather_kv", ids):
            return _gather_kv(kv, ids.to(kv.device), self.channel.data)

    def install_kv(self, kv: torch.Tensor, chunk: torch.Tensor, l0: int, l1: int,
                   block_ids) -> None:
        """A received chunk with all KV heads [l1 - l0, 2, n, B, H, D] into blocks `block_ids`
        of layers l0..l1-1: each rank takes its heads (done when this returns)."""
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
        with self.mirrored("install_kv", chunk, ids, torch.tensor([l0, l1])):
            _install_kv(kv, chunk, ids, l0, l1)


def _gather_kv(kv: torch.Tensor, ids: torch.Tensor, pg) -> torch.Tensor:
    tp = parallel.group()
    local = kv[:, :, ids.to(kv.device)].contiguous()  # [L, 2, n, B, H / N, D]
    parts = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(parts, local, group=pg)
    return torch.cat(parts, dim=4)


def _install_kv(kv: torch.Tensor, chunk: torch.Tensor, ids: torch.Tensor, l0: int, l1: int) -> None:
    tp = parallel.group()
    heads = kv.shape[4]
    mine = chunk[..., tp.rank * heads:(tp.rank + 1) * heads, :].to(kv.device, kv.dtype)
    kv[l0:l1, :, ids.to(kv.device)] = mine


_ACTIVE: Mirror | None = None


def active() -> Mirror | None:
    """Rank 0's mirror while this process runs a tensor-parallel node, else None."""
    return _ACTIVE


class Workers:
    """Rank 0's handle on its worker processes: started before the model loads (every rank
    loads its slice at once), told the cache's size once rank 0 knows it (`setup`), stopped
    with the node."""

    def __init__(self, cfg: EngineConfig) -> None:
        size = cfg.tensor_parallel_size
        self.cfg, self.size = cfg, size
        self.device = rank_device(cfg.device, 0)
        if self.device.type == "cuda":
            last = rank_device(cfg.device, size - 1).index
            if last >= torch.cuda.device_count():
                raise ValueError(f"tensor parallel size {size} on {cfg.device} needs cuda:{last}; "
                                 f"this host has {torch.cuda.device_count()} GPU(s)")
        else:  # the node's cores, shared among its ranks (each worker takes its share too)
            torch.set_num_threads(max(1, torch.get_num_threads() // size))
        # NOTE: rank 0 serves the store on a port the OS picks; the workers find it there
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=INIT_TIMEOUT,
                              wait_for_workers=False)
        config = {k: v for k, v in asdict(cfg).items() if k != "extra"}
        self.procs = [subprocess.Popen([sys.executable, "-m", "pd.engine.tp", "--rank", str(r),
                                        "--port", str(store.port), "--config", json.dumps(config)])
                      for r in range(1, size)]
        self.stopping = False
        self.failed: str | None = None  # why a worker's end took the node down
        threading.Thread(target=self._watch, name="pd-tp-watch", daemon=True).start()
        log.info("tensor parallel: %d ranks (workers %s)", size,
                 ", ".join(str(p.pid) for p in self.procs))
        self.channel = _join(0, size, store, self.device)
        self.mirror: Mirror | None = None

    def setup(self, num_blocks: int, spare_blocks: int, rope_positions: int) -> Mirror:
        """Tell the workers the cache's size (each allocates its heads' share) and how many
        positions the rotary tables cover; returns rank 0's mirror, for its model."""
        self.channel.send({"op": "setup", "num_args": 0, "ctx": None,
                           "num_blocks": num_blocks, "spare_blocks": spare_blocks,
                           "rope_positions": rope_positions}, [])
        global _ACTIVE
        self.mirror = _ACTIVE = Mirror(self.channel)
        return self.mirror

    def _watch(self) -> None:
        """A worker that ends while the node runs takes the node down: SIGINT to this process
        (a node stops as on Ctrl-C, ending what it runs with an error; a script gets
        KeyboardInterrupt), and its exit if that has not ended it within EXIT_GRACE_S."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.wait()
            if self.stopping:
                return
            self.failed = (f"tensor parallel rank {rank} (pid {proc.pid}) ended with exit code "
                           f"{code}: this node cannot compute without it and goes down")
            log.error("%s", self.failed)
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
            os.kill(os.getpid(), signal.SIGINT)
            threading.Timer(EXIT_GRACE_S, os._exit, (70,)).start()
            return

    def close(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        # NOTE: the graphs go first (on the workers too): NCCL's destroy waits forever on a
        # communicator that a live CUDA graph holds work of; then every rank destroys the group
        # at once (a destroy waits for the other ranks')
        if self.mirror is not None:
            self.mirror.release_graphs()
        try:
            if self.failed is None:
                with self.mirror.lock if self.mirror is not None else nullcontext():
                    self.channel.send({"op": "stop", "num_args": 0, "ctx": None}, [])
                dist.destroy_process_group()
        finally:
            for p in self.procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            if dist.is_initialized():  # a worker died: nothing to wait for
                dist.destroy_process_group()
            parallel.init(0, 1, None)
            global _ACTIVE
            _ACTIVE = None


def _join(rank: int, size: int, store, device: torch.device) -> Channel:
    """Join the node's process group as `rank`; the layers' group (`pd.model.parallel`) and
    the call channel."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=INIT_TIMEOUT,
                            device_id=device if device.type == "cuda" else None)
    control = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    parallel.init(rank, size, dist.group.WORLD)
    return Channel(control, dist.group.WORLD, device)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when rank 0's ends (PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


def worker_main(rank: int, port: int, cfg: EngineConfig) -> None:
    """Rank `rank`: load this rank's slice, allocate its cache when rank 0 says how big, then
    run each call rank 0 sends until it says stop."""
    _die_with_parent()
    device = rank_device(cfg.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_num_threads(1)
    else:  # the node's cores, shared among its ranks
        torch.set_num_threads(max(1, torch.get_num_threads() // cfg.tensor_parallel_size))
    store = dist.TCPStore("127.0.0.1", port, cfg.tensor_parallel_size, is_master=False,
                          timeout=INIT_TIMEOUT)
    channel = _join(rank, cfg.tensor_parallel_size, store, device)
    model = load_model(cfg.model, cfg.torch_dtype, device)
    header, _ = channel.recv()
    if header["op"] == "stop":
        return
    kv_cache = KVCache(model.config, header["num_blocks"], cfg.block_size, cfg.torch_dtype, device,
                       spare_blocks=header["spare_blocks"],
                       kv_heads=model.attention_layers()[0].num_kv_heads)
    kv_cache.bind(model.attention_layers())
    model.rotary.cache_positions(header["rope_positions"], device, cfg.torch_dtype)
    log.info("tensor parallel rank %d ready on %s", rank, device)
    graphs: dict[int, torch.cuda.CUDAGraph] = {}  # twins of rank 0's graphs, by key
    capturing = None  # (key, graph, its capture context) between capture_begin and _end
    pool = None  # one memory pool for every twin, as rank 0's graphs share one
    with torch.inference_mode():
        while True:
            header, tensors = channel.recv()
            op = header["op"]
            if op == "replay":
                graphs[header["key"]].replay()
                continue
            if op == "stop":
                break
            if op == "capture_begin":
                graph = torch.cuda.CUDAGraph()
                capturing = (header["key"], graph, torch.cuda.graph(graph, pool=pool))
                capturing[2].__enter__()
                continue
            if op == "capture_end":
                key, graph, cm = capturing
                cm.__exit__(None, None, None)
                pool = pool if pool is not None else graph.pool()
                if header["keep"]:
                    graphs[key] = graph
                capturing = None
                continue
            args = tensors[:header["num_args"]]
            ctx = _context(header["ctx"], tensors[header["num_args"]:])
            with forward_context(ctx) if ctx is not None else nullcontext():
                if op == "forward":
                    model(*args)
                elif op == "head_logits":
                    model.head_logits(*args)
                elif op == "mtp_forward":
                    model.mtp_forward(*args)
                elif op == "gather_kv":
                    _gather_kv(kv_cache.kv, args[0], channel.data)
                elif op == "install_kv":
                    l0, l1 = args[2].tolist()
                    _install_kv(kv_cache.kv, args[0], args[1], l0, l1)
                else:
                    raise RuntimeError(f"tensor parallel rank {rank}: unknown call {op!r}")
    # NOTE: graphs first, then the group, with rank 0 (see Workers.close)
    for graph in graphs.values():
        graph.reset()
    dist.destroy_process_group()
    logging.shutdown()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pd.engine.tp",
                                description="A tensor-parallel worker rank of a pd node (started "
                                            "by the node; not run by hand).")
    p.add_argument("--rank", type=int, required=True, help="this process's rank, 1..N-1")
    p.add_argument("--port", type=int, required=True, help="rank 0's store port on 127.0.0.1")
    p.add_argument("--config", required=True, help="the node's engine config, as JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank-{args.rank} "
                                                   "%(name)s: %(message)s")
    cfg = EngineConfig(**json.loads(args.config))
    worker_main(args.rank, args.port, cfg)


if __name__ == "__main__":
    main()
