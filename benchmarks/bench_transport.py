"""Benchmark of the KV transport: throughput of the shm ring vs ZMQ ipc:// and tcp:// vs memcpy,
and FIRST_TOKEN latency (publish -> the decode side has the decoded record).

Each throughput figure moves `size`-byte messages from a producer process to this process,
which copies every payload into its own buffer (as installing KV does); memcpy is one copy of
the same bytes in this process, read from a pool as large as the ring (not from one cached
buffer); each path runs --repeat times per size, interleaved, and the table shows medians (the
host's memory bandwidth drifts). Latency is measured one record at a time with the receiver
asleep in its poll, using CLOCK_MONOTONIC (the same clock in both processes); on shm the
receiver is woken by its wake pipe (`shm_ipc.doorbell.WakePipe`) ahead of the ZMQ doorbell.
The wake alone (a FIFO write, a ZMQ message) is timed the same way: the floor under each path.

    .venv/bin/python benchmarks/bench_transport.py [--sizes 64K,1M,64M] [--repeat 3] [--latency-n 2000]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import tempfile
import time

import numpy as np
import zmq

from shm_ipc import header
from shm_ipc.doorbell import Doorbell, DoorbellWaiter
from shm_ipc.ring import DATA_OFFSET, Ring


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)


def fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


# ---- producers (child processes) ----------------------------------------------------------------
def touch_pages(ring: Ring, write: bool) -> None:
    """Fault in this process's mapping of the whole ring before the clock starts, as a node's
    long-lived ring is after its first laps (the memcpy pool is warm the same way)."""
    pages = np.frombuffer(ring.seg.buf, dtype=np.uint8)[DATA_OFFSET::4096]  # data region only
    if write:
        pages[:] = 0
    else:
        int(pages.sum())


def ring_producer(name: str, bell_ep: str, go_ep: str, size: int, count: int) -> None:
    ring = Ring.create(name, max(64 << 20, 4 * size))
    touch_pages(ring, write=True)
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    bell = Doorbell(bell_ep)
    go = zmq.Context.instance().socket(zmq.PULL)
    go.connect(go_ep)
    go.recv()
    word = header.pack(header.KV)
    for _ in range(count):
        bell.ring(ring.publish(word, src, timeout=60))
    while ring.read_pos < ring.write_pos:
        time.sleep(0.001)
    bell.close()
    ring.close()


def zmq_producer(data_ep: str, go_ep: str, size: int, count: int) -> None:
    ctx = zmq.Context.instance()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 4)
    out.connect(data_ep)
    go = ctx.socket(zmq.PULL)
    go.connect(go_ep)
    go.recv()
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    word = header.to_bytes(header.pack(header.KV))
    for _ in range(count):
        out.send_multipart([word, src], copy=False)
    out.close(linger=-1)
    go.close()
    ctx.term()  # NOTE: waits until every zero-copy frame of `src` is sent, while `src` lives


_ipc_dir: list[str] = []  # made on first use, in this process only (children re-import us)
_ipc_n = itertools.count()


def _ipc_endpoint() -> str:
    if not _ipc_dir:
        _ipc_dir.append(tempfile.mkdtemp(prefix="pd-bench-transport-"))
    return f"ipc://{_ipc_dir[0]}/{next(_ipc_n)}"


# ---- consumers (this process) -------------------------------------------------------------------
def _go_socket():
    go = zmq.Context.instance().socket(zmq.PUSH)
    port = go.bind_to_random_port("tcp://127.0.0.1")
    return go, f"tcp://127.0.0.1:{port}"


def attach_when_created(name: str) -> Ring:
    """The consumer end of a ring that a producer process is about to create."""
    while True:
        try:
            return Ring.attach(name)
        except Exception:
            time.sleep(0.01)


def read_rung(ring: Ring, waiter: DoorbellWaiter, handle, total: int, timeout: float) -> None:
    """Read records up to each rung position, releasing as it goes, until `handle(word,
    payload)` (which returns what one record counts for) has counted `total`."""
    got = 0
    while got < total:
        pos = waiter.wait(timeout=timeout)
        while (rec := ring.next_record(pos)) is not None:
            got += handle(*rec)
        ring.release()


def bench_ring(size: int, count: int) -> float:
    ctx = mp.get_context("spawn")
    waiter = DoorbellWaiter(_ipc_endpoint())
    go, go_ep = _go_socket()
    name = f"pd_shm_bench_{os.getpid()}"
    proc = ctx.Process(target=ring_producer, args=(name, waiter.endpoint, go_ep, size, count))
    proc.start()
    ring = attach_when_created(name)
    touch_pages(ring, write=False)
    dst = np.empty(size, dtype=np.uint8)
    dst[:] = 0

    def copy_out(word: int, payload) -> int:
        np.copyto(dst, np.frombuffer(payload, dtype=np.uint8))
        return 1

    t0 = time.perf_counter()
    go.send(b"go")
    read_rung(ring, waiter, copy_out, count, timeout=30)
    dt = time.perf_counter() - t0
    proc.join()
    ring.close()
    waiter.close()
    go.close()
    return size * count / dt


def bench_zmq(scheme: str, size: int, count: int) -> float:
    ctx = mp.get_context("spawn")
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 4)
    if scheme == "tcp":
        ep = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    else:
        ep = _ipc_endpoint()
        sock.bind(ep)
    go, go_ep = _go_socket()
    proc = ctx.Process(target=zmq_producer, args=(ep, go_ep, size, count))
    proc.start()
    time.sleep(0.3)  # let it connect; the clock starts at "go"
    dst = np.empty(size, dtype=np.uint8)
    dst[:] = 0
    t0 = time.perf_counter()
    go.send(b"go")
    for _ in range(count):
        frames = sock.recv_multipart(copy=False)
        np.copyto(dst, np.frombuffer(frames[1].buffer, dtype=np.uint8))
    dt = time.perf_counter() - t0
    proc.join()
    sock.close()
    go.close()
    return size * count / dt


def bench_memcpy(size: int, count: int) -> float:
    """One copy of each message into a fixed buffer, the source cycling through a pool as large
    as the ring, as the ring's consumer reads it (a single source buffer would stay in cache
    and time the cache, not memory)."""
    pool = np.random.default_rng(0).integers(0, 256, max(64 << 20, 4 * size), dtype=np.uint8)
    slots = len(pool) // size
    dst = np.empty(size, dtype=np.uint8)
    np.copyto(dst, pool[:size])
    t0 = time.perf_counter()
    for i in range(count):
        at = (i % slots) * size
        np.copyto(dst, pool[at:at + size])
    return size * count / (time.perf_counter() - t0)


# ---- FIRST_TOKEN latency ------------------------------------------------------------------------
def latency_producer(endpoint: str, mode: str, n: int, topk: int) -> None:
    from shm_ipc.records import FirstTokenRecord
    from shm_ipc.tiers import make_transport
    tx = make_transport(endpoint, f"bench-{mode}-{os.getpid()}", mode=mode, ring_bytes=1 << 20)
    top = [(1000 + i, -0.1 * i) for i in range(topk)]
    sent = []
    for i in range(n):
        rec = FirstTokenRecord(f"{i:032x}", i, -0.5, 1, top)
        time.sleep(0.0005)  # the receiver is asleep in its poll when each record goes out
        t = time.perf_counter()
        tx.send_record(rec)
        sent.append(t)
        assert tx.recv_control(timeout=10)["type"] == "ack"
    tx.send_control({"type": "times", "version": 1, "t": sent})
    tx.recv_control(timeout=10)
    tx.close()


def bench_latency(mode: str, n: int, topk: int) -> tuple[float, float, float]:
    from shm_ipc.receiver import KVReceiver
    from shm_ipc.records import FirstTokenRecord
    rx = KVReceiver("tcp://127.0.0.1:*", max_topk=max(topk, 1))
    proc = mp.get_context("spawn").Process(target=latency_producer, args=(rx.endpoint, mode, n, topk))
    proc.start()
    got, sent = [], None
    idle_cpu = None
    while sent is None:
        for peer, item in rx.recv(timeout=30):
            if isinstance(item, FirstTokenRecord):
                got.append(time.perf_counter())
                rx.send_control(peer, {"type": "ack", "version": 1})
            elif isinstance(item, dict) and item["type"] == "times":
                sent = item["t"]
                if mode == "shm":  # the peer is attached and idle: how much CPU does waiting use?
                    r0 = resource.getrusage(resource.RUSAGE_SELF)
                    rx.recv(timeout=2.0)
                    r1 = resource.getrusage(resource.RUSAGE_SELF)
                    idle_cpu = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / 2.0
                rx.send_control(peer, {"type": "ack", "version": 1})
    proc.join()
    rx.close()
    lat = sorted((r - s) * 1e6 for r, s in zip(got, sent))
    return statistics.median(lat), lat[int(len(lat) * 0.99) - 1], idle_cpu


# ---- the wake alone ------------------------------------------------------------------------------
def wake_receiver(kind: str, where: str, n: int, out: str) -> None:
    """Sleep in a zmq.Poller (as the decode node does) until woken n times; save the wake times."""
    poller = zmq.Poller()
    if kind == "pipe":
        fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK)
        poller.register(fd, zmq.POLLIN)
        read = lambda: os.read(fd, 64)  # noqa: E731
    else:
        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.connect(where)
        poller.register(sock, zmq.POLLIN)
        read = lambda: sock.recv(zmq.NOBLOCK)  # noqa: E731
    times = []
    while len(times) < n:
        if poller.poll(30_000):
            read()
            times.append(time.perf_counter())
    np.save(out, np.array(times))


def bench_wake(kind: str, n: int) -> tuple[float, float]:
    """One-way latency (p50, p99 us) of waking a sleeping process: a FIFO write, or a ZMQ tcp
    message; the floor under FIRST_TOKEN latency on each path."""
    tmp = tempfile.mkdtemp(prefix="pd-bench-wake-")
    _ipc_dir.append(tmp)
    if kind == "pipe":
        where = os.path.join(tmp, "fifo")
        os.mkfifo(where, 0o600)
    else:
        sock = zmq.Context.instance().socket(zmq.PUSH)
        where = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    out = os.path.join(tmp, "times.npy")
    proc = mp.get_context("spawn").Process(target=wake_receiver, args=(kind, where, n, out))
    proc.start()
    if kind == "pipe":
        while True:
            try:
                fd = os.open(where, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:  # ENXIO until the receiver opened its end
                time.sleep(0.01)
        send = lambda: os.write(fd, b"w")  # noqa: E731
    else:
        send = lambda: sock.send(b"w")  # noqa: E731
    time.sleep(0.5)  # the receiver connected and asleep
    sent = []
    for _ in range(n):
        time.sleep(0.0005)
        sent.append(time.perf_counter())
        send()
    proc.join()
    if kind == "pipe":
        os.close(fd)
    else:
        sock.close()
    lat = np.sort((np.load(out) - np.array(sent)) * 1e6)
    return float(np.median(lat)), float(lat[int(len(lat) * 0.99) - 1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64K,256K,1M,4M,16M,64M")
    ap.add_argument("--bytes-per-size", default="512M", help="data moved per size and path")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of each path per size, interleaved; the table shows medians")
    ap.add_argument("--latency-n", type=int, default=2000)
    ap.add_argument("--topk", type=int, default=20)
    args = ap.parse_args()
    total = parse_size(args.bytes_per_size)
    print(f"medians of {args.repeat} interleaved runs")
    print(f"{'size':>8} {'memcpy':>9} {'ring':>9} {'zmq ipc':>9} {'zmq tcp':>9} "
          f"{'ring/memcpy':>12} {'ring/tcp':>9}   (GB/s)")
    for size in map(parse_size, args.sizes.split(",")):
        count = max(8, total // size)
        runs: dict[str, list[float]] = {"memcpy": [], "ring": [], "ipc": [], "tcp": []}
        for _ in range(args.repeat):  # interleaved, so a slow spell of the host hits every path
            runs["memcpy"].append(bench_memcpy(size, count))
            runs["ring"].append(bench_ring(size, count))
            runs["ipc"].append(bench_zmq("ipc", size, count))
            runs["tcp"].append(bench_zmq("tcp", size, count))
        mc, ring, ipc, tcp = (statistics.median(runs[k]) for k in ("memcpy", "ring", "ipc", "tcp"))
        print(f"{fmt_size(size):>8} {mc / 1e9:9.2f} {ring / 1e9:9.2f} {ipc / 1e9:9.2f} "
              f"{tcp / 1e9:9.2f} {ring / mc:11.0%} {ring / tcp:8.1f}x", flush=True)
    print(f"\nFIRST_TOKEN latency, publish -> decoded on the receiver, top-k {args.topk}, "
          f"n={args.latency_n}")
    for mode in ("shm", "zmq"):
        p50, p99, idle = bench_latency(mode, args.latency_n, args.topk)
        extra = f"   idle receiver CPU {idle:.1%} of a core" if idle is not None else ""
        print(f"  {mode:>3}: p50 {p50:7.1f} us   p99 {p99:7.1f} us{extra}", flush=True)
    print("the wake alone (a process asleep in a zmq.Poller, one-way):")
    for kind, name in (("pipe", "pipe"), ("zmq", "zmq tcp")):
        p50, p99 = bench_wake(kind, args.latency_n)
        print(f"  {name:>7}: p50 {p50:7.1f} us   p99 {p99:7.1f} us", flush=True)


if __name__ == "__main__":
    try:
        main()
    finally:
        for d in _ipc_dir:
            shutil.rmtree(d, ignore_errors=True)
