"""A decode node's intake: requests handed over by prefill nodes, from their RequestMeta until
they join the running batch (or fail), on the KV ingest socket.

Per request, from one prefill node, in order:
  RequestMeta (blocks reserved, or queued until free; KVAccept sent once reserved) ->
  FIRST_TOKEN (forwarded to the router) -> KV records (installed) -> KVDone -> KVAck sent, the
  request joins the batch (once its records' copies have completed: `decode_node.landing`).
A prefill node sends RequestMeta as the request's prefill starts, so the blocks are reserved and
KVAccept is on its way while it runs: KVAccept may precede FIRST_TOKEN, and the KV follows the
first token at once.
With prefix caching, the blocks reserved start with the prompt's longest prefix this node holds
in its cache (a previous turn of the same conversation, a shared system prompt); KVAccept says
how many, and the prefill node sends only the rest. A prefill node on this host with its cache
on a GPU may write the KV into this node's blocks itself (CUDA IPC, `shm_ipc.cuda_ipc`): the
cache is offered in HelloOk, the request's RequestMeta says `direct`, KVAccept names the blocks,
no records come, and KVDone means the blocks are filled; nothing is installed and no step waits
for a transfer. A direct request dropped after its KVAccept keeps its blocks until the prefill
node answers that KVAccept (KVDone, or KVReleased when it will not write them) or is gone.
A request waiting for blocks or for its KV has a deadline (`--kv-timeout`): on expiry the router
gets an error and the prefill node a KVRefuse. Every record's request id must name a request in
the state that expects it, from the peer that announced it; anything else is refused and
counted. The intake talks to its node only through `IntakeOwner`.

From KVAccept on, the records' installs, KVDone and the request's joining the batch are
`decode_node.landing.Landing`'s, mixed in here.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Protocol

from decode_node.incoming import INCOMING_STATES, Incoming, IncomingState
from decode_node.landing import Landing
from pd.engine.engine import Engine
from pd.engine.request import Req
from pd.service import metrics as node_metrics
from pd.service.trace import trace
from pd.wire import messages as m
from pd.wire.geometry import mismatch
from pd.wire.sampling_params import SamplingParams
from shm_ipc.cuda_ipc import export as export_kv
from shm_ipc.header import Flag
from shm_ipc.kv import prepare as prepare_kv_copies
from shm_ipc.receiver import KVReceiver, PeerGone
from shm_ipc.records import AbortRecord, FirstTokenRecord, KVRecord, TokensRecord

log = logging.getLogger(__name__)

# socket messages read in a turn of the node's loop while requests decode (`on_socket`): the
# arrivals' pace is a few a step (~4 messages a request; 170 requests a second at concurrency
# 64 on the 1B shape, 745 steps a second)
MESSAGES_PER_TURN = 4


class IntakeOwner(Protocol):
    """What the intake needs from its decode node."""

    node_id: str
    draining: bool
    events: object  # pd.service.node.EventSender: TokenStreams to routers
    loop: object  # pd.engine.decode_loop.DecodeLoop: its host times ("intake")

    def refuse(self, source: str, error: Exception) -> None: ...
    def stream(self, reply_to: str, req: Req, n: int, finish_reason: str | None) -> None: ...
    def send_first_tokens(self, batch: dict[str, list[Req]]) -> None:
        """First tokens to the routers, one message per router: reply_to -> its requests."""
    def running(self, req_id: str) -> bool: ...
    def join(self, req: Req, reply_to: str) -> None:
        """The request's KV is in: it joins the running batch, streaming to `reply_to`."""
    def abort(self, req_id: str, peer: bytes | None = None) -> None: ...


class Intake(Landing):
    def __init__(self, owner: IntakeOwner, engine: Engine, receiver: KVReceiver, metrics, *,
                 max_queue: int, kv_timeout: float) -> None:
        self.owner, self.engine, self.receiver, self.metrics = owner, engine, receiver, metrics
        self.scheduler, self.allocator = engine.scheduler, engine.allocator
        self.max_queue, self.kv_timeout = max_queue, kv_timeout
        prepare_kv_copies(engine.runner.kv_cache.kv)  # the first transfer compiles nothing
        self.num_kv_records = 0  # `Landing`'s
        self.geometry = engine.geometry(mtp_enabled=engine.spec is not None)
        self.peers: dict[bytes, str] = {}  # paired prefill nodes: identity -> node id
        # tensor parallelism: each record is handed out to the ranks by heads (`install_tp`)
        self.tp = engine.runner.mirror
        # the cache for peers on this host (not with tensor parallelism: it holds rank 0's heads)
        self.kv_ipc = export_kv(engine.runner.kv_cache.kv) if self.tp is None else None
        self.ipc_peers: set[bytes] = set()  # peers offered it
        self.fenced: dict[str, Incoming] = {}  # dropped direct requests a peer may still write
        self.incoming: dict[str, Incoming] = {}
        self.waiting_blocks: deque[Incoming] = deque()
        self.landing: deque[Incoming] = deque()  # `Landing`'s
        # first tokens read and not yet sent on: reply_to -> requests (`flush_first_tokens`)
        self.first_tokens: dict[str, list[Req]] = {}

    def on_socket(self) -> None:
        """Read and apply what the prefill nodes sent (the node calls this on the socket and
        the ring's wake)."""
        t = time.perf_counter()
        num_records = self.num_kv_records
        # NOTE: while requests decode, a few messages a turn: a burst of arrivals (each ~0.5
        # ms of host work on an H100 host: its RequestMeta, FIRST_TOKEN, KVDone) would hold
        # every stream's next tokens for as long; the rest stay on the socket for the next turns
        limit = MESSAGES_PER_TURN if self.owner.loop.has_work else None
        for peer, item in self.receiver.recv(timeout=0, limit=limit):
            try:
                self.dispatch(peer, item)
            except m.MessageError as e:
                self.owner.refuse("kv", e)
        self.flush_first_tokens()
        # NOTE: while nothing decodes, wait for the records' copies here, so their requests
        # join now (while decoding, `land` joins them once the copies are done, between steps)
        self.land(wait=self.num_kv_records != num_records and not self.owner.loop.has_work)
        self.owner.loop.times.add("intake", t)

    def flush_first_tokens(self) -> None:
        """Send the first tokens read since the last flush, one message per router: a burst of
        prefills (a batch of arrivals) reaches each router as one message, not one each, which
        the router read one per pass of its event loop (the first tokens' p99 from this node
        to the router was 78 ms at concurrency 64 on the H100)."""
        if self.first_tokens:
            batch, self.first_tokens = self.first_tokens, {}
            self.owner.send_first_tokens(batch)

    def dispatch(self, peer: bytes, item) -> None:
        if isinstance(item, dict):
            msg = m.from_dict(item)
            if isinstance(msg, m.Hello):
                self.on_hello(peer, msg)
            elif peer not in self.peers:
                raise m.MessageError(f"{type(msg).__name__} from an unpaired peer {peer!r}")
            elif isinstance(msg, m.RequestMeta):
                self.on_meta(peer, msg)
            elif isinstance(msg, m.KVDone) and msg.req_id not in self.fenced:
                self.on_kv_done(peer, msg)
            elif isinstance(msg, (m.KVDone, m.KVReleased)):
                self.unfence(peer, msg.req_id)
            else:
                raise m.MessageError(f"unexpected {type(msg).__name__} on the KV ingest socket")
        elif isinstance(item, PeerGone):
            self.on_peer_gone(peer, item.reason)
        elif isinstance(item, AbortRecord):
            self.owner.abort(item.req_id, peer=peer)
        elif isinstance(item, FirstTokenRecord):
            inc = self.expect(peer, item.req_id, IncomingState.WAITING_BLOCKS, IncomingState.RECEIVING)
            if inc.first_token_at:
                raise m.MessageError(f"a second FIRST_TOKEN for request {item.req_id!r}")
            self.on_first_token(inc, item)
        elif isinstance(item, TokensRecord) and item.flag == Flag.DRAFT_TOKENS:
            self.on_drafts(item)
        elif isinstance(item, KVRecord):
            self.on_kv(self.expect(peer, item.req_id, IncomingState.RECEIVING), item)
        else:
            raise m.MessageError(f"unexpected record {type(item).__name__}")

    def expect(self, peer: bytes, req_id: str, *states: IncomingState) -> Incoming:
        inc = self.incoming.get(req_id)
        if inc is None or inc.peer != peer or inc.state not in states:
            raise m.MessageError(
                f"record for request {req_id!r}, which is not "
                f"{' or '.join(repr(s.value) for s in states)} from this peer "
                f"({'unknown' if inc is None else inc.state.value})")
        return inc

    def on_hello(self, peer: bytes, msg: m.Hello) -> None:
        why = mismatch(self.geometry, msg.geometry)
        if why is not None:
            log.error("refusing to pair with prefill node %s: %s", msg.node_id, why)
            self.receiver.send_control(peer, m.to_dict(m.HelloRefused(self.owner.node_id, why)))
            return
        self.peers[peer] = msg.node_id
        offer = self.kv_ipc if self.receiver.tier(peer) == "shm" else None
        if offer is not None:
            self.ipc_peers.add(peer)
        self.receiver.send_control(peer, m.to_dict(m.HelloOk(self.owner.node_id, kv_ipc=offer)))
        log.info("paired with prefill node %s", msg.node_id)

    def on_meta(self, peer: bytes, msg: m.RequestMeta) -> None:
        try:
            if self.owner.draining:
                raise ValueError(f"decode node {self.owner.node_id} is draining (shutting down)")
            if (msg.req_id in self.incoming or msg.req_id in self.fenced
                    or self.owner.running(msg.req_id)):
                raise ValueError(f"duplicate request id {msg.req_id!r}")
            if msg.direct and peer not in self.ipc_peers:
                raise ValueError("direct KV (CUDA IPC) was not offered to this prefill node")
            if len(self.incoming) >= self.max_queue:
                raise ValueError(f"decode node {self.owner.node_id} is full ({self.max_queue} "
                                 f"incoming)")
            params = SamplingParams.from_dict(msg.params)
            self.engine.validate_prompt(msg.prompt_ids)
            req = Req(msg.req_id, list(msg.prompt_ids), params,
                      eos_token_ids=self.engine.eos_token_ids)
            # NOTE: the grammar's matcher walks the first token when it arrives (append_token)
            self.engine.bind_grammar(req)
        except (ValueError, TypeError) as e:
            self.metrics.refused("draining" if self.owner.draining else "bad_request").inc()
            self.receiver.send_control(peer, m.to_dict(m.KVRefuse(msg.req_id, str(e))))
            self.owner.events.send(msg.reply_to, m.TokenStream(msg.req_id, [], error=str(e)))
            return
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = msg.prompt_logprobs or []  # sent on with the first token
        deadline = time.monotonic() + min(msg.deadline_s, self.kv_timeout)
        inc = self.incoming[msg.req_id] = Incoming(req, peer, msg.reply_to, msg.num_blocks,
                                                   deadline, direct=msg.direct)
        self.waiting_blocks.append(inc)
        trace("decode_meta", msg.req_id)
        self.may_reserve()

    def on_first_token(self, inc: Incoming, rec: FirstTokenRecord) -> None:
        req, vocab = inc.req, self.engine.model_config.vocab_size
        if not 0 <= rec.token_id < vocab:
            # NOTE: an id outside the vocabulary would index the embedding out of range on the
            # device, an assert that takes every request of this node down with it: this one
            # fails alone
            self.fail(inc, f"the prefill node sent first token {rec.token_id}, outside the "
                           f"vocabulary (0..{vocab - 1})")
            return
        req.append_token(rec.token_id, rec.logprob, rec.rank, [tuple(p) for p in rec.top])
        inc.first_token_at = time.perf_counter()
        self.metrics.first_token_receive_seconds.observe(inc.first_token_at - inc.meta_at)
        # NOTE: the first token goes to the router now (at the end of this read of the
        # socket, `flush_first_tokens`); TTFT does not wait for the KV. Prompt logprobs travel
        # in a message of their own.
        if req.params.prompt_logprobs is None:
            self.first_tokens.setdefault(inc.reply_to, []).append(req)
        else:
            self.owner.stream(inc.reply_to, req, 1, None)
        trace("decode_first_in", req.req_id)

    def on_drafts(self, rec: TokensRecord) -> None:
        inc = self.incoming.get(rec.req_id)
        if self.engine.spec is None or inc is None or not inc.first_token_at or inc.state not in (
                IncomingState.WAITING_BLOCKS, IncomingState.RECEIVING):
            raise m.MessageError(f"DRAFT_TOKENS for request {rec.req_id!r}, which expects none")
        vocab, req = self.engine.model_config.vocab_size, inc.req
        if len(rec.token_ids) > self.engine.spec.k or any(not 0 <= t < vocab for t in rec.token_ids):
            raise m.MessageError(f"DRAFT_TOKENS for {rec.req_id!r}: more than k drafts or ids "
                                 f"outside the vocabulary")
        room = min(req.num_prompt_tokens + req.params.max_tokens, self.engine.max_model_len) - req.num_tokens
        req.spec_token_ids = list(rec.token_ids[:max(0, room - 1)])

    def may_reserve(self) -> None:
        """Reserve blocks for waiting requests, in arrival order, keeping one free block per
        running request so the batch can grow without preempting."""
        prefix, bs = self.scheduler.prefix, self.engine.config.block_size
        while self.waiting_blocks:
            inc = self.waiting_blocks[0]
            req = inc.req
            hit = prefix.match(req, min(inc.num_blocks, req.num_prompt_tokens // bs)) if prefix else []
            # the prompt and the first token (come or to come)
            need = self.scheduler.blocks_needed(req, req.num_prompt_tokens + 1) - len(hit)
            if need + self.allocator.share_cost(hit) > self.allocator.num_free - len(self.scheduler.running):
                return
            self.waiting_blocks.popleft()
            if prefix is not None:
                prefix.count(req, len(hit))
                node_metrics.export_prefix_cache(self.metrics, self.engine)
            self.allocator.share(hit)
            req.block_ids = hit + self.allocator.allocate(need)
            inc.num_cached = len(hit)
            INCOMING_STATES.move(inc, IncomingState.RECEIVING)
            ids = req.block_ids[len(hit):inc.num_blocks] if inc.direct else None
            self.receiver.send_control(inc.peer, m.to_dict(m.KVAccept(req.req_id, len(hit), ids)))
            inc.accepted_at = time.perf_counter()

    def on_peer_gone(self, peer: bytes, reason: str) -> None:
        self.peers.pop(peer, None)
        self.ipc_peers.discard(peer)
        # NOTE: a LANDING request has all its KV (its copies are done once the ring is closed)
        for inc in [i for i in self.incoming.values()
                    if i.peer == peer and i.state is not IncomingState.LANDING]:
            self.fail(inc, f"prefill node gone before the KV arrived: {reason}", tell_peer=False)
        for req_id in [r for r, inc in self.fenced.items() if inc.peer == peer]:
            self.unfence(peer, req_id)

    def unfence(self, peer: bytes, req_id: str) -> None:
        """The prefill node will not write a dropped direct request's blocks: free them."""
        inc = self.fenced.get(req_id)
        if inc is None or inc.peer != peer:
            raise m.MessageError(f"KV answer for request {req_id!r}, which holds no blocks for "
                                 f"this peer")
        del self.fenced[req_id]
        self.scheduler.free_blocks(inc.req)
        self.may_reserve()

    def fail(self, inc: Incoming, error: str, tell_peer: bool = True) -> None:
        log.warning("request %s failed: %s", inc.req.req_id, error)
        self.metrics.refused("failed").inc()
        self.flush_first_tokens()  # its first token, if read, goes to the router before this
        self.owner.events.send(inc.reply_to, m.TokenStream(inc.req.req_id, [], error=error))
        if tell_peer:
            self.receiver.send_control(inc.peer, m.to_dict(m.KVRefuse(inc.req.req_id, error)))
        self.drop(inc)

    def drop(self, inc: Incoming) -> None:
        """Forget the request and free its blocks (a direct one's once its peer answers)."""
        self.incoming.pop(inc.req.req_id, None)
        if inc.state is IncomingState.WAITING_BLOCKS:
            self.waiting_blocks.remove(inc)
        if inc.fence is not None and inc.state in (IncomingState.RECEIVING, IncomingState.LANDING):
            inc.fence.synchronize()  # a copy may still write its blocks
        if inc.direct and inc.state is IncomingState.RECEIVING and inc.peer in self.peers:
            self.fenced[inc.req.req_id] = inc  # the peer may be writing them: see unfence
        else:
            self.scheduler.free_blocks(inc.req)
        INCOMING_STATES.move(inc, IncomingState.DROPPED)

    def abort(self, req_id: str, peer: bytes | None) -> bool:
        """Drop an incoming request (from `peer` only, when given); False when none is here."""
        inc = self.incoming.get(req_id)
        if inc is None or (peer is not None and inc.peer != peer):
            return False
        self.drop(inc)
        return True

    def on_router_gone(self, reply_to: str) -> None:
        for inc in [i for i in self.incoming.values() if i.reply_to == reply_to]:
            self.metrics.refused("router_gone").inc()
            refuse = m.KVRefuse(inc.req.req_id, "router gone")
            self.receiver.send_control(inc.peer, m.to_dict(refuse))
            self.drop(inc)

    def expire(self, now: float) -> None:
        """Fail the requests past their deadline, then reserve blocks for those waiting."""
        self.on_socket()  # NOTE: the receiver checks its ring producers' lives when read
        for inc in [i for i in self.incoming.values() if now > i.deadline]:
            self.fail(inc, m.TIMEOUT_PREFIX + " " + (
                "waiting for the first token" if not inc.first_token_at else {
                    IncomingState.WAITING_BLOCKS: "waiting for free KV blocks at the decode node",
                    IncomingState.RECEIVING: "waiting for the KV",
                    IncomingState.LANDING: "waiting for the KV"}[inc.state]))
        self.may_reserve()

    def close(self, error: str) -> None:
        for inc in list(self.incoming.values()):
            self.fail(inc, error)
        self.receiver.close()
