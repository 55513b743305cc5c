"""The router's bounded admission queue, counted in sequences.

A request holds as many slots as the sequences it asks for (its prompts times `n`): at most
`max_running` sequences are in flight to the backend; requests that do not fit wait here in
arrival order (first come, first served: a large request at the head is not overtaken), up to
`max_queue` of them; one more is refused at once with `QueueFull` (HTTP 429), so an overload
shows up as fast refusals instead of unbounded memory and latency. A request of more sequences
than `max_running` can never run and is refused with `TooLarge` (HTTP 400). The nodes keep
their own queues; this one only bounds what the router holds.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque


class QueueFull(Exception):
    pass


class TooLarge(Exception):
    pass


class Admission:
    def __init__(self, max_running: int, max_queue: int) -> None:
        if max_running < 1 or max_queue < 0:
            raise ValueError(f"max_running={max_running} must be >= 1 and "
                             f"max_queue={max_queue} >= 0")
        self.max_running = max_running
        self.max_queue = max_queue
        self.num_running = 0  # sequences admitted and not yet released
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, weight: int = 1) -> float:
        """Wait until `weight` sequences fit; return the seconds waited. Raises QueueFull when
        the queue is full and TooLarge when they never can."""
        if weight > self.max_running:
            raise TooLarge(f"the request asks for {weight} sequences (prompts x n); the router "
                           f"runs at most {self.max_running} at once (--max-running)")
        if not self._waiters and self.num_running + weight <= self.max_running:
            self.num_running += weight
            return 0.0
        if len(self._waiters) >= self.max_queue:
            raise QueueFull(f"the router's queue is full ({self.num_running} sequences running, "
                            f"{len(self._waiters)} requests waiting)")
        t0 = time.perf_counter()
        fut = asyncio.get_running_loop().create_future()
        entry = (weight, fut)
        self._waiters.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted as it was cancelled: give it back
                self.release(weight)
            else:
                self._waiters.remove(entry)
                self._grant()  # a large request that left may unblock smaller ones behind it
            raise
        return time.perf_counter() - t0

    def release(self, weight: int = 1) -> None:
        self.num_running -= weight
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.num_running + self._waiters[0][0] <= self.max_running:
            weight, fut = self._waiters.popleft()
            if fut.done():
                continue
            self.num_running += weight
            fut.set_result(None)
