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

A request also holds the KV-cache tokens its sequences may fill (prompt and asked max_tokens,
in whole blocks): with a `kv_budget` (the decode nodes' KV tokens as they report them, or this
worker's share of them; None while unknown), a request waits until its tokens fit beside those
of the requests in flight, in the same turns, so a few long requests cannot take every block
and leave the rest to fail at the decode nodes. A request alone is let in whatever it asks: one
that no decode node could ever hold was refused before it got here (`router.capacity`).
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
                 max_queue_per_client: int | None = None, kv_budget=None) -> None:
        if max_running < 1 or max_queue < 0:
            raise ValueError(f"max_running={max_running} must be >= 1 and "
                             f"max_queue={max_queue} >= 0")
        self.max_running = max_running
        self.max_queue = max_queue
        self.max_queue_per_client = (max(1, max_queue // 2) if max_queue_per_client is None
                                     else max_queue_per_client)
        self.num_running = 0  # sequences admitted and not yet released
        self.kv_budget = kv_budget  # () -> KV tokens the requests in flight may hold, or None
        self.kv_running = 0  # KV tokens of the requests admitted and not yet released
        self.num_waiting = 0  # requests waiting, every client's
        # each waiting client's (sequences, KV tokens, future), oldest first; the first
        # client's turn is next
        self._queues: OrderedDict[str, deque[tuple[int, int, asyncio.Future]]] = OrderedDict()

    def fits(self, weight: int, tokens: int = 0) -> bool:
        """Whether `weight` sequences of `tokens` KV tokens in all fit beside those in flight."""
        if self.num_running + weight > self.max_running:
            return False
        budget = self.kv_budget() if self.kv_budget is not None else None
        return budget is None or self.kv_running == 0 or self.kv_running + tokens <= budget

    async def acquire(self, weight: int = 1, client: str = "", tokens: int = 0) -> float:
        """Wait until `weight` sequences (and `tokens` KV tokens) fit and it is `client`'s turn;
        return the seconds waited. Raises QueueFull when the queue (or the client's share of
        it) is full and TooLarge when they never can fit."""
        if weight > self.max_running:
            raise TooLarge(f"the request asks for {weight} sequences (prompts x n); the router "
                           f"runs at most {self.max_running} at once (--max-running)")
        if not self._queues and self.fits(weight, tokens):
            self.num_running += weight
            self.kv_running += tokens
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
        entry = (weight, tokens, fut)
        if queue is None:
            queue = self._queues[client] = deque()
        queue.append(entry)
        self.num_waiting += 1
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted as it was cancelled: give it back
                self.release(weight, tokens)
            else:
                self._remove(client, entry)
                self._grant()  # a large request that left may unblock smaller ones behind it
            raise
        return time.perf_counter() - t0

    def release(self, weight: int = 1, tokens: int = 0) -> None:
        self.num_running -= weight
        self.kv_running -= tokens
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
            weight, tokens, fut = queue[0]
            if fut.done():  # cancelled, and its waiter not yet resumed: drop it
                self._remove(client, queue[0])
                continue
            if not self.fits(weight, tokens):
                return  # the head of the turn waits; nobody overtakes it
            queue.popleft()
            self.num_waiting -= 1
            if queue:
                self._queues.move_to_end(client)  # the next client's turn
            else:
                del self._queues[client]
            self.num_running += weight
            self.kv_running += tokens
            fut.set_result(None)
