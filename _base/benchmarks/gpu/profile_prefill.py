"""On a CUDA machine: where one prefill of the Llama-3.2-1B shape (random bf16 weights) spends its
time, from torch.profiler: wall time, kernel time and count, the span from the first kernel to
the last, how long after the call the first one starts and the largest idle gaps between
kernels, and the kernels by device time.
Prefix caching is off (the same prompt is run several times).

    python benchmarks/gpu/profile_prefill.py [--prompt 1024 8192] [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import LLAMA_1B  # noqa: E402

from pd.config import EngineConfig  # noqa: E402
from pd.engine.engine import Engine  # noqa: E402
from pd.testing.tiny import write_tiny_checkpoint  # noqa: E402
from pd.wire.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    model = str(write_tiny_checkpoint(tempfile.mkdtemp(prefix="pd-llama1b-"), "llama", mtp=False,
                                      dtype="bfloat16", **LLAMA_1B))
    engine = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", max_model_len=16384,
                                 num_blocks=8192 // 16 + 64, max_num_batched_tokens=max(args.prompt),
                                 enable_prefix_caching=False))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    for n in args.prompt:
        prompt = torch.randint(3, 32000, (n,), generator=gen).tolist()
        for _ in range(2):
            engine.generate([prompt], [params])  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate([prompt], [params])
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate([prompt], [params])
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        counts, times = collections.Counter(), collections.defaultdict(float)
        for e in kernels:
            counts[e.name] += 1
            times[e.name] += e.device_time_total
        total = sum(times.values())
        start = min(e.time_range.start for e in prof.events())
        first = min(e.time_range.start for e in kernels)
        span = max(e.time_range.end for e in kernels) - first
        print(f"prompt {n}: wall {wall * 1e3:.2f} ms, kernels {sum(counts.values())} taking "
              f"{total / 1e3:.2f} ms of device time over a span of {span / 1e3:.2f} ms, the first "
              f"{(first - start) / 1e3:.2f} ms after the call (profiled)")
        ordered = sorted(kernels, key=lambda e: e.time_range.start)
        gaps = sorted(((b.time_range.start - a.time_range.end, a.name, b.name)
                       for a, b in zip(ordered, ordered[1:])), reverse=True)[:4]
        print("  largest idle gaps: " + "; ".join(
            f"{g / 1e3:.2f} ms after {a[:40]} before {b[:40]}" for g, a, b in gaps))
        for name, t in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {t / 1e3:8.3f} ms {counts[name]:5d}x  {name[:110]}")
        cpu = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:args.top]
        print("  host, by own time: " + ", ".join(
            f"{a.key[:40]} {a.self_cpu_time_total / 1e3:.2f} ms ({a.count}x)" for a in cpu))


if __name__ == "__main__":
    main()
