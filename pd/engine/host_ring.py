"""Host buffers reused step after step instead of allocated per step (page-locked on CUDA, where
an allocation per step costs host time and the copies from them must not block)."""

from __future__ import annotations

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
