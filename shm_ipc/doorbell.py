"""The doorbell: the consumer of a ring sleeps on a ZMQ socket, the producer rings after publishing.

A ring is an 8-byte little-endian write position: the consumer reads the ring up to the highest
position it was rung with (never further, so the socket orders memory for it). `Doorbell` and
`DoorbellWaiter` are a PUSH/PULL pair for a bare ring; the KV transport carries the same 8 bytes
on its own DEALER/ROUTER connection (`encode_pos`/`decode_pos`). Nothing here spins: waiting is
a `zmq.Poller` sleep in the kernel.
"""

from __future__ import annotations

import struct

import zmq

from pd import security

_POS = struct.Struct("<Q")


def encode_pos(pos: int) -> bytes:
    return _POS.pack(pos)


def decode_pos(frame) -> int:
    if len(frame) != 8:
        raise ValueError(f"doorbell frame of {len(frame)} bytes, need 8")
    return _POS.unpack(frame)[0]


class Doorbell:
    """Producer side: `ring(pos)` after each `Ring.commit()`."""

    def __init__(self, endpoint: str, ctx: zmq.Context | None = None):
        self._sock = (ctx or zmq.Context.instance()).socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 1000)
        security.secure_client(self._sock)
        self._sock.connect(endpoint)

    def ring(self, pos: int) -> None:
        self._sock.send(_POS.pack(pos), copy=True)

    def close(self) -> None:
        self._sock.close()


class DoorbellWaiter:
    """Consumer side: binds, and `wait(timeout)` returns the highest position rung so far."""

    def __init__(self, endpoint: str, ctx: zmq.Context | None = None):
        self.sock = (ctx or zmq.Context.instance()).socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        security.secure_server(self.sock)
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.pos = 0

    def fileno(self) -> int:
        return self.sock.getsockopt(zmq.FD)

    def wait(self, timeout: float | None) -> int | None:
        """Sleep until rung (or `timeout` seconds); drain pending rings; None on timeout."""
        ms = None if timeout is None else max(0, int(timeout * 1000))
        if not self.sock.poll(ms, zmq.POLLIN):
            return None
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return self.pos
            self.pos = max(self.pos, decode_pos(frame))

    def close(self) -> None:
        self.sock.close()
