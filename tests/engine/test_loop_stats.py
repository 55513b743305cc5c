"""`SlowSteps`: the decode node's warning for a slow turn of its loop, with the phases that took
the time, only while decoding goes on (a turn after an idle wait is not a slow step), and off
unless PD_LOG_SLOW_STEPS_MS is set."""

from __future__ import annotations

import time

from pd.engine.loop_stats import HostTimes, SlowSteps


class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def warning(self, fmt, *args) -> None:
        self.lines.append(fmt % args)


def turn(times: HostTimes, phase: str, seconds: float) -> None:
    t = time.perf_counter()
    time.sleep(seconds)
    times.add(phase, t)


def test_a_slow_turn_is_logged_with_its_phases():
    times, log = HostTimes(), Log()
    slow = SlowSteps(times, {"PD_LOG_SLOW_STEPS_MS": "5"})
    slow.end(log, "d", 4, more=True)
    turn(times, "wait", 0.001)  # fast
    slow.end(log, "d", 4, more=True)
    turn(times, "wait", 0.012)
    time.sleep(0.004)  # outside the phases: the loop's own
    slow.end(log, "d", 4, more=False)
    assert len(log.lines) == 1
    line = log.lines[0]
    assert "slow step" in line and "batch 4" in line
    parts = dict(p.rsplit(" ", 1) for p in line.split(": ", 2)[2].split(", "))
    assert float(parts["wait"]) >= 12.0 and float(parts["loop"]) >= 4.0
    time.sleep(0.02)  # idle: the next turn is not a step's
    slow.end(log, "d", 4, more=True)
    assert len(log.lines) == 1


def test_off_unless_asked():
    times, log = HostTimes(), Log()
    slow = SlowSteps(times, {})
    slow.end(log, "d", 1, more=True)
    turn(times, "wait", 0.01)
    slow.end(log, "d", 1, more=True)
    assert log.lines == []


def test_a_node_of_another_role_names_its_own_phases():
    times, log = HostTimes(("sends", "run")), Log()
    slow = SlowSteps(times, {"PD_LOG_SLOW_STEPS_MS": "1"})
    slow.end(log, "p", 2, more=True, role="prefill")
    turn(times, "run", 0.005)
    slow.end(log, "p", 2, more=True, role="prefill")
    assert len(log.lines) == 1 and log.lines[0].startswith("prefill node p: slow step")
    assert "run " in log.lines[0] and "wait" not in log.lines[0]
