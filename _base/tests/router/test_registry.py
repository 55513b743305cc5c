"""Node registry: registration, heartbeats, down and back up, load accounting (fake clock)."""

from __future__ import annotations

import pytest

from router.registry import NodeLoad, NodeRegistry, Role


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def reg(clock):
    return NodeRegistry(heartbeat_timeout=3.0, forget_after=30.0, clock=clock)


def test_static_node_is_down_until_first_heartbeat(reg):
    node = reg.add("prefill", "10.0.0.1:7000")
    assert node.static and not node.healthy
    assert reg.counts() == {"prefill": 0, "decode": 0}
    reg.heartbeat("prefill", "10.0.0.1:7000", {"queue_len": 2, "unknown_field": 9})
    assert node.healthy and node.load.queue_len == 2
    assert reg.counts() == {"prefill": 1, "decode": 0}


def test_draining_node_stays_up_but_is_not_routable(reg):
    reg.heartbeat("decode", "d1:1", NodeLoad(free_kv_blocks=10))
    node = reg.heartbeat("decode", "d2:1", NodeLoad(free_kv_blocks=10), draining=True)
    assert node.healthy and node.draining
    assert [n.address for n in reg.routable("decode")] == ["d1:1"]
    assert len(reg.healthy("decode")) == 2 and reg.counts()["decode"] == 1
    reg.heartbeat("decode", "d2:1", NodeLoad(free_kv_blocks=10))  # restarted: takes requests
    assert reg.counts()["decode"] == 2


def test_missed_heartbeats_take_node_out_and_it_comes_back(reg, clock):
    reg.heartbeat("decode", "d1:1", NodeLoad(free_kv_blocks=10))
    reg.heartbeat("decode", "d2:1", NodeLoad(free_kv_blocks=10))
    clock.t += 2.0
    reg.heartbeat("decode", "d2:1", NodeLoad(free_kv_blocks=9))
    assert reg.sweep() == []
    clock.t += 1.5  # d1 is 3.5 s late, d2 1.5 s
    assert [n.address for n in reg.sweep()] == ["d1:1"]
    assert [n.address for n in reg.healthy("decode")] == ["d2:1"]
    reg.heartbeat("decode", "d1:1", NodeLoad(free_kv_blocks=10))
    assert {n.address for n in reg.healthy(Role.DECODE)} == {"d1:1", "d2:1"}


def test_self_registered_node_is_forgotten_static_one_is_not(reg, clock):
    reg.add("prefill", "p1:1")
    reg.heartbeat("prefill", "p1:1", {})
    reg.heartbeat("prefill", "p2:1", {})
    clock.t += 4
    reg.sweep()
    assert reg.counts()["prefill"] == 0
    clock.t += 31
    forgotten = reg.sweep()
    assert [n.address for n in forgotten] == ["p2:1"]
    assert [n.address for n in reg.nodes()] == ["p1:1"]


def test_mark_down_then_heartbeat(reg):
    reg.heartbeat("prefill", "p:1", {})
    reg.mark_down("p:1", "connection refused")
    assert reg.healthy("prefill") == []
    reg.mark_down("nowhere:1", "unknown nodes are ignored")
    reg.heartbeat("prefill", "p:1", {})
    assert len(reg.healthy("prefill")) == 1


def test_role_conflict_and_bad_load(reg):
    reg.heartbeat("prefill", "n:1", {})
    with pytest.raises(ValueError, match="registered as prefill"):
        reg.heartbeat("decode", "n:1", {})
    with pytest.raises(ValueError, match="free_kv_blocks"):
        reg.heartbeat("prefill", "n:1", {"free_kv_blocks": -1})
    with pytest.raises(ValueError, match="queue_len"):
        NodeLoad(queue_len=True)
    with pytest.raises(ValueError):
        NodeRegistry(heartbeat_timeout=0)


def test_dispatch_accounting(reg):
    p = reg.heartbeat("prefill", "p:1", NodeLoad(outstanding_prefill_tokens=50, queue_len=1))
    d = reg.heartbeat("decode", "d:1", NodeLoad(free_kv_blocks=100, num_running=3))
    reg.dispatch(p, d, prompt_len=30, kv_blocks=4)
    assert (p.prefill_load, p.busy) == (80, 2)
    assert (d.free_kv, d.busy) == (96, 4)
    reg.prefill_done(p, 30)
    reg.decode_done(d, 4)
    assert (p.prefill_load, d.free_kv, p.busy, d.busy) == (50, 100, 1, 3)
    reg.decode_done(d, 4)  # never below zero
    assert d.pending_kv_blocks == 0 and d.pending_requests == 0
