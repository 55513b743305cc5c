"""The decode node: takes requests handed over by prefill nodes (`intake.py`: each first token
forwarded to the router at once, the KV installed into its own blocks or written there by the
prefill node), and decodes them in its running batch, streaming every token to the router: each
step's tokens of the requests of one router go in one message, in columns (`TokenStreams`).

An ABORT (router or prefill node) ends the request wherever it is and frees its blocks (after
the step in flight, if one still holds it); so does the loss of the router that asked for it.
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

import logging
import os
import time
from collections import Counter

from decode_node.intake import Intake
from pd.engine.decode_loop import make_decode_loop
from pd.engine.loop_stats import SlowSteps
from pd.engine.engine import Engine
from pd.engine.request import Req, ReqStatus
from pd.service import metrics as node_metrics
from pd.service.flags import default
from pd.service.node import NodeService
from pd.spec.verify import SpecStats
from pd.wire import messages as m
from shm_ipc.receiver import KVReceiver

log = logging.getLogger(__name__)
GAP_LOG_S = 30.0  # how often the step-gap quantiles are logged while decoding


def _columns() -> tuple[list, ...]:
    """Empty `TokenStreams` columns, in its fields' order: req_ids, counts, token_ids,
    num_prompt_tokens, num_output_tokens, ended, logprobs."""
    return [], [], [], [], [], [], []


def _add_stream(cols: tuple[list, ...], req: Req, n: int) -> int:
    """Request `req`'s last n tokens (and their logprobs where asked) into `cols`; returns its
    row. NOTE: per request every step: locals, no property calls."""
    ids, ns, tokens, prompts, outputs, _, logprobs = cols
    i = len(ids)
    ids.append(req.req_id)
    ns.append(n)
    all_ids, prompt_len = req.token_ids, len(req.prompt_token_ids)
    if n == 1:
        tokens.append(all_ids[-1])
    else:
        tokens += all_ids[-n:]
    prompts.append(prompt_len)
    outputs.append(len(all_ids) - prompt_len)
    if req.params.logprobs is not None:
        logprobs.append([i, req.output_logprobs[-n:], [
            [list(p) for p in top] for top in req.output_top_logprobs[-n:]]])
    return i


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
        self.scheduler = engine.scheduler
        self.allocator = engine.allocator
        self.reply_to: dict[str, str] = {}  # running request -> router event endpoint
        self.ready_at: dict[str, float] = {}  # joined, no token decoded yet: when its KV was in
        self.metrics = node_metrics.for_node(self.role, node_id)
        receiver = KVReceiver(f"tcp://{host}:{kv_port}", ctx=self.ctx,
                              pin_rings=engine.runner.device.type == "cuda")
        self.kv_addr = receiver.endpoint
        self.intake = Intake(self, engine, receiver, self.metrics, max_queue=max_queue,
                             kv_timeout=kv_timeout)
        self.register(receiver.socket, self.intake.on_socket)
        if receiver.wake_fd is not None:
            self.register(receiver.wake_fd, self.intake.on_socket)  # the ring's fast wake
        fallback = {"on": True, "off": False}.get(spec_fallback, engine.runner.device.type == "cuda")
        self.loop = make_decode_loop(engine.runner, self.scheduler, overlap,
                                     on_gap=self.metrics.step_gap_seconds.observe, spec=engine.spec,
                                     on_busy=self.metrics.step_device_seconds.observe,
                                     spec_fallback=fallback)
        self.spec_seen = SpecStats()  # MTP counters already exported
        self.last_send = 0.0  # when the last step that emitted sent its tokens
        self.slow = SlowSteps(self.loop.times, os.environ)  # PD_LOG_SLOW_STEPS_MS
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

    # -- decoding ------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.loop.has_work or bool(self.intake.landing)

    def step(self) -> None:
        t = time.perf_counter()
        # requests whose KV copies completed join this step (with nothing to decode, once
        # they have: no empty steps while KV lands)
        self.intake.land(wait=not self.loop.has_work)
        start = self.loop.times.add("intake", t)
        emitted = self.loop.step()
        if self.loop.batch_size:
            self.metrics.batch_size.observe(self.loop.batch_size)
        self.metrics.step_seconds.observe(time.perf_counter() - start)
        self.metrics.generation_tokens.inc(len(emitted))
        self.metrics.count_steps_ahead(self.loop.num_ahead)
        t = time.perf_counter()
        self.send_streams(Counter(emitted) if self.engine.spec is not None  # once per kept token
                          else dict.fromkeys(emitted, 1), t)
        # NOTE: the pace of sends, between steps that both emitted (an idle wait is not one)
        if emitted and self.last_send:
            self.metrics.send_interval_seconds.observe(t - self.last_send)
        self.last_send = t if emitted else 0.0
        self.loop.times.add("stream", t)
        self.intake.may_reserve()
        self.slow.end(log, self.node_id, self.loop.batch_size, self.has_work())
        if self.engine.spec is not None:
            self.spec_seen = self.engine.spec.stats.export(self.metrics, self.spec_seen)
            if self.loop.choice is not None:
                self.metrics.count_spec_plain_steps(self.loop.choice.num_plain_steps)

    def send_streams(self, counts: dict[Req, int], now: float) -> None:
        """A step's tokens, one `TokenStreams` per router: request -> its new tokens' count.
        NOTE: per request every step: locals, no property calls, columns in a tuple."""
        if self.ready_at:
            for req in counts:
                ready = self.ready_at.pop(req.req_id, None)
                if ready is not None:
                    self.metrics.kv_exposed_seconds.observe(now - ready)
        batches: dict[str, tuple] = {}  # router -> this step's columns for it
        reply_tos, finished = self.reply_to, ReqStatus.FINISHED
        for req, n in counts.items():
            req_id = req.req_id
            reply_to = reply_tos.get(req_id)
            if reply_to is None:
                continue
            cols = batches.get(reply_to)
            if cols is None:
                cols = batches[reply_to] = _columns()
            i = _add_stream(cols, req, n)
            if req.status is finished:
                cols[5].append([i, req.finish_reason.value])  # the `ended` column
                del reply_tos[req_id]
        for reply_to, cols in batches.items():
            self.events.send(reply_to, m.TokenStreams(*cols))

    def send_first_tokens(self, batch: dict[str, list[Req]]) -> None:
        """First tokens (the prefill node's), one `TokenStreams` per router."""
        for reply_to, reqs in batch.items():
            cols = _columns()
            for req in reqs:
                _add_stream(cols, req, 1)
            self.events.send(reply_to, m.TokenStreams(*cols))

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
        if req.params.prompt_logprobs is not None and req.num_output_tokens == n:
            extra["prompt_logprobs"] = req.prompt_logprobs  # as the prefill node sent them
        return m.TokenStream(
            req.req_id, req.token_ids[-n:], finish_reason=finish_reason,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens, **extra)

    # -- the intake's owner (`decode_node.intake.IntakeOwner`) -----------------------------------
    def running(self, req_id: str) -> bool:
        return req_id in self.reply_to

    def join(self, req: Req, reply_to: str) -> None:
        self.reply_to[req.req_id] = reply_to
        self.ready_at[req.req_id] = time.perf_counter()
        self.scheduler.add_running(req)

    # -- endings -------------------------------------------------------------------------------
    def abort(self, req_id: str, peer: bytes | None = None) -> None:
        """End the request wherever it is here; `peer` (its prefill node) may end it only while
        it is being handed over."""
        if not self.intake.abort(req_id, peer) and req_id in self.reply_to and peer is None:
            del self.reply_to[req_id]
            self.ready_at.pop(req_id, None)
            req = next((r for r in self.scheduler.running if r.req_id == req_id), None) or \
                next((r for r in self.scheduler.waiting if r.req_id == req_id), None)
            if req is not None:
                self.loop.abort(req)
        self.intake.may_reserve()

    def busy(self) -> bool:
        return bool(self.intake.incoming or self.reply_to)

    def on_router_gone(self, reply_to: str) -> None:
        self.intake.on_router_gone(reply_to)
        for req_id in [r for r, to in self.reply_to.items() if to == reply_to]:
            self.metrics.refused("router_gone").inc()
            log.warning("request %s: its router is gone", req_id)
            self.abort(req_id)

    def tick(self, now: float) -> None:
        self.intake.expire(now)
        mt = self.metrics
        mt.waiting.set(len(self.scheduler.waiting) + len(self.intake.waiting_blocks))
        mt.running.set(len(self.scheduler.running))
        mt.kv_usage.set(self.allocator.usage)
        mt.count_preemptions(self.scheduler.num_preemptions)
        node_metrics.export_prefix_cache(mt, self.engine)
        mt.count_host_seconds(self.loop.times.total)
        if not self.intake.incoming and not self.loop.has_work and self.integrity_due():
            self.allocator.check_integrity()
        if now - self.last_gap_log >= GAP_LOG_S:
            self.last_gap_log = now
            summary = self.loop.take_gap_summary()
            if summary is not None:
                log.info("decode node %s (overlap %s): %s", self.node_id,
                         "on" if self.loop.overlap else "off", summary)

    def stats(self) -> dict:
        return {
            "queue_len": len(self.intake.waiting_blocks) + len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "incoming": len(self.intake.incoming),
            "free_blocks": self.allocator.num_free,
            "total_blocks": self.allocator.num_blocks,
            "block_size": self.engine.config.block_size,
            **self.engine.prefix_stats(),
        }

    def shutdown(self) -> None:
        self.loop.close()
        error = f"decode node {self.node_id} shut down"
        for req_id, reply_to in list(self.reply_to.items()):
            self.events.send(reply_to, m.TokenStream(req_id, [], error=error))
        self.intake.close(error)
        self.engine.runner.close()  # tensor-parallel worker ranks, if any
