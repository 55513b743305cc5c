"""What the receiver holds back while copies run: ring records held until their copies complete
(one by one, or several), and a ZMQ frame's buffer taken again only once ZMQ sent it."""

from __future__ import annotations

import threading
import time

import torch

from shm_ipc.kv import install_kv, plan_chunks, unit_bytes
from shm_ipc.records import KVRecord
from shm_ipc.tiers import make_transport

from fence import Fence


def test_ring_records_held_one_by_one_go_back_as_each_copy_completes(rx):
    """A KV record held from its own position (`hold(peer, fence, rec.ring_pos)`, as the decode
    node does) gives its space back once its copy and those before it completed, while later
    records stay held: the sender refills the ring while the later copies run."""
    kv = torch.randn(2, 2, 12, 8, 2, 16, dtype=torch.bfloat16)
    tx = make_transport(rx.endpoint, "p-one-by-one", mode="shm", ring_bytes=64 << 10,
                        max_record_bytes=8 << 10)
    try:
        tx.send_kv("r", kv, list(range(12)))  # four records of two layers' halves
        recs, deadline = [], time.monotonic() + 10
        while len(recs) < 4:
            assert time.monotonic() < deadline
            recs += [i for i in rx.recv(timeout=0.2) if isinstance(i.item, KVRecord)]
        peer = recs[0].peer
        ring = rx.rings[peer]
        positions = [i.item.ring_pos for i in recs]
        assert positions == sorted(set(positions)) and len(positions) == 4
        fences = [Fence() for _ in recs]
        for pos, fence in zip(positions, fences):
            rx.hold(peer, fence, pos)
        rx.release()
        assert ring.read_pos == positions[0]
        fences[1].done = True  # out of order: the first still holds everything after it
        rx.release()
        assert ring.read_pos == positions[0]
        fences[0].done = True
        rx.release()
        assert ring.read_pos == positions[2]  # the first two records' space is back
        for fence in fences:
            fence.done = True
        rx.release()
        assert ring.read_pos == ring.cursor and rx.num_held == 0
    finally:
        tx.close()


def test_held_ring_records_stay_until_their_copies_complete(rx):
    """`hold(peer, fence)` keeps the ring space of the last `recv()`'s records from that peer
    until the fence completes (the decode node's copies on CUDA, which nothing waits for); the
    sender, short of space, waits for it; the KV arrives intact."""
    torch.manual_seed(2)
    kv = torch.randn(4, 2, 40, 8, 2, 16, dtype=torch.bfloat16)
    src_ids, dst_ids = list(range(39, 9, -1)), list(range(30))
    dst = torch.zeros_like(kv)
    tx = make_transport(rx.endpoint, "p-held", mode="shm", ring_bytes=64 << 10,
                        max_record_bytes=16 << 10)
    sender = threading.Thread(target=lambda: tx.send_kv("r", kv, src_ids))
    sender.start()
    # NOTE: every record, not until the sender returns: its last records may still be unread
    expected = len(plan_chunks(kv.shape[0], len(src_ids), unit_bytes(kv), 16 << 10))
    try:
        fences, got, deadline = [], 0, time.monotonic() + 20
        held_seen = False
        while got < expected:
            assert time.monotonic() < deadline
            for f in fences:  # the copies of the batch before complete now
                f.done = True
            fences = []
            batch = [i for i in rx.recv(timeout=0.2) if isinstance(i.item, KVRecord)]
            if not batch:
                continue
            ring = rx.rings[batch[0].peer]
            start = ring.read_pos  # released up to here by this recv(): the batch begins here
            for inc in batch:
                install_kv(inc.item, dst, dst_ids)
                got += 1
            fences.append(Fence())
            rx.hold(batch[0].peer, fences[-1])
            rx.release()
            assert ring.read_pos == start < ring.cursor  # kept until the fence completes
            held_seen = True
        sender.join(timeout=20)
        assert held_seen and torch.equal(dst[:, :, dst_ids], kv[:, :, src_ids])
    finally:
        tx.close()


def test_a_kv_frame_buffer_is_taken_again_only_once_zmq_sent_it():
    """`FrameBuffers`: the ZMQ transport's KV chunks go out without a copy, so a buffer whose
    frame ZMQ has not sent yet is never handed out again; sent ones are, and idle ones are not
    hoarded."""
    import zmq

    from shm_ipc.zmq_transport import FrameBuffers

    ctx = zmq.Context()
    tx, rx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    tx.bind("inproc://frames")
    rx.connect("inproc://frames")
    frames = FrameBuffers(pin=False, keep=2)
    first = frames.take(100_000)
    assert first.numel() >= 100_000
    tracker = tx.send(memoryview(first.numpy()), copy=False, track=True)
    frames.give(first, tracker)
    held = rx.recv(copy=False)  # received but not released: the frame is still in use
    second = frames.take(100_000)
    assert second.data_ptr() != first.data_ptr()
    del held
    tracker.wait(5)
    third = frames.take(50_000)
    assert third.data_ptr() == first.data_ptr()  # sent: taken again
    for buf in (second, third, frames.take(10), frames.take(10)):
        frames.give(buf, None)
    frames.take(1)
    assert len(frames.idle) <= 2
    tx.close()
    rx.close()
    ctx.term()
