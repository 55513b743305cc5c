"""Microseconds per sampler step over a 32k vocabulary, batch 1/32/256: greedy and sampled
(temperature + top-k + top-p), with and without logprobs (5 top), seeded sampling, top-p alone
(its full-sort fallback) and penalties (each row: 286 prompt and 100 output tokens).

    .venv/bin/python benchmarks/bench_sampler.py [--device cuda] [--vocab 32000] [--threads 1]

Prints one table; timings only, no assertions. Logits are random, made once per batch size.
"""

from __future__ import annotations

import argparse
import time

import torch

from pd.engine.sampler import Sampler, SamplingRow
from pd.wire.sampling_params import SamplingParams

MODES = {
    "greedy": dict(temperature=0.0),
    "greedy+logprobs": dict(temperature=0.0, logprobs=5),
    "sampled": dict(temperature=0.8, top_k=50, top_p=0.95),
    "sampled+logprobs": dict(temperature=0.8, top_k=50, top_p=0.95, logprobs=5),
    "sampled temp only": dict(temperature=0.8),
    "sampled seeded": dict(temperature=0.8, top_k=50, top_p=0.95, seed=1),
    # random logits are flat: top-p 0.95 alone needs more than the 256 candidates -> full sort
    "top-p only (sort)": dict(temperature=0.8, top_p=0.95),
    "greedy+penalties": dict(temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.5),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(sampler: Sampler, logits: torch.Tensor, rows, min_time: float) -> float:
    """Mean seconds per call, after one warm-up call, over at least `min_time` seconds."""
    sampler(logits, rows)
    sync(logits.device)
    n, start = 0, time.perf_counter()
    while True:
        sampler(logits, rows)
        n += 1
        sync(logits.device)
        elapsed = time.perf_counter() - start
        if elapsed >= min_time and n >= 3:
            return elapsed / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sampler = Sampler(0)
    gen = torch.Generator(device=device).manual_seed(0)
    print(f"device={device} vocab={args.vocab} torch={torch.__version__} "
          f"threads={torch.get_num_threads()}")
    print(f"{'mode':<20}" + "".join(f"{f'B={b} us/step':>16}" for b in args.batch))
    logits = {b: torch.randn(b, args.vocab, device=device, generator=gen) * 3 for b in args.batch}
    prompt = list(range(0, 2000, 7))
    for name, kw in MODES.items():
        cells = []
        for b in args.batch:
            rows = [SamplingRow(SamplingParams(**kw), list(range(i, i + 100)), prompt, 100, (2,))
                    for i in range(b)]
            cells.append(time_step(sampler, logits[b], rows, args.min_time) * 1e6)
        print(f"{name:<20}" + "".join(f"{c:>16.1f}" for c in cells))


if __name__ == "__main__":
    main()
