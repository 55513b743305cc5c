"""`pd.wire.refusals.RefusalLog`: a flood of refused messages writes a few lines and a summary
per interval, not one line each."""

from __future__ import annotations

import logging

from pd.wire.refusals import RefusalLog


def test_a_flood_is_a_few_lines_and_a_summary(caplog):
    now = [0.0]
    log = logging.getLogger("test-refusals")
    refusals = RefusalLog(log, burst=3, interval=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test-refusals"):
        for i in range(200_000):
            now[0] = i * 1e-4  # 20 s of garbage at 10k messages/s
            refusals("refused message %d: %s", i, "bad frame")
        refusals.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 + 1 + 3 + 1  # two intervals: 3 each and a summary each
    assert all(r.levelname == "WARNING" for r in caplog.records)
    assert lines[:3] == [f"refused message {i}: bad frame" for i in range(3)]
    assert lines[3].startswith("99997 more refused messages not logged")
    assert lines[-1].startswith("99997 more refused messages")
    assert sum(len(x) for x in lines) < 1000
