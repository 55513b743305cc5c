"""A request a prefill node hands over to a decode node, from its RequestMeta until it joins the
running batch or is dropped (`Incoming`), and its states with their transitions
(`IncomingState`, `INCOMING_STATES`): what `decode_node.intake.Intake` keeps per request."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pd.engine.request import Req
from pd.service.states import Transitions


class IncomingState(enum.Enum):
    WAITING_BLOCKS = "waiting_blocks"  # RequestMeta arrived, waiting for free blocks
    RECEIVING = "receiving"  # KVAccept sent, the first token and KV records arriving
    LANDING = "landing"  # KVDone arrived, the copies of its last records still running
    JOINED = "joined"  # KVDone: in the running batch
    DROPPED = "dropped"  # failed, aborted or timed out; blocks freed


INCOMING_STATES = Transitions({
    IncomingState.WAITING_BLOCKS: (IncomingState.RECEIVING, IncomingState.DROPPED),
    IncomingState.RECEIVING: (IncomingState.LANDING, IncomingState.JOINED, IncomingState.DROPPED),
    IncomingState.LANDING: (IncomingState.JOINED, IncomingState.DROPPED),
    IncomingState.JOINED: (),
    IncomingState.DROPPED: (),
})


@dataclass(eq=False)
class Incoming:
    req: Req
    peer: bytes
    reply_to: str
    num_blocks: int  # blocks of prompt KV the request has (the prefill node sends the uncached)
    deadline: float
    state: IncomingState = IncomingState.WAITING_BLOCKS
    num_records: int = 0
    num_cached: int = 0  # leading prompt blocks found in this node's prefix cache, not sent
    kv_bytes: int = 0  # KV bytes received for it
    accepted_at: float = 0.0  # perf_counter time of its KVAccept
    first_token_at: float = 0.0  # perf_counter time of the first token's arrival (0: not yet)
    meta_at: float = field(default_factory=time.perf_counter)  # its RequestMeta's arrival
    direct: bool = False  # the prefill node writes its KV into our blocks (CUDA IPC)
    fence: object = None  # its last record's copy (a CUDA event: done when it completes)
