"""Host buffers reused step after step instead of allocated per step (page-locked on CUDA, where
an allocation per step costs host time and the copies from them must not block): `HostRing`
for a step's fixed-shape buffers (`EventRing`: its timing events), `to_device` for small host
data of any size (the sampler's indices and parameters, a grammar's masks; `list_to_device`
from a list), `copy_async` for a step's copies between a ring's buffer and the device."""

from __future__ import annotations

import functools

import torch


class HostRing:
    """Host buffers (page-locked when `pin`) handed out in rotation, `size` per use (`name`),
    shape and dtype: a step's buffer is filled or read before the step after next is launched
    (the decode loop processes step N before it launches N + 2), so with three a buffer is free
    again when its turn comes, and no step allocates page-locked memory."""

    def __init__(self, pin: bool, size: int = 3) -> None:
        self.pin, self.size = pin, size
        self.rings: dict[tuple, list[torch.Tensor]] = {}

    def get(self, shape: tuple[int, ...], dtype: torch.dtype = torch.int64,
            name: str = "") -> torch.Tensor:
        """The next buffer for `name` (a step taking two buffers of one shape names them apart)."""
        key = (name, tuple(shape), dtype)
        ring = self.rings.get(key)
        if ring is None:
            ring = self.rings[key] = [torch.empty(shape, dtype=dtype, pin_memory=self.pin)
                                      for _ in range(self.size)]
        ring.append(ring.pop(0))  # the least recently handed out goes next
        return ring[-1]


class EventRing:
    """Timing events (CUDA) handed out in rotation instead of made per step: a step's two
    events are read (waited for, timed against the step before) before the loop launches
    the step after next, so with 16 an event is long done with when its turn comes back.
    Making one cost a step ~5 us of host on the H100 machine (`torch.cuda.Event` and the CUDA
    event made at its first record)."""

    def __init__(self, size: int = 16) -> None:
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(size)]
        self.next = 0

    def take(self):
        event = self.events[self.next]
        self.next = (self.next + 1) % len(self.events)
        return event


class _Staging:
    """Page-locked staging buffers for `to_device`, each reused once the copy that last read
    it has completed (an event recorded after the copy says so), grown as copies in flight
    need: a `pin_memory()` per copy cost a step up to a millisecond of host time on the H100
    host (the allocator's page-locked blocks)."""

    def __init__(self) -> None:
        # (current device, size) -> buffers with their events: an event belongs to the device
        # whose stream it was recorded on
        self.free: dict[tuple[int, int], list[tuple[torch.Tensor, object]]] = {}

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        size = 1 << max(12, (nbytes - 1).bit_length())
        pool = self.free.setdefault((torch.cuda.current_device(), size), [])
        # NOTE: the oldest first; a buffer keeps its event, recorded again at each use
        if pool and pool[0][1].query():
            buf, event = pool.pop(0)
        else:
            buf, event = torch.empty(size, dtype=torch.uint8, pin_memory=True), torch.cuda.Event()
        staged = buf[:nbytes].view(t.dtype).view(t.shape)
        staged.copy_(t)
        out = staged.to(device, non_blocking=True)
        event.record()
        pool.append((buf, event))
        return out


_STAGING = _Staging()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without blocking: on CUDA through a reused page-locked buffer,
    on the current stream."""
    if device.type != "cuda":
        return t
    return _STAGING.to_device(t.contiguous(), device)


def list_to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `data` on `device` (`to_device`): building it never waits for the work
    already queued (the overlap loop)."""
    return to_device(torch.tensor(data, dtype=dtype), device)


@functools.cache
def _runtime():
    """CuPy's CUDA runtime bindings, or None (no cupy: torch's copies)."""
    try:
        import cupy  # noqa: PLC0415 (deferred: CPU machines have no cupy)

        return cupy.cuda.runtime
    except Exception:  # ImportError, or a CUDA runtime cupy cannot load
        return None


def copy_async(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src, non_blocking=True)` between a page-locked host buffer that its owner
    keeps (a `HostRing`'s: never freed, refilled only once the copy that read it is done) and
    the device, or between two device buffers, on the current stream: one cudaMemcpyAsync
    where cupy is there. Torch's copy cost 8 us of host (H2D) and 5 us (D2H) on the H100
    machine against 2 and 3 for the raw call: its dispatch, and the event its host allocator
    records for the buffer. Both contiguous and of one dtype; `dst` may be longer (its first
    src.numel() elements)."""
    rt = _runtime()
    if (rt is None or not (dst.is_cuda or src.is_cuda)
            or not (src.is_contiguous() and dst.is_contiguous())):
        if dst.numel() != src.numel():
            dst = dst[:src.numel()]
        dst.copy_(src, non_blocking=True)
        return
    index = (dst if dst.is_cuda else src).device.index or 0
    if rt.getDevice() != index:  # cupy's current device, for a node on another GPU than 0
        rt.setDevice(index)
    rt.memcpyAsync(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(),
                   # cudaMemcpyDeviceToDevice, HostToDevice, DeviceToHost
                   (3 if src.is_cuda else 1) if dst.is_cuda else 2,
                   torch._C._cuda_getCurrentRawStream(index))
