"""Page-locking shared memory for the CUDA copies of the KV fast path.

A ring's mapping registered with `cudaHostRegister` is pinned memory to the CUDA driver: the
prefill node copies KV blocks from its GPU cache straight into ring records, and the decode node
from ring records straight into its GPU cache, by DMA, with no staging copy through pageable
memory. Each process registers its own mapping (`Segment.pin`) and unregisters it before it
unmaps (`Segment.close`). Nothing here imports CUDA unless asked to pin.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)


def register(mapping) -> int | None:
    """Page-lock a writable buffer (an mmap) for CUDA; returns its address, or None when CUDA
    is not available or the driver refuses (the copies then stage through pageable memory)."""
    import torch

    if not torch.cuda.is_available():
        return None
    view = np.frombuffer(mapping, dtype=np.uint8)
    ptr, size = view.ctypes.data, view.nbytes
    del view  # NOTE: the address stays valid while the mapping lives; no export is kept
    err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    if int(err) != 0:
        log.warning("cudaHostRegister of %d bytes failed (error %d): KV copies stage through "
                    "pageable memory", size, int(err))
        return None
    return ptr


def unregister(ptr: int) -> None:
    import torch

    err = torch.cuda.cudart().cudaHostUnregister(ptr)
    if int(err) != 0:
        log.warning("cudaHostUnregister failed (error %d)", int(err))
