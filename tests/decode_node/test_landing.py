"""The decode node's intake while it decodes (issue: decode never waits for KV): a record's copy
into the node's blocks is not waited for; a request whose KVDone arrives while its last copy
still runs waits in LANDING, out of the batch, until that copy has completed, then joins
(`Landing.land`, before every step); an abort or timeout while LANDING waits for the copy before
freeing the blocks it writes; a prefill node gone while one of its requests lands does not fail
it (all its KV arrived). A stand-in fence (what a CUDA event, or a CPU copy's `CopyDone`, is to
the intake: `query`, `synchronize`) says when each copy completes. The e2e PD tests run the
real thing on the CPU (copies on a thread of their own: about two thirds of their requests
land before they join)."""

from __future__ import annotations

import pytest

import decode_node.landing as landing_module
from pd.engine.decode_loop import DecodeLoop
from pd.wire import messages as m
from shm_ipc.kv import unit_bytes
from shm_ipc.records import KVRecord
from tests.shm_ipc.fence import Fence
from tests.decode_node.test_direct_kv import RING_PEER, hand_over, node, replies  # noqa: F401


@pytest.fixture
def busy(node, monkeypatch):  # noqa: F811
    """The node decoding (its loop has work) and every install giving a fence of its own."""
    fences = []
    real = landing_module.install_kv

    def install(*args, **kwargs):
        real(*args, **kwargs)
        fences.append(Fence())
        return fences[-1]

    monkeypatch.setattr(landing_module, "install_kv", install)
    monkeypatch.setattr(DecodeLoop, "has_work", property(lambda self: True))
    node.fences = fences
    return node


def send_kv(node, req_id: str) -> None:  # noqa: F811
    kv = node.engine.runner.kv_cache.kv
    layers = kv.shape[0]
    payload = memoryview(bytearray(layers * 3 * unit_bytes(kv)))
    node.intake.dispatch(RING_PEER, KVRecord(req_id, 0, layers, 3, payload, dtype="float32"))
    node.intake.dispatch(RING_PEER, m.to_dict(m.KVDone(req_id, 1)))


def running(node) -> set[str]:  # noqa: F811
    return {r.req_id for r in node.scheduler.running}


def test_a_request_lands_before_it_joins(busy):
    hand_over(busy, RING_PEER, "r", direct=False)
    send_kv(busy, "r")
    inc = busy.intake.incoming["r"]
    assert inc.state is landing_module.IncomingState.LANDING and inc.fence is busy.fences[-1]
    assert replies(busy, RING_PEER, m.KVAck)  # the prefill node may free its blocks
    assert "r" not in running(busy) and busy.has_work()
    busy.intake.land()
    assert "r" not in running(busy) and not busy.fences[-1].waited  # nothing waited
    busy.fences[-1].done = True
    busy.intake.land()
    assert "r" in running(busy) and "r" not in busy.intake.incoming and not busy.intake.landing


def test_requests_join_in_order_of_their_kv_done(busy):
    for r in ("a", "b"):
        hand_over(busy, RING_PEER, r, direct=False)
        send_kv(busy, r)
    busy.fences[1].done = True  # b's copy is done, a's is not: b waits behind a
    busy.intake.land()
    assert not running(busy) & {"a", "b"}
    busy.fences[0].done = True
    busy.intake.land()
    assert {"a", "b"} <= running(busy)


@pytest.mark.parametrize("how", ["abort", "timeout"])
def test_a_landing_request_dropped_waits_for_its_copy(busy, how):
    free = busy.allocator.num_free
    hand_over(busy, RING_PEER, "r", direct=False)
    send_kv(busy, "r")
    if how == "abort":
        busy.abort("r")
    else:
        busy.intake.incoming["r"].deadline = 0.0
        busy.intake.expire(1.0)
    assert busy.fences[-1].waited == 1  # before its blocks were freed
    assert busy.allocator.num_free == free and "r" not in busy.intake.incoming
    busy.intake.land()
    assert "r" not in running(busy) and not busy.intake.landing


def test_a_landing_request_outlives_its_prefill_node(busy):
    hand_over(busy, RING_PEER, "r", direct=False)
    send_kv(busy, "r")
    hand_over(busy, RING_PEER, "s", direct=False)  # still receiving: it fails
    busy.intake.on_peer_gone(RING_PEER, "ring closed")
    assert "s" not in busy.intake.incoming and "r" in busy.intake.incoming
    busy.fences[-1].done = True
    busy.intake.land()
    assert "r" in running(busy)
