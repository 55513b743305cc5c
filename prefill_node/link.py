"""One prefill node's connection to one decode node: the handshake, then the request hand-off.

On creation it connects the KV transport (shm ring on this host, ZMQ frames across hosts) and
sends `Hello` with this node's geometry. Requests submitted before `HelloOk` wait in `pending`;
`HelloRefused` (or no answer within the handshake timeout) fails them with the reason. Once
paired, a request goes out as RequestMeta + FIRST_TOKEN record (+ a DRAFT_TOKENS record with
MTP); its KV follows on `KVAccept`,
closed by `KVDone`. Replies are dispatched back to the node. Transport errors (ring full past its
timeout, peer gone) fail the request and mark the link failed, so the next request reconnects.
A decode node that disconnects (killed, restarted) has lost every request handed to it: they all
fail at once, and the link with them (a restarted node must be greeted again).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import TYPE_CHECKING

import zmq
from zmq.utils.monitor import recv_monitor_message

from pd.wire import messages as m
from shm_ipc.errors import TransportError
from shm_ipc.header import Flag
from shm_ipc.records import AbortRecord, FirstTokenRecord, TokensRecord
from shm_ipc.transport import make_transport

if TYPE_CHECKING:
    from prefill_node.node import Job, PrefillNode

log = logging.getLogger(__name__)
_ids = itertools.count()


class DecodeLink:
    def __init__(self, node: "PrefillNode", addr: str) -> None:
        self.node, self.addr = node, addr
        self.state = "hello_sent"  # -> ready | failed
        self.reason = ""
        self.pending: list[Job] = []
        self.hello_deadline = time.monotonic() + node.handoff_timeout
        instance = f"{node.node_id}-{os.getpid()}-{next(_ids)}"
        self.transport = make_transport(addr, instance, mode=node.transport)
        self.monitor = self.transport.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        node.register(self.transport.socket, self.on_socket)
        node.register(self.monitor, self.on_monitor)
        self.control(m.Hello(node.node_id, node.geometry))
        log.info("connecting to decode node %s over %s", addr, self.transport.mode)

    @property
    def failed(self) -> bool:
        return self.state == "failed"

    def control(self, msg) -> None:
        self.transport.send_control(m.to_dict(msg))

    def submit(self, job: "Job") -> None:
        if self.state == "ready":
            self._send_request(job)
        elif self.state == "hello_sent":
            self.pending.append(job)
        else:
            self.node.fail(job, f"decode node {self.addr} unusable: {self.reason}")

    def _send_request(self, job: "Job") -> None:
        req = job.req
        first = req.output_token_ids[0]
        asked = req.params.logprobs is not None
        try:
            self.control(m.RequestMeta(req.req_id, req.prompt_token_ids, job.msg.params,
                                       job.msg.reply_to, num_blocks=self.num_prompt_blocks(job),
                                       deadline_s=self.node.handoff_timeout))
            self.transport.send_record(FirstTokenRecord(
                req.req_id, first,
                req.output_logprobs[0] if asked else 0.0,
                req.output_ranks[0] if asked else 0,
                list(req.output_top_logprobs[0]) if asked else []))
            if req.spec_token_ids:  # MTP: the first drafts, so D's first step verifies them
                self.transport.send_record(TokensRecord(req.req_id, list(req.spec_token_ids),
                                                        flag=Flag.DRAFT_TOKENS))
            self.node.metrics.first_token_send_seconds.observe(time.monotonic() - job.arrival)
        except TransportError as e:
            self._broken(f"sending to decode node {self.addr} failed: {e}", job)

    def num_prompt_blocks(self, job: "Job") -> int:
        bs = self.node.engine.config.block_size
        return -(-job.req.num_prompt_tokens // bs)

    def send_kv(self, job: "Job") -> int:
        """Send the prompt's KV blocks then KVDone; returns the bytes sent."""
        kv = self.node.engine.runner.kv_cache.kv
        blocks = job.req.block_ids[: self.num_prompt_blocks(job)]
        try:
            num_records = self.transport.send_kv(job.req.req_id, kv, blocks)
            self.control(m.KVDone(job.req.req_id, num_records))
        except TransportError as e:
            self._broken(f"KV transfer to decode node {self.addr} failed: {e}", job)
            return 0
        return kv[:, :, :1].numel() * kv.element_size() * len(blocks)

    def send_abort(self, req_id: str, reason: str) -> None:
        if self.state == "failed":
            return
        try:
            self.transport.send_record(AbortRecord(req_id, reason[:512]))
        except TransportError as e:
            log.warning("could not send abort for %s to %s: %s", req_id, self.addr, e)

    def _broken(self, reason: str, job: "Job | None" = None, everything: bool = False) -> None:
        """Mark the link failed and fail `job` and the pending jobs (`everything`: every job
        handed to this node too)."""
        self.state, self.reason = "failed", reason
        log.error("%s", reason)
        jobs = [job, *self.pending] if job is not None else list(self.pending)
        if everything:
            jobs += [j for j in self.node.jobs.values() if j.link is self]
        for j in jobs:
            if j.state != "done":
                self.node.fail(j, reason)
        self.pending.clear()

    def on_monitor(self) -> None:
        while self.monitor.poll(0):
            if recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED \
                    and self.state != "failed":
                self._broken(f"decode node {self.addr} disconnected", everything=True)

    # -- replies ---------------------------------------------------------------------------------
    def on_socket(self) -> None:
        while True:
            try:
                raw = self.transport.recv_control(0)
            except (ValueError, TransportError) as e:
                self.node.refuse("kv", e)
                continue
            if raw is None:
                return
            try:
                msg = m.from_dict(raw)
            except m.MessageError as e:
                self.node.refuse("kv", e)
                continue
            self._dispatch(msg)

    def _dispatch(self, msg) -> None:
        node = self.node
        if isinstance(msg, m.HelloOk):
            self.state = "ready"
            log.info("paired with decode node %s (%s)", msg.node_id, self.addr)
            pending, self.pending = self.pending, []
            for job in pending:
                if job.state == "handed_off":
                    self._send_request(job)
        elif isinstance(msg, m.HelloRefused):
            self._broken(f"decode node {self.addr} refused to pair: {msg.reason}")
        elif isinstance(msg, m.KVAccept):
            node.on_kv_accept(self, msg.req_id)
        elif isinstance(msg, m.KVAck):
            node.on_kv_ack(self, msg.req_id)
        elif isinstance(msg, m.KVRefuse):
            node.on_kv_refuse(self, msg.req_id, msg.reason)
        else:
            node.refuse("kv", m.MessageError(f"unexpected {type(msg).__name__} from a decode node"))

    def tick(self, now: float) -> None:
        if self.state == "hello_sent" and now > self.hello_deadline:
            self._broken(f"decode node {self.addr} did not answer the handshake")

    def close(self) -> None:
        for sock in (self.transport.socket, self.monitor):
            self.node.poller.unregister(sock)
            self.node.handlers.pop(sock, None)
        self.transport.socket.disable_monitor()
        self.monitor.close()
        self.transport.close()
