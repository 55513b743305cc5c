"""Request tracing (`pd.service.trace`): events written by several processes into one directory
come back as each request's hops, for the requests that arrived after a time and met every
event."""

from __future__ import annotations

import importlib
import multiprocessing

import pytest


def _write(directory: str, events: list[tuple[str, str, float]]) -> None:
    import os

    os.environ["PD_TRACE_REQUESTS"] = directory
    from pd.service import trace

    importlib.reload(trace)  # reads the variable at import
    for event, req_id, t in events:
        trace.trace(event, req_id, t)


def test_events_of_several_processes_come_back_as_hops(tmp_path, monkeypatch):
    monkeypatch.delenv("PD_TRACE_REQUESTS", raising=False)
    from pd.service import trace

    events = list(trace.EVENTS)
    router = [(e, r, t0 + i) for r, t0 in (("a", 100.0), ("b", 200.0), ("old", 1.0))
              for i, e in enumerate(events) if e.startswith("router")]
    nodes = [(e, r, t0 + i * 1.5) for r, t0 in (("a", 100.0), ("b", 200.0), ("old", 1.0))
             for i, e in enumerate(events) if not e.startswith("router")]
    nodes = [n for n in nodes if not (n[1] == "b" and n[0] == "decode_meta")]  # b misses one
    ctx = multiprocessing.get_context("spawn")
    for part in (router, nodes):
        p = ctx.Process(target=_write, args=(str(tmp_path), part))
        p.start()
        p.join(30)
        assert p.exitcode == 0
    assert len(list(tmp_path.glob("*.trace"))) == 2
    hops = trace.hops(str(tmp_path), since=50.0)  # "old" arrived before
    assert list(hops) == [f"{a} -> {b}" for a, b in zip(events, events[1:])]
    assert all(len(v) == 1 for v in hops.values())  # "a" alone met every event
    assert hops["router_arrive -> router_dispatch"] == [1.0]
    assert hops["router_dispatch -> prefill_admit"] == [pytest.approx(2.0)]  # 1 -> 3


def test_unset_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("PD_TRACE_REQUESTS", raising=False)
    from pd.service import trace

    importlib.reload(trace)
    trace.trace("router_arrive", "x")
    assert trace._file is None
