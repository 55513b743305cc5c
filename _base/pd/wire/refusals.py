"""Logging refused messages without letting a flood of them flood the log.

Every process refuses malformed or unauthorized messages (the nodes' sockets, the router's
event socket, the ring readers) and counts each in a metric. A peer that sends garbage as fast
as it can must not turn that into megabytes of log and seconds of formatting: `RefusalLog`
writes the first `burst` refusals of each `interval` at WARNING, counts the rest, and writes one
summary line for them when the next refusal comes after the interval (or on `flush`).
"""

from __future__ import annotations

import logging
import time
from typing import Callable


class RefusalLog:
    def __init__(self, logger: logging.Logger, burst: int = 5, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.burst, self.interval, self.clock = logger, burst, interval, clock
        self.window_start = -float("inf")
        self.logged = self.suppressed = 0

    def __call__(self, fmt: str, *args) -> None:
        now = self.clock()
        if now - self.window_start >= self.interval:
            self.flush()
            self.window_start, self.logged = now, 0
        if self.logged < self.burst:
            self.logged += 1
            self.logger.warning(fmt, *args)
        else:
            self.suppressed += 1

    def flush(self) -> None:
        """Write the summary line of the refusals not logged so far, if any."""
        if self.suppressed:
            self.logger.warning("%d more refused messages not logged in %.0f s (each is counted "
                                "in the refusal metrics)", self.suppressed, self.interval)
            self.suppressed = 0
