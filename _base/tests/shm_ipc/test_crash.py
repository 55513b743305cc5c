"""Crash safety: a producer killed mid-write gives the consumer a clear "peer gone", not a hang."""

from __future__ import annotations

import os
import time
import zlib

import pytest

from shm_ipc.doorbell import DoorbellWaiter
from shm_ipc.errors import PeerGoneError
from shm_ipc.ring import Ring
from shm_ipc import cleanup
from shm_ipc.segment import SHM_DIR

from shm_peer import REC, spawn_peer


def _consume_until_gone(ring: Ring, waiter: DoorbellWaiter, timeout: float, seqs: list) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pos = waiter.wait(timeout=0.2)
        if pos is None:
            if not ring.producer_alive():
                pos = ring.write_pos  # doorbells may die with the process; the ring does not
            else:
                continue
        while (rec := ring.next_record(pos)) is not None:
            seq, crc = REC.unpack_from(rec[1])
            assert crc == zlib.crc32(rec[1][REC.size:])
            seqs.append(seq)
        ring.release()
        ring.check_producer()  # raises PeerGoneError once the producer is dead
    raise AssertionError(f"no PeerGoneError within {timeout}s")


def test_sigkill_mid_write_then_restart(seg_name):
    waiter = DoorbellWaiter("tcp://127.0.0.1:*")
    procs = []
    try:
        proc = spawn_peer("midwrite", seg_name, waiter.endpoint)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "READY"  # it sits inside an uncommitted write
        ring = Ring.attach(seg_name)
        proc.kill()  # SIGKILL; the test does not reap it, so it lingers as a zombie
        seqs = []
        with pytest.raises(PeerGoneError, match="gone"):
            _consume_until_gone(ring, waiter, 10, seqs)
        assert seqs == list(range(10))  # every committed record arrived intact before the error
        ring.release()
        assert ring.write_pos == ring.read_pos  # the half-written record was never published
        ring.close()

        restarted = spawn_peer("midwrite", seg_name, waiter.endpoint)  # same name: stale replaced
        procs.append(restarted)
        assert restarted.stdout.readline().strip() == "READY"
        ring = Ring.attach(seg_name)
        seen = []
        while len(seen) < 10:
            pos = waiter.wait(timeout=5)
            assert pos is not None
            while (rec := ring.next_record(pos)) is not None:
                seen.append(REC.unpack_from(rec[1])[0])
        assert seen == list(range(10))
        ring.close()
    finally:
        for p in procs:
            p.terminate()  # SIGTERM: the restarted producer removes its segment
            p.wait()
        waiter.close()
        cleanup.remove(os.path.join(SHM_DIR, seg_name))  # left by a SIGKILL on failure
