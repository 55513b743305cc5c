"""The wake pipe beside the ZMQ doorbell (`shm_ipc.doorbell`): a record read at once without its
doorbell, never ahead of a control message sent before it; the writer's refusals; a dead
process's pipe swept."""

from __future__ import annotations

import os
import time

from shm_ipc import control, records
from shm_ipc.doorbell import WakePipe, WakeWriter, encode_pos
from shm_ipc.receiver import KVReceiver
from shm_ipc.records import FirstTokenRecord

from linked import attached_ring, collect
from shm_peer import spawn_peer


def _woken_transport(rx: KVReceiver, name: str):
    """A shm transport whose ring `rx` attached and which opened `rx`'s wake pipe."""
    tx = attached_ring(rx, name)
    deadline = time.monotonic() + 10
    while tx.waker is None:
        assert time.monotonic() < deadline, "the transport never opened the wake pipe"
        tx.recv_control(timeout=0.05)
    return tx


def test_wake_pipe_delivers_a_record_without_its_zmq_doorbell(rx):
    rec = FirstTokenRecord("w", 3, -0.5, 1, [(3, -0.5)])
    tx = _woken_transport(rx, "p-wake")
    try:
        word, body = records.encode(rec)
        tx.waker.wake(tx.ring.publish(word, body))  # no ZMQ doorbell: the pipe alone
        assert [i.item for i in rx.recv(timeout=5)] == [rec]
    finally:
        tx.close()


def test_wake_pipe_never_lets_a_record_pass_a_control_message_sent_before_it(rx):
    rec = FirstTokenRecord("w", 3, -0.5, 1, [(3, -0.5)])
    msg = {"type": "hello", "version": 1}
    tx = _woken_transport(rx, "p-wake-order")
    try:
        # The control message is counted and "on its way" (not yet sent) when the record is
        # published and the pipe rung: the receiver must hold the record back.
        before = tx.ring.write_pos
        tx.ring.note_control()
        word, body = records.encode(rec)
        pos = tx.ring.publish(word, body)
        tx.waker.wake(pos)
        assert rx.recv(timeout=0.3) == []
        tx.socket.send_multipart([control.encode(msg), encode_pos(before)])  # the late message
        tx.socket.send_multipart([b"", encode_pos(pos)])  # and the record's ZMQ doorbell
        assert collect(rx, 2) == [msg, rec]
        tx.send_record(rec)  # counts agree again: the pipe path reads at once
        word, body = records.encode(rec)
        tx.waker.wake(tx.ring.publish(word, body))
        assert [i.item for i in rx.recv(timeout=5)] == [rec, rec]
    finally:
        tx.close()


def test_wake_writer_refuses_what_is_not_a_fifo_and_outlives_its_reader(tmp_path):
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    assert WakeWriter.open(str(plain), 1) is None  # never writes into a regular file
    assert WakeWriter.open(str(tmp_path / "missing"), 1) is None
    pipe = WakePipe()
    writer = WakeWriter.open(pipe.path, 7)
    for pos in (64, 192, 128):
        writer.wake(pos)
    assert pipe.drain() == {7: 192}
    assert pipe.drain() == {}
    pipe.close()
    assert not os.path.exists(pipe.dir)
    writer.wake(256)  # the reader is gone: no error, no signal
    writer.close()


def test_a_dead_processs_wake_pipe_is_swept_by_the_next_one():
    child = spawn_peer("wakepipe")
    path = child.stdout.readline().split()[1]
    assert os.path.exists(path)
    child.kill()  # SIGKILL: it cannot remove its pipe
    child.wait()
    child.stdout.close()
    WakePipe().close()
    assert not os.path.exists(os.path.dirname(path))
