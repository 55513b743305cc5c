"""On a CUDA machine: the skinny-GEMM kernel (`kernels.skinny_linear`) against cuBLAS
(`F.linear`) for the linear layers of the Llama-3.2-1B shape at 1-16 rows, bf16: each
configuration's time and achieved weight bandwidth, the best per shape, and its error against
float64. Weights rotate through enough copies to overflow L2 (as a model's layers do), inside
one CUDA graph, so the figures are HBM streams without launch gaps.

    python benchmarks/gpu/bench_skinny.py [--rows 1 8] [--quick]
"""

from __future__ import annotations

import argparse
import itertools

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import graph_time  # noqa: E402

from kernels.skinny_linear import skinny_linear  # noqa: E402

SHAPES = {"qkv": (3072, 2048), "o_proj": (2048, 2048), "gate_up": (16384, 2048),
          "down": (2048, 8192), "lm_head": (128256, 2048)}


def per_call(fn, copies: int) -> float:
    """Seconds per call of fn(i) for i over the copies, from a CUDA graph of one pass."""
    return graph_time(lambda: [fn(i) for i in range(copies)]) / copies


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--quick", action="store_true", help="fewer configurations")
    args = p.parse_args()
    if args.quick:
        grid = list(itertools.product((16, 32), (256, 512), (4,), (4,)))
    else:
        grid = list(itertools.product((16, 32, 64), (256, 512), (3, 4, 6), (4, 8)))
    print(f"{torch.cuda.get_device_name()}; {len(grid)} configurations (BN, BK, stages, warps)")
    best_rows = []
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, -(-(256 << 20) // nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.double(), ws[0].double())
            t_cublas = per_call(lambda i: F.linear(x, ws[i]), copies)
            results = []
            for cfg in grid:
                if cfg[0] > n:
                    continue
                try:
                    t = per_call(lambda i: skinny_linear(x, ws[i], use_kernel=True, config=cfg), copies)
                except Exception as e:  # out of shared memory and the like
                    print(f"  {name} m={m} {cfg}: {type(e).__name__}")
                    continue
                results.append((t, cfg))
            t_best, cfg = min(results)
            y = skinny_linear(x, ws[0], use_kernel=True, config=cfg)
            err = ((y.double() - ref).norm() / ref.norm()).item()
            print(f"{name:>8} m={m:<2} cuBLAS {t_cublas * 1e6:7.1f} us {nbytes / t_cublas / 1e12:5.2f} TB/s"
                  f" | skinny best {t_best * 1e6:7.1f} us {nbytes / t_best / 1e12:5.2f} TB/s {cfg}"
                  f" | x{t_cublas / t_best:4.2f} err {err:.1e}")
            for t, c in sorted(results)[:3]:
                print(f"      {c}: {t * 1e6:7.1f} us")
            best_rows.append((name, m, cfg, t_cublas / t_best))
        del ws
        torch.cuda.empty_cache()
    print("\nshape  rows  best config  speedup over cuBLAS")
    for name, m, cfg, sp in best_rows:
        print(f"{name:>8} {m:>3}  {cfg}  {sp:.2f}x")


if __name__ == "__main__":
    main()
