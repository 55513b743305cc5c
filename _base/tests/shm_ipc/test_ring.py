"""The ring: records in order and intact, wraparound and PAD, a full ring, two real processes."""

from __future__ import annotations

import random
import time
import zlib

import pytest

from shm_ipc import header
from shm_ipc.doorbell import DoorbellWaiter
from shm_ipc.errors import RingFullError
from shm_ipc.ring import ALIGN, Ring, record_size

from fence import Fence
from shm_peer import REC, pool_bytes, record, spawn_peer


@pytest.fixture
def pair(seg_name):
    prod = Ring.create(seg_name, 4096)
    cons = Ring.attach(seg_name)
    yield prod, cons
    cons.close()
    prod.close()


def test_records_cross_in_order_with_wraparound(pair):
    prod, cons = pair
    rng = random.Random(1)
    sent = []
    for i in range(500):
        payload = rng.randbytes(rng.randrange(0, 700))
        word = header.pack(rng.randrange(1, 6), rng.randrange(0, 100))
        prod.publish(word, payload)
        sent.append((word, payload))
        while (rec := cons.next_record()) is not None:
            got_word, view = rec
            assert (got_word, bytes(view)) == sent.pop(0)
            cons.release()
    assert not sent
    assert prod.write_pos > 20 * prod.capacity  # wrapped many times
    assert prod.write_pos == cons.read_pos


def test_pad_fills_the_tail_and_records_never_wrap(pair):
    prod, cons = pair
    for _ in range(3):
        prod.publish(1, b"x" * 1000)  # 1008 -> 1024 bytes each; 1024 left at the tail
        cons.next_record()
    cons.release()
    prod.publish(2, b"y" * 1500)  # does not fit the tail: PAD, then at offset 0
    word, view = cons.next_record()
    assert (word, bytes(view)) == (2, b"y" * 1500)
    assert prod.write_pos == 4096 + record_size(1500)


def test_full_ring_waits_then_raises_clearly(pair):
    prod, cons = pair
    for _ in range(4096 // ALIGN):
        prod.publish(3, b"z" * (ALIGN - 8), timeout=0.05)
    with pytest.raises(RingFullError, match="full"):
        prod.publish(3, b"!", timeout=0.05)
    word, view = cons.next_record()
    assert (word, bytes(view)) == (3, b"z" * (ALIGN - 8))
    cons.release()  # one record released: room for one more
    prod.publish(4, b"!", timeout=0.05)


def test_nothing_is_overwritten_before_release(pair):
    prod, cons = pair
    prod.publish(1, b"a" * 2000)
    prod.publish(2, b"b" * 1000)
    word, view = cons.next_record()
    with pytest.raises(RingFullError):
        prod.publish(3, b"c" * 1500, timeout=0.05)  # would need the unreleased bytes
    assert bytes(view) == b"a" * 2000


def test_held_records_go_back_only_once_their_fences_complete(pair):
    """`hold(start, fence)`: `release` gives back what was read before the oldest fence not
    yet completed, and nothing after it (the ring releases in order); close waits for fences."""
    prod, cons = pair
    fences = [Fence(), Fence()]
    for j, fence in enumerate(fences):
        prod.publish(1, bytes([j]) * 1000)
        start = cons.cursor
        cons.next_record()
        cons.hold(start, fence)
    prod.publish(2, b"c" * 1000)  # read, not held, but after the held ones
    word, view = cons.next_record()
    cons.release()
    assert cons.read_pos == 0 and cons.num_held == 2
    with pytest.raises(RingFullError):
        prod.publish(3, b"d" * 1500, timeout=0.05)
    fences[1].done = True  # the second's copy is done, the first's is not: nothing goes
    cons.release()
    assert cons.read_pos == 0
    fences[0].done = True
    cons.release()
    assert cons.read_pos == cons.cursor == prod.write_pos and cons.num_held == 0
    prod.publish(3, b"d" * 1500, timeout=0.05)
    start = cons.cursor
    cons.next_record()
    cons.hold(start, late := Fence())
    cons.release()
    assert cons.read_pos == start
    cons.close()  # waits for the fence: no copy may read an unmapped ring
    assert late.done


def test_record_larger_than_ring_and_pad_word_are_refused(pair):
    prod, _ = pair
    with pytest.raises(ValueError, match="chunks"):
        prod.reserve(1, 2048 - 7)  # more than half the ring
    with pytest.raises(ValueError, match="PAD"):
        prod.publish(0, b"x")


def test_write_in_place(pair):
    prod, cons = pair
    view = prod.reserve(header.pack(header.KV), 256)
    view[:] = bytes(range(256))
    assert cons.next_record() is None  # not published before commit
    prod.commit()
    word, got = cons.next_record()
    assert bytes(got) == bytes(range(256))


def test_several_reserved_records_publish_in_order_across_the_wrap(pair):
    """A sender with copies in flight reserves ahead; each commit publishes the oldest record,
    and a reservation that wraps (after a PAD) stays unseen until its own commit."""
    prod, cons = pair
    size = 300
    for round_ in range(8):
        views = [prod.reserve(header.pack(header.KV), size) for _ in range(3)]
        assert prod.num_pending == 3
        for i, view in enumerate(views):
            view[:] = bytes([round_ * 3 + i]) * size
        for i in range(3):
            assert cons.next_record(prod.write_pos) is None  # reserved, not yet published
            prod.commit()
            _, got = cons.next_record(prod.write_pos)
            assert bytes(got) == bytes([round_ * 3 + i]) * size
        cons.release()
    assert prod.num_pending == 0
    with pytest.raises(RuntimeError, match="without a reserved record"):
        prod.commit()


def test_100k_records_between_two_processes(seg_name):
    count, seed = 100_000, 7
    waiter = DoorbellWaiter("tcp://127.0.0.1:*")
    proc = spawn_peer("stream", seg_name, waiter.endpoint, count, 64 * 1024, seed)
    try:
        assert proc.stdout.readline().strip() == "READY"
        ring = Ring.attach(seg_name)
        rng, pool = random.Random(seed), pool_bytes(seed)
        seq, stalled = 0, False
        while seq < count:
            pos = waiter.wait(timeout=5)
            assert pos is not None, f"no doorbell after record {seq}"
            while (rec := ring.next_record(pos)) is not None:
                word, view = rec
                exp_word, exp_payload = record(seq, rng, pool)
                got_seq, crc = REC.unpack_from(view)
                assert (word, got_seq, len(view)) == (exp_word, seq, len(exp_payload))
                assert crc == zlib.crc32(view[REC.size:]) and bytes(view) == exp_payload
                seq += 1
            ring.release()
            if not stalled and seq >= 20_000:
                time.sleep(0.2)  # stall the consumer once: the producer meets a full ring
                stalled = True
        summary = proc.stdout.readline().split()
        stats = dict(kv.split("=") for kv in summary[1:])
        assert summary[0] == "DONE" and int(stats["waits"]) > 0 and int(stats["wraps"]) > 100
        ring.close()
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()
        waiter.close()
