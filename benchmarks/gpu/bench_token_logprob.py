"""`pd_kernels.token_logprob` timed on a CUDA device: rows of a 128k vocabulary (Llama-3's) in
bf16, 20 calls captured in one CUDA graph, the median replay over 20, per call in us: the cost
a step's top_logprobs 0 columns add (an MTP step at batch b has b * (k + 1) rows). Then an MTP
step's whole top_logprobs 0 tail (`pd.spec.step_graphs.StepGraphs._with_lp0`: its result [S, 3k + 4]
followed by its S * (k + 1) rows' pairs) as the graphs build it, the ids read in place and the
pairs written in place, beside the way before it (the accepted columns clamped into a copy, the
pairs concatenated after the result).

    python benchmarks/gpu/bench_token_logprob.py [--rows 4 16 64 256] [--vocab 128256] [--k 3]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench_decode import graph_time  # noqa: E402

from pd_kernels.token_logprob import split, token_logprob  # noqa: E402


def per_call_us(rows: int, vocab: int, calls: int = 20) -> float:
    x = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, vocab, (rows,), device="cuda")
    token_logprob(x, ids)  # compiled before the capture
    return graph_time(lambda: [token_logprob(x, ids) for _ in range(calls)]) / calls * 1e6


def tail_us(slots: int, k: int, vocab: int, in_place: bool, calls: int = 20) -> float:
    """Per call: an MTP step's top_logprobs 0 tail over `slots` slots."""
    k1, width = k + 1, 3 * k + 4
    x = torch.randn(slots * k1, vocab, device="cuda", dtype=torch.bfloat16)
    result = torch.randint(-1, vocab, (slots, width), device="cuda")

    def tail() -> torch.Tensor:
        if not in_place:
            lp = token_logprob(x, result[:, :k1].clamp(min=0).reshape(-1), int_ranks=True)
            return torch.cat([result, lp.view(torch.int64).view(slots, k1)], dim=1)
        out = torch.empty(slots, width + k1, dtype=torch.int64, device="cuda")
        out[:, :width].copy_(result)
        token_logprob(x, result[:, :k1], int_ranks=True,
                      out=out[:, width:].view(torch.int32).view(slots, k1, 2))
        return out

    tail()  # compiled before the capture
    return graph_time(lambda: [tail() for _ in range(calls)]) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 16, 64, 256])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--k", type=int, default=3, help="MTP draft tokens of the tail's step")
    args = ap.parse_args()
    print(f"{'rows':>5} {'segments':>8} {'us/call':>8}")
    for rows in args.rows:
        _, parts, _ = split(rows, args.vocab)
        print(f"{rows:>5} {parts:>8} {per_call_us(rows, args.vocab):8.2f}")
    print(f"\nan MTP step's top_logprobs 0 tail, k = {args.k}, us/call")
    print(f"{'slots':>5} {'clamp+cat':>10} {'in place':>9}")
    for slots in (1, 16):
        before = tail_us(slots, args.k, args.vocab, in_place=False)
        print(f"{slots:>5} {before:10.2f} {tail_us(slots, args.k, args.vocab, in_place=True):9.2f}")


if __name__ == "__main__":
    main()
