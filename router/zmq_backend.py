"""The backend that runs requests on prefill and decode nodes over ZMQ.

One DEALER per node carries PrefillRequest / Abort / Ping out and Pong back; one PULL socket
(the `reply_to` every request names) takes the TokenStream messages of every request. A ping
every `heartbeat_interval` feeds the registry (health and load); a node silent for
`heartbeat_timeout` (the router's own stalls not counted), or whose connection drops, is marked
down, and its in-flight requests end: those still waiting for
their first token are retried once on another prefill and decode node, the others get an error
event (never a silent truncation); a request that ends in an error is aborted on both its nodes,
so the survivor frees its blocks at once. A node that reports draining takes no new requests.
The policy picks a (P, D) pair per request.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import zmq
import zmq.asyncio

from pd.config import ModelConfig
from pd.service.trace import trace
from pd.wire import messages as m
from pd.wire import security
from pd.wire.refusals import RefusalLog
from router.backend import Backend, BackendUnavailable, GenerateRequest, TokenEvent
from router.metrics import (BACKEND_RETRIES, FIRST_TOKEN_NODES, MESSAGES_REFUSED,
                            ROUTING_DECISIONS)
from router.policies import make_policy
from router.registry import Node, NodeRegistry, Role

log = logging.getLogger(__name__)
_REFUSALS = RefusalLog(log)  # rate-limited: a flood of garbage must not flood the log
_LOAD = {"queue_len": "queue_len", "num_running": "running", "free_kv_blocks": "free_blocks",
         "total_kv_blocks": "total_blocks",
         "outstanding_prefill_tokens": "outstanding_prefill_tokens"}  # registry <- Pong stats


EVENTS_PER_PASS = 256  # event messages read at once (`ZmqBackend._read_events`)


def _refuse(socket: str, message: str) -> None:
    MESSAGES_REFUSED.labels(socket).inc()
    _REFUSALS("refused a message on the %s socket: %s", socket, message)


@dataclass(eq=False)
class Flight:
    """One request on the nodes: the attempt now running and the events it receives."""

    prefill: Node
    decode: Node
    node_req_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    got_token: bool = False
    sent_at: float = field(default_factory=time.perf_counter)  # the PrefillRequest's dispatch
    blocks: int = 0  # KV blocks counted against the decode node until it reports
    # a token has arrived from the decode node (read off the socket, maybe not yet from
    # `queue`): the request is the decode node's now
    at_decode: bool = False


class ZmqBackend(Backend):
    def __init__(self, prefill: list[str], decode: list[str], *, policy: str = "load",
                 max_model_len: int, host: str = "127.0.0.1", heartbeat_interval: float = 0.5,
                 heartbeat_timeout: float = 3.0, policy_options: dict | None = None) -> None:
        self.registry = NodeRegistry(heartbeat_timeout=heartbeat_timeout)
        for addr in prefill:
            self.registry.add(Role.PREFILL, addr)
        for addr in decode:
            self.registry.add(Role.DECODE, addr)
        self.policy = make_policy(policy, **(policy_options or {}), **(
            {"on_decision": lambda role, reason: ROUTING_DECISIONS.labels(role, reason).inc()}
            if policy == "cache_aware" else {}))
        self._max_model_len = max_model_len
        self.host = host
        self.heartbeat_interval = heartbeat_interval
        self.ctx = zmq.asyncio.Context.instance()
        self.sockets: dict[str, zmq.asyncio.Socket] = {}
        self.kv_addr: dict[str, str] = {}  # decode node -> its KV ingest endpoint
        self.block_size: dict[str, int] = {}
        self.flights: dict[str, Flight] = {}  # node-side request id -> flight
        self.tasks: list[asyncio.Task] = []
        self.reply_to = ""

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        self.events = self.ctx.socket(zmq.PULL)
        self.events.setsockopt(zmq.LINGER, 0)
        self.events.setsockopt(zmq.MAXMSGSIZE, m.MAX_MESSAGE_BYTES + 4096)
        security.secure_server(self.events)
        port = self.events.bind_to_random_port(f"tcp://{self.host}")
        self.reply_to = f"tcp://{self.host}:{port}"
        self.tasks.append(asyncio.create_task(self._read_events()))
        self.tasks.append(asyncio.create_task(self._heartbeats()))

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for s in self.sockets.values():
            s.close()
        self.events.close()

    def health(self) -> dict:
        return self.registry.counts()

    def max_model_len(self) -> int:
        return self._max_model_len

    def kv_blocks(self) -> list[tuple[int, int]] | None:
        nodes = [n for n in self.registry.routable(Role.DECODE) if n.load.total_kv_blocks]
        return [(n.load.total_kv_blocks, self.block_size.get(n.address, 16)) for n in nodes] or None

    # -- sockets ---------------------------------------------------------------------------------
    def _socket(self, addr: str) -> zmq.asyncio.Socket:
        sock = self.sockets.get(addr)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            security.secure_client(sock)
            sock.connect(f"tcp://{addr}")
            self.sockets[addr] = sock
            self.tasks.append(asyncio.create_task(self._read_pongs(addr, sock)))
            self.tasks.append(asyncio.create_task(self._watch(addr, sock)))
        return sock

    async def _watch(self, addr: str, sock: zmq.asyncio.Socket) -> None:
        """A node whose connection drops (its process died or closed) is down at once, not a
        heartbeat timeout later; once it answers a ping again it is back."""
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                await monitor.recv_multipart()
                node = self.registry.get(addr)
                if node is not None and node.healthy:
                    self.registry.mark_down(addr, "its connection dropped")
                    self._node_down(node)
        finally:
            monitor.close()

    def _send(self, addr: str, msg) -> None:
        try:
            self._socket(addr).send(m.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self.registry.mark_down(addr, "its control socket is not draining")

    async def _heartbeats(self) -> None:
        seq = 0
        while True:
            seq += 1
            for node in self.registry.nodes():
                self._send(node.address, m.Ping(seq))
            for node in self.registry.sweep():
                if not node.healthy:
                    self._node_down(node)
            planned = time.monotonic() + self.heartbeat_interval
            await asyncio.sleep(self.heartbeat_interval)
            self._excuse(time.monotonic() - planned)

    def _excuse(self, late: float) -> None:
        """The router's own stall (its loop woke `late` seconds late: CPU starved, a long
        callback) does not count as the nodes' silence: pongs it could not read meanwhile wait
        unread, so every heartbeat deadline moves by that much."""
        if late <= 0:
            return
        now = time.monotonic()
        for node in self.registry.nodes():
            if node.last_heartbeat is not None:
                node.last_heartbeat = min(now, node.last_heartbeat + late)

    async def _read_pongs(self, addr: str, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                if len(frames) != 1:
                    raise m.MessageError(f"reply of {len(frames)} frames from {addr}")
                pong = m.decode(frames[0])
                node = self.registry.get(addr)
                if not isinstance(pong, m.Pong) or node is None or pong.role != node.role.value:
                    raise m.MessageError(f"unexpected reply {pong!r} from {addr}")
                s = pong.stats
                load = {name: s.get(key, 0) for name, key in _LOAD.items()}
                block_size = s.get("block_size", 16)
                counts = [*load.values(), block_size]
                if not all(type(v) is int and v >= 0 for v in counts) or block_size < 1:
                    raise m.MessageError(f"load figures from {addr} are not counts: {s!r}")
                self.registry.heartbeat(node.role, addr, load, draining=s.get("draining") is True)
                if pong.kv_addr:
                    self.kv_addr[addr] = pong.kv_addr
                self.block_size[addr] = block_size
            except m.MessageError as e:
                _refuse("control", f"bad heartbeat reply from {addr}: {e}")

    async def _read_events(self) -> None:
        while True:
            messages = [await self.events.recv_multipart()]
            # NOTE: then what else is there already (up to EVENTS_PER_PASS), before a pass of
            # the event loop: read one per pass, a burst of messages (the first tokens of a
            # batch of arrivals, one message each) waited a pass of every request handler and
            # stream each, up to 78 ms (p99 at concurrency 64 on the H100); a router behind
            # by several steps catches up in one write per stream
            while len(messages) < EVENTS_PER_PASS:
                try:
                    messages.append(self.events.recv_multipart(zmq.NOBLOCK).result())
                except zmq.Again:
                    break
            for frames in messages:
                self._on_event(frames)
            await asyncio.sleep(0)

    def _on_event(self, frames) -> None:
        try:
            if len(frames) != 1:
                raise m.MessageError(f"event of {len(frames)} frames")
            streams = m.unpack_streams(m.decode(frames[0]))
        except m.MessageError as e:
            _refuse("events", str(e))
            return
        for msg in streams:
            flight = self.flights.get(msg.req_id)
            if flight is not None:  # else: a request already ended (aborted, failed over)
                if msg.token_ids and not flight.at_decode:
                    flight.at_decode = True
                    FIRST_TOKEN_NODES.observe(time.perf_counter() - flight.sent_at)
                    trace("router_first_read", msg.req_id)
                flight.queue.put_nowait(msg)

    def _node_down(self, node: Node) -> None:
        # NOTE: a request whose first token came is its decode node's, which says what ends it
        # (its prefill node gone before the KV arrived included): a prefill node that drained
        # and left (SIGTERM) after handing it off ends nothing of it
        for flight in list(self.flights.values()):
            if node is flight.decode or (node is flight.prefill and not flight.at_decode):
                flight.queue.put_nowait(m.TokenStream(
                    flight.node_req_id, [], error=f"{node.role.value} node {node.address} is down"))

    # -- requests --------------------------------------------------------------------------------
    def _pick(self, prompt_ids, exclude: tuple[str, ...] = ()) -> tuple[Node, Node]:
        prefill = self.policy.pick_prefill(self.registry.routable(Role.PREFILL), exclude, prompt_ids)
        decode = self.policy.pick_decode(
            [n for n in self.registry.routable(Role.DECODE) if n.address in self.kv_addr], exclude,
            prompt_ids)
        if prefill is None or decode is None:
            h = self.registry.counts()
            raise BackendUnavailable(f"no healthy prefill or decode node ({h['prefill']} prefill, "
                                     f"{h['decode']} decode)")
        return prefill, decode

    def _launch(self, req: GenerateRequest, node_req_id: str, exclude=()) -> Flight:
        prefill, decode = self._pick(req.prompt_ids, exclude)
        flight = Flight(prefill, decode, node_req_id)
        self.flights[node_req_id] = flight
        bs = self.block_size.get(decode.address, 16)
        blocks = -(-(len(req.prompt_ids) + req.params.max_tokens) // bs)
        self.registry.dispatch(prefill, decode, len(req.prompt_ids), blocks)
        flight.blocks = blocks
        trace("router_dispatch", node_req_id)
        self._send(prefill.address, m.PrefillRequest(
            node_req_id, req.prompt_ids, req.params.to_dict(), self.kv_addr[decode.address],
            self.reply_to))
        return flight

    def _end(self, flight: Flight, abort: bool, prompt_len: int) -> None:
        self.flights.pop(flight.node_req_id, None)
        if abort:
            for node in (flight.prefill, flight.decode):
                self._send(node.address, m.Abort(flight.node_req_id, "client"))
        if not flight.got_token:
            self.registry.prefill_done(flight.prefill, prompt_len)
        self.registry.decode_done(flight.decode, flight.blocks)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        flight = self._launch(req, req.req_id)
        finished = failed = False
        retried = False
        asked = req.params.logprobs is not None
        output: list[int] | None = [] if self.policy.learns_outputs else None
        try:
            while True:
                msg: m.TokenStream = await flight.queue.get()
                if msg.error is not None and not flight.got_token and not retried:
                    # NOTE: nothing reached the client yet: try once more on other nodes.
                    log.warning("request %s failed before its first token (%s); retrying",
                                req.req_id, msg.error)
                    retried = True
                    BACKEND_RETRIES.inc()
                    self._end(flight, abort=True, prompt_len=len(req.prompt_ids))
                    try:
                        flight = self._launch(req, f"{req.req_id}-retry", exclude=(
                            flight.prefill.address, flight.decode.address))
                    except BackendUnavailable:
                        finished = True
                        yield TokenEvent([], error=msg.error, first_token_sent=True)
                        return
                    continue
                if msg.token_ids and not flight.got_token:
                    flight.got_token = True
                    self.registry.prefill_done(flight.prefill, len(req.prompt_ids))
                finished = msg.finish_reason is not None or msg.error is not None
                failed = msg.error is not None
                if output is not None:
                    output += msg.token_ids
                    if finished and not failed:
                        self.policy.finished(flight.decode, [*req.prompt_ids, *output])
                yield TokenEvent(
                    list(msg.token_ids),
                    logprobs=list(msg.logprobs) if asked and msg.logprobs is not None else None,
                    top_logprobs=[[tuple(p) for p in top] for top in msg.top_logprobs]
                    if asked and msg.top_logprobs is not None else None,
                    finish_reason=msg.finish_reason, error=msg.error, first_token_sent=True,
                    prompt_logprobs=msg.prompt_logprobs)
                if finished:
                    return
        finally:
            # NOTE: an error may come from one node (or from a node going down); the other may
            # still hold the request's blocks, so it is aborted there too.
            self._end(flight, abort=not finished or failed, prompt_len=len(req.prompt_ids))


def make_backend(args: argparse.Namespace, prefill: list[str], decode: list[str]) -> ZmqBackend:
    """The backend of a router started with `args` (`pd router`'s flags, as `pd launch` and
    each router worker have them) over these nodes."""
    context = ModelConfig.from_dir(args.model).max_context_len
    options = {}
    if args.policy == "cache_aware":
        options = dict(cache_threshold=args.cache_threshold, balance_abs=args.balance_abs_threshold,
                       balance_rel=args.balance_rel_threshold)
    return ZmqBackend(prefill, decode, policy=args.policy, policy_options=options,
                      max_model_len=min(args.max_model_len or context, context),
                      heartbeat_interval=args.heartbeat_interval,
                      heartbeat_timeout=args.heartbeat_timeout)
