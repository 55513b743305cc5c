"""The decode loop's MTP steps (`SpecSteps`, a mix-in of `pd.engine.decode_loop.DecodeLoop`): a
step launched from the host or, with overlap, chained on the device after the step in flight
(`spec_step`, `reserve_chain`: `pd.spec.graphed`), its results applied (`process_spec`), and with
`spec_fallback` the choice of MTP or plain steps for the batch size (`choose_kind`, `measure`).
"""

from __future__ import annotations

import time

from pd.engine.request import Req, ReqStatus
from pd.engine.scheduler import ScheduledBatch


class SpecSteps:
    """`DecodeLoop`'s MTP steps (a mix-in: it reads the loop's `spec`, `scheduler`, `overlap`,
    `last`, `choice`, `times` and step figures, and calls its `process`, `finish`, `drain`,
    `idle` and `record_busy`)."""

    def choose_kind(self) -> tuple[bool, list[Req]]:
        """MTP (True) or plain for the next step, and the tokens of the step a switch drained
        (a switch waits for the step in flight). Plain steps drop the requests' drafts; the MTP
        layer's KV of their positions is not written, so later drafts may be accepted less
        often, never wrongly."""
        if self.choice is None:
            return True, []
        mtp = self.choice.use_mtp(max(1, len(self.scheduler.running)))
        drained = []
        if mtp != self.mtp_mode:
            drained = self.drain()
            self.last_done, self.skip_measure = 0.0, 2
            self.prev_done = None  # no step gap across kinds
            self.mtp_mode = mtp
        if not mtp:  # requests handed over since carry drafts too
            for req in (*self.scheduler.running, *self.scheduler.waiting):
                req.spec_token_ids = []
        return mtp, drained

    def measure(self, mtp: bool, batch: ScheduledBatch | None, tokens: int) -> None:
        """Feed `choice` the wall time since the previous processed step, for steps of decode
        rows only (`batch` None: a step not to measure, such as an eager MTP step with prompt
        chunks), and not the first two after a switch (the drafts refill)."""
        if self.choice is None:
            return
        now = time.perf_counter()
        decode = batch is not None and all(r.num_output_tokens > 1 for r in batch.reqs)
        if decode and self.last_done and self.skip_measure <= 0:
            self.choice.record(len(batch.reqs), mtp, now - self.last_done, tokens)
        self.skip_measure -= 1
        self.last_done = now if decode else 0.0

    def spec_step(self) -> list[Req]:
        """One MTP step: verify, keep, stop, draft. With overlap, a graphed step whose slots all
        continue is followed by the next one, computed on the device from its result
        (`SpecDecoder.launch_chained`), before the host reads it; anything else (new requests,
        sampling that needs the host, prefill slots, a batch too big for the graphs) waits for
        the step in flight, then schedules as usual."""
        last, emitted = self.last, []
        if last is not None and not (self.overlap and self.reserve_chain(last)):
            self.num_syncs += self.overlap
            emitted, last = self.process(last, None), None
        if last is not None:
            t = time.perf_counter()
            cur = self.spec.launch_chained(last)
            self.times.add("launch", t)
            self.num_ahead += 1
            emitted += self.process(last, cur)
        else:
            t = time.perf_counter()
            batch = self.scheduler.schedule()
            t = self.times.add("schedule", t)
            self.batch_size = len(batch.reqs) if batch is not None else 0
            if batch is None:
                self.last = None
                return emitted + self.idle()
            key = self.spec.graph_key(batch)
            if key is None:  # eager: run to the end
                results = self.spec.run(batch)
                self.scheduler.update_spec(batch, results)
                self.times.add("launch", t)
                self.last = None
                done = [batch.reqs[i] for i, res in sorted(results.items()) for _ in res.token_ids]
                self.measure(True, None, len(done))
                return emitted + done
            cur = self.spec.launch_graphed(batch, key)
            self.times.add("launch", t)
        if not self.overlap:
            emitted += self.process(cur, None)
            cur = None
        self.last = cur
        return emitted

    def reserve_chain(self, last) -> bool:
        """Whether the step after `last` can be launched before `last` is read, reserving its
        blocks if so: same requests, all running and greedy without processing, nothing
        waiting, within the token budget, blocks for `last`'s k + 1 tokens plus this step's
        1 + k rows and k - 1 chained draft positions, and the same graph."""
        spec, sched = self.spec, self.scheduler
        if not last.chainable or sched.waiting:
            return False
        rows = last.rows
        live = [r for r, b in last.members.items() if rows[b] >= 0]
        if not live or len(live) != len(sched.running):
            return False
        if len(last.batch.reqs) * (spec.k + 1) > sched.max_num_batched_tokens:
            return False
        horizon = 3 * spec.k + 1  # past num_tokens - 1: k + 1 kept, then 1 + k rows and k - 1 chained
        # NOTE: per request every step: one pass, no property or method calls (`blocks_needed`)
        bs, running, need, total = sched.block_size, ReqStatus.RUNNING, [], 0
        for r in live:
            if r.status is not running:
                return False
            n = -(-(len(r.token_ids) + horizon) // bs) - len(r.block_ids)
            if n > 0:
                need.append((r, n))
                total += n
        if total > sched.allocator.num_free:
            return False
        for r, n in need:
            r.block_ids += sched.allocator.allocate(n)
        width = max(len(r.block_ids) for r in last.batch.reqs)
        return spec.graphs.key(len(last.batch.reqs), width) == last.key

    def process_spec(self, f, nxt) -> list[Req]:
        """Apply a graphed MTP step's results (`pd.spec.graphed.SpecFlight`)."""
        t = time.perf_counter()
        if f.end is not None:
            f.end.synchronize()
        t = self.times.add("wait", t)
        results = self.spec.collect(f)
        if f.start is not None:
            self.record_busy(f.start.elapsed_time(f.end) / 1000.0)
            if self.prev_done is not None:
                gap = max(0.0, self.prev_done.elapsed_time(f.start) / 1000.0)
                self.gaps.add(gap)
                if self.on_gap is not None:
                    self.on_gap(gap)
            self.prev_done = f.end
        self.scheduler.update_spec(f.batch, results,
                                   finish=lambda req, reason: self.finish(req, reason, nxt))
        for req in f.free_after:
            self.scheduler.free_blocks(req)
        emitted = [f.batch.reqs[i] for i, res in sorted(results.items()) for _ in res.token_ids]
        self.measure(True, f.batch, len(emitted))
        self.times.add("process", t)
        return emitted
