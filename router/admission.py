"""The router's bounded admission queue, counted in sequences, shared fairly between clients.

A request holds as many slots as the sequences it asks for (its prompts times `n`): at most
`max_running` sequences are in flight to the backend. Requests that do not fit wait here, in one
queue per client (the request's `user`, else its address: the server's choice), and the clients
take turns: when slots free up, the client whose turn it is gets its oldest request in, then
the next client; a request at the head of the turn that does not fit yet is not overtaken, so
a large one is never starved either. One client's flood therefore delays each other client by
at most one of its requests per turn instead of all of them. At most `max_queue` requests wait
in all, and one client at most `max_queue_per_client` (half the queue by default, so another
client always finds room); one more is refused at once with `QueueFull` (HTTP 429), so an
overload shows up as fast refusals instead of unbounded memory and latency. A request of more
sequences than `max_running` can never run and is refused with `TooLarge` (HTTP 400). The
nodes keep their own queues; this one only bounds what the router holds.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque


class QueueFull(Exception):
    pass


class TooLarge(Exception):
    pass


class Admission:
    def __init__(self, max_running: int, max_queue: int,
                 max_queue_per_client: int | None = None) -> None:
        if max_running < 1 or max_queue < 0:
            raise ValueError(f"max_running={max_running} must be >= 1 and "
                             f"max_queue={max_queue} >= 0")
        self.max_running = max_running
        self.max_queue = max_queue
        self.max_queue_per_client = (max(1, max_queue // 2) if max_queue_per_client is None
                                     else max_queue_per_client)
        self.num_running = 0  # sequences admitted and not yet released
        self.num_waiting = 0  # requests waiting, every client's
        # each waiting client's requests, oldest first; the first client's turn is next
        self._queues: OrderedDict[str, deque[tuple[int, asyncio.Future]]] = OrderedDict()

    async def acquire(self, weight: int = 1, client: str = "") -> float:
        """Wait until `weight` sequences fit and it is `client`'s turn; return the seconds
        waited. Raises QueueFull when the queue (or the client's share of it) is full and
        TooLarge when they never can fit."""
        if weight > self.max_running:
            raise TooLarge(f"the request asks for {weight} sequences (prompts x n); the router "
                           f"runs at most {self.max_running} at once (--max-running)")
        if not self._queues and self.num_running + weight <= self.max_running:
            self.num_running += weight
            return 0.0
        if self.num_waiting >= self.max_queue:
            raise QueueFull(f"the router's queue is full ({self.num_running} sequences running, "
                            f"{self.num_waiting} requests waiting)")
        queue = self._queues.get(client)
        if queue is not None and len(queue) >= self.max_queue_per_client:
            raise QueueFull(f"this client already has {len(queue)} requests waiting, its share "
                            f"of the router's queue ({self.num_running} sequences running)")
        t0 = time.perf_counter()
        fut = asyncio.get_running_loop().create_future()
        entry = (weight, fut)
        if queue is None:
            queue = self._queues[client] = deque()
        queue.append(entry)
        self.num_waiting += 1
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted as it was cancelled: give it back
                self.release(weight)
            else:
                self._remove(client, entry)
                self._grant()  # a large request that left may unblock smaller ones behind it
            raise
        return time.perf_counter() - t0

    def release(self, weight: int = 1) -> None:
        self.num_running -= weight
        self._grant()

    def _remove(self, client: str, entry) -> None:
        queue = self._queues.get(client)
        if queue is not None and entry in queue:
            queue.remove(entry)
            self.num_waiting -= 1
            if not queue:
                del self._queues[client]

    def _grant(self) -> None:
        while self._queues:
            client, queue = next(iter(self._queues.items()))
            weight, fut = queue[0]
            if fut.done():  # cancelled, and its waiter not yet resumed: drop it
                self._remove(client, queue[0])
                continue
            if self.num_running + weight > self.max_running:
                return  # the head of the turn waits; nobody overtakes it
            queue.popleft()
            self.num_waiting -= 1
            if queue:
                self._queues.move_to_end(client)  # the next client's turn
            else:
                del self._queues[client]
            self.num_running += weight
            fut.set_result(None)
