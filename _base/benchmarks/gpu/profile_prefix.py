"""On a CUDA machine: where the time of a prefill over a cached prefix goes (engine only, no
serving path). A random Llama-3.2-1B-shaped checkpoint; waves of --batch prompts, each a shared
system prompt of --prefix-len tokens and a question of --input-len, one token out, with prefix
caching off and on: the wall time of each wave (after warm-up waves), then the torch profiler's
top CPU and CUDA ops of one cached wave.

    python benchmarks/gpu/profile_prefix.py [--prefix-len 2048 --input-len 128 --batch 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench_decode import LLAMA_1B  # noqa: E402
from pd.engine.llm import LLM  # noqa: E402
from pd.testing.tiny import write_tiny_checkpoint  # noqa: E402
from pd.wire.sampling_params import SamplingParams  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def wave(engine, prompts) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, ONE)
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--waves", type=int, default=6)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    model = str(write_tiny_checkpoint(tempfile.mkdtemp(prefix="pd-prefix-"), "llama", mtp=False,
                                      dtype="bfloat16", **LLAMA_1B))
    rng = np.random.default_rng(0)
    prefix = rng.integers(10, 30000, args.prefix_len).tolist()

    def prompts():
        return [prefix + rng.integers(10, 30000, args.input_len).tolist() for _ in range(args.batch)]

    for caching in (False, True):
        llm = LLM(model, device="cuda", num_blocks=4096, enable_prefix_caching=caching)
        engine = llm.engine
        times = [wave(engine, prompts()) for _ in range(args.waves)]
        print(f"caching {'on ' if caching else 'off'}: wave of {args.batch} x ({args.prefix_len} + "
              f"{args.input_len}) tokens: " + " ".join(f"{t * 1000:.1f}" for t in times) + " ms",
              flush=True)
        if caching:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                wave(engine, prompts())
            for key in ("self_cpu_time_total", "self_cuda_time_total"):
                print(prof.key_averages().table(sort_by=key, row_limit=args.top, max_name_column_width=60))
        engine.close()
        del llm, engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
