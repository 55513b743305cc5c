"""When each part of a request's KV leaves the prefill node (`KVSends`): a long prompt's blocks
in parts as the chunks of its prefill fill them, once its decode node has accepted it (before
each later step; by CUDA IPC on the side stream beside that step, after the event that marks
the steps that computed them), and the rest as its prefill ends: by CUDA IPC queued behind the
last step on its stream when the KVAccept came during the prefill (KVDone then follows
FIRST_TOKEN at once), else when the KVAccept comes. While a step runs, the direct links'
KVAccepts are read as they come (`await_accepts`). A step waits for the parts copied beside the
step before it (their blocks may have been freed and given to it). The bytes go through
`DecodeLink.send_kv`; the job counts what has gone (`kv_sent`, `kv_records`, `kv_chunk`,
`kv_ready`)."""

from __future__ import annotations

import time

import torch

from pd.wire import messages as m
from prefill_node.job import Job, JobState


class KVSends:
    """`jobs`: the node's, by request id (shared, not copied); `block_size`: its cache's;
    `cuda`: whether its model runs on a GPU (events and the in-step wait); `metrics`: its
    metrics (`pd.service.metrics.for_node`)."""

    def __init__(self, jobs: dict[str, Job], block_size: int, cuda: bool, metrics) -> None:
        self.jobs, self.block_size, self.cuda, self.metrics = jobs, block_size, cuda, metrics
        self.sent_bytes = 0  # KV bytes sent, every tier
        self.parts_sent = 0  # parts sent while their prefill ran (`send_parts`)
        self.beside = None  # CUDA: the event of the last part copied beside the step under way

    def write_early(self, batch) -> None:
        """Called inside the step, before the host waits for its tokens: the KV of the requests
        whose prefill it ends, whose decode node named its blocks meanwhile (CUDA IPC), is
        queued behind the step on its stream: written once the first token is known, so
        KVDone follows FIRST_TOKEN at once. While the step runs, KVAccepts that come for the
        batch's other direct requests are taken as they come (`await_accepts`)."""
        waiting = []
        for i, req in enumerate(batch.reqs):
            job = self.jobs.get(req.req_id)
            if (job is None or job.state is not JobState.ANNOUNCED
                    or job.link.peer_cache is None):
                continue
            if job.accept is None:
                waiting.append((job, batch.samples(i)))
            elif batch.samples(i):
                self.write_last(job)
        if waiting and self.cuda:
            self.await_accepts(waiting)

    def write_last(self, job: Job) -> None:
        """Its KV's rest behind the step that ends its prefill (its KVAccept has come)."""
        accept, job.accept = job.accept, None
        self.start(job, accept, early=True)

    def await_accepts(self, waiting: list[tuple[Job, bool]], done=None) -> None:
        """Until the step's work queued so far is done (`done`, an event recorded now unless
        given): read the direct links' replies for the KVAccepts of `waiting` (job, whether the
        step ends its prefill), and write what each accepted one can have now (its last KV
        behind the step, or the part earlier steps filled beside it); other replies wait for
        the step's end."""
        if done is None:
            done = torch.cuda.Event()
            done.record()
        links = {job.link for job, _ in waiting}
        while waiting and not done.query():
            for link in links:
                if not link.failed:
                    link.read_accepts()
            accepted = [(job, last) for job, last in waiting if job.accept is not None]
            if not accepted:
                continue
            waiting = [(job, last) for job, last in waiting if job.accept is None]
            for job, last in accepted:
                if job.state is not JobState.ANNOUNCED:
                    continue
                if last:
                    self.write_last(job)
                else:
                    self.send_part(job)

    def mark_ready(self, batch) -> None:
        """After a step is queued (on CUDA): the event its requests' KV is complete at, for the
        parts `send_part` copies beside the later steps."""
        if not self.cuda:
            return
        ready = torch.cuda.Event()
        ready.record()
        for req in batch.reqs:
            job = self.jobs.get(req.req_id)
            if job is not None:
                job.kv_ready = ready

    def send_parts(self) -> None:
        """Before a step: `send_part` for every request whose prefill goes on. The step waits
        for the parts copied beside the one before it: a block they read may be freed meanwhile
        (a preempted request's) and written by this step."""
        if self.beside is not None:
            torch.cuda.current_stream().wait_event(self.beside)
            self.beside = None
        for job in list(self.jobs.values()):
            self.send_part(job)

    def send_part(self, job: Job) -> None:
        """The KV blocks that finished steps of a prefill still under way have filled go to its
        decode node once it has accepted the request (by CUDA IPC on the side stream, beside
        the steps that follow; records at once on the other tiers)."""
        accept, link = job.accept, job.link
        if job.state is not JobState.ANNOUNCED or accept is None or link.failed:
            return
        upto = min(job.req.num_computed_tokens // self.block_size, link.num_prompt_blocks(job))
        if upto > accept.num_cached_blocks + job.kv_sent:
            nbytes = link.send_kv(job, accept.num_cached_blocks, accept.block_ids, upto=upto)
            self.count(job, nbytes)
            if nbytes:
                self.parts_sent += 1
                self.metrics.kv_parts_sent(link.tier).inc()
                if self.cuda and job.kv_chunk is not None:  # copied on the side stream
                    self.beside = job.kv_chunk

    def start(self, job: Job, accept: m.KVAccept, early: bool = False) -> None:
        """The rest of the job's KV (all of it unless parts went during its prefill)."""
        job.kv_started = time.perf_counter()
        self.count(job, job.link.send_kv(job, accept.num_cached_blocks, accept.block_ids,
                                         early=early))

    def count(self, job: Job, nbytes: int) -> None:
        """Bytes of the job's KV sent (metrics by tier)."""
        job.kv_bytes += nbytes
        self.metrics.kv_sent_bytes(job.link.tier).inc(nbytes)
        self.sent_bytes += nbytes
