"""The backend streams of one API request, run side by side and merged.

A request with several choices (prompts x n) becomes one backend request per choice. Each
runs in its own task that feeds the choice's `Delta`s into one queue, so the server reads a
single stream in arrival order. The task retries once, under a new request id, when the
backend reports a failure before any token was sent, and it closes the backend stream (which
aborts the request on the nodes) when a stop string ends the choice early or when the server
closes the generation (client gone, error). Refusals before any output (`BackendUnavailable`,
`BackendOverloaded`) are raised from the first read so the server can answer 503 / 429; later
ones become error deltas. SSE and response shapes are left to the server.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Callable

from pd.wire.messages import is_invalid, is_timeout
from router.backend import Backend, BackendOverloaded, BackendUnavailable, GenerateRequest
from router.choice import Choice, Delta

log = logging.getLogger(__name__)


class Generation:
    def __init__(self, backend: Backend, choices: list[Choice], requests: list[GenerateRequest],
                 on_retry: Callable[[], None] | None = None,
                 on_abort: Callable[[str], None] | None = None) -> None:
        self.backend = backend
        self.choices = choices
        self.requests = requests
        self._on_retry = on_retry or (lambda: None)
        self._on_abort = on_abort or (lambda reason: None)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._num_open = len(choices)
        self._yielded = False

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._drive(c, r))
                       for c, r in zip(self.choices, self.requests)]

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self) -> Delta:
        if self._num_open == 0:
            raise StopAsyncIteration
        return self._take(await self._queue.get())

    def ready(self) -> list[Delta]:
        """The deltas that have arrived and not been read, without waiting."""
        out = []
        while self._num_open and not self._queue.empty():
            out.append(self._take(self._queue.get_nowait()))
        return out

    def _take(self, item) -> Delta:
        if isinstance(item, tuple):
            index, exc = item
            if not self._yielded:
                raise exc
            item = Delta(index, error=str(exc))
        self._yielded = True
        if item.is_last:
            self._num_open -= 1
        return item

    async def close(self, reason: str | None = None) -> None:
        """Stop every choice still running; `reason` labels the abort in the metrics."""
        pending = [t for t in self._tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
            if reason:
                self._on_abort(reason)

    async def _drive(self, choice: Choice, req: GenerateRequest) -> None:
        put = self._queue.put_nowait
        try:
            for attempt in range(2):
                retry = False
                stream = self.backend.generate(req)
                try:
                    async for ev in stream:
                        # a node that died is retried once elsewhere; one that timed out is
                        # alive and loaded, and a second wait would double the client's; a
                        # request refused for its own content would be refused again
                        if (ev.error is not None and not ev.first_token_sent and attempt == 0
                                and choice.num_generated == 0 and not ev.token_ids
                                and not is_timeout(ev.error) and not is_invalid(ev.error)):
                            log.warning("request %s failed before its first token (%s); "
                                        "retrying once", req.req_id, ev.error)
                            retry = True
                            break
                        d = choice.process(ev)
                        put(d)
                        if d.is_last:
                            if ev.finish_reason is None and ev.error is None:
                                self._on_abort("stop_string")
                                break  # a stop string: closing the stream aborts on the nodes
                    if not retry and not choice.done:
                        put(Delta(choice.index, error="the backend stream ended without a "
                                                      "finish reason"))
                        choice.done = True
                finally:
                    await stream.aclose()
                if not retry:
                    return
                self._on_retry()
                req = GenerateRequest(uuid.uuid4().hex, req.prompt_ids, req.params)
        except (BackendUnavailable, BackendOverloaded) as e:
            put((choice.index, e))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug or a broken backend must end the choice, not hang it
            log.exception("choice %d of request %s failed", choice.index, req.req_id)
            put(Delta(choice.index, error=f"internal error: {type(e).__name__}: {e}"))
