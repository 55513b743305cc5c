"""`kernels.token_logprob` timed on a CUDA device: rows of a 128k vocabulary (Llama-3's) in
bf16, 20 calls captured in one CUDA graph, the median replay over 20, per call in us: the cost
a step's top_logprobs 0 columns add (an MTP step at batch b has b * (k + 1) rows).

    python benchmarks/gpu/bench_token_logprob.py [--rows 4 16 64 256] [--vocab 128256]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench_decode import graph_time  # noqa: E402

from kernels.token_logprob import split, token_logprob  # noqa: E402


def per_call_us(rows: int, vocab: int, calls: int = 20) -> float:
    x = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, vocab, (rows,), device="cuda")
    token_logprob(x, ids)  # compiled before the capture
    return graph_time(lambda: [token_logprob(x, ids) for _ in range(calls)]) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 16, 64, 256])
    ap.add_argument("--vocab", type=int, default=128256)
    args = ap.parse_args()
    print(f"{'rows':>5} {'segments':>8} {'us/call':>8}")
    for rows in args.rows:
        _, parts, _ = split(rows, args.vocab)
        print(f"{rows:>5} {parts:>8} {per_call_us(rows, args.vocab):8.2f}")


if __name__ == "__main__":
    main()
