"""Where a decode step's time goes on the GPU (embedded model): cProfile of LLM.generate with
MTP k (0: plain decoding), overlap on or off (host functions by own time), and for MTP the
device time of the verify and draft graphs from CUDA events.

    python benchmarks/gpu/profile_mtp.py [--k 3] [--batch 1] [--no-overlap] [--logprobs N] [--top 25]
                                         [--sort cumulative] [--callees launch_chained ...]

With --torch, torch.profiler instead of cProfile: the run's kernel time against its wall time
and the CPU-side operations (CUDA runtime calls included) by their own time. With
--device-time, where the device's time per loop step goes over a whole generate (kernels,
copies, idle gaps). With --kernels, the kernels of one replay of each MTP graph (verify, draft,
advance, the chained step's, and with --logprobs 0 its top_logprobs 0 graph) and of the plain
decode graph of the same batch size, by total time, and each graph's device time per replay.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

from pd.engine.llm import LLM
from pd.wire.sampling_params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_mtp import PROMPTS  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument("--torch", action="store_true", help="torch.profiler instead of cProfile")
    p.add_argument("--kernels", action="store_true", help="the kernels of each graph's replay")
    p.add_argument("--device-time", action="store_true",
                   help="where the device's time per loop step goes over a whole generate: "
                        "kernels, copies, idle gaps (torch.profiler)")
    p.add_argument("--timeline", action="store_true",
                   help="with --kernels: one replay's kernels in order, with the gaps between them")
    p.add_argument("--logprobs", type=int, default=None, help="top_logprobs width (default: none)")
    p.add_argument("--sort", default="tottime", choices=("tottime", "cumulative"),
                   help="cProfile's order: own time, or time with callees")
    p.add_argument("--callees", nargs="*", default=[], metavar="NAME",
                   help="also the callees of these functions (cProfile names, e.g. launch_chained)")
    args = p.parse_args()
    llm = LLM(device="cuda", num_speculative_tokens=args.k, num_blocks=1024, spec_fallback=False,
              overlap=not args.no_overlap)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=args.logprobs)
    llm.generate(prompts, params)  # warm-up and capture
    spec = llm.engine.spec
    torch.cuda.synchronize()
    if args.torch:
        torch_profile(llm, prompts, params, args.top)
        return
    if args.kernels:
        graph_kernels(llm, args.top, timeline=args.timeline)
        return
    if args.device_time:
        device_time(llm, prompts, params, args.top)
        return
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    outs = llm.generate(prompts, params)
    prof.disable()
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    loop = llm.engine.loop
    print(f"k={args.k} batch {args.batch} overlap {'off' if args.no_overlap else 'on'} "
          f"logprobs {args.logprobs}: {tokens} "
          f"tokens in {wall * 1e3:.1f} ms under the profiler; device busy per step "
          f"{sum(loop.busy) / max(1, len(loop.busy)) * 1e6:.0f} us over {len(loop.busy)} steps")
    if spec is not None and spec.graphs is not None and spec.graphs.graphs:
        g = next(iter(spec.graphs.graphs.values()))
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        for _ in range(3):
            ev[0].record(); g.verify(); ev[1].record(); g.draft(); ev[2].record()  # noqa: E702
        torch.cuda.synchronize()
        print(f"device: verify graph {ev[0].elapsed_time(ev[1]) * 1e3:.0f} us, draft graph "
              f"{ev[1].elapsed_time(ev[2]) * 1e3:.0f} us (slots x width {next(iter(spec.graphs.graphs))})")
    stats = pstats.Stats(prof)
    stats.sort_stats(args.sort).print_stats(args.top)
    for name in args.callees:
        stats.print_callees(name)


def torch_profile(llm: LLM, prompts: list[str], params: SamplingParams, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    kernels = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    tokens = sum(len(o.token_ids) for o in outs)
    print(f"torch.profiler: {tokens} tokens, wall {wall * 1e3:.1f} ms (profiled), device kernels "
          f"{kernels / 1e3:.1f} ms ({kernels / 1e3 / (wall * 1e3):.0%} of the wall)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=48))


@torch.inference_mode()
def graph_kernels(llm: LLM, top: int, replays: int = 20, timeline: bool = False) -> None:
    """Kernels per replay of each graph of the first captured MTP key, and of the plain decode
    graph with as many rows."""
    from torch.profiler import ProfilerActivity, profile

    spec = llm.engine.spec
    key, g = next(iter(spec.graphs.graphs.items()))
    runs = {"verify": g.verify, "draft": g.draft, "advance": g.advance,
            "chain": g.graphs[3].replay}
    if g.chain_lp0 is not None:  # captured by a chained step of the run with --logprobs 0
        runs["chain with top_logprobs 0"] = g.chain_lp0[0].replay
    decode = llm.engine.runner.graphs
    dkey = None if decode is None else next((k for k in sorted(decode.graphs) if k[0] >= key[0]), None)
    if dkey is not None:
        decode.pad_inputs(dkey)
        runs["plain decode"] = decode.graphs[dkey][0].replay
    else:
        print("no plain decode graph captured in this engine (profile one with --k 0 --torch)")
    snapshot = g.inputs.clone()
    for name, fn in runs.items():
        fn()
        torch.cuda.synchronize()
        span = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        span[0].record()
        for _ in range(replays):
            fn()
        span[1].record()
        torch.cuda.synchronize()
        print(f"== {name}: {span[0].elapsed_time(span[1]) * 1e3 / replays:.1f} us a replay "
              f"(CUDA events around {replays} in a row)")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                fn()
            torch.cuda.synchronize()
        g.inputs.copy_(snapshot)
        kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"
                   and e.self_device_time_total > 0]
        total = sum(e.self_device_time_total for e in kernels) / replays
        count = sum(e.count for e in kernels) / replays
        print(f"== {name} graph, slots x width {key}: {count:.0f} kernels, {total:.1f} us per replay")
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
            print(f"  {e.count / replays:4.0f} x {e.self_device_time_total / e.count:7.2f} us  "
                  f"{e.key[:90]}")
        print_timeline(prof, round(count), lines=timeline)


def device_time(llm: LLM, prompts: list[str], params: SamplingParams, top: int) -> None:
    """One generate under torch.profiler: the device's span from its first activity to its
    last, split into kernel time, copies (memcpy, memset) and idle time, per loop step (the
    prompts' prefill included), and the longest idle gaps with what ran on either side."""
    from torch.profiler import ProfilerActivity, profile

    loop = llm.engine.loop
    loop.busy.clear()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"
                     and e.device_time_total > 0), key=lambda e: e.time_range.start)
    if not events:
        print("no device activity recorded")
        return
    steps = max(1, len(loop.busy))
    copies = sum(e.time_range.elapsed_us() for e in events if "mem" in e.name.lower())
    kernels = sum(e.time_range.elapsed_us() for e in events) - copies
    gaps, end, prev = [], events[0].time_range.start, events[0]
    for e in events:
        if e.time_range.start > end:
            gaps.append((e.time_range.start - end, prev.name, e.name))
        if e.time_range.end >= end:
            end, prev = e.time_range.end, e
    span = end - events[0].time_range.start
    idle = sum(g for g, _, _ in gaps)
    print(f"device time over {steps} loop steps, per step (us): span {span / steps:.1f}, "
          f"kernels {kernels / steps:.1f}, copies {copies / steps:.1f}, idle {idle / steps:.1f} "
          f"({len(gaps)} gaps; the loop's own busy figure {sum(loop.busy) / steps * 1e6:.1f})")
    for gap, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"  idle {gap:7.1f} us  after {before[:50]}  before {after[:50]}")


def print_timeline(prof, per_replay: int, lines: bool) -> None:
    """The last replay's span (first kernel's start to last one's end) and with `lines` its
    kernels in launch order: start (us from the first), duration, the gap before each."""
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"
                     and e.device_time_total > 0), key=lambda e: e.time_range.start)
    last = events[-per_replay:]
    t0, end = last[0].time_range.start, last[0].time_range.start
    for e in last:
        start = e.time_range.start
        if lines:
            print(f"    {start - t0:7.1f} {e.time_range.elapsed_us():6.2f} gap {start - end:5.2f}  "
                  f"{e.name[:80]}")
        end = max(end, e.time_range.end)
    print(f"    span {end - t0:.1f} us, kernels {sum(e.time_range.elapsed_us() for e in last):.1f}")


if __name__ == "__main__":
    main()
