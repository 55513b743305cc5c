"""Shared-memory IPC and the KV transport between prefill and decode nodes.

`header` (the uint32 header word), `segment`/`ring`/`doorbell` (shared-memory ring buffer),
`records` (typed records), `kv` (cache <-> record helpers), `transport` (+ `shm_transport`,
`zmq_transport`: the sending side; `tiers`: which one an endpoint gets) and `receiver` (the
decode node's ingest). The transport modules import torch; import them by name (`from
shm_ipc.tiers import make_transport`). What control messages mean is left to the node services.
"""

from .errors import PeerGoneError, RingFullError, SegmentError, TransportError
from .header import ABORT, DRAFT_TOKENS, FIRST_TOKEN, KV, PAD, TARGET_TOKENS, Flag, pack, unpack
from .metrics import RECORDS_REFUSED
from .records import AbortRecord, FirstTokenRecord, KVRecord, TokensRecord

__all__ = [
    "Flag", "pack", "unpack", "PAD", "KV", "FIRST_TOKEN", "TARGET_TOKENS", "DRAFT_TOKENS", "ABORT",
    "FirstTokenRecord", "TokensRecord", "KVRecord", "AbortRecord", "RECORDS_REFUSED",
    "TransportError", "SegmentError", "PeerGoneError", "RingFullError",
]
