"""One prefill node's connection to one decode node: the handshake, then the request hand-off.

On creation it connects the KV transport (shm ring on this host, ZMQ frames across hosts) and
sends `Hello` with this node's geometry. A decode node on this host whose cache is on a GPU
offers it by CUDA IPC in `HelloOk`; a prefill node on a GPU opens it (transport "auto" or "ipc")
and then writes each request's KV straight into the blocks `KVAccept` names (`shm_ipc.cuda_ipc`),
the ring carrying only the records and control messages. Requests announced or submitted before
`HelloOk` wait in `pending`; `HelloRefused` (or no answer within the handshake timeout) fails
them with the reason. Once paired, a request goes out as RequestMeta (`announce`, when its
prefill starts, or with its first token) then a FIRST_TOKEN record (+ a DRAFT_TOKENS record with
MTP) once the prefill is done (`submit`); its KV follows on `KVAccept` (all but the prompt
blocks the decode node says it already holds), closed by `KVDone`. Replies are dispatched back
to the node.
Transport errors (ring full past its timeout, peer gone) fail the request and mark the link
failed, so the next request reconnects.
A decode node that disconnects (killed, restarted) has lost every request handed to it: they all
fail at once, and the link with them (a restarted node must be greeted again).

The link talks to its owner (the prefill node) only through `LinkOwner`: the sockets it asks to
be watched, the hand-off events it raises, and nothing else; the KV it sends comes from the
`kv` tensor it is given. Its states are `LinkState`, with their transitions in `LINK_STATES`.
"""

from __future__ import annotations

import enum
import logging
import secrets
import time
from collections import deque
from typing import Callable, Protocol

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from pd.engine.request import Req
from pd.service.states import Transitions
from pd.wire import messages as m
from shm_ipc.cuda_ipc import PeerCache
from shm_ipc.errors import TransportError
from shm_ipc.header import Flag
from shm_ipc.kv import block_bytes
from shm_ipc.records import AbortRecord, FirstTokenRecord, TokensRecord
from shm_ipc.tiers import make_transport

log = logging.getLogger(__name__)


class LinkState(enum.Enum):
    HELLO_SENT = "hello_sent"
    READY = "ready"
    FAILED = "failed"


LINK_STATES = Transitions({
    LinkState.HELLO_SENT: (LinkState.READY, LinkState.FAILED),
    LinkState.READY: (LinkState.FAILED,),
    LinkState.FAILED: (),
})


class Handoff(Protocol):
    """One request being handed to a decode node, as the link sees it."""

    msg: m.PrefillRequest
    req: Req
    arrival: float
    deadline: float  # monotonic: the end of its prefill's wait, then of its hand-off
    kv_sent: int  # prompt blocks (past those the decode node holds) sent so far (`send_kv`)
    kv_records: int  # KV records sent so far
    kv_chunk: object  # the copy event of its last direct part sent during its prefill, or None
    kv_ready: object  # CUDA: the event after the last step that computed its KV, or None


class LinkOwner(Protocol):
    """What a `DecodeLink` needs from the node that owns it."""

    node_id: str
    geometry: dict

    def register(self, sock: zmq.Socket, handler: Callable[[], None]) -> None: ...
    def unregister(self, sock: zmq.Socket) -> None: ...
    def refuse(self, source: str, error: Exception) -> None: ...
    def on_first_token_sent(self, job: Handoff) -> None: ...
    def on_kv_accept(self, link: "DecodeLink", msg: m.KVAccept) -> None: ...
    def on_kv_ack(self, link: "DecodeLink", req_id: str) -> None: ...
    def on_kv_refuse(self, link: "DecodeLink", req_id: str, reason: str) -> None: ...
    def on_link_broken(self, link: "DecodeLink", reason: str, jobs: list[Handoff] | None) -> None:
        """The link failed: end `jobs`, or every request handed to it when None."""


class DecodeLink:
    def __init__(self, owner: LinkOwner, addr: str, *, kv: torch.Tensor, block_size: int,
                 handoff_timeout: float, transport: str, tp=None) -> None:
        self.owner, self.addr = owner, addr
        self.kv, self.block_size = kv, block_size  # the KV source: the owner's paged cache
        # tensor parallelism (`pd.engine.tp.Mirror`): the ranks' heads of a request's blocks
        # are joined before they are sent, so KV crosses with every head (no CUDA IPC)
        self.tp = tp
        self.handoff_timeout = handoff_timeout
        self.state = LinkState.HELLO_SENT
        self.reason = ""
        # announced or submitted before HelloOk: request id -> [job, submitted]
        self.pending: dict[str, list] = {}
        self.announced: set[str] = set()  # RequestMeta sent, FIRST_TOKEN not yet
        self.hello_deadline = time.monotonic() + handoff_timeout
        # NOTE: the link's identity on D's KV port is random and named nowhere (not in a
        # segment name, not in a log): D's KV socket takes no identity handover, and a request's
        # messages count only from the identity that handed it over
        # "ipc": the ring for records and control, KV by CUDA IPC or the link fails
        self.ipc = transport in ("auto", "ipc") and kv.is_cuda and tp is None
        self.ipc_required = transport == "ipc"
        self.peer_cache: PeerCache | None = None  # D's cache, once opened by CUDA IPC
        self.writes: deque = deque()  # (request id, copy done event) of direct KV in flight
        self.deferred: deque = deque()  # replies read during a step, left for after it
        self.transport = make_transport(addr, secrets.token_hex(16),
                                        mode="shm" if transport == "ipc" else transport)
        self.monitor = self.transport.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        owner.register(self.transport.socket, self.on_socket)
        owner.register(self.monitor, self.on_monitor)
        self.control(m.Hello(owner.node_id, owner.geometry))
        log.info("connecting to decode node %s over %s", addr, self.transport.mode)

    @property
    def tier(self) -> str:
        """How KV crosses this link: "ipc" (into D's cache), "shm" (the ring) or "zmq" (frames)."""
        return "ipc" if self.peer_cache is not None else self.transport.mode

    @property
    def failed(self) -> bool:
        return self.state is LinkState.FAILED

    def control(self, msg) -> None:
        self.transport.send_control(m.to_dict(msg))

    def announce(self, job: Handoff) -> None:
        """RequestMeta while the job's prefill runs, so the decode node reserves its blocks
        meanwhile. A failure to send marks the link failed and leaves the job to `submit`,
        which fails it (the caller's step is under way)."""
        if self.state is LinkState.READY:
            try:
                self._send_meta(job, early=True)
                self.announced.add(job.req.req_id)
            except TransportError as e:
                self._broken(f"sending to decode node {self.addr} failed: {e}")
        elif self.state is LinkState.HELLO_SENT:
            self.pending[job.req.req_id] = [job, False]

    def submit(self, job: Handoff) -> None:
        """The job's prefill is done: its RequestMeta unless announced, then FIRST_TOKEN."""
        if self.state is LinkState.READY:
            self._send_request(job)
        elif self.state is LinkState.HELLO_SENT:
            self.pending[job.req.req_id] = [job, True]
        else:
            self.owner.on_link_broken(self, f"decode node {self.addr} unusable: {self.reason}",
                                      [job])

    def withdraw(self, job: Handoff) -> None:
        """Forget a job (it ended at the owner)."""
        self.pending.pop(job.req.req_id, None)
        self.announced.discard(job.req.req_id)

    def _send_meta(self, job: Handoff, early: bool) -> None:
        req = job.req
        # sent early, the decode node holds the blocks for the rest of the prefill too
        wait = max(0.0, job.deadline - time.monotonic()) if early else 0.0
        self.control(m.RequestMeta(req.req_id, req.prompt_token_ids, job.msg.params,
                                   job.msg.reply_to, num_blocks=self.num_prompt_blocks(job),
                                   deadline_s=self.handoff_timeout + wait,
                                   direct=self.peer_cache is not None,
                                   prompt_logprobs=prompt_logprobs_wire(req)))

    def _send_request(self, job: Handoff) -> None:
        req = job.req
        first = req.output_token_ids[0]
        asked = req.params.logprobs is not None
        try:
            if req.req_id in self.announced:
                self.announced.discard(req.req_id)
            else:
                self._send_meta(job, early=False)
            self.transport.send_record(FirstTokenRecord(
                req.req_id, first,
                req.output_logprobs[0] if asked else 0.0,
                req.output_ranks[0] if asked else 0,
                list(req.output_top_logprobs[0]) if asked else []))
            if req.spec_token_ids:  # MTP: the first drafts, so D's first step verifies them
                self.transport.send_record(TokensRecord(req.req_id, list(req.spec_token_ids),
                                                        flag=Flag.DRAFT_TOKENS))
            self.owner.on_first_token_sent(job)
        except TransportError as e:
            self._broken(f"sending to decode node {self.addr} failed: {e}", job)

    def num_prompt_blocks(self, job: Handoff) -> int:
        return -(-job.req.num_prompt_tokens // self.block_size)

    def send_kv(self, job: Handoff, num_cached_blocks: int = 0, dst_block_ids=None,
                early: bool = False, upto: int | None = None) -> int:
        """Send the prompt's KV blocks but the first `num_cached_blocks` (the decode node holds
        them) and those sent before, then KVDone; returns the bytes sent. A direct request's
        blocks are written into the decode node's `dst_block_ids` (CUDA IPC) instead of being
        sent as records, and its KVDone goes once the copy is done (`finish_writes`, called by
        the owner's loop).
        `early`: a direct write queued on the current stream by the prefill step that computes
        the KV, before the host waits for its first token (so done when that is), its KVDone
        after the first token.
        `upto`: a part of the KV of a prefill still under way (a chunk of a long prompt): the
        prompt blocks before block `upto` not sent yet, without KVDone; a direct one is copied on
        the side stream once the step that computed them is done (the job's `kv_ready` event,
        else the current stream's work). The job's `kv_sent` (blocks) and `kv_records` count
        what has gone; `kv_chunk` is the event of its last direct part."""
        kv = self.kv
        num_blocks = self.num_prompt_blocks(job)
        if not 0 <= num_cached_blocks <= num_blocks:
            self._broken(f"decode node {self.addr} claims {num_cached_blocks} cached blocks of "
                         f"request {job.req.req_id}'s {num_blocks}", job)
            return 0
        sent = job.kv_sent
        blocks = job.req.block_ids[num_cached_blocks + sent:num_blocks if upto is None else upto]
        try:
            if self.tp is not None and blocks:
                kv, blocks = self.tp.gather_kv(kv, blocks), list(range(len(blocks)))
            if self.peer_cache is not None and dst_block_ids is not None:
                dst = dst_block_ids[sent:sent + len(blocks)]
                if upto is not None:
                    if blocks:
                        job.kv_chunk = self.peer_cache.write(kv, blocks, dst, side=True,
                                                             after=job.kv_ready)
                else:  # KVDone once this copy and its parts' are done
                    after = job.kv_chunk if early else None  # else on the parts' stream
                    self.writes.append((job.req.req_id, self.peer_cache.write(
                        kv, blocks, dst, side=not early, after=after)))
                    if not early:
                        self.finish_writes()
            else:
                job.kv_records += self.transport.send_kv(job.req.req_id, kv, blocks, first_block=sent)
                if upto is None:
                    self.control(m.KVDone(job.req.req_id, job.kv_records))
        except (TransportError, ValueError, TypeError) as e:  # TypeError: block ids not ints
            self._broken(f"KV transfer to decode node {self.addr} failed: {e}", job)
            return 0
        job.kv_sent += len(blocks)
        return block_bytes(kv) * len(blocks)

    def finish_writes(self) -> None:
        """KVDone for each direct write whose copy has completed, in order (also for a request
        that ended here meanwhile: the decode node holds its blocks until told; this node may
        have reused the source blocks before the copy read them, which only fills blocks the
        decode node has dropped). Not before the request's first token (an early write)."""
        while self.writes and self.writes[0][0] not in self.announced and self.writes[0][1].query():
            req_id, _ = self.writes.popleft()
            try:
                self.control(m.KVDone(req_id, 0))
            except TransportError as e:
                self._broken(f"KV transfer to decode node {self.addr} failed: {e}")
                return

    def release(self, req_id: str, written: torch.cuda.Event | None = None) -> None:
        """Tell the decode node that this node will write no more into the blocks its direct
        KVAccept for `req_id` named (the request ended here first): KVReleased, or, when parts
        went into them (`written`: the last part's copy event), KVDone once that copy is done
        (`finish_writes`)."""
        if written is not None:
            if self.state is not LinkState.FAILED:
                self.writes.append((req_id, written))
        elif self.state is not LinkState.FAILED:
            try:
                self.control(m.KVReleased(req_id))
            except TransportError as e:
                log.warning("could not release %s's blocks at %s: %s", req_id, self.addr, e)

    def send_abort(self, req_id: str, reason: str) -> None:
        if self.state is LinkState.FAILED:
            return
        try:
            self.transport.send_record(AbortRecord(req_id, reason[:512]))
        except TransportError as e:
            log.warning("could not send abort for %s to %s: %s", req_id, self.addr, e)

    def _broken(self, reason: str, job: Handoff | None = None, everything: bool = False) -> None:
        """Mark the link failed and have the owner end `job` and the pending jobs
        (`everything`: every job handed to this node)."""
        LINK_STATES.move(self, LinkState.FAILED)
        self.reason = reason
        log.error("%s", reason)
        waiting = [j for j, _ in self.pending.values()]
        jobs = [job, *waiting] if job is not None else waiting
        self.pending.clear()
        self.owner.on_link_broken(self, reason, None if everything else jobs)

    def on_monitor(self) -> None:
        while self.monitor.poll(0):
            if recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED \
                    and self.state is not LinkState.FAILED:
                self._broken(f"decode node {self.addr} disconnected", everything=True)

    # -- replies ---------------------------------------------------------------------------------
    def on_socket(self) -> None:
        while self.deferred:
            self._dispatch(self.deferred.popleft())
        while (msg := self._read()) is not None:
            self._dispatch(msg)

    def read_accepts(self) -> None:
        """During a step: the KVAccepts that have come are handled now, the other replies
        after it (`on_socket`, which the owner calls when `deferred` holds some). A KVAccept is
        the decode node's first reply about its request, so none deferred is about it."""
        while (msg := self._read()) is not None:
            if isinstance(msg, m.KVAccept):
                self._dispatch(msg)
            else:
                self.deferred.append(msg)

    def _read(self):
        """The next reply, or None when none is waiting (bad ones refused on the way)."""
        while True:
            try:
                raw = self.transport.recv_control(0)
            except (ValueError, TransportError) as e:
                self.owner.refuse("kv", e)
                continue
            if raw is None:
                return None
            try:
                return m.from_dict(raw)
            except m.MessageError as e:
                self.owner.refuse("kv", e)

    def _dispatch(self, msg) -> None:
        owner = self.owner
        if isinstance(msg, m.HelloOk):
            if self.state is not LinkState.HELLO_SENT:
                owner.refuse("kv", m.MessageError(f"HelloOk from {self.addr} out of turn"))
                return
            if not self._open_peer_cache(msg.kv_ipc):
                return
            LINK_STATES.move(self, LinkState.READY)
            log.info("paired with decode node %s (%s), KV over %s", msg.node_id, self.addr,
                     self.tier)
            pending, self.pending = self.pending, {}
            for job, submitted in pending.values():
                if self.failed:  # a send failed: the rest fail with it
                    self.owner.on_link_broken(self, self.reason, [job])
                elif submitted:
                    self._send_request(job)
                else:
                    self.announce(job)
        elif isinstance(msg, m.HelloRefused):
            self._broken(f"decode node {self.addr} refused to pair: {msg.reason}")
        elif isinstance(msg, m.KVAccept):
            owner.on_kv_accept(self, msg)
        elif isinstance(msg, m.KVAck):
            owner.on_kv_ack(self, msg.req_id)
        elif isinstance(msg, m.KVRefuse):
            owner.on_kv_refuse(self, msg.req_id, msg.reason)
        else:
            owner.refuse("kv", m.MessageError(f"unexpected {type(msg).__name__} from a decode node"))

    def _open_peer_cache(self, offer: dict | None) -> bool:
        """Open the decode node's cache when offered and wanted; False when the link failed
        (transport "ipc" and no usable offer)."""
        if self.ipc and offer is not None:
            try:
                self.peer_cache = PeerCache.open(offer, self.kv)
                log.info("decode node %s: KV by CUDA IPC into its cache (%s)", self.addr,
                         "same GPU" if self.peer_cache.same_gpu else "another GPU")
            except TransportError as e:
                if self.ipc_required:
                    self._broken(f"decode node {self.addr}: no CUDA IPC ({e})")
                    return False
                log.warning("decode node %s: %s; KV goes through the ring", self.addr, e)
        elif self.ipc_required:
            self._broken(f"no CUDA IPC to decode node {self.addr}: both caches must be on GPUs "
                         f"of one host")
            return False
        return True

    def tick(self, now: float) -> None:
        if self.state is LinkState.HELLO_SENT and now > self.hello_deadline:
            self._broken(f"decode node {self.addr} did not answer the handshake")

    def close(self) -> None:
        for sock in (self.transport.socket, self.monitor):
            self.owner.unregister(sock)
        self.transport.socket.disable_monitor()
        self.monitor.close()
        self.transport.close()
        if self.peer_cache is not None:
            self.peer_cache.close()


def prompt_logprobs_wire(req: Req) -> list | None:
    """The request's prompt logprobs as messages carry them (None when not asked)."""
    if req.params.prompt_logprobs is None:
        return None
    return [[v, rank, [list(p) for p in top]] for v, rank, top in req.prompt_logprobs]
