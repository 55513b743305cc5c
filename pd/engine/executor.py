"""Where a step's device work runs, and how the host learns it is done: one strategy per device.

- `CudaExecutor`: a dedicated compute stream; each step records a start event, enqueues the
  forward, the sampler and the non-blocking copies into pinned host buffers, then an end event
  (the step's `copy_done`). Launching never waits for the device. A step whose sampler needs
  the host to know the previous step's tokens first (grammars, penalties) can be launched in
  two parts (`can_defer`): the forward now, the sampler (`sample_deferred`) once the loop has
  read the previous step, while the forward runs. A step launched `late` runs whole and keeps
  its logits, and some of its rows are sampled again (`resample`, under grammar masks the loop
  fills meanwhile) before its end. `ThreadExecutor` splits such steps the same way on its
  worker.
- `ThreadExecutor` (CPU, overlap on): the device part runs on one worker thread, in launch
  order, like a stream; torch releases the GIL inside its ops, so the host schedules and
  streams while the worker computes. `copy_done` is the worker's future.
- `InlineExecutor` (CPU, overlap off): the device part runs on the caller's thread at launch.

Each completion also carries when the step started and ended on the device (CUDA events, or
the worker's wall clock), from which `gap_seconds` gives the device's idle time between two
steps. Building the step (`ModelRunner.prepare`) and what is done with its results is the
loop's business (`pd.engine.decode_loop`).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pd.engine.host_ring import EventRing
from pd.engine.runner import ForwardOutput, ModelRunner
from pd.engine.step_inputs import ForwardInput
from pd.engine.scheduler import ScheduledBatch


class HostCompletion:
    """A step run on the host (worker thread or inline), with its wall-clock start and end."""

    def __init__(self) -> None:
        self.future: Future = Future()
        self.started = self.ended = 0.0
        # a deferred sampling's forward, or a late step's kept logits (`ThreadExecutor`)
        self.logits: Future | None = None

    def run_part(self, fn, *args):
        """The first part of a step run in two (its start is the step's): fn's result."""
        self.started = time.perf_counter()
        return fn(*args)

    def run(self, fn, *args) -> None:
        self.started = self.started or time.perf_counter()
        try:
            fn(*args)
        except BaseException as e:  # surfaced by wait() on the loop's thread
            self.ended = time.perf_counter()
            self.future.set_exception(e)
        else:
            self.ended = time.perf_counter()
            self.future.set_result(None)

    def wait(self) -> None:
        self.future.result()

    def done(self) -> bool:
        return self.future.done()


class CudaCompletion:
    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event, logits=None) -> None:
        self.start, self.end = start, end
        # a deferred sampling's input, or a late step's kept logits (`CudaExecutor.launch`)
        self.logits = logits

    def wait(self) -> None:
        self.end.synchronize()

    def done(self) -> bool:
        return self.end.query()


class InlineExecutor:
    """Runs the step on the caller's thread: the plain loop on CPU."""

    name = "inline"
    can_defer = False  # the sampler runs with the forward (`CudaExecutor.sample_deferred`)

    def launch(self, runner: ModelRunner, batch: ScheduledBatch, prev: ForwardOutput | None,
               before=None) -> tuple[ForwardInput, ForwardOutput]:
        inp = runner.prepare(batch)
        bufs = runner.alloc_output(inp)
        if before is not None:
            before()
        done = HostCompletion()
        done.run(runner.execute, inp, prev.next_tokens_gpu if prev else None, *bufs)
        return inp, ForwardOutput(*bufs, done)

    @staticmethod
    def gap_seconds(prev: ForwardOutput, cur: ForwardOutput) -> float:
        return max(0.0, cur.copy_done.started - prev.copy_done.ended)

    @staticmethod
    def busy_seconds(out: ForwardOutput) -> float:
        return out.copy_done.ended - out.copy_done.started

    def close(self) -> None:
        pass


class ThreadExecutor(InlineExecutor):
    """Runs each step on one worker thread, in launch order (the CPU's stream)."""

    name = "thread"
    can_defer = True

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-device")

    def launch(self, runner: ModelRunner, batch: ScheduledBatch, prev: ForwardOutput | None,
               defer: bool = False, late: bool = False, before=None
               ) -> tuple[ForwardInput, ForwardOutput]:
        inp = runner.prepare(batch, masks=not defer)
        bufs = runner.alloc_output(inp)
        if before is not None:  # work queued for the worker before this step (`CudaExecutor`)
            before()
        done = HostCompletion()
        prev_tokens = prev.next_tokens_gpu if prev else None
        # NOTE: the worker runs steps in submission order, so step N+1 reads step N's
        # next_tokens (its future ids) only after step N wrote them.
        if defer:  # the forward now; `sample_deferred` queues the rest
            done.logits = self.pool.submit(done.run_part, runner.forward_rows, inp, prev_tokens)
        elif late:  # the step now, its logits kept; `resample` queues the rest
            done.logits = self.pool.submit(done.run_part, runner.execute, inp, prev_tokens,
                                           *bufs, True)
        else:
            self.pool.submit(done.run, runner.execute, inp, prev_tokens, *bufs)
        return inp, ForwardOutput(*bufs, done)

    def sample_deferred(self, runner: ModelRunner, out: ForwardOutput, rows: list) -> None:
        done = out.copy_done
        part, done.logits = done.logits, None

        def finish() -> None:
            sampled = runner.sample_rows(part.result(), rows)
            runner.emit(sampled, out.next_tokens_gpu, out.next_tokens_cpu, out.logprobs_cpu)

        self.pool.submit(done.run, finish)

    def resample(self, runner: ModelRunner, out: ForwardOutput, prev: ForwardOutput | None,
                 work, num: int) -> None:
        """Rows of a step launched `late` taken again under their masks (the first `num` rows
        of work of a `LateWork`), from its logits or those of `prev` (the step before, launched
        late) (`ModelRunner.resample`), then its end."""
        done = out.copy_done

        def finish() -> None:
            runner.resample(work, num, done.logits.result(),
                            prev.copy_done.logits.result() if prev is not None else None,
                            out.next_tokens_gpu, out.next_tokens_cpu)

        self.pool.submit(done.run, finish)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class CudaExecutor:
    """A dedicated compute stream; events bracket each step."""

    name = "cuda"
    can_defer = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        # NOTE: the loop's thread's stream, where the node installs KV; it never changes
        # (looked up once: `current_stream` costs a step ~5 us on the H100 host)
        self.node_stream = torch.cuda.current_stream(device)
        self.installed = torch.cuda.Event()  # recorded there before each step (`launch`)
        self.events = EventRing()

    def launch(self, runner: ModelRunner, batch: ScheduledBatch, prev: ForwardOutput | None,
               defer: bool = False, late: bool = False, before=None
               ) -> tuple[ForwardInput, ForwardOutput]:
        """Enqueue the step; with `defer` only up to its rows' logits, and its rows without
        their grammars' masks: `sample_deferred` enqueues the rest; with `late` all of it, its
        logits kept for `resample`. `before()` runs once the step's inputs are built, before
        its device work is queued (work it queues on the compute stream goes first)."""
        start, end = self.events.take(), self.events.take()
        # NOTE: KV installed by the node (on the current stream) must land before a step that
        # reads it; the compute stream waits for what is queued there, without a host wait.
        self.installed.record(self.node_stream)
        self.stream.wait_event(self.installed)
        # NOTE: the stream switched by hand: `with torch.cuda.stream(...)` cost 18 us of host
        # per step on the H100 machine, two `set_stream` 3
        torch.cuda.set_stream(self.stream)
        try:
            if before is None:
                start.record(self.stream)
            inp = runner.prepare(batch, masks=not defer)  # pinned, non-blocking copies
            bufs = runner.alloc_output(inp)
            if before is not None:  # its work (the step before's) is not this step's
                before()
                torch.cuda.set_stream(self.stream)  # `resample` leaves the node's stream current
                start.record(self.stream)
            prev_tokens = prev.next_tokens_gpu if prev else None
            if defer:
                logits = runner.forward_rows(inp, prev_tokens)
                return inp, ForwardOutput(*bufs, CudaCompletion(start, end, logits))
            logits = runner.execute(inp, prev_tokens, *bufs, late)
            end.record(self.stream)  # after the host copies: waiting on it means the results are there
        finally:
            torch.cuda.set_stream(self.node_stream)
        return inp, ForwardOutput(*bufs, CudaCompletion(start, end, logits))

    def sample_deferred(self, runner: ModelRunner, out: ForwardOutput, rows: list) -> None:
        """The sampler of a step launched with `defer`, over `rows` built now, then its end."""
        done = out.copy_done
        torch.cuda.set_stream(self.stream)
        try:
            logits, done.logits = done.logits, None
            sampled = runner.sample_rows(logits, rows)
            runner.emit(sampled, out.next_tokens_gpu, out.next_tokens_cpu, out.logprobs_cpu)
            done.end.record(self.stream)
        finally:
            torch.cuda.set_stream(self.node_stream)

    def resample(self, runner: ModelRunner, out: ForwardOutput, prev: ForwardOutput | None,
                 work, num: int) -> None:
        """Rows of a step launched `late` taken again under their masks (the first `num` rows
        of work of a `LateWork`), from its logits or those of `prev` (the step before, launched
        late) (`ModelRunner.resample`); its end is recorded again after them (and after the
        tokens' new copy to the host)."""
        done = out.copy_done
        torch.cuda.set_stream(self.stream)
        try:
            runner.resample(work, num, done.logits,
                            prev.copy_done.logits if prev is not None else None,
                            out.next_tokens_gpu, out.next_tokens_cpu)
            done.end.record(self.stream)
        finally:
            torch.cuda.set_stream(self.node_stream)

    @staticmethod
    def gap_seconds(prev: ForwardOutput, cur: ForwardOutput) -> float:
        return max(0.0, prev.copy_done.end.elapsed_time(cur.copy_done.start) / 1000.0)

    @staticmethod
    def busy_seconds(out: ForwardOutput) -> float:
        """From the step's start event to its end event (includes waits for its launches)."""
        return out.copy_done.start.elapsed_time(out.copy_done.end) / 1000.0

    def close(self) -> None:
        self.stream.synchronize()


def make_executor(device: torch.device, overlap: bool):
    """The one place the device strategy is picked."""
    if device.type == "cuda":
        return CudaExecutor(device)
    return ThreadExecutor() if overlap else InlineExecutor()
