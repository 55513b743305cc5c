"""The router's listening socket's first defence: a cap on open connections and a deadline for
each connection's first request head.

`GuardedSite` serves the aiohttp application like `web.TCPSite`, but each accepted connection
first meets `ConnectionGuard`:
- past `max_connections` open ones, it gets a canned `503 Service Unavailable` (JSON, OpenAI
  style, `Retry-After: 1`) and is closed at once, so the process never runs out of file
  descriptors and the connections it holds keep being served;
- a connection whose first request line and headers are not complete within `header_timeout`
  seconds is closed (a client that trickles its head a byte at a time, or sends nothing);
  later requests on a kept-alive connection are bounded by aiohttp's keep-alive timeout.
Everything after the head (body and write timeouts, admission) is `router.server`'s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource

from aiohttp import web

log = logging.getLogger(__name__)

HEAD_END = b"\r\n\r\n"
# descriptors kept back from the process's limit for everything but client connections (ZMQ
# sockets to the nodes, the tokenizer's files, logs)
FD_RESERVE = 256


def default_max_connections() -> int:
    """The open-file limit less `FD_RESERVE` (at least 64)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 65536
    return max(64, soft - FD_RESERVE)


def _busy_response() -> bytes:
    body = json.dumps({"error": {
        "message": "the server holds as many connections as it may (--max-connections); retry",
        "type": "service_unavailable", "param": None, "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


BUSY = _busy_response()


class ConnectionGuard:
    """Counts the open connections and makes the protocol that wraps each one."""

    def __init__(self, max_connections: int, header_timeout: float, on_refused=None,
                 on_timeout=None) -> None:
        if max_connections < 1 or header_timeout <= 0:
            raise ValueError(f"max_connections {max_connections} must be >= 1 and "
                             f"header_timeout {header_timeout} > 0")
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.num_open = 0
        self.num_refused = 0
        self.num_timed_out = 0
        self.on_refused = on_refused  # callbacks for metrics
        self.on_timeout = on_timeout

    def protocol(self, inner: asyncio.Protocol) -> "GuardedProtocol":
        return GuardedProtocol(self, inner)


class GuardedProtocol(asyncio.Protocol):
    """Forwards everything to aiohttp's protocol for the connection (`inner`) unless the
    guard refuses the connection or its first head comes too late."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard, self.inner = guard, inner
        self.transport: asyncio.Transport | None = None
        self.counted = False
        self.timer: asyncio.TimerHandle | None = None
        self.tail = b""  # the last bytes seen while the first head is incomplete

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        guard = self.guard
        if guard.num_open >= guard.max_connections:
            guard.num_refused += 1
            if guard.on_refused is not None:
                guard.on_refused()
            transport.write(BUSY)
            transport.close()
            return
        guard.num_open += 1
        self.counted = True
        self.timer = asyncio.get_running_loop().call_later(guard.header_timeout, self._expired)
        self.inner.connection_made(transport)

    def _expired(self) -> None:
        self.timer = None
        self.guard.num_timed_out += 1
        if self.guard.on_timeout is not None:
            self.guard.on_timeout()
        if self.transport is not None:
            self.transport.abort()  # nothing was asked: nothing to answer

    def data_received(self, data: bytes) -> None:
        if not self.counted:
            return
        if self.timer is not None:
            seen = self.tail + data
            if HEAD_END in seen:
                self.timer.cancel()
                self.timer = None
                self.tail = b""
            else:
                self.tail = seen[-(len(HEAD_END) - 1):]
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.counted else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.counted:
            self.counted = False
            self.guard.num_open -= 1
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.counted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.counted:
            self.inner.resume_writing()


class GuardedSite(web.BaseSite):
    """`web.TCPSite` with every connection behind `guard`."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int,
                 guard: ConnectionGuard, backlog: int = 1024, reuse_port: bool = False) -> None:
        # NOTE: a deep listen backlog: a burst of connections is accepted (and, past the cap,
        # answered 503) at once rather than left to the kernel's SYN retries
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self._guard = host, port, guard
        self._bound_port, self._reuse_port = port, reuse_port

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._bound_port}"

    @property
    def port(self) -> int:
        return self._bound_port

    async def start(self) -> None:
        await super().start()
        inner = self._runner.server
        self._server = await asyncio.get_running_loop().create_server(
            lambda: self._guard.protocol(inner()), self._host, self._port, reuse_address=True,
            reuse_port=self._reuse_port or None, backlog=self._backlog)
        if self._server.sockets:
            self._bound_port = self._server.sockets[0].getsockname()[1]
