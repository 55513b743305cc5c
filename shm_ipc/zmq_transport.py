"""`ZmqTransport`: records as ZMQ multipart messages, for a decode node on another host.

Each record is [header word, meta, raw buffers...]: small records carry their whole body as the
meta frame; KV carries the KV_DATA_OFFSET-byte meta and the gathered blocks as one raw frame
sent with `copy=False`. Control messages ride the same socket, so order is kept by ZMQ.
"""

from __future__ import annotations

import torch

from . import control, header, records
from .header import Flag
from .kv import gather
from .transport import Transport

_KV_WORD = header.to_bytes(header.pack(Flag.KV, 0))


class ZmqTransport(Transport):
    mode = "zmq"

    def _send_small(self, word: int, body: bytes) -> None:
        self._send([header.to_bytes(word), body])

    def _send_kv_chunks(self, req_id: str, dtype: str, kv: torch.Tensor, ids: torch.Tensor,
                        chunks) -> None:
        for chunk in chunks:
            l0, l1, b0, b1 = chunk
            data = gather(kv, ids, chunk).view(torch.uint8).numpy()
            meta = records.kv_meta(req_id, l0, l1, b0, b1 - b0, dtype)
            self._send([_KV_WORD, meta, data], copy=False)

    def send_control(self, msg: dict) -> None:
        self._send([control.encode(msg)])
