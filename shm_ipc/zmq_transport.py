"""`ZmqTransport`: records as ZMQ multipart messages, for a decode node on another host.

Each record is [header word, meta, raw buffers...]: small records carry their whole body as the
meta frame; KV carries the KV_DATA_OFFSET-byte meta and the gathered blocks as one raw frame
sent with `copy=False`. Control messages ride the same socket, so order is kept by ZMQ.

A request's KV chunks are gathered as the ring tier gathers them (`kv.gather_pipelined`: on a
GPU by DMA on the copy stream into page-locked memory, up to `kv.STAGING_SLOTS` chunks in
flight; on CPU one at a time), each into a host buffer of its own (`FrameBuffers`), and handed
to ZMQ as soon as its bytes are in: the next chunks' copies run while ZMQ sends the earlier
ones. A buffer is taken again only once ZMQ has sent the frame that used it.
"""

from __future__ import annotations

from collections import deque

import torch

from . import control, header, records
from .header import Flag
from .kv import STAGING_SLOTS, gather_pipelined, unit_bytes
from .transport import Transport

_KV_WORD = header.to_bytes(header.pack(Flag.KV, 0))


class FrameBuffers:
    """Host buffers for KV frames sent without a copy (page-locked with `pin`: the copy engine
    writes into them, and allocating page-locked memory per record costs milliseconds), each
    taken again once ZMQ's tracker of the frame that used it says it was sent. Sizes are
    powers of two; at most `keep` idle ones are kept."""

    def __init__(self, pin: bool, keep: int = 2 * STAGING_SLOTS) -> None:
        self.pin, self.keep = pin, keep
        self.idle: list[torch.Tensor] = []
        self.sent: deque[tuple[torch.Tensor, object]] = deque()  # (buffer, tracker) in order

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least `nbytes` no frame in flight uses."""
        while self.sent and (self.sent[0][1] is None or self.sent[0][1].done):
            self.idle.append(self.sent.popleft()[0])
        del self.idle[:max(0, len(self.idle) - self.keep)]
        for i, buf in enumerate(self.idle):
            if buf.numel() >= nbytes:
                return self.idle.pop(i)
        size = 1 << max(12, (nbytes - 1).bit_length())
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor, tracker) -> None:
        """`buf` is in a frame ZMQ sends; `tracker` (None: sent) tells when it is done."""
        self.sent.append((buf, tracker))


class ZmqTransport(Transport):
    mode = "zmq"
    frames: FrameBuffers | None = None  # made on the first KV sent (page-locked for a GPU's)

    def _send_small(self, word: int, body: bytes) -> None:
        self._send([header.to_bytes(word), body])

    def _send_kv_chunks(self, req_id: str, dtype: str, kv: torch.Tensor, ids: torch.Tensor,
                        chunks, first_block: int) -> None:
        if self.frames is None:
            self.frames = FrameBuffers(pin=kv.is_cuda)
        pending: deque = deque()  # (meta, buffer, bytes) reserved, not yet sent

        def reserve(chunk) -> memoryview:
            l0, l1, b0, b1 = chunk
            nbytes = (l1 - l0) * (b1 - b0) * unit_bytes(kv)
            buf = self.frames.take(nbytes)
            pending.append((records.kv_meta(req_id, l0, l1, first_block + b0, b1 - b0, dtype), buf, nbytes))
            return memoryview(buf.numpy())[:nbytes]

        def publish() -> None:
            meta, buf, nbytes = pending.popleft()
            tracker = self._send([_KV_WORD, meta, memoryview(buf.numpy())[:nbytes]], copy=False,
                                 track=True)
            self.frames.give(buf, tracker)

        # NOTE: on CPU a chunk's copy is done when gathered: sent at once (holding it back
        # for later chunks measured 20% slower on loopback TCP)
        gather_pipelined(kv, ids, chunks, reserve, publish,
                         depth=STAGING_SLOTS if kv.is_cuda else 1)

    def send_control(self, msg: dict) -> None:
        self._send([control.encode(msg)])
