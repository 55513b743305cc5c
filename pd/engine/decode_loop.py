"""The decode loop: one step ahead of the device (overlap), or the plain loop.

With overlap, each call of `DecodeLoop.step` does `last = step(last)`: it schedules and launches
step N+1 while step N may still run, then waits for step N's results (its `copy_done`) and
processes them (append, stop checks). Step N+1 is predicted from step N: every request that
sampled in N and is still running gets one more token, whose id the host does not know yet; in
`token_ids` it stands, only while N+1 is scheduled and prepared, as the placeholder `-(j + 1)`:
row j of step N's next tokens, read on the device (future-token slots, see `pd.engine.runner`).
Requests admitted since (a decode node's newly handed-over requests, re-prefills) correct the
prediction: the ordinary scheduler builds the batch, placeholders and all.

A request found finished (stop, length, abort) while a launched step still holds it leaves an
invalid slot (-1) in that step: its result is discarded, and its blocks are freed only after
that step has completed, since the step still reads and writes them.

When the host needs N's tokens before N+1's sampler (a running request with penalties, whose
token sets the sampler builds on the host, or with a grammar, whose matcher walks each token
before the next mask), step N+1's forward is launched ahead all the same and its sampler after
step N is processed (the executors' `sample_deferred`; an executor without it makes the loop
wait for step N first). Greedy grammars checked after sampling (`pd.engine.grammar_steps`) ask
for neither: such a step runs whole and keeps its logits, and its rows to sample under masks
are taken again from them once step N is processed (`resample_late`), a refused token's
position too, from step N's logits. The loop waits for step N before scheduling N+1 when the
batch might preempt (preemption frees blocks that step N still writes). Without overlap, each step is
launched and waited for at once. Both produce the same tokens. With MTP (a
`pd.spec.verify.SpecDecoder` given as `spec`), each step verifies the requests' drafts and
proposes the next ones. A graphed MTP step (`pd.spec.graphs`) whose requests all continue
greedily is followed, with overlap, by the next one before the host reads it: how many tokens a
step keeps is known only on the device, so the next step's inputs are computed there from its
result (`SpecDecoder.launch_chained`), with blocks reserved for the most both steps can take.
Anything else (new requests, sampled rows, prompt chunks, eager steps) waits for the step in
flight. With `spec_fallback` the loop also runs plain steps where they measure faster
(`pd.engine.loop_stats.SpecChoice`, beside what else the loop measures of itself); the MTP
steps' part of the loop is `pd.engine.spec_steps`. A request is emitted once per kept token.
Where a plain step's device work runs is the executor's business (`pd.engine.executor`; MTP
steps run on the current stream); streaming the tokens is the node's.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, NamedTuple

from pd.config import env_flag
from pd.engine.executor import make_executor
from pd.engine.grammar_steps import GrammarSteps
from pd.engine.loop_stats import HostTimes, SpecChoice, StepGaps
from pd.engine.request import FinishReason, Req, ReqStatus
from pd.engine.runner import ForwardOutput, ModelRunner, SampledToken, unpack_sampled
from pd.engine.scheduler import ScheduledBatch, Scheduler
from pd.engine.spec_steps import SpecSteps
from pd.engine.step_inputs import ForwardInput

log = logging.getLogger(__name__)

ENV_DISABLE = "PD_DISABLE_OVERLAP"


def overlap_disabled_by_env(environ) -> bool:
    """PD_DISABLE_OVERLAP: 1/true/yes/on disable the overlap loop; 0/false/no/off or unset don't."""
    return env_flag(environ, ENV_DISABLE, False)


class InFlight(NamedTuple):
    batch: ScheduledBatch
    inp: ForwardInput
    out: ForwardOutput
    rows: list[int]  # batch index of each sampled row; -1: an invalid slot, its result discarded
    members: dict[Req, int]  # each request of the batch -> its sampled row, or -1
    free_after: list[Req]  # finished while in flight: their blocks are freed once this step is done
    # launched late (`grammar_modes`): its logits kept, its requests to sample again under their
    # grammars' masks once launched (`resample_late`); None: not launched late
    late: list[Req] | None
    fixes: list[tuple[int, int]]  # (row of the step before, row here) to sample again (`take_back`)


class DecodeLoop(SpecSteps, GrammarSteps):
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, *, overlap: bool = True,
                 executor=None, on_gap: Callable[[float], None] | None = None,
                 spec=None, spec_fallback: bool = False,
                 on_busy: Callable[[float], None] | None = None) -> None:
        self.runner = runner
        self.spec = spec
        # with MTP: plain steps where they measure faster for the batch size (`SpecChoice`)
        self.choice = SpecChoice() if spec is not None and spec_fallback else None
        self.mtp_mode = True  # the kind of the step in flight / last run
        self.last_done = 0.0  # wall clock of the last processed step, for `choice`
        self.skip_measure = 0  # steps after a switch that `choice` does not measure
        self.scheduler = scheduler
        self.overlap = overlap
        self.executor = executor or make_executor(runner.device, overlap)
        self.max_model_len = runner.max_model_len
        self.last: InFlight | None = None  # the step launched and not yet processed
        self.prev_done: ForwardOutput | None = None  # the last processed step, for its end time
        self.gaps = StepGaps()
        self.busy: deque[float] = deque(maxlen=4096)  # device time of each step, for benchmarks
        self.on_gap, self.on_busy = on_gap, on_busy
        self.num_steps = 0  # steps processed
        self.num_syncs = 0  # overlap steps that had to wait for the previous one first
        self.num_ahead = 0  # steps launched while the previous one was still unprocessed
        self.num_deferred = 0  # of those, steps whose sampler waited for the previous one's tokens
        self.num_taken_back = 0  # tokens a grammar checked after sampling refused (`take_back`)
        self.num_resampled = 0  # rows sampled again under their masks (`resample_late`)
        self.num_fixed = 0  # of those, refused tokens' positions, in the step after (`take_back`)
        self.checking = False  # grammars checked after sampling, not masked (`grammar_modes`)
        self.batch_size = 0  # requests in the step launched last (0: none)
        self.times = HostTimes()

    @property
    def in_flight(self) -> bool:
        return self.last is not None

    @property
    def has_work(self) -> bool:
        return self.last is not None or self.scheduler.has_work

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Launch the next step and process the previous one (or, without overlap, run one step
        to the end). Returns the requests that got a token, in row order; those that finished
        have their finish_reason set."""
        emitted = []
        if self.spec is not None:
            self.settle_late()  # an MTP step may read the step in flight's tokens
            mtp, emitted = self.choose_kind()
            if mtp:
                return emitted + self.spec_step()
        if not self.overlap:
            cur = self.launch(None)
            return emitted + (self.process(cur, None) if cur is not None else self.idle())
        last, defer = self.last, False
        if last is not None:
            blocks, host_tokens = self.can_predict(last)
            if not blocks or (host_tokens and not self.executor.can_defer):
                self.num_syncs += 1
                emitted, last = emitted + self.process(last, None), None
            else:
                defer = host_tokens
        cur = self.launch(last, defer)
        masks = None
        if last is not None:
            # NOTE: step N+1 is already queued behind step N; only now does the host wait for N.
            self.num_ahead += cur is not None
            if cur is not None and cur.late is not None:
                masks = self.runner.late_work(len(cur.inp.sample_reqs))
            elif cur is not None and defer and any(
                    cur.batch.reqs[i].grammar is not None and cur.batch.reqs[i].grammar.masks_now
                    for i in cur.inp.sample_reqs):
                masks = self.runner.mask_buffer(len(cur.inp.sample_reqs))
            emitted += self.process(last, cur, masks)
        if cur is not None and cur.late is not None:
            # NOTE: its late rows are sampled once their masks, filling meanwhile, are done:
            # before the next step is queued (its launch's `before`) or cur is waited for
            self.pending_late = (last, cur, masks)
        elif defer and cur is not None:
            # NOTE: step N's tokens are on the host now (and in the requests' grammars, whose
            # masks for N+1 `process` filled): step N+1's sampler follows its forward, which
            # ran meanwhile
            self.num_deferred += 1
            t = time.perf_counter()
            reqs = [cur.batch.reqs[i] for i in cur.inp.sample_reqs]
            rows = self.runner.sampling_rows(reqs, filled=masks)
            self.executor.sample_deferred(self.runner, cur.out, rows)
            self.times.add("launch", t)
        self.last = cur
        if cur is None:
            self.idle()
        return emitted

    def drain(self) -> list[Req]:
        """Process the step in flight, launching nothing new."""
        last, self.last = self.last, None
        return self.process(last, None) if last is not None else []

    def idle(self) -> list[Req]:
        self.prev_done = None  # the device idles for want of work: that is not a step gap
        return []

    def can_predict(self, last: InFlight) -> tuple[bool, bool]:
        """Whether step N+1 can be scheduled before step N's tokens are on the host (its
        blocks are there without preempting), and whether its sampler needs them there first
        (a request's penalties or grammar): then only its forward can go ahead."""
        need, host_tokens, checking, late = 0, False, self.checking, self.executor.can_defer
        # NOTE: per request every step: locals, no property or method calls (`blocks_needed`)
        members, rows, bs = last.members, last.rows, self.scheduler.block_size
        for req in self.scheduler.running:
            row = members.get(req, -1)
            pending = row >= 0 and rows[row] >= 0
            # NOTE: a grammar checked after sampling needs no token on the host first, nor one
            # whose masked steps a refusal asked for, sampled late (`grammar_modes`)
            if pending and req.params.needs_host_tokens and (
                    req.grammar is None or req.grammar.checked is None or not checking
                    or req.grammar.checked.masked_left > 0 and not late):
                host_tokens = True
            more = -(-(len(req.token_ids) + pending) // bs) - len(req.block_ids)
            if more > 0:
                need += more
        return need <= self.scheduler.allocator.num_free, host_tokens

    def launch(self, last: InFlight | None, defer: bool = False) -> InFlight | None:
        pending = []  # (request, row of `last`) whose newest token is still on the device
        if last is not None:
            for row, i in enumerate(last.rows):
                req = last.batch.reqs[i] if i >= 0 else None
                if req is not None and req.status is ReqStatus.RUNNING:
                    pending.append(req)
                    req.token_ids.append(-(row + 1))
        # a request whose pending token is its last by length sits the next step out
        # NOTE: per request every step: no property calls (`num_output_tokens`, `num_tokens`)
        mml = self.max_model_len
        done = frozenset(r for r in pending if len(r.token_ids) >= mml or len(r.token_ids)
                         - len(r.prompt_token_ids) >= r.params.max_tokens)
        preemptions = self.scheduler.num_preemptions
        try:
            t = time.perf_counter()
            batch = self.scheduler.schedule(done)
            t = self.times.add("schedule", t)
            self.batch_size = len(batch.reqs) if batch is not None else 0
            if batch is None:
                return None
            if last is not None and self.scheduler.num_preemptions != preemptions:
                raise RuntimeError("a step preempted while another was in flight")
            late = self.grammar_modes(batch, last is not None and not defer
                                      and self.executor.can_defer)
            prev = last.out if last else None
            # NOTE: a late step's sampling, once this step's inputs are built, before it is queued
            before = self.settle_late if self.pending_late is not None else None
            if defer:
                inp, out = self.executor.launch(self.runner, batch, prev, defer=True,
                                                before=before)
            elif late is not None:
                inp, out = self.executor.launch(self.runner, batch, prev, late=True,
                                                before=before)
            else:
                inp, out = self.executor.launch(self.runner, batch, prev, before=before)
            self.times.add("launch", t)
        finally:
            for req in pending:
                req.token_ids.pop()
        prefix = self.scheduler.prefix
        for req, n in zip(batch.reqs, batch.num_new_tokens):
            req.num_computed_tokens += n  # computed by the launched step
            if prefix is not None and n > 1:
                # NOTE: a prompt chunk's block hashes, while the device runs the step: its
                # registration after the step then has them (0.6 ms for 8k tokens)
                prefix.hashes(req)
        members = dict.fromkeys(batch.reqs, -1)
        for row, i in enumerate(inp.sample_reqs):
            members[batch.reqs[i]] = row
        return InFlight(batch, inp, out, list(inp.sample_reqs), members, [], late, [])

    def record_busy(self, seconds: float) -> None:
        """A processed step's device time (`busy`, and the node's metric where it gave one)."""
        self.num_steps += 1
        self.busy.append(seconds)
        if self.on_busy is not None:
            self.on_busy(seconds)

    def process(self, f: InFlight, nxt: InFlight | None, masks=None) -> list[Req]:
        """Wait for step f's results and apply them; `nxt` is the step launched after it.
        `masks` (a `ModelRunner.mask_buffer` of nxt's rows, or its `late_work` where nxt was
        launched late): fill there the grammar masks of nxt's sampled rows, which follow f's
        tokens (a deferred sampler's, or its late rows')."""
        if not isinstance(f, InFlight):
            return self.process_spec(f, nxt)
        t = time.perf_counter()
        self.settle_late()  # f's own late rows, where no launch after it settled them
        f.out.copy_done.wait()
        t = self.times.add("wait", t)
        self.record_busy(self.executor.busy_seconds(f.out))
        if self.prev_done is not None:
            gap = self.executor.gap_seconds(self.prev_done, f.out)
            self.gaps.add(gap)
            if self.on_gap is not None:
                self.on_gap(gap)
        self.prev_done = f.out
        emitted = []
        prefix = self.scheduler.prefix
        if prefix is not None:  # prompt chunks that sample nothing yet (hashed at launch)
            prefix.new_step()
            for req, row in f.members.items():
                if row < 0 and req.status is ReqStatus.RUNNING:
                    prefix.register(req)
        if f.inp.rows:
            plain = f.out.logprobs_cpu is None  # no request asked for logprobs
            sampled = self.unpack(f)
            refused, fills = self.walk_grammars(f, sampled if plain else [s[0] for s in sampled],
                                                nxt, masks)
            for row, i in enumerate(f.rows):
                if i < 0:
                    continue  # invalid slot: the request ended after this step was launched
                req = f.batch.reqs[i]
                if refused and req in refused:
                    self.take_back(req, row, f, nxt, fills)
                    continue
                if not plain:
                    req.append_token(*sampled[row])
                elif req.grammar is None:
                    req.token_ids.append(sampled[row])  # `append_token` without its branches
                else:
                    req.append_token(sampled[row])
                emitted.append(req)
                # NOTE: `prompt_block_due`, inlined: a call per request per step is most of
                # its cost, and a prompt block fills rarely
                if prefix is not None:
                    done = req.num_registered_blocks * prefix.block_size
                    if (req.num_computed_tokens >= done + prefix.block_size
                            and done < len(req.prompt_token_ids)):
                        prefix.register(req, bounded=True)
                reason = req.check_stop(self.max_model_len)
                if reason is not None:
                    self.finish(req, reason, nxt)
            if fills:
                self.fill_masks(nxt, fills, masks)
        for req in f.free_after:
            self.scheduler.free_blocks(req)
        self.measure(False, f.batch, len(emitted))
        self.times.add("process", t)
        return emitted

    def unpack(self, f: InFlight) -> list[SampledToken] | list[int]:
        """Step f's sampled tokens by row: their ids alone when no row asked for logprobs."""
        if f.out.logprobs_cpu is None:
            return f.out.next_tokens_cpu.tolist()
        by_index = unpack_sampled(f.out.next_tokens_cpu, f.out.logprobs_cpu,
                                  list(range(len(f.inp.rows))), f.inp.rows)
        return [by_index[row] for row in range(len(f.inp.rows))]

    # -- endings -------------------------------------------------------------------------------
    def finish(self, req: Req, reason: FinishReason, holder: InFlight | None) -> None:
        """End a request; if `holder` (a launched step) holds it, invalidate its slot there and
        free its blocks once that step is done."""
        if holder is None or req not in holder.members:
            self.scheduler.finish(req, reason)
            return
        self.discard_slot(holder, req)
        # NOTE: the launched step still writes this request's KV; its blocks must not be
        # handed to anyone (a KV import on the host) before that step has completed.
        held, req.hold_blocks_on_finish = req.hold_blocks_on_finish, True
        self.scheduler.finish(req, reason)
        req.hold_blocks_on_finish = held
        if not held:
            holder.free_after.append(req)

    @staticmethod
    def discard_slot(step, req: Req) -> None:
        """Make the request's slot in a launched step (`InFlight`, or an MTP step's
        `SpecFlight`), if it has one, an invalid slot: its result is discarded (the request
        ended, or the token that was its input is taken back)."""
        row = step.members.get(req, -1)
        if row >= 0:
            step.rows[row] = -1

    def abort(self, req: Req) -> None:
        """End a request now (the client went away); takes effect within one step."""
        if not req.is_finished:
            self.finish(req, FinishReason.ABORT, self.last)

    def take_gap_summary(self) -> str | None:
        return self.gaps.take_summary()

    def close(self) -> None:
        self.drain()
        self.executor.close()


def make_decode_loop(runner: ModelRunner, scheduler: Scheduler, overlap: bool,
                     on_gap: Callable[[float], None] | None = None, spec=None,
                     spec_fallback: bool = False,
                     on_busy: Callable[[float], None] | None = None) -> DecodeLoop:
    loop = DecodeLoop(runner, scheduler, overlap=overlap, on_gap=on_gap, spec=spec,
                      spec_fallback=spec_fallback, on_busy=on_busy)
    log.info("decode loop: overlap %s (executor %s)", "on" if overlap else "off", loop.executor.name)
    return loop

