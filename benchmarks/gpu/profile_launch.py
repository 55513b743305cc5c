"""Where a graphed decode step's host time goes, call by call: the decode loop's, the
executor's and the runner's calls (and torch's graph replay, event creation and stream waits)
wrapped with timers inside the engine's own loop, `LLM.generate` of the shipped model, greedy,
256 tokens; per loop step, microseconds and calls, largest first. Compare a call's figure here
with its cost timed alone: on the H100 host every call cost about three times as much inside
the loop. With --k K, MTP steps (k = K, overlap on) and the calls of the graphed MTP step
(launched from the host or chained on the device, its results read and applied); --logprobs N
asks top_logprobs N.

    python benchmarks/gpu/profile_launch.py [--batch 1 64] [--k 3 --logprobs 0]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import pd.engine.cuda_graph as cuda_graph  # noqa: E402
import pd.engine.decode_loop as decode_loop  # noqa: E402
import pd.engine.executor as executor  # noqa: E402
import pd.engine.runner as runner  # noqa: E402
import pd.engine.scheduler as scheduler  # noqa: E402
import pd.spec.graphed as graphed  # noqa: E402
import pd.spec.step_graphs as step_graphs  # noqa: E402
import pd.spec.verify as verify  # noqa: E402
from pd.engine.llm import LLM  # noqa: E402
from pd.wire.sampling_params import SamplingParams  # noqa: E402

SECONDS: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)
TIMED = ((executor.CudaExecutor, "launch"), (runner.ModelRunner, "prepare"),
         (runner.ModelRunner, "prepare_graphed"), (runner.ModelRunner, "sampling_rows"),
         (cuda_graph.DecodeGraphs, "host_inputs"), (runner.ModelRunner, "alloc_output"),
         (runner.ModelRunner, "execute"), (runner.ModelRunner, "forward_rows"),
         (cuda_graph.DecodeGraphs, "launch"), (runner.ModelRunner, "emit"),
         (decode_loop.DecodeLoop, "launch"), (decode_loop.DecodeLoop, "process"),
         (decode_loop.DecodeLoop, "can_predict"), (decode_loop.DecodeLoop, "step"),
         (torch.cuda.CUDAGraph, "replay"), (torch.cuda.Stream, "wait_stream"),
         (decode_loop.DecodeLoop, "spec_step"), (decode_loop.DecodeLoop, "reserve_chain"),
         (decode_loop.DecodeLoop, "process_spec"), (graphed.GraphedSteps, "launch_graphed"),
         (graphed.GraphedSteps, "launch_chained"), (graphed.GraphedSteps, "_finish_launch"),
         (graphed.GraphedSteps, "collect"), (graphed.KnownPart, "patch"),
         (step_graphs.StepGraphs, "chain"), (verify.SpecDecoder, "results"),
         (scheduler.Scheduler, "update_spec"))


def timed(fn, label: str):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SECONDS[label] += time.perf_counter() - t
            CALLS[label] += 1
    return call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--k", type=int, default=0, help="MTP speculative tokens (0: plain decoding)")
    p.add_argument("--logprobs", type=int, default=None, help="top_logprobs (default: none)")
    args = p.parse_args()
    for owner, name in TIMED:
        setattr(owner, name, timed(getattr(owner, name), f"{owner.__name__}.{name}"))
    torch.cuda.Event = timed(torch.cuda.Event, "Event()")  # a class: its constructor
    llm = LLM(None, device="cuda", num_speculative_tokens=args.k, spec_fallback=False)
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True,
                            logprobs=args.logprobs)
    for batch in args.batch:
        prompts = ["def f(x):"] * batch
        llm.generate(prompts, params)  # graphs captured, warm
        SECONDS.clear()
        CALLS.clear()
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        steps = CALLS["DecodeLoop.step"] or 1
        print(f"\n== batch {batch}, k={args.k}, logprobs {args.logprobs}: {steps} loop steps, "
              f"{wall / steps * 1e6:.0f} us of wall per step")
        for label, secs in sorted(SECONDS.items(), key=lambda kv: -kv[1]):
            print(f"  {secs / steps * 1e6:8.1f} us/step  {CALLS[label] / steps:5.2f}x  {label}")


if __name__ == "__main__":
    main()
