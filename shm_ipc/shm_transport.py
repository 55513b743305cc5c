"""`ShmTransport`: records in a shared-memory ring, for a decode node on this host.

P creates one ring per (P instance, D endpoint), announces it with a `shm_attach` control
message, then for each record writes the ring and rings the doorbell ([b"", u64 position]) on the
DEALER. Control messages carry the ring position at send time, so D delivers every record
published before a control message ahead of it. KV is gathered straight from the cache into
ring memory; from a GPU cache, by DMA into the ring's page-locked mapping. If D answers `shm_refused` (e.g. no shared /dev/shm), the next call raises;
choosing the ZMQ transport instead is the caller's (mode "zmq").

When D's `shm_attached` names its wake pipe (`doorbell.WakePipe`), each record also writes
(ring id, position) there before the ZMQ doorbell, which wakes D sooner; every control message
is counted in the ring (`Ring.note_control`) before it is sent, so D reads by the pipe only when
no control message is still on its way.
"""

from __future__ import annotations

import os
import secrets

import torch
import zmq

from . import control, records
from .doorbell import WakeWriter, encode_pos
from .errors import TransportError
from .header import Flag, pack
from .kv import gather_pipelined, unit_bytes
from .records import KV_DATA_OFFSET
from .ring import ALIGN, RECORD_HEADER, Ring
from .segment import segment_name
from .transport import DEFAULT_MAX_RECORD, Transport

DEFAULT_RING_BYTES = 64 << 20
_KV_WORD = pack(Flag.KV, 0)


class ShmTransport(Transport):
    mode = "shm"

    def __init__(self, endpoint: str, instance_id: str, ring_bytes: int = DEFAULT_RING_BYTES,
                 max_record_bytes: int = DEFAULT_MAX_RECORD, timeout: float = 30.0,
                 ctx: zmq.Context | None = None):
        max_record_bytes = min(max_record_bytes, ring_bytes // 2 - ALIGN - RECORD_HEADER - KV_DATA_OFFSET)
        super().__init__(endpoint, instance_id, max_record_bytes, ctx)
        self.timeout = timeout
        self.refused: str | None = None
        self.attached = False
        self.waker: WakeWriter | None = None
        try:
            # a name that reveals nothing (no identity, pid or port): D learns it from the attach
            self.ring = Ring.create(segment_name(secrets.token_hex(16)), ring_bytes)
        except BaseException:
            self.socket.close(linger=0)
            raise
        self.ring.note_control()
        self._send([control.encode({
            "type": control.SHM_ATTACH, "version": 1, "segment": self.ring.name,
            "capacity": self.ring.capacity, "pid": os.getpid()}), encode_pos(0)])

    def _check(self) -> None:
        # NOTE: a refusal arrives as a control message; it is seen once the node reads control
        # messages (recv_control), which it does for its acks.
        if self.refused is not None:
            raise TransportError(f"decode node at {self.endpoint} refused ring "
                                 f"{self.ring.name!r}: {self.refused}; use the zmq transport")

    def _on_internal(self, msg: dict) -> None:
        if msg["type"] == control.SHM_ATTACHED:
            self.attached = True
            wake, ring_id = msg.get("wake"), msg.get("ring_id")
            if isinstance(wake, str) and isinstance(ring_id, int) and 0 <= ring_id <= 0xFFFFFFFF:
                self.waker = WakeWriter.open(wake, ring_id)
        elif msg["type"] == control.SHM_REFUSED:
            self.refused = str(msg.get("reason", "no reason given"))

    def _send_small(self, word: int, body: bytes) -> None:
        self._check()
        self._ring_bell(self.ring.publish(word, body, timeout=self.timeout))

    def _send_kv_chunks(self, req_id: str, dtype: str, kv: torch.Tensor, ids: torch.Tensor,
                        chunks, first_block: int) -> None:
        """Each chunk gathered straight into its ring record, two in flight on a GPU
        (`gather_pipelined`), each record published (and the bell rung) once its bytes are in."""
        self._check()
        if kv.is_cuda:
            self.ring.seg.pin()  # the GPU copies straight into the ring (shm_ipc.pinned)

        def size(chunk) -> int:
            l0, l1, b0, b1 = chunk
            return KV_DATA_OFFSET + (l1 - l0) * (b1 - b0) * unit_bytes(kv)

        def reserve(chunk) -> memoryview:
            l0, l1, b0, b1 = chunk
            view = self.ring.reserve(_KV_WORD, size(chunk), self.timeout)
            view[:KV_DATA_OFFSET] = records.kv_meta(req_id, l0, l1, first_block + b0, b1 - b0, dtype)
            return view[KV_DATA_OFFSET:]

        gather_pipelined(kv, ids, chunks, reserve, lambda: self._ring_bell(self.ring.commit()),
                         fits=lambda chunk: self.ring.fits(size(chunk)))

    def _ring_bell(self, pos: int) -> None:
        if self.waker is not None:
            self.waker.wake(pos)
        self._send([b"", encode_pos(pos)])

    def send_control(self, msg: dict) -> None:
        self._check()
        self.ring.note_control()
        self._send([control.encode(msg), encode_pos(self.ring.write_pos)])

    def close(self) -> None:
        """Tell D the ring ends after what was sent, then remove it."""
        if not self.socket.closed:
            try:
                self.ring.note_control()
                self._send([control.encode({"type": control.SHM_DETACH, "version": 1}),
                            encode_pos(self.ring.write_pos)])
            except TransportError:
                pass  # D is not reading: it finds the ring's creator gone instead
        if self.waker is not None:
            self.waker.close()
        self.ring.close()
        super().close()
