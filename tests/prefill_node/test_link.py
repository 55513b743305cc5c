"""The prefill node's link to a decode node, alone: a real ZMQ transport to a ROUTER socket that
plays the decode node, and a recording owner in place of the prefill node (the link reaches its
owner only through `LinkOwner`). And the prefill job's state table."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
import torch
import zmq

from pd.engine.request import Req
from pd.service.states import IllegalTransition
from pd.wire import messages as m
from pd.wire.sampling_params import SamplingParams
from prefill_node.link import DecodeLink, LinkState
from prefill_node.job import JOB_STATES, Job, JobState
from shm_ipc import control


@dataclass
class Owner:
    node_id: str = "prefill-test"
    geometry: dict = field(default_factory=lambda: {"model_id": "x"})
    events: list = field(default_factory=list)
    sockets: dict = field(default_factory=dict)

    def register(self, sock, handler):
        self.sockets[sock] = handler

    def unregister(self, sock):
        self.sockets.pop(sock, None)

    def refuse(self, source, error):
        self.events.append(("refuse", source, str(error)))

    def on_first_token_sent(self, job):
        self.events.append(("first_token_sent", job.req.req_id))

    def on_kv_accept(self, link, msg):
        self.events.append(("kv_accept", msg.req_id))

    def on_kv_ack(self, link, req_id):
        self.events.append(("kv_ack", req_id))

    def on_kv_refuse(self, link, req_id, reason):
        self.events.append(("kv_refuse", req_id, reason))

    def on_link_broken(self, link, reason, jobs):
        self.events.append(("broken", reason, None if jobs is None else [j.req.req_id for j in jobs]))


@pytest.fixture
def decode_side():
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close(linger=0)


def make_job(req_id: str) -> Job:
    req = Req(req_id, [1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
    req.append_token(7)
    msg = m.PrefillRequest(req_id, [1, 2, 3, 4, 5], SamplingParams(max_tokens=4).to_dict(),
                           "tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
    return Job(msg, req, deadline=time.monotonic() + 30)


def recv_control(sock) -> tuple[bytes, dict]:
    """The next control message (one frame after the identity, plus the ring position from a
    ring's sender); records and doorbells are skipped."""
    while True:
        assert sock.poll(5000), "nothing arrived"
        frames = sock.recv_multipart()
        if len(frames) in (2, 3) and len(frames[1]) > 4:  # not a header word or a doorbell
            msg = control.decode(frames[1])
            if msg["type"] not in control.INTERNAL:
                return frames[0], msg


def pump(owner: Owner, until, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"timed out; events: {owner.events}"
        for sock, handler in list(owner.sockets.items()):
            if sock.poll(10):
                handler()


def link_to(owner: Owner, addr: str, transport: str = "zmq") -> DecodeLink:
    return DecodeLink(owner, addr, kv=torch.zeros(2, 2, 4, 16, 1, 8), block_size=16,
                      handoff_timeout=30.0, transport=transport)


def test_jobs_wait_for_the_handshake_then_go_out_in_order(decode_side):
    sock, addr = decode_side
    owner = Owner()
    link = link_to(owner, addr)
    peer, hello = recv_control(sock)
    assert hello["type"] == m.Hello.TYPE and hello["node_id"] == "prefill-test"
    first, second, gone = make_job("a"), make_job("b"), make_job("c")
    for job in (first, gone, second):
        link.submit(job)
    link.withdraw(gone)  # ended at the owner before the handshake came back
    assert link.state is LinkState.HELLO_SENT and len(link.pending) == 2
    sock.send_multipart([peer, control.encode(m.to_dict(m.HelloOk("decode-test")))])
    pump(owner, lambda: link.state is LinkState.READY)
    metas = [recv_control(sock)[1] for _ in range(2)]
    assert [(meta["type"], meta["req_id"]) for meta in metas] == [
        (m.RequestMeta.TYPE, "a"), (m.RequestMeta.TYPE, "b")]
    sock.send_multipart([peer, control.encode(m.to_dict(m.KVAccept("a")))])
    pump(owner, lambda: ("kv_accept", "a") in owner.events)
    assert ("first_token_sent", "a") in owner.events and ("first_token_sent", "b") in owner.events
    assert ("first_token_sent", "c") not in owner.events
    link.close()
    assert not owner.sockets


def test_an_announced_job_sends_its_request_meta_once(decode_side):
    """RequestMeta as the prefill starts (before the handshake: once paired), with a deadline
    covering the rest of the prefill's wait; the first token later comes alone."""
    sock, addr = decode_side
    owner = Owner()
    link = link_to(owner, addr)
    peer, _ = recv_control(sock)
    early, late = make_job("early"), make_job("late")
    link.announce(early)  # before the handshake: waits for it
    sock.send_multipart([peer, control.encode(m.to_dict(m.HelloOk("decode-test")))])
    pump(owner, lambda: link.state is LinkState.READY)
    meta = recv_control(sock)[1]
    assert (meta["type"], meta["req_id"]) == (m.RequestMeta.TYPE, "early")
    assert 59 < meta["deadline_s"] <= 60  # 30 s of prefill wait left, then the hand-off's 30
    link.announce(late)
    assert recv_control(sock)[1]["req_id"] == "late"
    for job in (early, late):
        job.deadline = time.monotonic() + 30  # the hand-off's
        link.submit(job)
    assert [e for e in owner.events if e[0] == "first_token_sent"] == [
        ("first_token_sent", "early"), ("first_token_sent", "late")]
    assert no_control(sock) and not link.announced  # no second RequestMeta
    link.close()


def test_a_refused_handshake_ends_the_pending_jobs_through_the_owner(decode_side):
    sock, addr = decode_side
    owner = Owner()
    link = link_to(owner, addr)
    peer, _ = recv_control(sock)
    link.submit(make_job("a"))
    sock.send_multipart([peer, control.encode(m.to_dict(m.HelloRefused("decode-test", "block_size differs")))])
    pump(owner, lambda: link.failed)
    assert owner.events == [("broken", f"decode node {addr} refused to pair: block_size differs",
                             ["a"])]
    link.submit(make_job("late"))  # a failed link ends new work at once
    assert owner.events[-1][2] == ["late"]
    link.close()


def test_a_reply_out_of_turn_is_refused_not_obeyed(decode_side):
    sock, addr = decode_side
    owner = Owner()
    link = link_to(owner, addr)
    peer, _ = recv_control(sock)
    sock.send_multipart([peer, control.encode(m.to_dict(m.HelloOk("d")))])
    pump(owner, lambda: link.state is LinkState.READY)
    sock.send_multipart([peer, control.encode(m.to_dict(m.HelloOk("d")))])
    pump(owner, lambda: owner.events)
    assert owner.events[0][0] == "refuse" and "out of turn" in owner.events[0][2]
    assert link.state is LinkState.READY
    link.close()


def test_job_states_move_only_along_the_table():
    job = make_job("a")
    with pytest.raises(IllegalTransition, match="QUEUED to KV_SENT"):
        JOB_STATES.move(job, JobState.KV_SENT)
    for state in (JobState.ANNOUNCED, JobState.HANDED_OFF, JobState.KV_SENT, JobState.DONE):
        JOB_STATES.move(job, state)
    with pytest.raises(IllegalTransition):
        JOB_STATES.move(job, JobState.QUEUED)


@pytest.mark.parametrize("offer", [None, {"handle": b"x" * 64}])
def test_transport_ipc_fails_the_link_when_the_cache_cannot_be_shared(decode_side, offer):
    # a CPU cache here: CUDA IPC is impossible whether or not the decode node offers its cache
    sock, addr = decode_side
    owner = Owner()
    link = link_to(owner, addr, transport="ipc")
    peer, _ = recv_control(sock)
    link.submit(make_job("a"))
    sock.send_multipart([peer, control.encode(m.to_dict(m.HelloOk("decode-test", kv_ipc=offer)))])
    pump(owner, lambda: link.failed)
    assert owner.events == [("broken", f"no CUDA IPC to decode node {addr}: both caches must be "
                             f"on GPUs of one host", ["a"])]
    link.close()


def test_auto_ignores_an_offer_it_cannot_use_and_sends_records(decode_side):
    sock, addr = decode_side
    owner = Owner()
    link = link_to(owner, addr, transport="auto")
    peer, _ = recv_control(sock)
    sock.send_multipart([peer, control.encode(m.to_dict(m.HelloOk("decode-test",
                                                                   kv_ipc={"handle": b"x"})))])
    pump(owner, lambda: link.state is LinkState.READY)
    assert link.tier in ("shm", "zmq") and link.peer_cache is None
    link.submit(make_job("a"))
    assert recv_control(sock)[1]["direct"] is False
    link.close()


class FakeCopy:
    """A direct copy's completion event, finished when the test says."""

    def __init__(self) -> None:
        self.finished = False

    def query(self) -> bool:
        return self.finished


class FakePeerCache:
    """Stands in for a decode node's cache opened by CUDA IPC (this machine has no GPU)."""

    def __init__(self) -> None:
        self.writes: list = []
        self.closed = False

    def write(self, kv, src, dst, side: bool = True, after=None) -> FakeCopy:
        copy = FakeCopy()
        self.writes.append((list(src), list(dst), copy))
        return copy

    def close(self) -> None:
        self.closed = True


def no_control(sock, wait_ms: int = 200) -> bool:
    """Nothing but records and doorbells arrives within `wait_ms`."""
    deadline = time.monotonic() + wait_ms / 1000
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1):
            frames = sock.recv_multipart()
            if len(frames) in (2, 3) and len(frames[1]) > 4 and \
                    control.decode(frames[1])["type"] not in control.INTERNAL:
                return False
    return True


def paired_link(decode_side, transport: str = "zmq") -> tuple[DecodeLink, Owner, bytes]:
    """A link the decode node has answered HelloOk: (link, its owner, the decode side's peer)."""
    sock, addr = decode_side
    owner = Owner()
    link = link_to(owner, addr, transport=transport)
    peer, _ = recv_control(sock)
    sock.send_multipart([peer, control.encode(m.to_dict(m.HelloOk("decode-test")))])
    pump(owner, lambda: link.state is LinkState.READY)
    return link, owner, peer


def direct_link(decode_side) -> tuple[DecodeLink, FakePeerCache]:
    """A paired link writing KV into a stand-in of the decode node's cache."""
    link, _, _ = paired_link(decode_side, transport="shm")
    link.peer_cache = FakePeerCache()
    return link, link.peer_cache


def test_direct_kv_is_done_only_once_its_copy_has_completed(decode_side):
    sock, _ = decode_side
    link, cache = direct_link(decode_side)
    assert link.tier == "ipc"
    job = make_job("a")
    job.req.block_ids = [3]
    link.submit(job)
    assert recv_control(sock)[1]["direct"] is True
    assert link.send_kv(job, 0, [7]) == link.kv[:, :, :1].numel() * link.kv.element_size()
    (src, dst, copy), = cache.writes
    assert (src, dst) == ([3], [7]) and link.writes
    link.finish_writes()  # the copy is still running: no KVDone yet
    assert no_control(sock)
    copy.finished = True
    link.finish_writes()
    assert recv_control(sock)[1] == m.to_dict(m.KVDone("a", 0)) and not link.writes
    link.release("gone")  # a KVAccept for a request that ended here: its blocks are released
    assert recv_control(sock)[1] == m.to_dict(m.KVReleased("gone"))
    link.close()
    assert cache.closed


def test_an_early_write_is_done_only_after_the_first_token(decode_side):
    """A direct write queued by the prefill step (`early`) holds its KVDone until the request's
    FIRST_TOKEN has gone, even when its copy completed first."""
    sock, _ = decode_side
    link, cache = direct_link(decode_side)
    job = make_job("a")
    job.req.block_ids = [3]
    link.announce(job)
    assert recv_control(sock)[1]["type"] == m.RequestMeta.TYPE
    link.send_kv(job, 0, [7], early=True)
    cache.writes[0][2].finished = True
    link.finish_writes()
    assert no_control(sock)  # its first token has not gone
    link.submit(job)
    link.finish_writes()
    assert recv_control(sock)[1] == m.to_dict(m.KVDone("a", 0))
    link.close()


def test_during_a_step_accepts_are_taken_and_other_replies_wait(decode_side):
    """`read_accepts` (the prefill node's wait for a step): KVAccepts are handled as they come,
    the other replies kept, in order, for `on_socket` after the step."""
    sock, _ = decode_side
    link, owner, peer = paired_link(decode_side)
    for msg in (m.KVAck("a"), m.KVAccept("b"), m.KVRefuse("c", "full"), m.KVAccept("d")):
        sock.send_multipart([peer, control.encode(m.to_dict(msg))])
    deadline = time.monotonic() + 5
    # NOTE: until all four are read: the last may reach the socket after the third
    while (len(link.deferred) < 2 or len(owner.events) < 2) and time.monotonic() < deadline:
        link.read_accepts()
    assert owner.events == [("kv_accept", "b"), ("kv_accept", "d")]
    assert [type(x) for x in link.deferred] == [m.KVAck, m.KVRefuse]
    link.on_socket()
    assert owner.events[2:] == [("kv_ack", "a"), ("kv_refuse", "c", "full")] and not link.deferred
    link.close()
