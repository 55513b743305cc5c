"""On a CUDA machine: KV transfer GPU -> ring -> GPU between two processes, as a prefill node
and a decode node on one host move it, beside pinned D2H and H2D copy bandwidth measured in the
same run.

The producer process gathers each request's KV blocks from its GPU cache into ring records
(`shm_ipc.kv.gather_into`) and rings the doorbell; this process decodes each record and installs
it into its own GPU cache (`shm_ipc.kv.install_kv`), releasing the ring as it goes. The cache
has a Llama-3.2-1B shape (16 layers, 8 KV heads, head dim 64, bf16, 16-token blocks); each
request carries `--tokens` tokens of KV. Run with the ring page-locked for CUDA (the fast path)
and without (copies staged through pageable memory). The installed blocks are compared with the
producer's (same seed) at the end.

    python benchmarks/gpu/bench_kv.py [--tokens 4096] [--requests 16]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time

import torch
import zmq

from shm_ipc import records
from shm_ipc.doorbell import Doorbell, DoorbellWaiter
from shm_ipc.header import Flag, pack
from shm_ipc.kv import dtype_name, gather_into, install_kv, plan_chunks, unit_bytes
from shm_ipc.records import KV_DATA_OFFSET
from shm_ipc.ring import Ring
from shm_ipc.transport import DEFAULT_MAX_RECORD

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_transport import attach_when_created, read_rung  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK = 16, 8, 64, 16
RING_BYTES = 256 << 20


def cache(num_blocks: int, seed: int | None) -> torch.Tensor:
    shape = (LAYERS, 2, num_blocks, BLOCK, HEADS, HEAD_DIM)
    if seed is None:
        return torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)


def producer(name: str, bell_ep: str, go_ep: str, num_blocks: int, per_req: int, requests: int,
             pin: bool) -> None:
    kv = cache(num_blocks, seed=0)
    ring = Ring.create(name, RING_BYTES)
    if pin:
        ring.seg.pin()
    bell = Doorbell(bell_ep)
    go = zmq.Context.instance().socket(zmq.PULL)
    go.connect(go_ep)
    go.recv()
    word = pack(Flag.KV, 0)
    chunks = plan_chunks(LAYERS, per_req, unit_bytes(kv), DEFAULT_MAX_RECORD)
    for r in range(requests):
        ids = torch.arange(r * per_req, (r + 1) * per_req) % num_blocks
        for l0, l1, b0, b1 in chunks:
            nbytes = (l1 - l0) * (b1 - b0) * unit_bytes(kv)
            view = ring.reserve(word, KV_DATA_OFFSET + nbytes, timeout=60)
            view[:KV_DATA_OFFSET] = records.kv_meta(f"r{r}", l0, l1, b0, b1 - b0, dtype_name(kv.dtype))
            gather_into(kv, ids, (l0, l1, b0, b1), view[KV_DATA_OFFSET:])
            bell.ring(ring.commit())
    while ring.read_pos < ring.write_pos:
        time.sleep(0.001)
    bell.close()
    ring.close()


def transfer(per_req: int, requests: int, pin: bool) -> tuple[float, bool]:
    """GB/s of KV installed, and whether the last request's blocks arrived intact."""
    num_blocks = per_req * 2
    ctx = mp.get_context("spawn")
    waiter = DoorbellWaiter(f"ipc://{tempfile.mkdtemp(prefix='pd-bench-kv-')}/bell")
    go = zmq.Context.instance().socket(zmq.PUSH)
    go_ep = f"tcp://127.0.0.1:{go.bind_to_random_port('tcp://127.0.0.1')}"
    name = f"pd_bench_kv_{os.getpid()}_{int(pin)}"
    proc = ctx.Process(target=producer, args=(name, waiter.endpoint, go_ep, num_blocks, per_req,
                                              requests, pin))
    proc.start()
    ring = attach_when_created(name)
    if pin:
        ring.seg.pin()
    kv = cache(num_blocks, seed=None)
    dst = {f"r{r}": (torch.arange(r * per_req, (r + 1) * per_req) + per_req) % num_blocks
           for r in range(requests)}
    total = requests * per_req * LAYERS * unit_bytes(kv)

    def install(word: int, payload) -> int:
        kv_rec = records.decode(word, payload)
        install_kv(kv_rec, kv, dst[kv_rec.req_id])
        return kv_rec.payload.nbytes

    t0 = time.perf_counter()
    go.send(b"go")
    read_rung(ring, waiter, install, total, timeout=60)
    dt = time.perf_counter() - t0
    proc.join()
    ring.close()
    waiter.close()
    go.close()
    src = cache(num_blocks, seed=0)
    last = requests - 1
    src_ids = torch.arange(last * per_req, (last + 1) * per_req) % num_blocks
    intact = torch.equal(src[:, :, src_ids.cuda()], kv[:, :, dst[f"r{last}"].cuda()])
    return total / dt / 1e9, intact


def pinned_bandwidth(nbytes: int) -> tuple[float, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def bw(fn):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        return 10 * nbytes / (time.perf_counter() - t0) / 1e9

    return (bw(lambda: host.copy_(dev, non_blocking=True)),
            bw(lambda: dev.copy_(host, non_blocking=True)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens of KV per request")
    p.add_argument("--requests", type=int, default=16)
    args = p.parse_args()
    per_req = args.tokens // BLOCK
    d2h, h2d = pinned_bandwidth(256 << 20)
    size = per_req * LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 2
    print(f"{torch.cuda.get_device_name()}: pinned D2H {d2h:.1f} GB/s, H2D {h2d:.1f} GB/s; "
          f"{args.requests} requests of {args.tokens} tokens ({size / 2**20:.0f} MiB of KV each)")
    print(f"{'ring':>10} | {'GB/s':>6} | {'of min(D2H, H2D)':>16} | intact")
    for pin in (True, False):
        gbs, intact = transfer(per_req, args.requests, pin)
        print(f"{'pinned' if pin else 'pageable':>10} | {gbs:>6.1f} | {gbs / min(d2h, h2d):>15.0%} | {intact}")


if __name__ == "__main__":
    main()
