"""A second process for the shm_ipc tests: a ring producer or a prefill-side transport.

Tests start it with `spawn_peer(...)` (imported from here, not from a conftest, whose module
name other test directories share):

    shm_peer.py stream NAME DOORBELL COUNT CAPACITY SEED   COUNT checksummed records, then exit
    shm_peer.py midwrite NAME DOORBELL                     a few records, then stop inside a write
    shm_peer.py tx ENDPOINT INSTANCE COUNT                 COUNT FIRST_TOKEN records over ShmTransport
    shm_peer.py hold NAME                                  create a segment and wait for a signal
    shm_peer.py wakepipe                                   make a wake pipe, print its path, wait

Each prints READY (and at the end a summary) on stdout for the test to read.
"""

from __future__ import annotations

import random
import signal
import struct
import subprocess
import sys
import time
import zlib

import numpy as np

from shm_ipc import header
from shm_ipc.doorbell import Doorbell
from shm_ipc.ring import Ring

REC = struct.Struct("<QI")


def spawn_peer(*args) -> subprocess.Popen:
    """Start this file in a fresh interpreter (a real second process)."""
    return subprocess.Popen([sys.executable, __file__, *map(str, args)], stdout=subprocess.PIPE,
                            text=True)  # sequence number, crc32 of the rest


def record(seq: int, rng: random.Random, pool: bytes) -> tuple[int, bytes]:
    """The seq-th record of a stream: a random word (never PAD) and a checksummed payload."""
    size = rng.choice((0, 1, 7, 63, 64, 65)) if rng.random() < 0.2 else \
        rng.randrange(0, 16384 if rng.random() < 0.05 else 2048)
    off = rng.randrange(0, len(pool) - size + 1)
    body = pool[off:off + size]
    word = header.pack(rng.randrange(1, 256), rng.randrange(0, 65536))
    return word, REC.pack(seq, zlib.crc32(body)) + body


def pool_bytes(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()


def stream(name: str, endpoint: str, count: int, capacity: int, seed: int) -> None:
    ring = Ring.create(name, capacity)
    bell = Doorbell(endpoint)
    print("READY", flush=True)
    rng, pool = random.Random(seed), pool_bytes(seed)
    for seq in range(count):
        word, payload = record(seq, rng, pool)
        bell.ring(ring.publish(word, payload, timeout=20))
    print(f"DONE waits={ring.num_waits} wraps={ring.write_pos // ring.capacity}", flush=True)
    while ring.read_pos < ring.write_pos:  # until the consumer has released everything
        time.sleep(0.01)
    bell.close()
    ring.close()


def midwrite(name: str, endpoint: str) -> None:
    ring = Ring.create(name, 1 << 20)
    bell = Doorbell(endpoint)
    for seq in range(10):
        body = bytes([seq]) * 1000
        bell.ring(ring.publish(header.pack(header.KV), REC.pack(seq, zlib.crc32(body)) + body))
    view = ring.reserve(header.pack(header.KV), 100_000)
    view[:50_000] = b"\xab" * 50_000  # half of a record written, never committed
    print("READY", flush=True)
    time.sleep(60)


def tx(endpoint: str, instance: str, count: int) -> None:
    from shm_ipc.records import FirstTokenRecord
    from shm_ipc.shm_transport import ShmTransport
    t = ShmTransport(endpoint, instance, ring_bytes=1 << 20)
    for i in range(count):
        t.send_record(FirstTokenRecord(f"req-{instance}-{i}", i, -0.25, 1, [(i, -0.5)]))
    print("READY", flush=True)
    time.sleep(60)


def hold(name: str) -> None:
    Ring.create(name, 1 << 16)
    print("READY", flush=True)
    signal.pause()


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "stream":
        stream(args[0], args[1], int(args[2]), int(args[3]), int(args[4]))
    elif cmd == "midwrite":
        midwrite(args[0], args[1])
    elif cmd == "tx":
        tx(args[0], args[1], int(args[2]))
    elif cmd == "hold":
        hold(args[0])
    elif cmd == "wakepipe":
        from shm_ipc.doorbell import WakePipe
        print("PIPE", WakePipe().path, flush=True)
        signal.pause()
