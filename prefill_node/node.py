"""The prefill node: takes `PrefillRequest`s from routers, prefills prompts in batches (chunked,
under a token budget), samples each request's first token, and hands the request to the decode
node it names: RequestMeta when its prefill starts (so the decode node reserves blocks while it
runs), FIRST_TOKEN when it ends, the KV once the decode node has reserved blocks (KVAccept: at
once when that came during the prefill), and frees its own blocks when the decode node
acknowledges (KVAck). A request asking for prompt logprobs, or for one token only, is announced
with its first token instead (its RequestMeta carries the prompt logprobs; it may never reach the
decode node).

With MTP (`--num-speculative-tokens k`), the prefill step also runs the MTP layer over the
prompt (its KV is the last cache layer and travels with the target's) and proposes the first k
drafts, sent as a DRAFT_TOKENS record right after FIRST_TOKEN, so the decode node's first step
is already a verify step.

A request that ends with its first token (max_tokens 1, EOS) is answered to the router here and
never reaches a decode node. Every waiting state has a deadline: queued or prefilling
(`--queue-timeout`), handed off but not acknowledged (`--handoff-timeout`); on expiry the
router gets an error, the decode node an Abort, and the blocks are freed. A request whose router
is gone, or whose decode node disconnected, ends the same way. While draining (SIGTERM) new
requests are refused, so the router retries them elsewhere, and those in flight run to their
hand-off. Talking to one decode node (handshake, transport) is `link.py`'s job; when each part
of a request's KV goes, `kv_sends.py`'s; a request's states, `job.py`'s.
"""

from __future__ import annotations

import logging
import os
import time

from pd.engine.engine import Engine
from pd.engine.grammar import GrammarError
from pd.engine.loop_stats import HostTimes, SlowSteps
from pd.engine.request import Req
from pd.service import metrics as node_metrics
from pd.service.flags import default
from pd.service.node import NodeService
from pd.service.trace import trace
from pd.wire import messages as m
from pd.wire.sampling_params import SamplingParams
from prefill_node.job import AT_DECODE, JOB_STATES, PREFILLING, Job, JobState
from prefill_node.kv_sends import KVSends
from prefill_node.link import DecodeLink, prompt_logprobs_wire
from shm_ipc.kv import prepare as prepare_kv_copies

log = logging.getLogger(__name__)


# a step's phases, for a slow step's warning: KV sends (the direct copies done, the parts
# beside the step), scheduling (and announcing), the step on the device, hand-offs
PHASES = ("sends", "schedule", "run", "hand_off")

class PrefillNode(NodeService):
    role = "prefill"

    def __init__(self, node_id: str, engine: Engine, *, host: str, port: int,
                 metrics_port: int | None, transport: str = default("transport", "prefill"),
                 max_queue: int = default("max_queue", "prefill"),
                 queue_timeout: float = default("queue_timeout", "prefill"),
                 handoff_timeout: float = default("handoff_timeout", "prefill"),
                 drain_timeout: float = default("drain_timeout", "prefill"),
                 capture_graphs_tokens: int = default("cuda_graph_prefill_tokens", "prefill")) -> None:
        super().__init__(node_id, host, port, metrics_port, drain_timeout)
        self.engine = engine
        prepare_kv_copies(engine.runner.kv_cache.kv)  # the first transfer compiles nothing
        self.scheduler = engine.scheduler
        self.transport = transport
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.handoff_timeout = handoff_timeout
        self.jobs: dict[str, Job] = {}
        self.links: dict[str, DecodeLink] = {}
        self.geometry = engine.geometry(mtp_enabled=engine.spec is not None)
        self.metrics = node_metrics.for_node(self.role, node_id)
        self.kv_sends = KVSends(self.jobs, engine.config.block_size,
                                engine.runner.device.type == "cuda", self.metrics)
        self.prompt_tokens_computed = 0
        self.times = HostTimes(PHASES)  # for PD_LOG_SLOW_STEPS_MS (`SlowSteps`)
        self.slow = SlowSteps(self.times, os.environ)
        self.capture_graphs(capture_graphs_tokens)

    def capture_graphs(self, max_tokens: int) -> None:
        """On CUDA, capture the prefill graphs of steps of up to `max_tokens` tokens before
        serving: captured on first use instead, each new shape stops the node for ~0.1-0.2 s
        while requests arrive (seen as TTFT p99)."""
        runner = self.engine.runner
        if runner.varlen_graphs is None or max_tokens <= 0:
            return
        start = time.perf_counter()
        log.info("capturing the prefill CUDA graphs of steps up to %d tokens", max_tokens)
        lone = runner.prefill_graphs.capture_up_to(max_tokens)
        several = runner.varlen_graphs.capture_up_to(max_tokens)
        log.info("captured %d prefill and %d varlen prefill CUDA graphs in %.1f s", lone, several,
                 time.perf_counter() - start)

    # -- intake --------------------------------------------------------------------------------
    def on_control(self, identity: bytes, msg) -> None:
        if isinstance(msg, m.PrefillRequest):
            self.admit(msg)
        elif isinstance(msg, m.Abort):
            self.abort(msg.req_id, msg.reason)
        else:
            super().on_control(identity, msg)

    def admit(self, msg: m.PrefillRequest) -> None:
        if self.draining:
            self.metrics.refused("draining").inc()
            self.events.send(msg.reply_to, m.TokenStream(
                msg.req_id, [], error=f"prefill node {self.node_id} is draining (shutting down)"))
            return
        try:
            if msg.req_id in self.jobs:
                raise ValueError(f"duplicate request id {msg.req_id!r}")
            if len(self.jobs) >= self.max_queue:
                raise ValueError(f"prefill node {self.node_id} is full ({self.max_queue} requests)")
            params = SamplingParams.from_dict(msg.params)
            ids = self.engine.validate_prompt(msg.prompt_ids)
            req = Req(msg.req_id, list(msg.prompt_ids), params, prompt_ids_np=ids,
                      eos_token_ids=self.engine.eos_token_ids, hold_blocks_on_finish=True)
            try:
                self.engine.bind_grammar(req)
            except GrammarError as e:  # the client's spec: the router answers 400
                raise ValueError(f"{m.INVALID_PREFIX}: structured output: {e}") from None
            self.scheduler.add(req)
        except (ValueError, TypeError) as e:
            self.metrics.refused("bad_request").inc()
            log.warning("refused request %s: %s", msg.req_id, e)
            self.events.send(msg.reply_to, m.TokenStream(msg.req_id, [], error=str(e)))
            return
        self.jobs[msg.req_id] = Job(msg, req, time.monotonic() + self.queue_timeout)
        trace("prefill_admit", msg.req_id)

    # -- the step --------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work or any(link.writes for link in self.links.values())

    def step(self) -> None:
        t = time.perf_counter()
        for link in self.links.values():
            link.finish_writes()  # KVDone for the direct KV copies done
        t = self.times.add("sends", t)
        batch = self.scheduler.schedule()
        if batch is None:
            return
        self.announce(batch)
        t = self.times.add("schedule", t)
        self.kv_sends.send_parts()
        start = self.times.add("sends", t)
        spec = self.engine.spec
        sampled = (spec.run(batch) if spec is not None
                   else self.engine.runner.run(batch, lambda: self.kv_sends.write_early(batch)))
        t = self.times.add("run", start)
        self.kv_sends.mark_ready(batch)
        self.metrics.prompt_tokens.inc(batch.num_tokens)
        self.prompt_tokens_computed += batch.num_tokens
        self.metrics.step_seconds.observe(time.perf_counter() - start)
        self.metrics.batch_size.observe(len(batch.reqs))
        node_metrics.export_prefix_cache(self.metrics, self.engine)
        if spec is not None:  # the first token, and the MTP layer's first drafts
            self.scheduler.update_spec(batch, sampled)
        else:
            self.scheduler.update(batch, sampled)
        for i in sampled:
            req = batch.reqs[i]
            job = self.jobs.get(req.req_id)
            if job is None:
                continue
            if req.is_finished:  # ended with its first token: answer here
                self.finish_here(job)
            else:
                self.scheduler.detach(req)
                self.hand_off(job)
        for link in list(self.links.values()):
            if link.deferred:  # replies read during the step
                link.on_socket()
        self.times.add("hand_off", t)
        self.may_check_integrity()
        self.slow.end(log, self.node_id, len(batch.reqs), self.has_work(), role="prefill")

    def announce(self, batch) -> None:
        """RequestMeta for the batch's requests whose decode node does not know of them yet: it
        reserves their blocks while this step runs."""
        for req in batch.reqs:
            job = self.jobs.get(req.req_id)
            if (job is not None and job.state is JobState.QUEUED
                    and req.params.prompt_logprobs is None and req.params.max_tokens > 1):
                JOB_STATES.move(job, JobState.ANNOUNCED)
                job.link = self.link_for(job)
                job.link.announce(job)

    def finish_here(self, job: Job) -> None:
        req = job.req
        if job.state is JobState.ANNOUNCED:  # the decode node drops it and frees its blocks
            job.link.send_abort(req.req_id, "ended at the prefill node")
        self.events.send(job.msg.reply_to, m.TokenStream(
            req.req_id, req.output_token_ids, **first_token_logprobs(req),
            finish_reason=req.finish_reason.value,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens))
        self.metrics.first_token_send_seconds.observe(time.monotonic() - job.arrival)
        self.release(job)

    def hand_off(self, job: Job) -> None:
        """The prefill is done: FIRST_TOKEN (after RequestMeta, unless announced), and the KV at
        once when the decode node accepted it meanwhile."""
        if job.state is JobState.QUEUED:
            job.link = self.link_for(job)
        JOB_STATES.move(job, JobState.HANDED_OFF)
        job.deadline = time.monotonic() + self.handoff_timeout
        job.link.submit(job)
        accept, job.accept = job.accept, None
        if job.state is not JobState.HANDED_OFF:  # the link failed
            return
        if job.kv_started:  # written by its step (`KVSends.write_early`): KVDone now
            JOB_STATES.move(job, JobState.KV_SENT)
            job.link.finish_writes()
        elif accept is not None:
            self.on_kv_accept(job.link, accept)

    def link_for(self, job: Job) -> DecodeLink:
        """The link to the job's decode node (a new one after a failed one)."""
        link = self.links.get(job.msg.decode_addr)
        if link is None or link.failed:
            if link is not None:
                link.close()
            link = DecodeLink(self, job.msg.decode_addr, kv=self.engine.runner.kv_cache.kv,
                              block_size=self.engine.config.block_size,
                              handoff_timeout=self.handoff_timeout, transport=self.transport,
                              tp=self.engine.runner.mirror)
            self.links[job.msg.decode_addr] = link
        return link

    # -- hand-off events (raised by DecodeLink, see prefill_node.link.LinkOwner) ---------------
    def on_first_token_sent(self, job: Job) -> None:
        self.metrics.first_token_send_seconds.observe(time.monotonic() - job.arrival)
        trace("prefill_first_sent", job.req.req_id)

    def on_link_broken(self, link: DecodeLink, reason: str, jobs: list[Job] | None) -> None:
        if jobs is None:
            jobs = [j for j in self.jobs.values() if j.link is link]
        for job in jobs:
            if job.state is not JobState.DONE:
                self.fail(job, reason)

    def on_kv_accept(self, link: DecodeLink, msg: m.KVAccept) -> None:
        job = self.jobs.get(msg.req_id)
        if job is not None and job.state is JobState.ANNOUNCED and job.link is link \
                and job.accept is None:
            job.accept = msg  # used once its prefill is done (`hand_off`)
            return
        if job is None or job.state is not JobState.HANDED_OFF or job.link is not link:
            log.warning("KVAccept for %s, which is not waiting for one here", msg.req_id)
            if msg.block_ids is not None:
                link.release(msg.req_id)  # the decode node holds those blocks until told
            return
        JOB_STATES.move(job, JobState.KV_SENT)
        self.kv_sends.start(job, msg)

    def on_kv_ack(self, link: DecodeLink, req_id: str) -> None:
        job = self.jobs.get(req_id)
        if job is None or job.link is not link or job.state is not JobState.KV_SENT:
            log.warning("KVAck for %s, which has no KV in flight to that node", req_id)
            return
        self.metrics.kv_transfer_seconds(link.tier).observe(time.perf_counter() - job.kv_started)
        self.metrics.kv_transfer_bytes(link.tier).observe(job.kv_bytes)
        self.release(job)

    def on_kv_refuse(self, link: DecodeLink, req_id: str, reason: str) -> None:
        job = self.jobs.get(req_id)
        if job is not None and job.link is link:
            # NOTE: the decode node has told the router; only the blocks are ours to free.
            log.warning("decode node %s refused %s: %s", link.addr, req_id, reason)
            self.release(job)

    def fail(self, job: Job, error: str) -> None:
        """End a request with an error to the router, wherever it is."""
        log.warning("request %s failed: %s", job.req.req_id, error)
        self.metrics.refused("failed").inc()
        self.events.send(job.msg.reply_to, m.TokenStream(job.req.req_id, [], error=error))
        if job.state in AT_DECODE and job.link is not None:
            job.link.send_abort(job.req.req_id, error)
        self.release(job)

    # -- endings ---------------------------------------------------------------------------------
    def release(self, job: Job) -> None:
        """Forget the job and free its blocks (an ANNOUNCED one's decode node has been sent an
        ABORT; blocks it named for a direct write are released after it)."""
        self.jobs.pop(job.req.req_id, None)
        if job.state in PREFILLING:
            self.scheduler.abort(job.req)
        if job.accept is not None and job.accept.block_ids is not None:
            job.link.release(job.req.req_id, written=job.kv_chunk)
        if job.link is not None:
            job.link.withdraw(job)
        self.scheduler.free_blocks(job.req)
        JOB_STATES.move(job, JobState.DONE)

    def abort(self, req_id: str, reason: str) -> None:
        job = self.jobs.get(req_id)
        if job is None:
            return
        if job.state in AT_DECODE and job.link is not None:
            job.link.send_abort(req_id, reason)
        self.release(job)

    def tick(self, now: float) -> None:
        for job in [j for j in self.jobs.values() if now > j.deadline]:
            where = {JobState.QUEUED: "queued at the prefill node",
                     JobState.ANNOUNCED: "queued at the prefill node",
                     JobState.HANDED_OFF: f"waiting for decode node {job.msg.decode_addr} to accept",
                     JobState.KV_SENT: f"KV in flight to decode node {job.msg.decode_addr}"}[job.state]
            self.fail(job, f"{m.TIMEOUT_PREFIX} {where}")
        for addr, link in list(self.links.items()):
            link.tick(now)
            if link.failed and not any(j.link is link for j in self.jobs.values()):
                link.close()  # NOTE: its ring goes now; the next request to addr reconnects
                del self.links[addr]
        self.update_gauges()

    def busy(self) -> bool:
        return bool(self.jobs)

    def on_router_gone(self, reply_to: str) -> None:
        for job in [j for j in self.jobs.values() if j.msg.reply_to == reply_to]:
            self.metrics.refused("router_gone").inc()
            log.warning("request %s: its router is gone", job.req.req_id)
            self.abort(job.req.req_id, "router gone")

    def update_gauges(self) -> None:
        mt = self.metrics
        mt.waiting.set(len(self.scheduler.waiting))
        mt.running.set(len(self.scheduler.running))
        mt.kv_usage.set(self.engine.allocator.usage)
        mt.transfers_waiting.set(sum(j.state not in PREFILLING for j in self.jobs.values()))
        mt.count_preemptions(self.scheduler.num_preemptions)
        node_metrics.export_prefix_cache(mt, self.engine)

    def may_check_integrity(self) -> None:
        if not self.jobs and not self.scheduler.has_work and self.integrity_due():
            self.engine.allocator.check_integrity()

    def stats(self) -> dict:
        alloc = self.engine.allocator
        return {
            "queue_len": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "handing_off": sum(j.state not in PREFILLING for j in self.jobs.values()),
            "outstanding_prefill_tokens": sum(
                j.req.num_tokens - j.req.num_computed_tokens for j in self.jobs.values()
                if j.state in PREFILLING),
            "free_blocks": alloc.num_free,
            "total_blocks": alloc.num_blocks,
            "block_size": self.engine.config.block_size,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "kv_sent_bytes": self.kv_sends.sent_bytes,
            "kv_parts_sent": self.kv_sends.parts_sent,
            **self.engine.prefix_stats(),
        }

    def shutdown(self) -> None:
        for job in list(self.jobs.values()):
            self.fail(job, f"prefill node {self.node_id} shut down")
        for link in self.links.values():
            link.close()
        self.engine.runner.close()  # tensor-parallel worker ranks, if any


def first_token_logprobs(req: Req) -> dict:
    """The logprobs a request's first TokenStream carries: its token's, and its prompt's when
    asked."""
    out = {}
    if req.params.logprobs is not None:
        out = {"logprobs": list(req.output_logprobs),
               "top_logprobs": [[list(p) for p in top] for top in req.output_top_logprobs]}
    if req.params.prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs_wire(req)
    return out

