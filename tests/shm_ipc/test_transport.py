"""The KV transport over real ZMQ sockets on loopback and a real ring: order, KV, refusals, crashes."""

from __future__ import annotations

import os
import stat
import resource
import signal
import socket
import threading
import time

import pytest
import torch
import zmq

from shm_ipc import control, header, records
from shm_ipc.doorbell import encode_pos
from shm_ipc.errors import TransportError
from shm_ipc.header import Flag
from shm_ipc.metrics import refused_count
from shm_ipc.receiver import PeerGone
from shm_ipc.records import AbortRecord, FirstTokenRecord, TokensRecord
from shm_ipc.segment import SHM_DIR
from shm_ipc.tiers import choose_mode, is_local, make_transport
from shm_ipc.transport import Transport

from linked import attached_ring, collect
from shm_peer import spawn_peer


@pytest.mark.parametrize("mode", ["shm", "zmq"])
def test_control_and_records_keep_their_order_and_kv_arrives_intact(rx, mode):
    torch.manual_seed(1)
    kv = torch.randn(5, 2, 40, 8, 2, 16, dtype=torch.bfloat16)  # 5 layers (the last as MTP)
    src_ids, dst_ids = list(range(39, 9, -1)), list(range(30))
    dst = torch.zeros_like(kv)
    first = FirstTokenRecord("a" * 32, 42, -0.75, 1, [(42, -0.75), (7, -1.25)])
    toks = TokensRecord("a" * 32, [1, 2], [-0.5, -0.25], [1, 3], [[(1, -0.5)], [(9, -0.125)]])
    # ring of 64 KiB, 16 KiB records: the ~245 KiB of KV wraps the ring and fills it
    tx = make_transport(rx.endpoint, f"p-{mode}", mode=mode, ring_bytes=64 << 10,
                        max_record_bytes=16 << 10)
    sent = {}

    def send():
        tx.send_control({"type": "hello", "version": 1})
        tx.send_record(first)
        sent["chunks"] = tx.send_kv("a" * 32, kv, src_ids)
        tx.send_control({"type": "kv_done", "version": 1, "req": "a" * 32})
        tx.send_record(toks)
        tx.send_record(AbortRecord("b" * 8, "client gone"))

    sender = threading.Thread(target=send)
    sender.start()
    try:
        _check_order(rx, tx, mode, sender, sent, kv, dst, src_ids, dst_ids, first, toks)
    finally:
        tx.close()


def _check_order(rx, tx, mode, sender, sent, kv, dst, src_ids, dst_ids, first, toks):
    # 30 blocks x 1 KiB per layer > 16 KiB: one layer and 16 blocks per record, 10 records
    got = collect(rx, 5 + 10, dst, dst_ids)
    sender.join()
    assert sent["chunks"] == 10
    assert got[:2] == [{"type": "hello", "version": 1}, first]
    assert got[2:12] == [("kv", layer, b0) for layer in range(5) for b0 in (0, 16)]
    assert got[12:] == [{"type": "kv_done", "version": 1, "req": "a" * 32}, toks,
                        AbortRecord("b" * 8, "client gone")]
    assert torch.equal(dst[:, :, dst_ids], kv[:, :, src_ids])

    peer = f"p-{mode}".encode()
    rx.send_control(peer, {"type": "kv_ack", "version": 1})
    assert tx.recv_control(timeout=5) == {"type": "kv_ack", "version": 1}
    tx.close()
    if mode == "shm":
        assert [i.item for i in rx.recv(timeout=5)] == [PeerGone("the prefill node closed its ring")]


def test_malformed_messages_are_counted_and_the_reader_carries_on(rx):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(rx.endpoint)
    body = b"\x01r" + b"\0" * 12
    before = {r: refused_count(r) for r in ("reserved", "unknown_flag", "topk", "control",
                                            "frames", "no_ring", "length")}
    sock.send_multipart([header.to_bytes(0x01000002), body])  # reserved byte set
    sock.send_multipart([header.to_bytes(0x09), body])  # unknown flag
    sock.send_multipart([header.to_bytes(header.pack(Flag.FIRST_TOKEN, 21)), body])  # k > 20
    sock.send_multipart([b"\x95\x01\x02\x03\x04\x05", b"\0" * 8])  # a list, not a control map
    sock.send_multipart([header.to_bytes(header.pack(Flag.ABORT)), body, b"x", b"y"])  # frames
    sock.send_multipart([b"", b"\0" * 7 + b"\1"])  # doorbell without a ring
    sock.send_multipart([header.to_bytes(header.pack(Flag.FIRST_TOKEN, 1)), body])  # short
    sock.send_multipart([header.to_bytes(header.pack(Flag.FIRST_TOKEN, 0)), body])  # valid
    got = collect(rx, 1)
    assert got == [FirstTokenRecord("r", 0, 0.0, 0, [])]
    for reason in before:
        assert refused_count(reason) == before[reason] + 1, reason
    sock.close(linger=0)


def test_corrupt_ring_records_are_counted_and_the_reader_carries_on(rx):
    """DESIGN section 3 through the real reader: each corrupt record is refused, counted and
    dropped, the reader stays inside the published bytes, and the next good record arrives."""
    good = FirstTokenRecord("r", 3, -0.5, 1, [(3, -0.5)])
    word, body = records.encode(good)
    reasons = ("reserved", "unknown_flag", "topk", "length", "malformed", "ring_length")
    before = {r: refused_count(r) for r in reasons}
    tx = attached_ring(rx, "p-corrupt")
    try:
        ring = tx.ring
        ring.publish(word | 1 << 24, body)
        ring.publish(0x07, body)
        ring.publish(header.pack(Flag.FIRST_TOKEN, 21), body)
        ring.publish(word, body[:-1])
        ring.publish(header.pack(Flag.KV), b"\xff" * records.KV_DATA_OFFSET + b"\0" * 64)
        tx.socket.send_multipart([b"", encode_pos(ring.write_pos)])
        start = ring.write_pos % ring.capacity
        ring.publish(word, body)
        ring._words[start // 4 + 1] = 1 << 20  # a length running past what was published
        tx.socket.send_multipart([b"", encode_pos(ring.write_pos)])
        tx.send_record(good)
        assert collect(rx, 1) == [good]
    finally:
        tx.close()
    for r in reasons:
        assert refused_count(r) == before[r] + 1, r


def test_doorbell_past_the_published_position_reads_nothing_unpublished(rx):
    first, second = AbortRecord("r1", "a"), AbortRecord("r2", "b")
    before = {r: refused_count(r) for r in ("ring_position", "ring_length", "unknown_flag")}
    tx = attached_ring(rx, "p-lying-bell")
    try:
        tx.send_record(first)
        tx.socket.send_multipart([b"", encode_pos(tx.ring.write_pos + 4096)])
        tx.send_record(second)
        assert collect(rx, 2) == [first, second]
    finally:
        tx.close()
    assert refused_count("ring_position") == before["ring_position"] + 1
    for r in ("ring_length", "unknown_flag"):  # nothing unpublished was read as a record
        assert refused_count(r) == before[r], r


def test_refused_attach_is_answered(rx):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(rx.endpoint)
    sock.send_multipart([control.encode({"type": control.SHM_ATTACH, "version": 1,
                                         "segment": "pd_shm_no_such_segment"}), b"\0" * 8])
    assert rx.recv(timeout=1.0) == []
    assert sock.poll(5000)
    reply = control.decode(sock.recv())
    assert reply["type"] == control.SHM_REFUSED and "does not exist" in reply["reason"]
    sock.send_multipart([control.encode({"type": control.SHM_ATTACH, "version": 1,
                                         "segment": ".."}), b"\0" * 8])  # a directory
    assert rx.recv(timeout=1.0) == []
    assert sock.poll(5000)
    assert control.decode(sock.recv())["type"] == control.SHM_REFUSED
    sock.close(linger=0)


def test_mode_choice():
    assert choose_mode("tcp://127.0.0.1:5555") == "shm"
    assert choose_mode("tcp://localhost:5555") == "shm"
    assert choose_mode("ipc:///tmp/pd.sock") == "shm"
    assert not is_local("tcp://192.0.2.7:5555")  # TEST-NET-1, never this host
    assert choose_mode("tcp://192.0.2.7:5555") == "zmq"
    assert choose_mode("tcp://127.0.0.1:5555", "zmq") == "zmq"
    os.environ["PD_KV_TRANSPORT"] = "zmq"
    try:
        assert choose_mode("tcp://127.0.0.1:5555") == "zmq"
    finally:
        del os.environ["PD_KV_TRANSPORT"]
    with pytest.raises(ValueError, match="auto, shm, zmq"):
        choose_mode("tcp://127.0.0.1:5555", "rdma")


def test_idle_receiver_sleeps(rx):
    tx = make_transport(rx.endpoint, "p-idle", mode="shm", ring_bytes=1 << 16)
    try:
        tx.send_record(AbortRecord("r", "x"))
        assert len(collect(rx, 1)) == 1
        t0 = resource.getrusage(resource.RUSAGE_SELF)
        assert rx.recv(timeout=1.0) == []
        t1 = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        tx.close()
    cpu = (t1.ru_utime - t0.ru_utime) + (t1.ru_stime - t0.ru_stime)
    assert cpu < 0.1, f"idle receiver used {cpu:.3f}s of CPU in 1s"  # spinning would be ~1s


def test_killed_prefill_process_is_reported_gone_then_reattaches(rx):
    procs = []
    try:
        before = set(os.listdir(SHM_DIR))
        for round_ in range(2):
            proc = spawn_peer("tx", rx.endpoint, "p-crash", 5)  # same instance id both times
            procs.append(proc)
            assert proc.stdout.readline().strip() == "READY"
            got = collect(rx, 5)
            assert [r.req_id for r in got] == [f"req-p-crash-{i}" for i in range(5)]
            if round_ == 0:
                proc.send_signal(signal.SIGKILL)
                gone = collect(rx, 1, timeout=10)
                assert isinstance(gone[0], PeerGone) and "died" in gone[0].reason
                # the killed producer could not remove its ring: the consumer did
                assert not set(os.listdir(SHM_DIR)) - before
    finally:
        for p in procs:
            p.terminate()  # the live one removes its segment on SIGTERM
            p.wait()


@pytest.mark.parametrize("mode", ["shm", "zmq"])
def test_send_to_a_peer_taking_nothing_raises_instead_of_blocking(monkeypatch, mode):
    monkeypatch.setattr(Transport, "send_hwm", 1000)
    with socket.socket() as s:  # a port where nobody listens: every message stays queued
        s.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    tx = make_transport(endpoint, f"p-stuck-{mode}", mode=mode)
    raised: list[Exception] = []

    def send():
        try:
            for i in range(100_000):
                tx.send_control({"type": "hello", "version": 1, "seq": i})
        except TransportError as e:
            raised.append(e)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "a send blocked"
    assert raised and "not taking messages" in str(raised[0])
    tx.close()  # does not block either


def test_a_second_connection_with_a_peers_identity_does_not_take_its_place(rx):
    """D's KV port takes no identity handover: a stranger that connects with a live prefill
    link's identity is not heard under it, and the link keeps its place."""
    ctx = zmq.Context.instance()
    owner, stranger = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for s in (owner, stranger):
            s.setsockopt(zmq.IDENTITY, b"link-identity")
            s.setsockopt(zmq.LINGER, 0)
        owner.connect(rx.endpoint)
        owner.send(b"from the owner")
        assert rx.socket.poll(5000) and rx.socket.recv_multipart() == [b"link-identity", b"from the owner"]
        stranger.connect(rx.endpoint)
        stranger.send(b"from the stranger")
        owner.send(b"owner again")
        got = []
        while rx.socket.poll(1000):
            got.append(rx.socket.recv_multipart())
        assert [b"link-identity", b"from the stranger"] not in got
        assert [b"link-identity", b"owner again"] in got
    finally:
        owner.close()
        stranger.close()


def test_shm_links_are_named_with_nothing_usable(rx):
    """A ring's segment name holds no identity, pid or port (anyone may list /dev/shm)."""
    tx = make_transport(rx.endpoint, "p-secret-identity", mode="shm", ring_bytes=64 << 10)
    try:
        name = tx.ring.name
        port = rx.endpoint.rsplit(":", 1)[1]
        assert "secret" not in name and str(os.getpid()) not in name and port not in name
        # the link to the creator's memfd (it names the creator's pid) is in a 0700 directory
        where = os.path.join(SHM_DIR, name)
        assert stat.S_IMODE(os.lstat(where).st_mode) == 0o700 and os.path.isdir(where)
        other = make_transport(rx.endpoint, "p-secret-identity-2", mode="shm", ring_bytes=64 << 10)
        assert other.ring.name != name
        other.close()
    finally:
        tx.close()


def test_a_limited_read_leaves_the_rest_on_the_socket_in_order(rx):
    # a decode node reads a few messages a turn while it decodes (`MESSAGES_PER_TURN`)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(rx.endpoint)
    for i in range(7):
        word, body = records.encode(FirstTokenRecord(f"r{i}", i, 0.0, 0, []))
        sock.send_multipart([header.to_bytes(word), body])
    time.sleep(0.3)  # all seven on the socket
    got = [inc.item.req_id for inc in rx.recv(timeout=0.5, limit=3)]
    assert got == ["r0", "r1", "r2"]
    deadline = time.monotonic() + 10
    while len(got) < 7:
        assert time.monotonic() < deadline, f"only {got} arrived"
        part = rx.recv(timeout=0.5, limit=3)
        assert len(part) <= 3
        got += [inc.item.req_id for inc in part]
    assert got == [f"r{i}" for i in range(7)]
    sock.close(linger=0)
