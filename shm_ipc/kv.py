"""Moving KV blocks between a node's paged cache and KV records, one call each way.

The cache is one tensor `kv[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`
(the MTP layer, when present, last in dim 0). A request's KV is split by layer range (and, when
one layer alone is too big, by block range) so that no record exceeds `max_record_bytes`; each
chunk's bytes are `kv[l0:l1, :, block_ids[b0:b1]]`, contiguous, in that order. The sender
gathers into ring memory (or a fresh tensor for ZMQ); the receiver copies a record's payload
into `kv[l0:l1, :, dst_block_ids[b0:b1]]`. On CUDA, with a page-locked record, each way is DMA
alone where the chunk's blocks form few runs of consecutive ids (`dma_plan`): one 2-D copy per
run between the cache and the record (a row per layer and K/V), on a side stream, with no
kernel and no staging. Otherwise each way is one block-copy kernel (`pd_kernels.block_copy`)
between the cache and a device staging buffer, and one DMA copy between that buffer and the
record: the DMAs on one side stream, the kernels on another, and `STAGING_SLOTS` staging buffers
used in turn, so one record's kernel overlaps another's DMA.
A receiver that does not wait for its installs (the decode node while it decodes) gets an event
per record; on CPU the copies run on a thread of their own instead, with the same contract.
Geometry agreement between the two nodes is the handshake's job (the node services); here each
record's size and dtype are checked.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

from pd_kernels.block_copy import compile_kernel, copy_blocks
from pd.engine.host_ring import to_device

from .records import DTYPE_CODES, KVRecord

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_CODES:
        raise ValueError(f"KV dtype {dtype} not carried; use one of {sorted(DTYPE_CODES)}")
    return name


def unit_bytes(kv: torch.Tensor) -> int:
    """Bytes of one layer's K and V for one block."""
    return 2 * kv[0, 0, 0].numel() * kv.element_size()


def block_bytes(kv: torch.Tensor) -> int:
    """Bytes of one block across every layer: what moving a block of a request's KV moves."""
    return kv.shape[0] * unit_bytes(kv)


def plan_chunks(num_layers: int, num_blocks: int, unit: int, max_bytes: int
                ) -> list[tuple[int, int, int, int]]:
    """(layer_start, layer_end, block_start, block_end) chunks of at most `max_bytes` each."""
    if num_blocks <= 0:
        return []
    if unit > max_bytes:
        raise ValueError(f"one block of one layer ({unit} bytes) exceeds the max record size "
                         f"({max_bytes} bytes)")
    per_layer = num_blocks * unit
    if per_layer <= max_bytes:
        step = max_bytes // per_layer
        return [(l0, min(l0 + step, num_layers), 0, num_blocks) for l0 in range(0, num_layers, step)]
    step = max_bytes // unit
    return [(layer, layer + 1, b0, min(b0 + step, num_blocks))
            for layer in range(num_layers) for b0 in range(0, num_blocks, step)]


def chunk_shape(kv: torch.Tensor, l0: int, l1: int, nb: int) -> tuple[int, ...]:
    return (l1 - l0, 2, nb) + tuple(kv.shape[3:])


class Copy2D(NamedTuple):
    """One 2-D copy of `dma_plan`: `height` rows of `width` bytes, `cache_pitch` bytes apart
    from `cache` (a byte offset into the cache) and `chunk_pitch` apart from `chunk` (a byte
    offset into the chunk's contiguous bytes)."""

    cache: int
    chunk: int
    width: int
    height: int
    cache_pitch: int
    chunk_pitch: int


MAX_DMA_RUNS = 32  # runs of consecutive blocks a chunk may have to move by DMA alone
DMA_ENV = "PD_KV_DMA"  # 0: every CUDA copy through the block-copy kernel (to compare)


def dma_plan(kv: torch.Tensor, l0: int, l1: int, block_ids) -> list[Copy2D] | None:
    """The copies that move `kv[l0:l1, :, block_ids]` to or from a chunk's contiguous bytes
    ([l1 - l0, 2, n, ...], `chunk_shape`), one per run of consecutive ids: each run is the
    same bytes in every (layer, K/V) plane of the cache, so one 2-D copy with a row per plane
    takes it. None when there are more than `MAX_DMA_RUNS` runs (too many small copies: the
    block-copy kernel gathers them)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.size == 0 or not kv.is_contiguous():
        return None
    starts = np.concatenate(([0], np.flatnonzero(np.diff(ids) != 1) + 1))
    if starts.size > MAX_DMA_RUNS:
        return None
    ends = np.append(starts[1:], ids.size)
    unit = kv[0, 0, 0].numel() * kv.element_size()  # one block of one plane
    plane = kv.stride(1) * kv.element_size()  # (layer, K) to (layer, V) to (layer + 1, K)
    base = l0 * kv.stride(0) * kv.element_size()
    rows, chunk_pitch = (l1 - l0) * 2, ids.size * unit
    return [Copy2D(base + int(ids[a]) * unit, int(a) * unit, int(b - a) * unit, rows, plane,
                   chunk_pitch) for a, b in zip(starts, ends)]


def _dma(plan: list[Copy2D], kv: torch.Tensor, chunk: torch.Tensor, to_chunk: bool) -> None:
    """Run `plan` between the CUDA cache and a page-locked chunk on torch's current stream."""
    from pd_kernels.launch import _cupy  # noqa: PLC0415

    runtime = _cupy().cuda.runtime
    stream = torch.cuda.current_stream(kv.device).cuda_stream
    cache, host = kv.data_ptr(), chunk.data_ptr()
    for c in plan:
        if to_chunk:
            runtime.memcpy2DAsync(host + c.chunk, c.chunk_pitch, cache + c.cache, c.cache_pitch,
                                  c.width, c.height, runtime.memcpyDefault, stream)
        else:
            runtime.memcpy2DAsync(cache + c.cache, c.cache_pitch, host + c.chunk, c.chunk_pitch,
                                  c.width, c.height, runtime.memcpyDefault, stream)


def _dma_plan_for(kv: torch.Tensor, l0: int, l1: int, block_ids, chunk: torch.Tensor):
    """`dma_plan` where the CUDA copy may be DMA alone (a page-locked chunk, not turned off by
    `PD_KV_DMA=0`), else None."""
    if os.environ.get(DMA_ENV, "1") == "0" or not chunk.is_pinned():
        return None
    return dma_plan(kv, l0, l1, block_ids)


STAGING_SLOTS = 3  # staging buffers per device, used in turn: records in flight at once
_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_KERNEL_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_STAGING: dict[tuple[torch.device, int], torch.Tensor] = {}
_SLOT_FREE: dict[tuple[torch.device, int], torch.cuda.Event] = {}  # receiver: slot's scatter done
_TURN: dict[torch.device, int] = {}


class CopyDone:
    """A CPU install's completion, read as a CUDA event is (`query`, `synchronize`)."""

    def __init__(self, future) -> None:
        self.future = future

    def query(self) -> bool:
        return self.future.done()

    def synchronize(self) -> None:
        self.future.result()


@functools.cache
def _cpu_stream() -> ThreadPoolExecutor:
    """The CPU's side stream for installs without `wait`: one thread, so copies end in order."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-kv-copy")


_cpu_last: CopyDone | None = None  # the last CPU install queued


def _cpu_copy(fn, *args) -> CopyDone:
    global _cpu_last
    _cpu_last = CopyDone(_cpu_stream().submit(fn, *args))
    return _cpu_last


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream KV copies run on, one per device, so they overlap the compute stream."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


def kernel_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream the block-copy kernels of the KV path run on, beside `copy_stream`'s
    DMAs (a kernel and a DMA on one stream would run one after the other)."""
    if device not in _KERNEL_STREAMS:
        _KERNEL_STREAMS[device] = torch.cuda.Stream(device)
    return _KERNEL_STREAMS[device]


def _next_slot(device: torch.device) -> int:
    turn = _TURN.get(device, 0)
    _TURN[device] = (turn + 1) % STAGING_SLOTS
    return turn


def prepare(kv: torch.Tensor) -> None:
    """Ready the KV copies of a node's cache before the first transfer: the side stream and the
    block-copy kernel (compiled once per process); nothing on CPU."""
    if kv.is_cuda:
        copy_stream(kv.device)
        kernel_stream(kv.device)
        compile_kernel(kv.device)


def staging(kv: torch.Tensor, shape, slot: int = 0) -> torch.Tensor:
    """Staging buffer `slot` (< STAGING_SLOTS) of kv's device, `shape` in kv's dtype: a chunk's
    blocks gathered before one DMA to the host, or a record's payload landed before being
    scattered. The caller makes sure a slot's previous use is done before the next starts
    (the sender waits for it on the host, the receiver orders it on the device)."""
    n = 1
    for d in shape:
        n *= d
    nbytes = n * kv.element_size()
    key = (kv.device, slot)
    buf = _STAGING.get(key)
    if buf is None or buf.numel() < nbytes:
        # NOTE: growing frees the old buffer through the caching allocator while a copy queued
        # on another stream may still use it: wait for the KV streams first
        if buf is not None:
            copy_stream(kv.device).synchronize()
            kernel_stream(kv.device).synchronize()
        buf = _STAGING[key] = torch.empty(nbytes, dtype=torch.uint8, device=kv.device)
    return buf[:nbytes].view(kv.dtype).view(shape)


def ids_on_device(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Block ids copied to the device without waiting: through reused page-locked memory
    (`pd.engine.host_ring.to_device`), since a copy from pageable memory would wait for every
    copy queued on the stream before it."""
    return to_device(ids, device)


def gather_pipelined(kv: torch.Tensor, block_ids: torch.Tensor, chunks, reserve, publish,
                     depth: int = STAGING_SLOTS, fits=None) -> None:
    """Gather each chunk of `plan_chunks` into the memory `reserve(chunk)` returns (its
    record's payload) and call `publish()` once per chunk, in order, when the oldest unpublished
    chunk's bytes are there; at most `depth` (<= STAGING_SLOTS) chunks are reserved and
    unpublished. On CUDA those are copies in flight (the block-copy kernel into a staging
    buffer of their own on the kernel stream, then one DMA into the record on the copy stream),
    so the copy engine keeps working while the next chunk is gathered and the host publishes
    and reserves; on CPU each chunk is copied at once (and published up to `depth` chunks
    later, the same order). `fits(chunk)` (optional): whether `reserve(chunk)` would not wait; when it
    would, every chunk reserved is published first, so that the receiver, woken by them, frees
    the space."""
    if not 1 <= depth <= STAGING_SLOTS:
        raise ValueError(f"depth {depth}: 1 to {STAGING_SLOTS} chunks in flight")
    stream = copy_stream(kv.device) if kv.is_cuda else None
    in_flight: deque = deque()  # per reserved chunk: its copy's event (None: done)
    try:
        if stream is not None:
            kstream = kernel_stream(kv.device)
            kstream.wait_stream(torch.cuda.current_stream(kv.device))  # the KV's writes
            stream.wait_stream(torch.cuda.current_stream(kv.device))
            ids = None  # on the device once a chunk needs the kernel
        for i, (l0, l1, b0, b1) in enumerate(chunks):
            full = fits is not None and not fits((l0, l1, b0, b1))
            while len(in_flight) == depth or (full and in_flight):
                done = in_flight.popleft()
                if done is not None:
                    done.synchronize()
                publish()
            out = reserve((l0, l1, b0, b1))
            dst = torch.frombuffer(out, dtype=kv.dtype).view(chunk_shape(kv, l0, l1, b1 - b0))
            if stream is None:
                torch.index_select(kv[l0:l1], 2, block_ids[b0:b1], out=dst)
                in_flight.append(None)
                continue
            plan = _dma_plan_for(kv, l0, l1, block_ids[b0:b1], dst)
            if plan is not None:
                with torch.cuda.stream(stream):
                    _dma(plan, kv, dst, to_chunk=True)
                    done = torch.cuda.Event()
                    done.record(stream)
                in_flight.append(done)
                continue
            if ids is None:
                with torch.cuda.stream(kstream):
                    ids = ids_on_device(block_ids, kv.device)
            # NOTE: slot i % depth was last used by chunk i - depth, whose copy is done (waited
            # for above before this chunk could be reserved)
            with torch.cuda.stream(kstream):
                staged = staging(kv, dst.shape, i % depth)
                copy_blocks(kv[l0:l1].flatten(0, 1), staged.flatten(0, 1), src_ids=ids[b0:b1])
                gathered = torch.cuda.Event()
                gathered.record(kstream)
            with torch.cuda.stream(stream):
                stream.wait_event(gathered)
                dst.copy_(staged, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            in_flight.append(done)
        while in_flight:
            done = in_flight.popleft()
            if done is not None:
                done.synchronize()
            publish()
    except BaseException:
        if stream is not None:
            stream.synchronize()  # no copy may still write into memory the caller gives up
            kstream.synchronize()
        raise


def gather_into(kv: torch.Tensor, block_ids: torch.Tensor, chunk, out: memoryview) -> None:
    """Write kv[l0:l1, :, block_ids[b0:b1]] into `out` (writable, exactly that many bytes): one
    chunk of `gather_pipelined`, returning once the bytes are in `out` (on CUDA by DMA when
    `out` is pinned; the compute stream is not waited for)."""
    gather_pipelined(kv, block_ids, [chunk], lambda _: out, lambda: None)


def payload_tensor(rec: KVRecord, kv: torch.Tensor) -> torch.Tensor:
    """The record's bytes viewed (no copy) as [l1-l0, 2, nb, block_size, heads, head_dim]."""
    if rec.dtype != dtype_name(kv.dtype):
        raise ValueError(f"KV record for {rec.req_id} carries {rec.dtype}, cache is {kv.dtype}")
    shape = chunk_shape(kv, rec.layer_start, rec.layer_end, rec.num_blocks)
    expected = (rec.layer_end - rec.layer_start) * rec.num_blocks * unit_bytes(kv)
    if rec.payload.nbytes != expected or rec.layer_end > kv.shape[0]:
        raise ValueError(f"KV record for {rec.req_id} (layers {rec.layer_start}:{rec.layer_end}, "
                         f"{rec.num_blocks} blocks, {rec.payload.nbytes} bytes) does not fit cache "
                         f"{tuple(kv.shape)} ({expected} bytes expected)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only ZMQ frames: we only read them
        return torch.frombuffer(rec.payload, dtype=kv.dtype).view(shape)


def record_block_ids(rec: KVRecord, dst_block_ids) -> torch.Tensor:
    """The receiver's blocks the record fills: dst_block_ids[b0:b0+nb] (int64); a ValueError
    where fewer are given."""
    ids = torch.as_tensor(dst_block_ids, dtype=torch.long)
    idx = ids[rec.block_start:rec.block_start + rec.num_blocks]
    if idx.numel() != rec.num_blocks:
        raise ValueError(f"KV record for {rec.req_id} covers blocks {rec.block_start}.."
                         f"{rec.block_start + rec.num_blocks} but only {ids.numel()} are given")
    return idx


def install_kv(rec: KVRecord, kv: torch.Tensor, dst_block_ids, wait: bool = True
               ) -> torch.cuda.Event | CopyDone | None:
    """Copy the record into kv[l0:l1, :, dst_block_ids[b0:b0+nb]] (the receiver's own blocks).

    On CUDA a page-locked record whose blocks form few runs (`dma_plan`) lands by DMA straight
    in them on the copy stream; otherwise by DMA in the next staging buffer on the copy stream,
    and the block-copy kernel scatters it on the kernel stream, so one record's scatter
    overlaps the next one's DMA. With `wait` this returns once it is done, so the record may be
    released and any step launched later reads the blocks; without, the copies of several
    records queue up, and the event returned completes once this record's payload is read and
    its blocks written (the events of a device complete in install order): until then the
    caller keeps the record (`Ring.hold`) and no step reads the blocks, or it waits for every
    install with `installed(kv)`. On CPU the copy is done on return with `wait` (None is
    returned); without, it runs on one thread of its own, the CPU's side stream, and a
    `CopyDone` stands for the event (the payload's tensor keeps a ZMQ frame alive meanwhile)."""
    src = payload_tensor(rec, kv)
    idx = record_block_ids(rec, dst_block_ids)
    dst = kv[rec.layer_start:rec.layer_end]
    if kv.device.type == "cpu":
        if not wait:
            return _cpu_copy(dst.index_copy_, 2, idx, src)
        dst.index_copy_(2, idx, src)
        return None
    stream, kstream = copy_stream(kv.device), kernel_stream(kv.device)
    plan = _dma_plan_for(kv, rec.layer_start, rec.layer_end, idx, src)
    if plan is not None:  # straight into the blocks: no staging, no kernel
        with torch.cuda.stream(stream):
            stream.wait_stream(kstream)  # after any earlier scatter: events end in install order
            _dma(plan, kv, src, to_chunk=False)
            done = torch.cuda.Event()
            done.record(stream)
        if wait:
            installed(kv)
        return done
    slot = _next_slot(kv.device)
    free = _SLOT_FREE.get((kv.device, slot))
    with torch.cuda.stream(stream):
        if free is not None:
            stream.wait_event(free)  # the slot's last scatter has read it
        staged = staging(kv, src.shape, slot)
        staged.copy_(src, non_blocking=src.is_pinned())
        landed = torch.cuda.Event()
        landed.record(stream)
    with torch.cuda.stream(kstream):
        kstream.wait_event(landed)
        copy_blocks(staged.flatten(0, 1), dst.flatten(0, 1), dst_ids=ids_on_device(idx, kv.device))
        free = _SLOT_FREE[(kv.device, slot)] = torch.cuda.Event()
        free.record(kstream)
    if wait:
        installed(kv)
    return free


def installed(kv: torch.Tensor) -> None:
    """Wait for every KV copy queued by `install_kv(..., wait=False)` on kv's device."""
    if kv.is_cuda:
        copy_stream(kv.device).synchronize()
        kernel_stream(kv.device).synchronize()
    elif _cpu_last is not None:
        _cpu_last.synchronize()  # the copies run in order: the last one done, all are
