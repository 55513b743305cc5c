"""The router's bounded admission queue.

At most `max_running` requests are in flight to the backend; up to `max_queue` more wait here
in arrival order; one more than that is refused at once with `QueueFull` (HTTP 429), so that
an overload shows up as fast refusals instead of unbounded memory and latency. The nodes keep
their own queues; this one only bounds what the router holds.
"""

from __future__ import annotations

import asyncio
import time


class QueueFull(Exception):
    pass


class Admission:
    def __init__(self, max_running: int, max_queue: int) -> None:
        if max_running < 1 or max_queue < 0:
            raise ValueError(f"max_running={max_running} must be >= 1 and "
                             f"max_queue={max_queue} >= 0")
        self.max_running = max_running
        self.max_queue = max_queue
        self.num_running = 0
        self.num_waiting = 0
        self._sem: asyncio.Semaphore | None = None

    async def acquire(self) -> float:
        """Wait for a slot; return the seconds waited. Raises QueueFull when full."""
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_running)
        if self._sem.locked() and self.num_waiting >= self.max_queue:
            raise QueueFull(f"the router's queue is full ({self.num_running} running, "
                            f"{self.num_waiting} waiting)")
        t0 = time.perf_counter()
        self.num_waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.num_waiting -= 1
        self.num_running += 1
        return time.perf_counter() - t0

    def release(self) -> None:
        self.num_running -= 1
        self._sem.release()
