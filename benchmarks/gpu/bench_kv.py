"""On a CUDA machine: KV transfer GPU -> ring -> GPU between two processes, as a prefill node
and a decode node on one host move it, beside pinned D2H and H2D copy bandwidth measured in the
same run.

The producer process gathers each request's KV blocks from its GPU cache into ring records
(`shm_ipc.kv.gather_pipelined`, as the ring transport does) and rings the doorbell; this
process decodes each record and installs it into its own GPU cache (`shm_ipc.kv.install_kv`),
as the decode node does: the records are queued back to back on the copy streams and nothing
waits for them; each one's ring space is held until its copy has completed (`Ring.hold`) and
given back as soon as it has. The cache has a Llama-3.2-1B shape (16 layers, 8 KV heads, head
dim 64, bf16, 16-token blocks); each request carries `--tokens` tokens of KV, its blocks in one
run of consecutive ids or, with `--run-blocks N`, in runs of N. Run with the ring page-locked
for CUDA (the fast path: a row by DMA alone where the runs allow, `shm_ipc.kv.dma_plan`, and a
row through the block-copy kernel, `PD_KV_DMA=0`) and without (copies staged through pageable
memory). The installed blocks are compared with the producer's (same seed) at the end.

    python benchmarks/gpu/bench_kv.py [--tokens 4096] [--requests 16] [--devices cuda:0,cuda:1]
                                      [--record-mib 16 64] [--run-blocks N]
                                      [--profile [--trace-dir DIR]]

Beside the one-process copy bandwidth, the D2H and H2D bandwidth of two processes copying at
once (on one GPU their copies share the GPU, so each gets about half): the ring's ceiling.

Then the CUDA IPC tier (`shm_ipc.cuda_ipc`): the decode side exports its cache, the producer
opens it and writes each request's blocks straight into the decode side's blocks
(`PeerCache.write`, as the prefill node does), beside a device copy of the same size in one
process (on one GPU a device-to-device copy, on two a peer copy).
"""

from __future__ import annotations

import argparse
import contextlib
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
from pd_kernels.block_copy import copy_blocks
from shm_ipc.kv import (DMA_ENV, dtype_name, gather_pipelined, install_kv, installed, plan_chunks,
                        prepare, unit_bytes)
from shm_ipc.records import KV_DATA_OFFSET
from shm_ipc.ring import Ring
from shm_ipc.transport import DEFAULT_MAX_RECORD

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_transport import attach_when_created  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK = 16, 8, 64, 16
RING_BYTES = 256 << 20


def cache(num_blocks: int, seed: int | None, device: str = "cuda",
          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A KV cache of the Llama-3.2-1B shape: zeros, or random of `seed` (the same on a device
    for a seed)."""
    shape = (LAYERS, 2, num_blocks, BLOCK, HEADS, HEAD_DIM)
    if seed is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device).to(dtype)


def request_blocks(r: int, per_req: int, num_blocks: int, run: int, shift: int = 0) -> torch.Tensor:
    """Request r's block ids on one side (`shift`: the consumer's are per_req further on): in
    runs of `run` consecutive ids taken in reverse order (0: one run), as a cache whose free
    blocks are scattered hands them out."""
    ids = (torch.arange(r * per_req, (r + 1) * per_req) + shift) % num_blocks
    return ids.view(-1, run).flip(0).reshape(-1) if run else ids


def _add(phases: dict, name: str, since: float) -> float:
    now = time.perf_counter()
    phases[name] += now - since
    return now


def profiled(on: bool, host: bool = False):
    """torch.profiler over the device's activity (copies and kernels of every stream), and with
    `host` the host's (torch operations, CUDA runtime calls), or a context that does nothing."""
    if not on:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    return profile(activities=[ProfilerActivity.CUDA] + [ProfilerActivity.CPU] * host)


def write_trace(prof, trace_dir: str | None, side: str) -> None:
    """A profiled side's chrome trace as `trace_dir`/kv_`side`.json (chrome://tracing,
    Perfetto): when each record's copies ran against what its host was doing."""
    if trace_dir:
        path = os.path.join(trace_dir, f"kv_{side}.json")
        prof.export_chrome_trace(path)
        print(f"  {side} trace: {path}", flush=True)


def busy_ms(intervals) -> float:
    """Milliseconds covered by the union of (start, end) intervals in microseconds."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def device_summary(prof) -> str:
    """How busy the copy engines (copies) and the SMs (kernels) were over the device's span
    of a profiled transfer: where the ring's time goes."""
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not events:
        return "no device events"
    spans = [(e.time_range.start, e.time_range.end) for e in events]
    copies = [(e.time_range.start, e.time_range.end) for e in events if "Memcpy" in e.name]
    kernels = [(e.time_range.start, e.time_range.end) for e in events
               if "Memcpy" not in e.name and "Memset" not in e.name]
    span = (max(b for _, b in spans) - min(a for a, _ in spans)) / 1e3
    return (f"device span {span:.1f} ms: copies busy {busy_ms(copies):.1f} ms ({len(copies)}), "
            f"kernels busy {busy_ms(kernels):.1f} ms ({len(kernels)})")


def producer(name: str, bell_ep: str, go_ep: str, num_blocks: int, per_req: int, requests: int,
             pin: bool, device: str, ring_bytes: int, record_bytes: int, run: int = 0,
             profile: bool = False, trace_dir: str | None = None) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    kv = cache(num_blocks, seed=0, device=device)
    prepare(kv)  # as a node does at start: the copy kernel is compiled before any transfer
    ring = Ring.create(name, ring_bytes)
    if pin:
        ring.seg.pin()
    bell = Doorbell(bell_ep)
    go = zmq.Context.instance().socket(zmq.PULL)
    go.connect(go_ep)
    go.recv()
    word = pack(Flag.KV, 0)
    chunks = plan_chunks(LAYERS, per_req, unit_bytes(kv), record_bytes)
    phases = dict.fromkeys(("reserve", "publish"), 0.0)

    def publish() -> None:
        t = time.perf_counter()
        bell.ring(ring.commit())
        _add(phases, "publish", t)

    t0 = time.perf_counter()
    with profiled(profile, host=trace_dir is not None) as prof:
        send_all(kv, ring, word, chunks, num_blocks, per_req, requests, phases, publish, run)
    wall = time.perf_counter() - t0
    while ring.read_pos < ring.write_pos:
        time.sleep(0.001)
    rest = wall - sum(phases.values())
    print(f"  producer ({'pinned' if pin else 'pageable'}): {wall * 1e3:.0f} ms for "
          f"{requests * len(chunks)} records, {ring.num_waits} waits for ring space: "
          + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in phases.items())
          + f", copies queued and waited for {rest * 1e3:.0f} ms", flush=True)
    if profile:
        print(f"  producer {device_summary(prof)}", flush=True)
        write_trace(prof, trace_dir, "producer")
    bell.close()
    ring.close()


def send_all(kv, ring, word, chunks, num_blocks, per_req, requests, phases, publish, run) -> None:
    """The producer's requests, each gathered into ring records as the ring transport does."""
    for r in range(requests):
        ids = request_blocks(r, per_req, num_blocks, run)

        def size(chunk) -> int:
            l0, l1, b0, b1 = chunk
            return KV_DATA_OFFSET + (l1 - l0) * (b1 - b0) * unit_bytes(kv)

        def reserve(chunk, r=r) -> memoryview:
            t = time.perf_counter()
            l0, l1, b0, b1 = chunk
            view = ring.reserve(word, size(chunk), timeout=60)
            view[:KV_DATA_OFFSET] = records.kv_meta(f"r{r}", l0, l1, b0, b1 - b0, dtype_name(kv.dtype))
            _add(phases, "reserve", t)
            return view[KV_DATA_OFFSET:]

        gather_pipelined(kv, ids, chunks, reserve, publish,
                         fits=lambda chunk: ring.fits(size(chunk)))


def transfer(per_req: int, requests: int, pin: bool, devices: tuple[str, str],
             ring_bytes: int = RING_BYTES, record_bytes: int = DEFAULT_MAX_RECORD,
             profile: bool = False, trace_dir: str | None = None, run: int = 0,
             dma: bool = True) -> tuple[float, bool]:
    """GB/s of KV installed, and whether the last request's blocks arrived intact; `run`: the
    requests' blocks in runs of that many (`request_blocks`); `dma` False: both sides through
    the block-copy kernel (`PD_KV_DMA=0`) rather than DMA alone where the runs allow; `profile`:
    both sides' device activity under torch.profiler, summed up (`device_summary`), and with
    `trace_dir` both sides' chrome traces there (`write_trace`)."""
    num_blocks = per_req * 2
    ctx = mp.get_context("spawn")
    waiter = DoorbellWaiter(f"ipc://{tempfile.mkdtemp(prefix='pd-bench-kv-')}/bell")
    go = zmq.Context.instance().socket(zmq.PUSH)
    go_ep = f"tcp://127.0.0.1:{go.bind_to_random_port('tcp://127.0.0.1')}"
    name = f"pd_bench_kv_{os.getpid()}_{int(pin)}"
    os.environ[DMA_ENV] = "1" if dma else "0"  # the producer inherits it
    proc = ctx.Process(target=producer, args=(name, waiter.endpoint, go_ep, num_blocks, per_req,
                                              requests, pin, devices[0], ring_bytes,
                                              record_bytes, run, profile, trace_dir))
    proc.start()
    ring = attach_when_created(name)
    if pin:
        ring.seg.pin()
    kv = cache(num_blocks, seed=None, device=devices[1])
    prepare(kv)
    dst = {f"r{r}": request_blocks(r, per_req, num_blocks, run, shift=per_req)
           for r in range(requests)}
    total = requests * per_req * LAYERS * unit_bytes(kv)

    phases = dict.fromkeys(("decode", "install", "release"), 0.0)
    fence = None

    def install(word: int, payload) -> int:
        nonlocal fence
        t = time.perf_counter()
        kv_rec = records.decode(word, payload)
        t = _add(phases, "decode", t)
        fence = install_kv(kv_rec, kv, dst[kv_rec.req_id], wait=False)  # as the decode node does
        _add(phases, "install", t)
        return kv_rec.payload.nbytes

    t0 = time.perf_counter()
    go.send(b"go")
    got = 0
    with profiled(profile, host=trace_dir is not None) as prof:
        while got < total:  # as the decode node's intake: nothing waits for a copy
            pos = waiter.wait(timeout=0.001 if ring.num_held else 60)
            start = ring.cursor
            while pos is not None and (rec := ring.next_record(pos)) is not None:
                got += install(*rec)
                # NOTE: record by record: its space goes back once its own copy has read it
                ring.hold(start, fence)
                start = ring.cursor
            t = time.perf_counter()
            ring.release()
            _add(phases, "release", t)
        installed(kv)
    ring.release()  # every copy is done: the last records' space goes back too
    dt = time.perf_counter() - t0
    print(f"  consumer: {dt * 1e3:.0f} ms: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in phases.items()))
    if profile:
        print(f"  consumer {device_summary(prof)}", flush=True)
        write_trace(prof, trace_dir, "consumer")
    proc.join()
    ring.close()
    waiter.close()
    go.close()
    src = cache(num_blocks, seed=0, device=devices[0]).to(devices[1])
    last = requests - 1
    src_ids = request_blocks(last, per_req, num_blocks, run)
    intact = torch.equal(src[:, :, src_ids.to(devices[1])], kv[:, :, dst[f"r{last}"].to(devices[1])])
    return total / dt / 1e9, intact


def ipc_producer(desc: dict, go, done, num_blocks: int, per_req: int, requests: int,
                 device: str) -> None:
    from shm_ipc.cuda_ipc import PeerCache  # noqa: PLC0415

    torch.cuda.set_device(device)
    kv = cache(num_blocks, seed=0, device=device)
    prepare(kv)
    peer = PeerCache.open(desc, kv)
    peer.write(kv, [0], [0]).synchronize()  # the first launch loads the kernel (a node: at start)
    # request r: its blocks r * per_req.. into the decode side's next per_req (as `ipc_transfer`
    # checks), built before any timing
    blocks = [([(b + r * per_req) % num_blocks for b in range(per_req)],
               [(b + (r + 1) * per_req) % num_blocks for b in range(per_req)])
              for r in range(requests)]
    go.wait()
    t0 = time.perf_counter()
    for src, dst in blocks:
        peer.write(kv, src, dst).synchronize()  # one at a time
    wall = time.perf_counter() - t0
    t0, host = time.perf_counter(), 0.0
    for src, dst in blocks:  # the same copies, not waited for one by one
        t = time.perf_counter()
        peer.write(kv, src, dst)
        host += time.perf_counter() - t
    torch.cuda.synchronize()
    done.put((wall, time.perf_counter() - t0, host / requests))
    peer.close()


def ipc_transfer(per_req: int, requests: int, devices: tuple[str, str]
                 ) -> tuple[float, float, float, bool]:
    """GB/s of KV written into this process's cache by another through CUDA IPC (each request's
    write waited for; and all queued, then waited for once, as a busy prefill node does), the host
    seconds of one queued write, and whether the last request's blocks arrived intact."""
    from shm_ipc.cuda_ipc import export  # noqa: PLC0415

    num_blocks = per_req * 2
    kv = cache(num_blocks, seed=None, device=devices[1])
    ctx = mp.get_context("spawn")
    go, done = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=ipc_producer, args=(export(kv), go, done, num_blocks, per_req,
                                                  requests, devices[0]))
    proc.start()
    go.set()
    dt, queued, host = done.get(timeout=120)
    proc.join()
    total = requests * per_req * LAYERS * unit_bytes(kv)
    src = cache(num_blocks, seed=0, device=devices[0]).to(devices[1])
    last = requests - 1
    src_ids = torch.arange(last * per_req, (last + 1) * per_req) % num_blocks
    dst_ids = (src_ids + per_req) % num_blocks
    intact = torch.equal(src[:, :, src_ids.to(devices[1])], kv[:, :, dst_ids.to(devices[1])])
    return total / dt / 1e9, total / queued / 1e9, host, intact


def _gbps(fn, nbytes: int, reps: int) -> float:
    """GB/s of `fn` moving `nbytes`, over `reps` calls after one warm-up."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return reps * nbytes / (time.perf_counter() - t0) / 1e9


def pinned_bandwidth(nbytes: int) -> tuple[float, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return (_gbps(lambda: host.copy_(dev, non_blocking=True), nbytes, 10),
            _gbps(lambda: dev.copy_(host, non_blocking=True), nbytes, 10))


def ring_copy_bandwidth(nbytes: int = DEFAULT_MAX_RECORD) -> tuple[float, float, bool, float]:
    """D2H and H2D GB/s of one record-sized copy to and from a registered ring mapping (what the
    KV path copies through), whether torch sees that memory as pinned, and the GB/s of the
    block-copy kernel gathering a record's worth of scattered blocks on the GPU."""
    ring = Ring.create(f"pd_bench_kv_copy_{os.getpid()}", RING_BYTES)
    ring.seg.pin()
    view = ring.reserve(1, nbytes)
    host = torch.frombuffer(view, dtype=torch.uint8)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    kv = cache(nbytes // (LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 2) * 2, seed=1)
    ids = torch.randperm(kv.shape[2], device="cuda")[:kv.shape[2] // 2]
    staged = torch.empty(LAYERS * 2, ids.numel(), BLOCK, HEADS, HEAD_DIM, dtype=kv.dtype, device="cuda")
    gather = _gbps(lambda: copy_blocks(kv.flatten(0, 1), staged, src_ids=ids), nbytes, 20)
    out = (_gbps(lambda: host.copy_(dev, non_blocking=True), nbytes, 20),
           _gbps(lambda: dev.copy_(host, non_blocking=True), nbytes, 20), host.is_pinned(), gather)
    del host, view
    ring.commit()
    ring.close()
    return out


def _copier(device: str, to_host: bool, nbytes: int, count: int, start, out) -> None:
    torch.cuda.set_device(device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    copy = (lambda: host.copy_(dev, non_blocking=True)) if to_host else \
        (lambda: dev.copy_(host, non_blocking=True))
    copy()
    torch.cuda.synchronize()
    start.wait()
    t0 = time.perf_counter()
    for _ in range(count):
        copy()
    torch.cuda.synchronize()
    out.put((to_host, count * nbytes / (time.perf_counter() - t0) / 1e9))


def duplex_bandwidth(devices: tuple[str, str], nbytes: int = DEFAULT_MAX_RECORD,
                     count: int = 200) -> tuple[float, float]:
    """GB/s of D2H in one process and H2D in another at the same time (as a prefill node and a
    decode node copy): the link's share each gets, the ceiling for the ring between them."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_copier, args=(dev, to_host, nbytes, count, start, out))
             for dev, to_host in ((devices[0], True), (devices[1], False))]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join()
    return got[True], got[False]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens of KV per request")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--ring-mib", type=int, default=RING_BYTES >> 20, help="the ring's size")
    p.add_argument("--profile", action="store_true",
                   help="the first pinned row once more, under torch.profiler in both processes: "
                        "how busy each side's copies and kernels kept the GPU")
    p.add_argument("--trace-dir", default=None, metavar="DIR",
                   help="with --profile: both sides' chrome traces there (kv_producer.json, "
                        "kv_consumer.json), host activity included")
    p.add_argument("--record-mib", type=int, nargs="+", default=[DEFAULT_MAX_RECORD >> 20],
                   help="the largest KV record (the transport's --max-record); several: a pinned "
                        "ring row each")
    p.add_argument("--run-blocks", type=int, default=0, metavar="N",
                   help="each request's blocks in runs of N consecutive ids, the runs in reverse "
                        "order, on both sides (default: one run); N must divide tokens / 16")
    p.add_argument("--devices", default="cuda:0,cuda:0",
                   help="the producer's (prefill) and the consumer's (decode) devices; cpu,cpu "
                        "runs the protocol alone, without the bandwidth figures")
    args = p.parse_args()
    devices = tuple(args.devices.split(","))
    ring_bytes = args.ring_mib << 20
    per_req = args.tokens // BLOCK
    size = per_req * LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 2
    print(f"{args.requests} requests of {args.tokens} tokens ({size / 2**20:.0f} MiB of KV each), "
          f"{devices[0]} -> {devices[1]}")
    if not all(d.startswith("cuda") for d in devices):  # the protocol alone (tests run it on CPU)
        gbs, intact = transfer(per_req, args.requests, False, devices, ring_bytes,
                               run=args.run_blocks)
        print(f"ring (CPU): {gbs:.2f} GB/s, intact {intact}")
        sys.exit(0 if intact else 1)
    d2h, h2d = pinned_bandwidth(256 << 20)
    print(f"{torch.cuda.get_device_name()}: pinned D2H {d2h:.1f} GB/s, H2D {h2d:.1f} GB/s")
    rd2h, rh2d, seen, gather = ring_copy_bandwidth()
    print(f"one {DEFAULT_MAX_RECORD >> 20} MiB copy to / from a registered ring: D2H {rd2h:.1f} "
          f"GB/s, H2D {rh2d:.1f} GB/s (torch sees it pinned: {seen}); the block-copy kernel "
          f"gathers a chunk on the GPU at {gather:.0f} GB/s")
    dd2h, dh2d = duplex_bandwidth(devices)
    print(f"at once, D2H on {devices[0]} in one process and H2D on {devices[1]} in another: "
          f"{dd2h:.1f} and {dh2d:.1f} GB/s")
    print(f"ring, blocks in runs of {args.run_blocks or per_req}; DMA: copies alone where the runs "
          f"allow (`dma_plan`), kernel: through the block-copy kernel and staging (PD_KV_DMA=0)")
    print(f"{'ring':>17} | {'GB/s':>6} | {'of min(D2H, H2D)':>16} | {'of duplex':>9} | intact")
    rows = [(True, mib << 20, dma) for mib in args.record_mib for dma in (True, False)]
    for pin, record, dma in rows + [(False, args.record_mib[0] << 20, True)]:
        gbs, intact = transfer(per_req, args.requests, pin, devices, ring_bytes, record,
                               run=args.run_blocks, dma=dma)
        way = (", DMA" if dma else ", kernel") if pin else ""
        name = f"{'pinned' if pin else 'pageable'} {record >> 20}M{way}"
        print(f"{name:>17} | {gbs:>6.1f} | {gbs / min(d2h, h2d):>15.0%} | "
              f"{gbs / min(dd2h, dh2d):>8.0%} | {intact}")
    if args.profile:
        # NOTE: a run of its own: the profiler's start-up falls inside a transfer's clock (the
        # first pinned row read 0.4 GB/s under it); its device summaries are what it is for
        print("the first pinned row again under torch.profiler (its GB/s is not a figure):")
        transfer(per_req, args.requests, True, devices, ring_bytes, args.record_mib[0] << 20,
                 profile=True, trace_dir=args.trace_dir, run=args.run_blocks)
    a, b = (torch.empty(size, dtype=torch.uint8, device=d) for d in devices)
    copy = _gbps(lambda: b.copy_(a, non_blocking=True), size, 20)
    gbs, queued, host, intact = ipc_transfer(per_req, args.requests, devices)
    print(f"one process, {size >> 20} MiB {devices[0]} -> {devices[1]}: {copy:.0f} GB/s")
    print(f"CUDA IPC, writes queued (as the prefill node does): {queued:.0f} GB/s, "
          f"{queued / copy:.0%} of that copy, {host * 1e6:.0f} us of host time each; one at a "
          f"time: {gbs:.0f} GB/s ({gbs / copy:.0%}); intact {intact}")

if __name__ == "__main__":
    main()
