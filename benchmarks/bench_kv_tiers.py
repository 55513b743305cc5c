"""KV through the transport's own API, one tier at a time: a producer process sends requests'
KV blocks from its cache with `make_transport(...).send_kv` (as the prefill node does), this
process receives them with `KVReceiver` and installs each record into its own cache
(`install_kv`, copies queued, as the decode node does), over the ring (`shm`) or ZMQ frames on
loopback TCP (`zmq`, the tier for another host). GB/s from the first record to the last install,
beside one process's copy of the same bytes (on CUDA: pinned D2H), then the installed blocks
are compared with the producer's (same seed).

    python benchmarks/bench_kv_tiers.py [--device cuda] [--tiers shm zmq] [--tokens 4096]
                                        [--requests 16] [--record-mib 16]

The cache has a Llama-3.2-1B KV shape (16 layers, 8 KV heads, head dim 64, 16-token blocks;
bfloat16 on CUDA, float32 on CPU); each request's blocks form one run of ids.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import torch

from shm_ipc.kv import install_kv, installed
from shm_ipc.receiver import KVReceiver
from shm_ipc.records import KVRecord
from shm_ipc.tiers import make_transport

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
from bench_kv import BLOCK, HEAD_DIM, HEADS, LAYERS, cache as kv_cache  # noqa: E402


def cache(num_blocks: int, seed: int | None, device: str) -> torch.Tensor:
    """`bench_kv.cache`: bfloat16 on CUDA, float32 on CPU."""
    return kv_cache(num_blocks, seed, device,
                    torch.bfloat16 if device.startswith("cuda") else torch.float32)


def producer(endpoint: str, tier: str, device: str, per_req: int, requests: int,
             record: int, done) -> None:
    kv = cache(per_req * requests, 7, device)
    tx = make_transport(endpoint, f"bench-{tier}", mode=tier, max_record_bytes=record)
    tx.send_control({"type": "hello", "version": 1})
    for r in range(requests):
        tx.send_kv(f"r{r:031d}", kv, list(range(r * per_req, (r + 1) * per_req)))
    tx.send_control({"type": "done", "version": 1})
    done.wait(60)
    tx.close()


def run(tier: str, device: str, per_req: int, requests: int, record: int) -> tuple[float, bool]:
    rx = KVReceiver("tcp://127.0.0.1:*", pin_rings=device.startswith("cuda"))
    kv = cache(per_req * requests, None, device)
    ctx = mp.get_context("spawn")
    done = ctx.Event()
    proc = ctx.Process(target=producer, args=(rx.endpoint, tier, device, per_req, requests,
                                              record, done))
    proc.start()
    start, finished, nbytes = None, False, 0
    deadline = time.monotonic() + 300
    while not finished:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{tier}: the producer did not finish")
        # NOTE: a recv gives back the ring space of records whose copies completed; a busy
        # decode node calls it every step, so this polls every 2 ms as well
        for inc in rx.recv(timeout=0.002):
            item = inc.item
            if isinstance(item, KVRecord):
                start = start or time.perf_counter()
                first = int(item.req_id[1:]) * per_req
                fence = install_kv(item, kv, range(first, first + per_req), wait=False)
                nbytes += len(item.payload)
                if fence is not None:
                    rx.hold(inc.peer, fence, item.ring_pos)
            elif isinstance(item, dict) and item.get("type") == "done":
                finished = True
    installed(kv)
    secs = time.perf_counter() - start
    done.set()
    proc.join(30)
    rx.close()
    same = torch.equal(kv, cache(per_req * requests, 7, device))
    return nbytes / secs / 1e9, same


def copy_gbps(nbytes: int, device: str) -> float:
    """One process's copy of `nbytes`: pinned D2H on CUDA, memcpy on CPU (best of 5)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
    best = float("inf")
    for _ in range(5):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tiers", nargs="+", choices=("shm", "zmq"), default=["shm", "zmq"])
    p.add_argument("--tokens", type=int, default=4096, help="tokens of KV per request")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--record-mib", type=int, default=16)
    args = p.parse_args()
    per_req = args.tokens // BLOCK
    unit = LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * (2 if args.device.startswith("cuda") else 4)
    total = unit * per_req * args.requests
    base = copy_gbps(min(total, 256 << 20), args.device)
    print(f"device {args.device}, {args.requests} requests of {unit * per_req >> 20} MiB, "
          f"records of {args.record_mib} MiB; one copy of the same bytes {base:.1f} GB/s")
    print(f"{'tier':>5} {'GB/s':>7} {'of copy':>8} {'intact':>6}")
    for tier in args.tiers:
        gbps, same = run(tier, args.device, per_req, args.requests, args.record_mib << 20)
        print(f"{tier:>5} {gbps:>7.2f} {gbps / base:>7.0%} {str(same):>6}")


if __name__ == "__main__":
    main()
