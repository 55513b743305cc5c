"""The sending side of the KV transport (prefill node P -> decode node D).

`Transport` is one interface with two implementations: `ShmTransport` (same host: records in a
shared-memory ring, doorbell on ZMQ) and `ZmqTransport` (across hosts: ZMQ data frames). Both
speak over one DEALER connected to D's ROUTER ("kv ingest" endpoint) and keep control messages
and records in the order they were sent. Frames from P, told apart by the first frame's length:

    control   [msgpack map]               (+ [u64 ring position] on shm)
    data      [u32 header word, meta, raw buffers...]          (ZMQ transport)
    doorbell  [b"", u64 ring position]                         (shm transport)

D answers on the same connection with control messages only. No send blocks: past `send_hwm`
messages queued unsent (D gone or not reading, a link down a long while) a send raises
`TransportError`, and the caller fails what it was sending. Which one connects to an endpoint
is `tiers.py`'s choice (`make_transport`). The receiving side is `receiver.py`; what the control
messages say is the node services' business.
"""

from __future__ import annotations

import abc
import time

import torch
import zmq

from pd.wire import security

from . import control, records
from .errors import TransportError
from .kv import dtype_name, plan_chunks, unit_bytes
from .records import Record

DEFAULT_MAX_RECORD = 16 << 20


class Transport(abc.ABC):
    """P's end of one (P, D) connection. Not thread-safe: one owner thread."""

    mode: str
    send_hwm = 100_000  # messages queued unsent (ZMQ's SNDHWM): deep, so bursts never reach it

    def __init__(self, endpoint: str, instance_id: str, max_record_bytes: int = DEFAULT_MAX_RECORD,
                 ctx: zmq.Context | None = None):
        self.endpoint = endpoint
        self.instance_id = instance_id
        self.max_record_bytes = max_record_bytes
        self.socket = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, instance_id.encode())
        self.socket.setsockopt(zmq.LINGER, 2000)
        self.socket.setsockopt(zmq.SNDHWM, self.send_hwm)
        security.secure_client(self.socket)
        self.socket.connect(endpoint)

    def _send(self, frames: list, copy: bool = True, track: bool = False):
        """Send one multipart message without blocking; a full queue raises TransportError.
        With `track` (and `copy` False) returns ZMQ's tracker of the last frame."""
        # NOTE: a blocking send would stall P's whole loop (no timeouts, no pongs, no drain) for
        # as long as D is unreachable; the high-water mark is checked on the first frame only.
        try:
            return self.socket.send_multipart(frames, zmq.NOBLOCK, copy=copy, track=track)
        except zmq.Again:
            raise TransportError(f"decode node at {self.endpoint} is not taking messages: "
                                 f"{self.send_hwm} queued unsent") from None

    # ---- records ------------------------------------------------------------------------------
    def send_record(self, rec: Record) -> None:
        """Send a FIRST_TOKEN, TARGET_TOKENS/DRAFT_TOKENS or ABORT record."""
        word, body = records.encode(rec)
        self._send_small(word, body)

    def send_kv(self, req_id: str, kv: torch.Tensor, block_ids, first_block: int = 0) -> int:
        """Send kv[:, :, block_ids] (all layers, MTP included) as records; returns their number.
        `first_block`: the request's block that block_ids[0] is (a part of its KV sent while its
        prefill goes on), which the records name."""
        ids = torch.as_tensor(block_ids, dtype=torch.long)
        dtype = dtype_name(kv.dtype)
        chunks = plan_chunks(kv.shape[0], ids.numel(), unit_bytes(kv), self.max_record_bytes)
        self._send_kv_chunks(req_id, dtype, kv, ids, chunks, first_block)
        return len(chunks)


    @abc.abstractmethod
    def _send_small(self, word: int, body: bytes) -> None: ...

    @abc.abstractmethod
    def _send_kv_chunks(self, req_id: str, dtype: str, kv: torch.Tensor, ids: torch.Tensor,
                        chunks, first_block: int) -> None:
        """Send kv[l0:l1, :, ids[b0:b1]] of each (l0, l1, b0, b1) chunk as one KV record, which
        names its blocks first_block + b0 on."""

    # ---- control ------------------------------------------------------------------------------
    @abc.abstractmethod
    def send_control(self, msg: dict) -> None:
        """Send a control message, ordered with the records sent before and after it."""

    def recv_control(self, timeout: float | None = 0) -> dict | None:
        """D's next control message (ack, refusal), or None after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not self.socket.poll(ms, zmq.POLLIN):
                return None
            msg = control.decode(self.socket.recv())
            if msg["type"] not in control.INTERNAL:
                return msg
            self._on_internal(msg)

    def _on_internal(self, msg: dict) -> None:
        pass

    def fileno(self) -> int:
        return self.socket.getsockopt(zmq.FD)

    def close(self) -> None:
        self.socket.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Transport", "TransportError", "DEFAULT_MAX_RECORD"]
