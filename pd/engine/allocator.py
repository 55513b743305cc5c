"""The block allocator: which KV blocks are free, who holds the others.

Plain Python over block ids (no tensors, no CUDA). Reference counts are kept per block so that
prefix sharing can later hand one block to several requests; today every allocation holds its
blocks once. `check_integrity()` is cheap and runs when a node goes idle and in tests.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be positive")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Take one more reference on blocks already held (prefix sharing)."""
        for b in blocks:
            if self._ref[b] <= 0:
                raise ValueError(f"block {b} is free and cannot be shared")
            self._ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._ref[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        used = {b for b, r in enumerate(self._ref) if r > 0}
        if free & used:
            raise AssertionError(f"blocks both free and used: {sorted(free & used)[:8]}")
        if len(free) + len(used) != self.num_blocks:
            raise AssertionError(
                f"free ({len(free)}) + used ({len(used)}) != total ({self.num_blocks})"
            )
