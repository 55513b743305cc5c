"""The decode node: takes requests handed over by prefill nodes, forwards each first token to
the router at once, installs the KV into its own blocks, and decodes them in its running batch,
streaming every token to the router: each step's tokens of the requests of one router go in one
message, in columns (`TokenStreams`).

Intake, per request, on the KV ingest socket (from one prefill node, in order):
  RequestMeta -> FIRST_TOKEN (forwarded to the router; blocks reserved, or queued until free)
  -> KVAccept sent -> KV records (installed) -> KVDone -> KVAck sent, the request joins the batch.
A prefill node on this host with its cache on a GPU may write the KV into this node's blocks
itself (CUDA IPC, `shm_ipc.cuda_ipc`): the cache is offered in HelloOk, the request's
RequestMeta says `direct`, KVAccept names the blocks, no records come, and KVDone means the
blocks are filled; nothing is installed here and no step waits for a transfer. A direct request
dropped after its KVAccept keeps its blocks until the prefill node answers that KVAccept
(KVDone, or KVReleased when it will not write them) or is gone.
With prefix caching, the blocks reserved start with the prompt's longest prefix this node holds
in its cache (a previous turn of the same conversation, a shared system prompt); KVAccept says
how many, and the prefill node sends only the rest. Received and decoded blocks join the cache.
A request waiting for blocks or for its KV has a deadline (`--kv-timeout`): on expiry the router
gets an error and the prefill node a KVRefuse. An ABORT (router or prefill node) ends the request
wherever it is and frees its blocks (after the step in flight, if one still holds it); so does
the loss of the router that asked for it. Every record's request id must name a request in the
state that expects it, from the peer that announced it; anything else is refused and counted.
While draining (SIGTERM) new requests are refused (KVRefuse, and an error the router retries
elsewhere); those already here are decoded to their end.

Decoding runs through `pd.engine.decode_loop.DecodeLoop`: by default one step ahead of the device (the
overlap scheduler), or the plain loop with `overlap=False` (`--no-overlap`,
PD_DISABLE_OVERLAP=1). With MTP the prefill node's DRAFT_TOKENS record (after FIRST_TOKEN)
gives the first drafts, so a request's first step here verifies them; every step may then
stream several tokens of a request. Requests joining from prefill nodes and aborts are applied between
steps; the step gap (device idle time between steps) is a histogram and a periodic log line.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass

from pd.engine.decode_loop import make_decode_loop
from pd.engine.engine import Engine
from pd.engine.request import Req
from pd.service import metrics as node_metrics
from pd.service.flags import default
from pd.service.node import NodeService
from pd.service.states import Transitions
from pd.spec.verify import SpecStats
from pd.wire import messages as m
from pd.wire.geometry import mismatch
from pd.wire.sampling_params import SamplingParams
from shm_ipc.cuda_ipc import export as export_kv
from shm_ipc.kv import install_kv, installed, prepare as prepare_kv_copies
from shm_ipc.receiver import KVReceiver, PeerGone
from shm_ipc.header import Flag
from shm_ipc.records import AbortRecord, FirstTokenRecord, KVRecord, TokensRecord

log = logging.getLogger(__name__)
GAP_LOG_S = 30.0  # how often the step-gap quantiles are logged while decoding


class IncomingState(enum.Enum):
    META = "meta"  # RequestMeta arrived, waiting for FIRST_TOKEN
    WAITING_BLOCKS = "waiting_blocks"  # first token forwarded, waiting for free blocks
    RECEIVING = "receiving"  # KVAccept sent, KV records arriving
    JOINED = "joined"  # KVDone: in the running batch
    DROPPED = "dropped"  # failed, aborted or timed out; blocks freed


INCOMING_STATES = Transitions({
    IncomingState.META: (IncomingState.WAITING_BLOCKS, IncomingState.DROPPED),
    IncomingState.WAITING_BLOCKS: (IncomingState.RECEIVING, IncomingState.DROPPED),
    IncomingState.RECEIVING: (IncomingState.JOINED, IncomingState.DROPPED),
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
    state: IncomingState = IncomingState.META
    num_records: int = 0
    num_cached: int = 0  # leading prompt blocks found in this node's prefix cache, not sent
    kv_bytes: int = 0  # KV bytes received for it
    accepted_at: float = 0.0  # perf_counter time of its KVAccept (the transfer's start)
    first_token_at: float = 0.0  # monotonic time of the first token's arrival
    direct: bool = False  # the prefill node writes its KV into our blocks (CUDA IPC)


class DecodeNode(NodeService):
    role = "decode"

    def __init__(self, node_id: str, engine: Engine, *, host: str, port: int, kv_port: int,
                 metrics_port: int | None, max_queue: int = default("max_queue", "decode"),
                 kv_timeout: float = default("kv_timeout", "decode"), overlap: bool = True,
                 spec_fallback: str = default("spec_fallback", "decode"),
                 drain_timeout: float = default("drain_timeout", "decode"),
                 capture_graphs_tokens: int = default("cuda_graph_max_tokens", "decode")) -> None:
        super().__init__(node_id, host, port, metrics_port, drain_timeout)
        self.engine = engine
        prepare_kv_copies(engine.runner.kv_cache.kv)  # the first transfer compiles nothing
        self.num_kv_records = 0  # KV records installed (`on_kv_socket` waits for new ones)
        self.scheduler = engine.scheduler
        self.allocator = engine.allocator
        self.max_queue = max_queue
        self.kv_timeout = kv_timeout
        self.receiver = KVReceiver(f"tcp://{host}:{kv_port}", ctx=self.ctx,
                                   pin_rings=engine.runner.device.type == "cuda")
        self.kv_addr = self.receiver.endpoint
        self.register(self.receiver.socket, self.on_kv_socket)
        if self.receiver.wake_fd is not None:
            self.register(self.receiver.wake_fd, self.on_kv_socket)  # the ring's fast wake
        self.geometry = engine.geometry(mtp_enabled=engine.spec is not None)
        self.peers: dict[bytes, str] = {}  # paired prefill nodes: identity -> node id
        self.kv_ipc = export_kv(engine.runner.kv_cache.kv)  # the cache for peers on this host
        self.ipc_peers: set[bytes] = set()  # peers offered it
        self.fenced: dict[str, Incoming] = {}  # dropped direct requests a peer may still write
        self.incoming: dict[str, Incoming] = {}
        self.waiting_blocks: deque[Incoming] = deque()
        self.reply_to: dict[str, str] = {}  # running request -> router event endpoint
        self.metrics = node_metrics.for_node(self.role, node_id)
        fallback = {"on": True, "off": False}.get(spec_fallback, engine.runner.device.type == "cuda")
        self.loop = make_decode_loop(engine.runner, self.scheduler, overlap,
                                     on_gap=self.metrics.step_gap_seconds.observe, spec=engine.spec,
                                     spec_fallback=fallback)
        self.spec_seen = SpecStats()  # MTP counters already exported
        self.capture_graphs(capture_graphs_tokens)
        self.last_gap_log = time.monotonic()

    def capture_graphs(self, max_tokens: int) -> None:
        """On CUDA, capture the decode step graphs (and MTP's) of every batch size for sequences
        of up to `max_tokens` tokens before serving: captured on first use instead, each new
        (batch, length) stalls every stream of the running batch (seen as ITL p99)."""
        runner, spec = self.engine.runner, self.engine.spec
        if runner.graphs is None or max_tokens <= 0:
            return
        keys = runner.graphs.keys_up_to(min(max_tokens, self.engine.max_model_len))
        start = time.perf_counter()
        log.info("capturing %d decode CUDA graphs (sequences up to %d tokens)", len(keys), max_tokens)
        runner.graphs.capture_all(keys)
        spec_keys = []
        if spec is not None and spec.graphs is not None:
            spec_keys = sorted({k for b, w in keys if (k := spec.graphs.key(b, w)) is not None})
            for key in spec_keys:
                spec.graphs.get(key)
        log.info("captured %d decode and %d MTP CUDA graphs in %.1f s", len(keys), len(spec_keys),
                 time.perf_counter() - start)

    # -- router control ------------------------------------------------------------------------
    def on_control(self, identity: bytes, msg) -> None:
        if isinstance(msg, m.Abort):
            self.abort(msg.req_id)
        else:
            super().on_control(identity, msg)

    def pong_extra(self) -> dict:
        return {"kv_addr": self.kv_addr}

    # -- KV ingest -----------------------------------------------------------------------------
    def on_kv_socket(self) -> None:
        t = time.perf_counter()
        num_records = self.num_kv_records
        for peer, item in self.receiver.recv(timeout=0):
            try:
                self.dispatch(peer, item)
            except m.MessageError as e:
                self.refuse("kv", e)
        if self.num_kv_records != num_records:
            # NOTE: the records' copies ran back to back on the copy stream (`on_kv`); they are
            # done before the next recv() releases their ring space and before a step reads them.
            installed(self.engine.runner.kv_cache.kv)
        self.loop.times.add("intake", t)

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
            self.abort(item.req_id, peer=peer)
        elif isinstance(item, FirstTokenRecord):
            self.on_first_token(self.expect(peer, item.req_id, IncomingState.META), item)
        elif isinstance(item, TokensRecord) and item.flag == Flag.DRAFT_TOKENS:
            self.on_drafts(item)
        elif isinstance(item, KVRecord):
            self.on_kv(self.expect(peer, item.req_id, IncomingState.RECEIVING), item)
        else:
            raise m.MessageError(f"unexpected record {type(item).__name__}")

    def expect(self, peer: bytes, req_id: str, state: IncomingState) -> Incoming:
        inc = self.incoming.get(req_id)
        if inc is None or inc.peer != peer or inc.state is not state:
            raise m.MessageError(
                f"record for request {req_id!r}, which is not {state.value!r} from this peer "
                f"({'unknown' if inc is None else inc.state.value})")
        return inc

    def on_hello(self, peer: bytes, msg: m.Hello) -> None:
        why = mismatch(self.geometry, msg.geometry)
        if why is not None:
            log.error("refusing to pair with prefill node %s: %s", msg.node_id, why)
            self.receiver.send_control(peer, m.to_dict(m.HelloRefused(self.node_id, why)))
            return
        self.peers[peer] = msg.node_id
        offer = self.kv_ipc if self.receiver.tier(peer) == "shm" else None
        if offer is not None:
            self.ipc_peers.add(peer)
        self.receiver.send_control(peer, m.to_dict(m.HelloOk(self.node_id, kv_ipc=offer)))
        log.info("paired with prefill node %s", msg.node_id)

    def on_meta(self, peer: bytes, msg: m.RequestMeta) -> None:
        try:
            if self.draining:
                raise ValueError(f"decode node {self.node_id} is draining (shutting down)")
            if msg.req_id in self.incoming or msg.req_id in self.reply_to or msg.req_id in self.fenced:
                raise ValueError(f"duplicate request id {msg.req_id!r}")
            if msg.direct and peer not in self.ipc_peers:
                raise ValueError("direct KV (CUDA IPC) was not offered to this prefill node")
            if len(self.incoming) >= self.max_queue:
                raise ValueError(f"decode node {self.node_id} is full ({self.max_queue} incoming)")
            params = SamplingParams.from_dict(msg.params)
            self.engine.validate_prompt(msg.prompt_ids)
        except (ValueError, TypeError) as e:
            self.metrics.refused("draining" if self.draining else "bad_request").inc()
            self.receiver.send_control(peer, m.to_dict(m.KVRefuse(msg.req_id, str(e))))
            self.events.send(msg.reply_to, m.TokenStream(msg.req_id, [], error=str(e)))
            return
        req = Req(msg.req_id, list(msg.prompt_ids), params, eos_token_ids=self.engine.eos_token_ids)
        deadline = time.monotonic() + min(msg.deadline_s, self.kv_timeout)
        self.incoming[msg.req_id] = Incoming(req, peer, msg.reply_to, msg.num_blocks, deadline,
                                             direct=msg.direct)

    def on_first_token(self, inc: Incoming, rec: FirstTokenRecord) -> None:
        req = inc.req
        req.append_token(rec.token_id, rec.logprob, rec.rank, [tuple(p) for p in rec.top])
        inc.first_token_at = time.monotonic()
        # NOTE: the first token goes to the router now; TTFT does not wait for the KV.
        self.stream(inc.reply_to, req, 1, None)
        INCOMING_STATES.move(inc, IncomingState.WAITING_BLOCKS)
        self.waiting_blocks.append(inc)
        self.may_reserve()

    def on_drafts(self, rec: TokensRecord) -> None:
        inc = self.incoming.get(rec.req_id)
        if self.engine.spec is None or inc is None or inc.state not in (
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
            need = self.scheduler.blocks_needed(req, req.num_tokens) - len(hit)
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

    def on_kv(self, inc: Incoming, rec: KVRecord) -> None:
        if inc.direct:
            raise m.MessageError(f"KV record for {inc.req.req_id}, whose KV is written directly")
        if rec.block_start + rec.num_blocks > inc.num_blocks - inc.num_cached:
            raise m.MessageError(f"KV record for {inc.req.req_id} beyond its "
                                 f"{inc.num_blocks - inc.num_cached} uncached blocks")
        try:
            install_kv(rec, self.engine.runner.kv_cache.kv, inc.req.block_ids[inc.num_cached:],
                       wait=False)
        except ValueError as e:
            raise m.MessageError(str(e)) from None
        inc.num_records += 1
        inc.kv_bytes += rec.payload.nbytes
        self.num_kv_records += 1
        self.metrics.kv_received_bytes(self.receiver.tier(inc.peer)).inc(rec.payload.nbytes)

    def on_kv_done(self, peer: bytes, msg: m.KVDone) -> None:
        inc = self.expect(peer, msg.req_id, IncomingState.RECEIVING)
        if inc.num_records != msg.num_records:
            self.fail(inc, f"KV incomplete: {inc.num_records} of {msg.num_records} records arrived")
            return
        self.receiver.send_control(peer, m.to_dict(m.KVAck(msg.req_id)))
        tier = "ipc" if inc.direct else self.receiver.tier(peer)
        if inc.direct:
            kv = self.engine.runner.kv_cache.kv
            inc.kv_bytes = (inc.num_blocks - inc.num_cached) * kv[:, :, :1].numel() * kv.element_size()
            self.metrics.kv_received_bytes(tier).inc(inc.kv_bytes)
        self.metrics.kv_transfer_seconds(tier).observe(time.perf_counter() - inc.accepted_at)
        self.metrics.kv_transfer_bytes(tier).observe(inc.kv_bytes)
        del self.incoming[msg.req_id]
        INCOMING_STATES.move(inc, IncomingState.JOINED)
        req = inc.req
        req.num_computed_tokens = req.num_prompt_tokens
        req.num_registered_blocks = inc.num_cached
        self.scheduler.register(req)  # the received blocks join the prefix cache
        self.reply_to[req.req_id] = inc.reply_to
        self.scheduler.add_running(req)
        self.metrics.join_seconds.observe(time.monotonic() - inc.first_token_at)

    def on_peer_gone(self, peer: bytes, reason: str) -> None:
        self.peers.pop(peer, None)
        self.ipc_peers.discard(peer)
        for inc in [i for i in self.incoming.values() if i.peer == peer]:
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

    # -- decoding ------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.loop.has_work

    def step(self) -> None:
        start = time.perf_counter()
        emitted = self.loop.step()
        if self.loop.batch_size:
            self.metrics.batch_size.observe(self.loop.batch_size)
        self.metrics.step_seconds.observe(time.perf_counter() - start)
        self.metrics.generation_tokens.inc(len(emitted))
        self.metrics.count_steps_ahead(self.loop.num_ahead)
        t = time.perf_counter()
        counts = Counter(emitted)  # with MTP a request is emitted once per kept token
        batches: dict[str, dict] = {}  # router -> this step's columns for it (`TokenStreams`)
        for req, n in counts.items():
            reply_to = self.reply_to.get(req.req_id)
            if reply_to is None:
                continue
            cols = batches.get(reply_to)
            if cols is None:
                cols = batches[reply_to] = {"req_ids": [], "counts": [], "token_ids": [],
                                            "num_prompt_tokens": [], "num_output_tokens": [],
                                            "ended": [], "logprobs": []}
            i = len(cols["req_ids"])
            cols["req_ids"].append(req.req_id)
            cols["counts"].append(n)
            cols["token_ids"] += req.token_ids[-n:]
            cols["num_prompt_tokens"].append(req.num_prompt_tokens)
            cols["num_output_tokens"].append(req.num_output_tokens)
            if req.params.logprobs is not None:
                cols["logprobs"].append([i, req.output_logprobs[-n:], [
                    [list(p) for p in top] for top in req.output_top_logprobs[-n:]]])
            if req.is_finished:
                cols["ended"].append([i, req.finish_reason.value])
                del self.reply_to[req.req_id]
        for reply_to, cols in batches.items():
            self.events.send(reply_to, m.TokenStreams(**cols))
        self.loop.times.add("stream", t)
        self.may_reserve()
        if self.engine.spec is not None:
            self.spec_seen = self.engine.spec.stats.export(self.metrics, self.spec_seen)
            if self.loop.choice is not None:
                self.metrics.count_spec_plain_steps(self.loop.choice.num_plain_steps)

    def stream(self, reply_to: str, req: Req, n: int, finish_reason: str | None) -> None:
        """Send the request's last n tokens (with logprobs when asked) to the router."""
        self.events.send(reply_to, self.token_stream(req, n, finish_reason))

    @staticmethod
    def token_stream(req: Req, n: int, finish_reason: str | None) -> m.TokenStream:
        """The request's last n tokens, with logprobs when asked."""
        extra = {}
        if req.params.logprobs is not None:
            extra = {"logprobs": req.output_logprobs[-n:],
                     "top_logprobs": [[list(p) for p in top] for top in req.output_top_logprobs[-n:]]}
        return m.TokenStream(
            req.req_id, req.token_ids[-n:], finish_reason=finish_reason,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens, **extra)

    # -- endings -------------------------------------------------------------------------------
    def fail(self, inc: Incoming, error: str, tell_peer: bool = True) -> None:
        log.warning("request %s failed: %s", inc.req.req_id, error)
        self.metrics.refused("failed").inc()
        self.events.send(inc.reply_to, m.TokenStream(inc.req.req_id, [], error=error))
        if tell_peer:
            self.receiver.send_control(inc.peer, m.to_dict(m.KVRefuse(inc.req.req_id, error)))
        self.drop_incoming(inc)

    def drop_incoming(self, inc: Incoming) -> None:
        self.incoming.pop(inc.req.req_id, None)
        if inc.state is IncomingState.WAITING_BLOCKS:
            self.waiting_blocks.remove(inc)
        if inc.direct and inc.state is IncomingState.RECEIVING and inc.peer in self.peers:
            self.fenced[inc.req.req_id] = inc  # the peer may be writing them: see unfence
        else:
            self.scheduler.free_blocks(inc.req)
        INCOMING_STATES.move(inc, IncomingState.DROPPED)

    def abort(self, req_id: str, peer: bytes | None = None) -> None:
        inc = self.incoming.get(req_id)
        if inc is not None and (peer is None or inc.peer == peer):
            self.drop_incoming(inc)
        elif req_id in self.reply_to and peer is None:
            del self.reply_to[req_id]
            req = next((r for r in self.scheduler.running if r.req_id == req_id), None) or \
                next((r for r in self.scheduler.waiting if r.req_id == req_id), None)
            if req is not None:
                self.loop.abort(req)
        self.may_reserve()

    def busy(self) -> bool:
        return bool(self.incoming or self.reply_to)

    def on_router_gone(self, reply_to: str) -> None:
        for inc in [i for i in self.incoming.values() if i.reply_to == reply_to]:
            self.metrics.refused("router_gone").inc()
            refuse = m.KVRefuse(inc.req.req_id, "router gone")
            self.receiver.send_control(inc.peer, m.to_dict(refuse))
            self.drop_incoming(inc)
        for req_id in [r for r, to in self.reply_to.items() if to == reply_to]:
            self.metrics.refused("router_gone").inc()
            log.warning("request %s: its router is gone", req_id)
            self.abort(req_id)

    def tick(self, now: float) -> None:
        self.on_kv_socket()  # NOTE: the receiver checks its ring producers' lives when read
        for inc in [i for i in self.incoming.values() if now > i.deadline]:
            self.fail(inc, m.TIMEOUT_PREFIX + " " + {
                IncomingState.META: "waiting for the first token",
                IncomingState.WAITING_BLOCKS: "waiting for free KV blocks at the decode node",
                IncomingState.RECEIVING: "waiting for the KV"}[inc.state])
        self.may_reserve()
        mt = self.metrics
        mt.waiting.set(len(self.scheduler.waiting) + len(self.waiting_blocks))
        mt.running.set(len(self.scheduler.running))
        mt.kv_usage.set(self.allocator.usage)
        mt.count_preemptions(self.scheduler.num_preemptions)
        node_metrics.export_prefix_cache(mt, self.engine)
        mt.count_host_seconds(self.loop.times.total)
        if not self.incoming and not self.loop.has_work and self.integrity_due():
            self.allocator.check_integrity()
        if now - self.last_gap_log >= GAP_LOG_S:
            self.last_gap_log = now
            summary = self.loop.take_gap_summary()
            if summary is not None:
                log.info("decode node %s (overlap %s): %s", self.node_id,
                         "on" if self.loop.overlap else "off", summary)

    def stats(self) -> dict:
        return {
            "queue_len": len(self.waiting_blocks) + len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "incoming": len(self.incoming),
            "free_blocks": self.allocator.num_free,
            "total_blocks": self.allocator.num_blocks,
            "block_size": self.engine.config.block_size,
            **self.engine.prefix_stats(),
        }

    def shutdown(self) -> None:
        self.loop.close()
        for inc in list(self.incoming.values()):
            self.fail(inc, f"decode node {self.node_id} shut down")
        for req_id, reply_to in list(self.reply_to.items()):
            self.events.send(reply_to, m.TokenStream(
                req_id, [], error=f"decode node {self.node_id} shut down"))
        self.receiver.close()
