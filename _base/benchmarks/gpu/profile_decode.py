"""On a CUDA machine: what one decode step of the Llama-3.2-1B shape (random bf16 weights)
launches, from torch.profiler: kernels per step and per layer, and device time by kernel, eager
and through the CUDA graph, at the batch sizes given. Run it with `PD_PDL=0` (as `run_all.sh`
does): under programmatic dependent launch a kernel starts before the one it follows ends and
the profiler counts its wait as its own time.

    PD_PDL=0 python benchmarks/gpu/profile_decode.py [--batch 1 64] [--steps 8] [--host 64]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import LLAMA_1B  # noqa: E402
from bench_overlap import inject  # noqa: E402

from pd.config import EngineConfig  # noqa: E402
from pd.engine.engine import Engine  # noqa: E402
from pd.engine.decode_loop import DecodeLoop  # noqa: E402
from pd.testing.tiny import write_tiny_checkpoint  # noqa: E402


def profile_steps(engine: Engine, batch: int, steps: int) -> tuple[collections.Counter, dict, float]:
    loop = DecodeLoop(engine.runner, engine.scheduler, overlap=False)
    inject(engine, batch, 512, steps + 4, seed=batch)
    for _ in range(3):  # warm-up (captures)
        loop.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            loop.step()
        torch.cuda.synchronize()
    while loop.has_work:
        loop.step()
    loop.close()
    counts, times = collections.Counter(), collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            counts[e.name] += 1
            times[e.name] += e.device_time_total
    total = sum(times.values()) / steps
    return counts, times, total


def host_profile(engine: Engine, batch: int, steps: int, overlap: bool) -> None:
    """Where the host's time goes in `steps` decode steps (cProfile, top functions by own time)."""
    import cProfile
    import pstats
    import time

    loop = DecodeLoop(engine.runner, engine.scheduler, overlap=overlap)
    inject(engine, batch, 512, steps + 8, seed=batch + 1)
    for _ in range(3):
        loop.step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        loop.step()
    prof.disable()
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - t0) / steps
    while loop.has_work:
        loop.step()
    loop.close()
    print(f"\n== host, batch {batch}, overlap {overlap}: {per_step * 1e3:.3f} ms per step "
          f"under cProfile; top functions by own time per step:")
    stats = pstats.Stats(prof).sort_stats("tottime")
    for (file, line, name), (cc, nc, tt, ct, _) in sorted(
            stats.stats.items(), key=lambda kv: -kv[1][2])[:22]:
        print(f"  {tt / steps * 1e3:8.3f} ms own {ct / steps * 1e3:8.3f} ms cum {nc / steps:7.1f}x "
              f"{os.path.basename(file)}:{line} {name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--host", type=int, nargs="*", default=[],
                   help="also profile the host (cProfile) at these batch sizes, eager and graphs")
    args = p.parse_args()
    model = str(write_tiny_checkpoint(tempfile.mkdtemp(prefix="pd-llama1b-"), "llama", mtp=False,
                                      dtype="bfloat16", **LLAMA_1B))
    layers = LLAMA_1B["num_layers"]
    for eager in (True, False):
        engine = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16",
                                     max_num_seqs=max(args.batch + args.host), num_blocks=8192,
                                     max_model_len=4096, enforce_eager=eager))
        for batch in args.batch:
            counts, times, per_step = profile_steps(engine, batch, args.steps)
            n = sum(counts.values()) / args.steps
            print(f"\n== {'eager' if eager else 'graph'} batch {batch}: {n:.0f} kernels per step "
                  f"({n / layers:.1f} per layer incl. head/sampler), device {per_step / 1e3:.3f} ms "
                  f"per step")
            for name, t in sorted(times.items(), key=lambda kv: -kv[1])[:14]:
                print(f"  {t / args.steps / 1e3:8.3f} ms  {counts[name] / args.steps:6.1f}x  {name[:90]}")
        for batch in args.host:
            for overlap in ((False,) if eager else (True, False)):
                print(f"\n({'eager' if eager else 'CUDA graphs'})", end="")
                host_profile(engine, batch, 20, overlap)
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
