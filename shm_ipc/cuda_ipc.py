"""The CUDA IPC tier of the KV transport: the prefill node writes a request's KV straight into
the blocks the decode node reserved for it, GPU to GPU, and the decode node installs nothing.

The decode node exports its cache once (`export`): a CUDA IPC memory handle of the allocation
holding `kv`, the cache's offset in it, its shape and dtype. The handle travels in `HelloOk`
(bytes inside msgpack) to a prefill node on this host. The prefill node opens it
(`PeerCache.open`, peer access enabled on demand when the cache is on another GPU of the host)
and, per request, copies its blocks from its own cache into the decode node's blocks named in
`KVAccept` with the block-copy kernel (`PeerCache.write`): on one GPU a device copy, between two
a peer copy over NVLink or PCIe. The copy runs on the side stream; the prefill node sends
`KVDone` once its event has completed, so the decode node finds the blocks filled and its steps
never wait for a transfer (nor does the prefill node's loop). Whoever holds the handle can
write the whole cache: it goes only to a paired prefill node (same host, through the
authenticated KV connection).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import numpy as np
import torch

from pd_kernels.block_copy import launch_copy

from .errors import TransportError
from .kv import copy_stream, dtype_name, ids_on_device

log = logging.getLogger(__name__)
_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


@functools.cache
def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def _allocation_of(ptr: int) -> tuple[int, int]:
    """(base, size) of the device allocation holding address `ptr` (the driver's view: an IPC
    handle names a whole allocation, which torch's allocator may share between tensors)."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    err = _libcuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                             ctypes.c_uint64(ptr))
    if err != 0:
        raise RuntimeError(f"cuMemGetAddressRange failed (CUresult {err})")
    return base.value, size.value


def export(kv: torch.Tensor) -> dict | None:
    """What a peer needs to open `kv` (a contiguous CUDA cache) in its own process, or None when
    it cannot be exported (CPU, no cupy, a driver that refuses)."""
    if not kv.is_cuda or not kv.is_contiguous():
        return None
    try:
        import cupy  # noqa: PLC0415

        base, size = _allocation_of(kv.data_ptr())
        with cupy.cuda.Device(kv.device.index or 0):
            handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(base))
    except Exception as e:  # ImportError, a CUDA error from the driver or cupy
        log.warning("the KV cache cannot be shared by CUDA IPC (%s): prefill nodes on this host "
                    "send KV through the ring", e)
        return None
    return {"handle": handle, "offset": kv.data_ptr() - base, "bytes": size,
            "shape": list(kv.shape), "dtype": dtype_name(kv.dtype),
            "gpu": str(torch.cuda.get_device_properties(kv.device).uuid)}


class PeerCache:
    """Another process's KV cache, opened in this one, that `write` fills block by block."""

    def __init__(self, base: int, desc: dict, device: torch.device) -> None:
        self.base, self.device = base, device
        self.ptr = base + desc["offset"]
        self.shape = tuple(desc["shape"])
        self.num_blocks = self.shape[2]
        self.same_gpu = desc["gpu"] == str(torch.cuda.get_device_properties(device).uuid)

    @classmethod
    def open(cls, desc: dict, kv: torch.Tensor) -> "PeerCache":
        """Open the cache `export` described, for copies from `kv` (this node's cache). Raises
        TransportError saying why when it cannot be used (another dtype or geometry, CPU, a
        handle this host's driver cannot open)."""
        try:
            shape, dtype, offset, nbytes = (list(desc["shape"]), desc["dtype"], int(desc["offset"]),
                                            int(desc["bytes"]))
            handle, gpu = bytes(desc["handle"]), str(desc["gpu"])
        except (KeyError, TypeError, ValueError) as e:
            raise TransportError(f"malformed CUDA IPC offer: {e!r}") from None
        if not kv.is_cuda:
            raise TransportError("this node's KV cache is not on a GPU")
        if (len(shape) != kv.dim() or shape[:2] != list(kv.shape[:2])
                or shape[3:] != list(kv.shape[3:]) or dtype != dtype_name(kv.dtype)):
            raise TransportError(f"the peer's cache {shape} {dtype} does not match this one "
                                 f"{list(kv.shape)} {dtype_name(kv.dtype)}")
        elems = 1
        for d in shape:
            elems *= d
        if offset < 0 or offset + elems * kv.element_size() > nbytes or len(handle) != 64 or not gpu:
            raise TransportError("CUDA IPC offer with an inconsistent size or handle")
        try:
            import cupy  # noqa: PLC0415

            with cupy.cuda.Device(kv.device.index or 0):
                base = cupy.cuda.runtime.ipcOpenMemHandle(handle, _LAZY_PEER_ACCESS)
        except Exception as e:
            raise TransportError(f"cannot open the peer's KV cache by CUDA IPC: {e}") from None
        return cls(base, dict(desc, offset=offset, shape=shape, gpu=gpu), kv.device)

    def write(self, kv: torch.Tensor, src_block_ids, dst_block_ids,
              side: bool = True, after: torch.cuda.Event | None = None) -> torch.cuda.Event:
        """Queue the copy of kv[:, :, src_block_ids[j]] into the peer's [:, :, dst_block_ids[j]]
        for every j, after the KV's writes: on the side stream after `after` (the event that
        marks them) or, without it, after the work queued so far on the current stream; with
        `side` False on the current stream, after `after` too when given. Returns the event that
        marks it done (and what its stream did before): the peer may read the blocks once it has
        completed. Ids are checked against both caches."""
        src, dst = np.asarray(src_block_ids, dtype=np.int64), np.asarray(dst_block_ids, dtype=np.int64)
        n = src.size
        if dst.size != n:
            raise ValueError(f"{n} blocks to send but {dst.size} reserved by the peer")
        if n and (src.min() < 0 or src.max() >= kv.shape[2] or dst.min() < 0
                  or dst.max() >= self.num_blocks):
            raise ValueError("block ids outside the caches")
        unit = kv[0, 0, 0].numel() * kv.element_size()
        stream = torch.cuda.current_stream(kv.device)
        if side:
            stream = copy_stream(kv.device)
            if after is None:
                stream.wait_stream(torch.cuda.current_stream(kv.device))
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            if n:
                ids = ids_on_device(torch.from_numpy(np.concatenate([src, dst])), kv.device)
                launch_copy(kv.data_ptr(), self.ptr, kv.shape[0] * 2, unit, kv.shape[2] * unit,
                            self.num_blocks * unit, n, kv.device, ids[:n], ids[n:])
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def close(self) -> None:
        """Wait for the copies queued, then unmap the peer's cache."""
        if self.base:
            import cupy  # noqa: PLC0415

            copy_stream(self.device).synchronize()

            try:
                with cupy.cuda.Device(self.device.index or 0):
                    cupy.cuda.runtime.ipcCloseMemHandle(self.base)
            except Exception as e:
                log.warning("closing a peer's KV cache: %s", e)
            self.base = 0
