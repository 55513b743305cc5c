"""`ZmqTransport`: records as ZMQ multipart messages, for a decode node on another host.

Each record is [header word, meta, raw buffers...]: small records carry their whole body as the
meta frame; KV carries the KV_DATA_OFFSET-byte meta and the gathered blocks as one raw frame
sent with `copy=False`. Control messages ride the same socket, so order is kept by ZMQ.
Sends never block: when the socket's send queue is full (`send_hwm` messages: the link has been
down a long while, or D stopped reading) a send raises `TransportError`, and the caller fails
what it was sending. The queue is deep so that a burst of hand-offs never reaches it.
"""

from __future__ import annotations

import torch
import zmq

from . import control, header
from .errors import TransportError
from .header import Flag
from .kv import gather
from .transport import Transport

_KV_WORD = header.to_bytes(header.pack(Flag.KV, 0))


class ZmqTransport(Transport):
    mode = "zmq"
    send_hwm = 100_000

    def _send(self, frames: list, copy: bool = True) -> None:
        # NOTE: a blocking send would stall P's whole loop (no timeouts, no pongs) for as long
        # as the link is down; the high-water mark is checked on the first frame only.
        try:
            self.socket.send_multipart(frames, zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            raise TransportError(
                f"decode node at {self.endpoint} is not taking messages: "
                f"{self.socket.getsockopt(zmq.SNDHWM)} queued unsent") from None

    def _send_small(self, word: int, body: bytes) -> None:
        self._send([header.to_bytes(word), body])

    def _send_kv_chunk(self, meta: bytes, kv: torch.Tensor, ids: torch.Tensor, chunk) -> None:
        data = gather(kv, ids, chunk).view(torch.uint8).numpy()
        self._send([_KV_WORD, meta, data], copy=False)

    def send_control(self, msg: dict) -> None:
        self._send([control.encode(msg)])
