"""The decode node's held launch (`DecodeNode.hold`): while a handed-over request may join soon
(its blocks reserved, its prefill or KV under way), the next step's launch waits, reading the
sockets, until the request joins (it is then in that step) or the step in flight is about to end
(`launch_by`); with `join_hold` off, or nothing to join, a step is launched at once. A real decode node
and engine on the tiny model decoding one request (overlap on: a step in flight between calls);
the second request's KVDone arrives on a socket the node polls, from a timer; the loop's clock
(`launch_by`, `in_flight_done`) is set by the test, since on this CPU a step may end before the
node asks."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from tests.decode_node.test_direct_kv import PROMPT, RING_PEER, hand_over, node  # noqa: F401
from pd.wire import messages as m
from pd.wire.sampling_params import SamplingParams


@pytest.fixture
def decoding(node):  # noqa: F811
    """The node decoding request "a", its next step launched and not yet read."""
    hand_over(node, RING_PEER, "a")
    node.intake.dispatch(RING_PEER, m.to_dict(m.KVDone("a", 0)))
    node.step()
    assert node.loop.in_flight
    yield node
    for timer in getattr(node, "timers", []):
        timer.join()
    node.loop.close()  # the step in flight done: no forward of this engine outlives the test
    for sock in node.extra:
        sock.close(linger=0)


def kv_done_after(node, req_id: str, seconds: float) -> None:
    """KVDone for `req_id` arrives `seconds` from now, on a socket the node polls."""
    pull = node.ctx.socket(zmq.PULL)
    addr = f"inproc://kv-done-{req_id}-{id(pull)}"
    pull.bind(addr)
    push = node.ctx.socket(zmq.PUSH)
    push.connect(addr)
    node.extra = [*getattr(node, "extra", []), pull, push]

    def on_readable() -> None:
        pull.recv()
        node.intake.dispatch(RING_PEER, m.to_dict(m.KVDone(req_id, 0)))

    node.register(pull, on_readable)
    timer = threading.Timer(seconds, push.send, [b"x"])
    timer.start()
    node.timers = [*getattr(node, "timers", []), timer]


def in_step(node, req_id: str) -> bool:
    return req_id in {r.req_id for r in node.loop.last.batch.reqs}


def holds(node, outcome: str) -> float:
    return node.metrics.launch_holds(outcome)._value.get()


def clock(monkeypatch, node, due_in: float) -> None:
    monkeypatch.setattr(node.loop, "launch_by", lambda: time.perf_counter() + due_in)
    monkeypatch.setattr(node.loop, "in_flight_done", lambda: False)


def test_a_request_about_to_join_is_in_the_next_step(decoding, monkeypatch):
    node = decoding
    node.extra = []
    hand_over(node, RING_PEER, "b")  # its blocks reserved, its first token in, its KV to come
    assert node.intake.expecting()
    clock(monkeypatch, node, due_in=5.0)
    joined = holds(node, "joined")
    kv_done_after(node, "b", 0.05)
    start = time.perf_counter()
    node.step()
    assert time.perf_counter() - start < 2.0  # held until it joined, not until the step was due
    assert in_step(node, "b") and holds(node, "joined") == joined + 1
    assert node.loop.times.total["hold"] > 0.04


def test_without_the_hold_it_joins_the_step_after(decoding, monkeypatch):
    node = decoding
    node.extra = []
    node.join_hold = False
    hand_over(node, RING_PEER, "b")
    clock(monkeypatch, node, due_in=5.0)
    kv_done_after(node, "b", 0.05)
    node.step()
    assert not in_step(node, "b")  # launched at once, without it
    node.timers[-1].join()
    deadline = time.monotonic() + 5
    while "b" in node.intake.incoming and time.monotonic() < deadline:
        for sock, _ in node.poller.poll(10):
            node.handlers[sock]()
    node.step()
    assert in_step(node, "b")


def test_the_hold_ends_when_the_step_in_flight_is_due(decoding, monkeypatch):
    node = decoding
    node.extra = []
    hand_over(node, RING_PEER, "b")  # its KVDone never comes in this test
    clock(monkeypatch, node, due_in=0.03)
    due = holds(node, "due")
    start = time.perf_counter()
    node.step()
    assert 0.025 < time.perf_counter() - start < 1.0
    assert not in_step(node, "b") and holds(node, "due") == due + 1


def test_nothing_is_held_when_the_step_in_flight_is_done_or_nothing_is_about_to_join(
        decoding, monkeypatch):
    node = decoding
    node.extra = []
    monkeypatch.setattr(node.loop, "launch_by", lambda: time.perf_counter() + 5.0)
    monkeypatch.setattr(node.loop, "in_flight_done", lambda: True)
    hand_over(node, RING_PEER, "b")
    start = time.perf_counter()
    node.step()  # about to join, but the step in flight is done: no reason to hold
    monkeypatch.setattr(node.loop, "in_flight_done", lambda: False)
    node.intake.dispatch(RING_PEER, m.to_dict(m.KVDone("b", 0)))
    assert not node.intake.expecting()
    node.step()  # nothing about to join
    assert time.perf_counter() - start < 2.0


def test_launch_by_follows_the_step_in_flight(decoding, monkeypatch):
    node = decoding
    node.extra = []
    loop = node.loop
    node.step()
    loop.busy.extend([0.030, 0.020, 0.025, 0.040])
    loop.launch_costs.extend([0.001, 0.003, 0.002])
    monkeypatch.setattr(loop, "in_flight_done", lambda: False)
    assert loop.launch_by() == pytest.approx(loop.started_at + 0.020 - 0.003 - 150e-6)
    monkeypatch.setattr(loop, "in_flight_done", lambda: True)
    assert loop.launch_by() is None
    monkeypatch.undo()
    loop.drain()
    assert loop.launch_by() is None  # nothing in flight


def test_a_request_is_expected_from_its_request_meta(node):  # noqa: F811
    hand_over(node, RING_PEER, "a")
    assert node.intake.expecting()  # first token in, KV to come
    node.intake.dispatch(RING_PEER, m.to_dict(m.KVDone("a", 0)))
    assert not node.intake.expecting()
    params = SamplingParams(max_tokens=4, temperature=0.0).to_dict()
    node.intake.dispatch(RING_PEER, m.to_dict(m.RequestMeta("b", PROMPT, params, node.reply,
                                                            num_blocks=3, direct=True)))
    assert node.intake.expecting()  # announced as its prefill starts: blocks reserved
