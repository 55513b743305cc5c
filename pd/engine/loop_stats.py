"""What the decode loop measures of itself, and the choice it makes from it: the device's idle
gaps between steps (`StepGaps`, for the log line), the host's time by phase (`HostTimes`, the
`pd_decode_host_seconds_total` metric), and whether MTP or plain steps serve a batch size
faster (`SpecChoice`, with `--spec-fallback`). `pd.engine.decode_loop` keeps them up to date.
"""

from __future__ import annotations

import time
from collections import deque


class StepGaps:
    """The device's idle time between consecutive steps: a bounded window for the log line."""

    def __init__(self, window: int = 4096) -> None:
        self.window: deque[float] = deque(maxlen=window)
        self.count = 0

    def add(self, seconds: float) -> None:
        self.window.append(seconds)
        self.count += 1

    def quantile(self, q: float) -> float:
        xs = sorted(self.window)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0

    def take_summary(self) -> str | None:
        """'N steps, step gap p50 X us p99 Y us' over the window, then start a new window."""
        if not self.window:
            return None
        text = (f"{len(self.window)} step gaps: p50 {self.quantile(0.5) * 1e6:.0f} us, "
                f"p99 {self.quantile(0.99) * 1e6:.0f} us")
        self.window.clear()
        return text


class HostTimes:
    """Host seconds spent in each phase of the decode loop since it started: `schedule` (the
    scheduler builds the batch), `launch` (inputs built and copied, the device work queued),
    `wait` (for a step's results), `process` (tokens appended, stop checks); the node adds
    `intake` (requests and KV arriving) and `stream` (tokens sent to routers). A prefill
    node names its own (`prefill_node.node.PHASES`). Set with `t = times.add(phase, t)`, which
    returns now for the next phase."""

    PHASES = ("schedule", "launch", "wait", "process", "intake", "stream")

    def __init__(self, phases: tuple[str, ...] = PHASES) -> None:
        self.total = dict.fromkeys(phases, 0.0)

    def add(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.total[phase] += now - since
        return now


class SlowSteps:
    """A warning for each turn of a node's loop (from the end of one step to the end of the
    next: the sockets' poll and handlers, then the step) longer than `threshold_ms` (env
    PD_LOG_SLOW_STEPS_MS; unset: off), with where its time went by `HostTimes` phase, the rest
    being the loop's own ("loop": polls, handlers, timers): what names the source of a stall
    that every stream sees (a decode node), or that holds arriving requests unread (a prefill
    node)."""

    ENV = "PD_LOG_SLOW_STEPS_MS"

    def __init__(self, times: HostTimes, environ) -> None:
        value = environ.get(self.ENV, "").strip()
        self.threshold = float(value) / 1e3 if value else None
        self.times = times
        self.ended = 0.0
        self.before = dict(times.total)
        self.more = False  # the last step left work: this turn is timed

    def end(self, log, node_id: str, batch_size: int, more: bool, role: str = "decode") -> None:
        """A step just ended; `more`: the loop has work left (it comes straight back, so the
        next turn is timed; not after an idle wait)."""
        if self.threshold is None:
            return
        now = time.perf_counter()
        took, self.ended = now - self.ended, now
        total = self.times.total
        if self.more and took > self.threshold:
            phases = {k: total[k] - self.before[k] for k in total}
            phases["loop"] = took - sum(phases.values())
            log.warning("%s node %s: slow step, %.1f ms at batch %d: %s", role, node_id,
                        took * 1e3, batch_size, ", ".join(
                            f"{k} {v * 1e3:.2f}" for k, v in phases.items() if v >= 5e-5))
        self.before, self.more = dict(total), more


class SpecChoice:
    """Whether MTP steps or plain steps serve the current batch size better, from measurement
    alone: per batch-size bucket (powers of two) the wall time per emitted token over the last
    `window` processed steps of each kind. MTP runs first; once it has `probe` steps, plain
    runs `probe` steps; then the faster kind runs, and every `explore` steps the slower one
    runs `probe` steps again to stay measured. The decode loop leaves out of the measurement
    the two steps after a switch (the first waited for the other kind's step; drafts refill)."""

    class Bucket:
        """Recent (seconds, tokens) of each kind's steps, and the choices made, in one bucket."""

        def __init__(self, window: int) -> None:
            self.steps = {True: deque(maxlen=window), False: deque(maxlen=window)}  # by mtp
            self.num_choices = 0

    def __init__(self, probe: int = 8, explore: int = 256, window: int = 32) -> None:
        self.probe, self.explore, self.window = probe, explore, window
        self.buckets: dict[int, SpecChoice.Bucket] = {}
        self.num_plain_steps = 0  # plain steps run because MTP measured slower

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, batch_size - 1).bit_length()

    def _state(self, batch_size: int) -> "SpecChoice.Bucket":
        b = self.bucket(batch_size)
        if b not in self.buckets:
            self.buckets[b] = SpecChoice.Bucket(self.window)
        return self.buckets[b]

    def per_token(self, batch_size: int, mtp: bool) -> float | None:
        xs = self._state(batch_size).steps[mtp]
        tokens = sum(n for _, n in xs)
        return sum(t for t, _ in xs) / tokens if len(xs) >= self.probe and tokens else None

    def use_mtp(self, batch_size: int) -> bool:
        st = self._state(batch_size)
        st.num_choices += 1
        mtp, plain = self.per_token(batch_size, True), self.per_token(batch_size, False)
        if mtp is None or plain is None:
            choice = mtp is None
        else:
            best = mtp <= plain
            choice = (not best) if st.num_choices % self.explore < self.probe else best
            if not choice and plain < mtp:
                self.num_plain_steps += 1
        return choice

    def record(self, batch_size: int, mtp: bool, seconds: float, tokens: int) -> None:
        if tokens:
            self._state(batch_size).steps[mtp].append((seconds, tokens))
