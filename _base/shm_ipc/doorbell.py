"""The doorbell: the consumer of a ring sleeps on a ZMQ socket, the producer rings after publishing.

A ring is an 8-byte little-endian write position: the consumer reads the ring up to the highest
position it was rung with (never further, so the socket orders memory for it). `Doorbell` and
`DoorbellWaiter` are a PUSH/PULL pair for a bare ring; the KV transport carries the same 8 bytes
on its own DEALER/ROUTER connection (`encode_pos`/`decode_pos`). Nothing here spins: waiting is
a `zmq.Poller` sleep in the kernel.

`WakePipe`/`WakeWriter` are the fast wake beside it: a named pipe (FIFO) owned by the consumer,
to which each producer on the host writes (ring id, position) after publishing. A ZMQ message
crosses two I/O threads on its way (about 100 us one-way on a small VM); a pipe write wakes the
sleeping reader directly (about 18 us). The ZMQ doorbell stays the contract: the pipe only lets
the consumer read sooner, when no control message sent before the record is still on its way
(`Ring.controls_sent`, checked by the receiver).
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import tempfile

import zmq

from pd.wire import security

_POS = struct.Struct("<Q")
_WAKE = struct.Struct("<IQ")  # ring id (the consumer's), write position


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


_PIPE_PREFIX = "pd-wake-"


def _sweep_dead_pipes() -> None:
    """Remove the wake pipes of processes that died without closing them (kill -9)."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if not name.startswith(_PIPE_PREFIX):
            continue
        try:
            pid = int(name[len(_PIPE_PREFIX):].split("-", 1)[0])
            os.kill(pid, 0)
            continue  # alive (or not ours to signal): kept
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError):
            continue
        path = os.path.join(root, name)
        try:
            for entry in os.listdir(path):
                os.unlink(os.path.join(path, entry))
            os.rmdir(path)
        except OSError:
            pass


class WakePipe:
    """Consumer side of the fast wake: a FIFO in a private directory, read without blocking.

    `fileno()` goes in the consumer's poller; `drain()` returns {ring id: highest position}."""

    def __init__(self):
        _sweep_dead_pipes()
        # mode 0700: only this user's processes
        self.dir = tempfile.mkdtemp(prefix=f"{_PIPE_PREFIX}{os.getpid()}-")
        self.path = os.path.join(self.dir, "wake")
        os.mkfifo(self.path, 0o600)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        # NOTE: our own write end keeps the FIFO from reading as EOF (always readable) while no
        # producer has it open.
        self._keep = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        self._tail = b""

    def fileno(self) -> int:
        return self.fd

    def drain(self) -> dict[int, int]:
        data = self._tail
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            data += chunk
            if len(chunk) < 65536:
                break
        cut = len(data) - len(data) % _WAKE.size
        self._tail = data[cut:]  # NOTE: writes are atomic (< PIPE_BUF); a tail is never expected
        out: dict[int, int] = {}
        for ring_id, pos in _WAKE.iter_unpack(data[:cut]):
            out[ring_id] = max(out.get(ring_id, 0), pos)
        return out

    def close(self) -> None:
        for fd in (self.fd, self._keep):
            try:
                os.close(fd)
            except OSError:
                pass
        for remove in (lambda: os.unlink(self.path), lambda: os.rmdir(self.dir)):
            try:
                remove()
            except OSError:
                pass


class WakeWriter:
    """Producer side: `wake(pos)` after publishing; never blocks, never raises.

    `open` returns None when `path` is not a FIFO this process may write (the consumer then
    wakes by the ZMQ doorbell alone)."""

    def __init__(self, fd: int, ring_id: int):
        self.fd = fd
        self.ring_id = ring_id

    @classmethod
    def open(cls, path: str, ring_id: int) -> "WakeWriter | None":
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        st = os.fstat(fd)
        if not stat.S_ISFIFO(st.st_mode) or st.st_uid != os.getuid():
            os.close(fd)
            return None
        return cls(fd, ring_id)

    def wake(self, pos: int) -> None:
        if self.fd < 0:
            return
        try:
            os.write(self.fd, _WAKE.pack(self.ring_id, pos))
        except BlockingIOError:
            pass  # the pipe is full of wakes the consumer has not read: it is awake anyway
        except OSError as e:
            if e.errno not in (errno.EPIPE, errno.EBADF):
                raise
            self.close()  # the consumer is gone; its ZMQ connection tells the rest

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
