"""`KVReceiver`: the decode node's "kv ingest" end, for any number of prefill nodes.

Binds one ROUTER; each prefill node's DEALER (`transport.py`) sends control messages and records
over it, by ZMQ frames or through a shared-memory ring rung by doorbells. `recv(timeout)` returns
what arrived, in each peer's send order, as `Incoming(peer, item)` where `item` is a control
dict, a record (`records.py`) or `PeerGone`. Record payloads that view a ring (KV) stay valid
until the next `recv()` call (or `release()`), which releases the ring space: install or copy
them before, or `hold(peer, fence, rec.ring_pos)` a KV record (and those after it) until a
copy reading it has completed (the decode node's KV copies on CUDA, which no step waits for).
Malformed records and control messages are counted (`metrics.py`), logged and dropped.
A ring producer whose process dies is reported as `PeerGone` once its published records are
delivered, and its segment is removed; a peer on the ZMQ transport that dies is left to the
node's own health checks.
Waiting is a ZMQ poll: no spinning. Use `socket` and `wake_fd` to poll with other sockets.
Beside the ZMQ doorbells, producers write (ring id, position) to this receiver's wake pipe
(`doorbell.WakePipe`, named in `shm_attached`); a ring is read on such a wake only when every
control message its producer sent (`Ring.controls_sent`) has arrived, so records never pass a
control message sent before them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import zmq

from pd.wire import security

from . import control, header, records
from .doorbell import WakePipe, decode_pos
from .errors import SegmentError
from .metrics import refuse
from .records import RecordError
from .ring import Ring
from .segment import remove_if_stale, sweep_stale
from .transport import DEFAULT_MAX_RECORD

log = logging.getLogger("shm_ipc")
MAX_FRAME_BYTES = DEFAULT_MAX_RECORD + 4096  # the largest KV frame a transport sends, and more


@dataclass
class PeerGone:
    reason: str


class Incoming(NamedTuple):
    peer: bytes
    item: Any  # dict | FirstTokenRecord | TokensRecord | KVRecord | AbortRecord | PeerGone


class KVReceiver:
    def __init__(self, endpoint: str, max_topk: int = header.DEFAULT_MAX_TOPK,
                 ctx: zmq.Context | None = None, liveness_interval: float = 0.5,
                 max_batch: int = 256, pin_rings: bool = False, fast_wake: bool = True):
        self.max_topk = max_topk
        self.pin_rings = pin_rings  # page-lock attached rings for CUDA copies (shm_ipc.pinned)
        self.liveness_interval = liveness_interval
        self.max_batch = max_batch
        self.socket = (ctx or zmq.Context.instance()).socket(zmq.ROUTER)
        # NOTE: no ROUTER_HANDOVER: a second connection with a peer's identity must not take
        # its place (its requests' KV, aborts and acks); peers' identities are random
        self.socket.setsockopt(zmq.LINGER, 0)
        # NOTE: a frame over this is dropped by libzmq with its sender's connection, unseen here.
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        security.secure_server(self.socket)
        self.socket.bind(endpoint)
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.rings: dict[bytes, Ring] = {}
        self._next_check = 0.0
        self.wake = WakePipe() if fast_wake else None
        self._poller = zmq.Poller()
        self._poller.register(self.socket, zmq.POLLIN)
        if self.wake is not None:
            self._poller.register(self.wake.fileno(), zmq.POLLIN)
        self._ring_ids: dict[int, bytes] = {}  # the id each attached ring's producer wakes with
        self._next_ring_id = 1
        self._controls_seen: dict[bytes, int] = {}  # per ring peer, counted as Ring.controls_sent
        self._read_from: dict[bytes, int] = {}  # per ring peer: its cursor when `recv` began

    @property
    def wake_fd(self) -> int | None:
        """The wake pipe's descriptor, for a poller beside `socket` (None: no wake pipe)."""
        return None if self.wake is None else self.wake.fileno()

    def fileno(self) -> int:
        return self.socket.getsockopt(zmq.FD)

    def send_control(self, peer: bytes, msg: dict) -> None:
        self.socket.send_multipart([peer, control.encode(msg)])

    def tier(self, peer: bytes) -> str:
        """How `peer`'s KV arrives: "shm" (through its shared-memory ring) or "zmq" (frames)."""
        return "shm" if peer in self.rings else "zmq"

    def poll(self, timeout: float | None = 0) -> bool:
        ms = None if timeout is None else int(timeout * 1000)
        return bool(self.socket.poll(ms, zmq.POLLIN))

    def release(self) -> None:
        """Give the rings' space read so far back to their producers, but what `hold` keeps."""
        for ring in self.rings.values():
            ring.release()

    def hold(self, peer: bytes, fence, at: int | None = None) -> None:
        """Keep `peer`'s ring records from position `at` on (a KV record's `ring_pos`; None:
        every record of the last `recv()`) until `fence.query()` (see `Ring.hold`); nothing to
        keep for a peer without a ring (ZMQ frames are its own). Held record by record, a
        record's space goes back as soon as its own copy (and those before it) completed, so
        the sender refills the ring while the later copies run."""
        ring = self.rings.get(peer)
        if ring is not None:
            # NOTE: 0: the ring was attached during that recv()
            ring.hold(self._read_from.get(peer, 0) if at is None else at, fence)

    @property
    def num_held(self) -> int:
        return sum(ring.num_held for ring in self.rings.values())

    def recv(self, timeout: float | None = None, limit: int | None = None) -> list[Incoming]:
        """What arrived, waiting up to `timeout` seconds (None: until something does); at most
        `limit` socket messages (default `max_batch`), the rest left on the socket for the next
        call (a ring's records up to a doorbell's position come whole)."""
        self.release()
        self._read_from = {peer: ring.cursor for peer, ring in self.rings.items()}
        out: list[Incoming] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = self.liveness_interval if deadline is None else \
                min(self.liveness_interval, max(0.0, deadline - time.monotonic()))
            ready = dict(self._poller.poll(int(wait * 1000)))
            if self.socket in ready:
                for _ in range(limit or self.max_batch):
                    try:
                        frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._dispatch(frames, out)
            if self.wake is not None and self.wake.fileno() in ready:
                self._on_wake(out)
            if time.monotonic() >= self._next_check:
                self._check_rings(out)
            if out or (deadline is not None and time.monotonic() >= deadline):
                return out

    # ---- dispatch -----------------------------------------------------------------------------
    def _dispatch(self, frames, out: list[Incoming]) -> None:
        peer = frames[0].bytes
        first = frames[1].buffer if len(frames) > 1 else b""
        try:
            if len(frames) == 3 and len(first) == 0:  # doorbell
                self._drain(peer, decode_pos(frames[2].buffer), out)
            elif len(first) == 4:  # ZMQ data message
                if len(frames) not in (3, 4):
                    raise RecordError("frames", f"data message of {len(frames) - 1} frames")
                raw = frames[3].buffer if len(frames) == 4 else None
                out.append(Incoming(peer, records.decode(
                    header.from_bytes(first), frames[2].buffer, raw, self.max_topk)))
            elif len(frames) in (2, 3) and len(first) > 4:  # control (+ ring position)
                msg = control.decode(first)
                if len(frames) == 3:
                    self._drain(peer, decode_pos(frames[2].buffer), out)
                    if peer in self._controls_seen:
                        self._controls_seen[peer] += 1
                self._on_control(peer, msg, out)
            else:
                raise RecordError("frames", f"message of {len(frames) - 1} frames, first "
                                            f"of {len(first)} bytes")
        except (RecordError, header.HeaderError) as e:
            refuse(e.reason, f"from {peer!r}: {e}")
        except (control.ControlError, ValueError) as e:
            refuse("control", f"from {peer!r}: {e}")

    def _on_control(self, peer: bytes, msg: dict, out: list[Incoming]) -> None:
        kind = msg["type"]
        if kind == control.SHM_ATTACH:
            self._drop_ring(peer)
            try:
                self.rings[peer] = Ring.attach(str(msg.get("segment", "")))
                if self.pin_rings:
                    self.rings[peer].seg.pin()
            except SegmentError as e:
                log.error("cannot attach ring for %r: %s", peer, e)
                remove_if_stale(str(msg.get("segment", "")))  # its creator died before we attached
                self.send_control(peer, {"type": control.SHM_REFUSED, "version": 1,
                                         "reason": str(e)})
            else:
                ring_id, self._next_ring_id = self._next_ring_id, self._next_ring_id + 1
                self._ring_ids[ring_id] = peer
                self._controls_seen[peer] = 1  # the attach itself
                reply = {"type": control.SHM_ATTACHED, "version": 1}
                if self.wake is not None:
                    reply |= {"wake": self.wake.path, "ring_id": ring_id}
                self.send_control(peer, reply)
        elif kind == control.SHM_DETACH:
            self._drop_ring(peer)
            out.append(Incoming(peer, PeerGone("the prefill node closed its ring")))
        else:
            out.append(Incoming(peer, msg))

    def _drain(self, peer: bytes, limit: int | None, out: list[Incoming]) -> None:
        ring = self.rings.get(peer)
        if ring is None and not limit:
            return  # a control message sent before any record (the attach itself)
        if ring is None:
            raise RecordError("no_ring", "doorbell from a peer without an attached ring")
        if limit is not None and limit > ring.write_pos:
            # NOTE: an honest producer rings only after its write position passed `limit`.
            refuse("ring_position", f"ring {ring.name!r}: doorbell at {limit}, past the "
                                    f"published {ring.write_pos}")
            limit = ring.write_pos
        start = ring.cursor
        while (rec := ring.next_record(limit)) is not None:
            word, body = rec
            try:
                item = records.decode(word, body, None, self.max_topk)
            except RecordError as e:
                refuse(e.reason, f"ring {ring.name!r}: {e}")
            else:
                if isinstance(item, records.KVRecord):
                    item.ring_pos = start
                out.append(Incoming(peer, item))
            start = ring.cursor

    def _on_wake(self, out: list[Incoming]) -> None:
        for ring_id, pos in self.wake.drain().items():
            peer = self._ring_ids.get(ring_id)
            ring = self.rings.get(peer)
            # NOTE: a control message sent before the record may still be on the ZMQ connection;
            # then the record waits for its ZMQ doorbell, which comes after that message.
            if ring is not None and ring.controls_sent == self._controls_seen.get(peer):
                self._drain(peer, pos, out)

    def _check_rings(self, out: list[Incoming]) -> None:
        self._next_check = time.monotonic() + self.liveness_interval
        for peer, ring in list(self.rings.items()):
            if not ring.seg.creator_alive():
                self._drain(peer, None, out)  # its process is dead: nothing more will be written
                self._drop_ring(peer)
                out.append(Incoming(peer, PeerGone(f"prefill process of ring {ring.name!r} died")))
        # NOTE: a killed creator cannot remove its rings, and one killed before its attach reached
        # us left a ring we never saw: every dead creator's ring goes here.
        sweep_stale()

    def _drop_ring(self, peer: bytes) -> None:
        ring = self.rings.pop(peer, None)
        self._controls_seen.pop(peer, None)
        for ring_id in [i for i, p in self._ring_ids.items() if p == peer]:
            del self._ring_ids[ring_id]
        if ring is not None:
            ring.close()

    def close(self) -> None:
        for peer in list(self.rings):
            self._drop_ring(peer)
        self.socket.close()
        if self.wake is not None:
            self.wake.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
