"""On a CUDA machine: the skinny-GEMM kernel (`pd_kernels.skinny_linear`) against cuBLAS (`F.linear`)
for the linear layers of the Llama-3.2-1B shape (or `--model`'s) at 1-64 rows, bf16: each
configuration's time and achieved weight bandwidth, the best per shape and row count, and its
error against float64. Weights rotate through enough copies to overflow L2 (as a model's layers
do), inside one CUDA graph, so the figures are HBM streams without launch gaps (and, with
programmatic dependent launch, with each call's weight prefetch overlapping the call before).
The closing table is what `SHAPES` takes.

With --prologues instead: the embedded model's products that follow a norm, with the norm as
the kernel's prologue (`pd_kernels.norm_linear`) against the two kernels it replaces
(the norm, then the product), each in a CUDA graph of its launches back to back (the model's
weights fit in L2, as in its decode step): what `PROLOGUE_SHAPES` takes.

    python benchmarks/gpu/bench_skinny.py [--model 1b|8b|8b-tp2] [--rows 1 16 32 64] [--quick]
    python benchmarks/gpu/bench_skinny.py --prologues [--rows 1 4 16]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import graph_time  # noqa: E402

from pd_kernels.rms_norm import rms_norm  # noqa: E402
from pd_kernels.norm_linear import norm_linear  # noqa: E402
from pd_kernels.skinny_linear import row_bucket, skinny_linear  # noqa: E402

SHAPES = {"qkv": (3072, 2048), "o_proj": (2048, 2048), "gate_up": (16384, 2048),
          "down": (2048, 8192), "lm_head": (128256, 2048)}
# Llama-3.1-8B's layers whole (one rank) and as each of two tensor-parallel ranks holds them
# (`pd.model.parallel`: QKV and gate/up split by output rows, o/down by input columns, the LM
# head by vocabulary rows)
MODELS = {
    "1b": SHAPES,
    "8b": {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
           "down": (4096, 14336), "lm_head": (128256, 4096)},
    "8b-tp2": {"qkv": (3072, 4096), "o_proj": (4096, 2048), "gate_up": (14336, 4096),
               "down": (4096, 7168), "lm_head": (64128, 4096)},
}


def per_call(fn, copies: int) -> float:
    """Seconds per call of fn(i) for i over the copies, from a CUDA graph of one pass."""
    return graph_time(lambda: [fn(i) for i in range(copies)]) / copies


def grid(n: int, k: int, bm: int, quick: bool) -> list[tuple[int, int, int, int, int]]:
    """(BN, BK, SPLITS, STAGES, warps) worth timing for an [n, k] weight and BM rows: enough
    programs to fill the GPU (132 SMs on an H100) without slicing K below two steps per
    program, and pipeline stages that fit in shared memory."""
    out = []
    for bn, bk, splits, stages, warps in itertools.product(
            (16, 32, 64, 128), (128, 256, 512), (1, 2, 4, 8), (3, 4), (4, 8)):
        programs = -(-n // bn) * splits
        if (k // splits < 2 * bk or not 120 <= programs <= 2200 or (warps == 8 and bn < 64)
                or (bm + bn) * bk * 2 * stages > 200 << 10):
            continue
        if quick and (stages == 3 or warps == 8):
            continue
        out.append((bn, bk, splits, stages, warps))
    return out


# the embedded model's (pd-tiny-code) products after a norm: N, K
PROLOGUE_PRODUCTS = {"qkv": (512, 256), "gate_up": (1536, 256), "lm_head": (4096, 256)}
PROLOGUE_CONFIGS = [(16, 256, 1, s, w) for s in (1, 2, 3) for w in (2, 4)] + [
    (32, 256, 1, 1, 4), (16, 128, 1, 1, 4)]


def prologues(rows: list[int]) -> None:
    launches = 40
    for name, (n, k) in PROLOGUE_PRODUCTS.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        g = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            r = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_two = per_call(lambda i: skinny_linear(rms_norm(x, g, 1e-6, r)[0], w), launches)
            results = []
            for cfg in PROLOGUE_CONFIGS:
                try:
                    results.append((per_call(lambda i: norm_linear(
                        x, g, 1e-6, w, None, r, use_kernel=True, config=cfg), launches), cfg))
                except Exception as e:  # out of registers or shared memory
                    print(f"  {name} m={m} {cfg}: {type(e).__name__}")
            t_best, cfg = min(results)
            print(f"{name:>8} ({n}, {k}) m={m:<2} two kernels {t_two * 1e6:5.2f} us | one "
                  f"{t_best * 1e6:5.2f} us {cfg} x{t_two / t_best:4.2f} | next: "
                  + ", ".join(f"{c} {t * 1e6:.2f}" for t, c in sorted(results)[1:3]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64])
    p.add_argument("--model", choices=list(MODELS), default="1b",
                   help="whose layers: Llama-3.2-1B, Llama-3.1-8B, or one of two TP ranks of it")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--quick", action="store_true", help="fewer configurations")
    p.add_argument("--prologues", action="store_true",
                   help="the embedded model's products after a norm, with it as their prologue or not")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}; configurations are (BN, BK, SPLITS, STAGES, warps)")
    if args.prologues:
        prologues(args.rows)
        return
    start, table = time.perf_counter(), []
    for name in args.shapes:
        n, k = MODELS[args.model][name]
        nbytes = n * k * 2
        copies = max(2, -(-(256 << 20) // nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in args.rows:
            configs = grid(n, k, row_bucket(m), args.quick)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.double(), ws[0].double())
            t_cublas = per_call(lambda i: F.linear(x, ws[i]), copies)
            results = []
            for cfg in configs:
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
                  f" | kernel best {t_best * 1e6:7.1f} us {nbytes / t_best / 1e12:5.2f} TB/s {cfg}"
                  f" | x{t_cublas / t_best:4.2f} err {err:.1e}")
            for t, c in sorted(results)[1:3]:
                print(f"      {c}: {t * 1e6:7.1f} us")
            table.append((name, n, k, m, cfg, t_cublas / t_best))
        ws.clear()
        torch.cuda.empty_cache()
    print(f"\n({time.perf_counter() - start:.0f} s) shape rows BM  best config  speedup over "
          "cuBLAS")
    for name, n, k, m, cfg, sp in table:
        print(f"{name:>8} {m:>3} {row_bucket(m):>3}  ({n}, {k}, {row_bucket(m)}): {cfg},  # {sp:.2f}x")


if __name__ == "__main__":
    main()
