"""On a CUDA machine: decode attention over the paged cache, the Triton kernel
(`pd_kernels.paged_decode`) against the engine's torch path (gather + SDPA, `PD_ATTENTION=torch`),
for one layer of a Llama-3.2-1B shape (32 query heads, 8 KV heads, head dim 64, bf16, 16-token
blocks), with achieved GB/s (KV bytes read / time) beside the device-to-device copy bandwidth.
Each path is captured in a CUDA graph and its replays are timed, as the engine runs it (the host
launch cost of either path stays out of the figure); then the kernel alone in each of `VARIANTS`
(keys per split, keys at once, stages, warps, whole), to choose its default.

    python benchmarks/gpu/bench_attention.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import copy_bandwidth, graph_time  # noqa: E402

from pd_kernels.paged_decode import paged_decode  # noqa: E402
from pd.model.attention import paged_attention  # noqa: E402
from pd.model.context import build_context, forward_context  # noqa: E402

KV_HEADS, GROUP, HEAD_DIM, BLOCK = 8, 4, 64, 16
# (keys per split, keys loaded at once, pipelining stages, warps, one program per sequence and
# KV head, a sequence's KV heads in neighbouring programs) of the kernel, timed alone after the
# table (the first two are the defaults below and above `WHOLE_PROGRAMS`: 128-key splits, each
# as one tile, 4 warps); the last three, fewer warps a program: a tile's softmax reduced within
# one or two warps, where four reduce across warps through shared memory and its barriers (the
# batch-64 profile's stall)
VARIANTS = ((128, 128, 1, 4, False, False), (128, 128, 2, 4, True, False),
            (128, 128, 1, 4, False, True), (128, 128, 2, 4, True, True),
            (128, 128, 3, 4, True, True), (128, 64, 3, 4, True, True),
            (128, 64, 2, 4, True, False), (128, 128, 2, 8, True, True), (256, 128, 2, 4, False, False),
            (128, 128, 2, 2, True, True), (128, 64, 2, 2, True, True), (128, 32, 3, 1, True, True))


def main() -> None:
    copy_bw = copy_bandwidth()
    torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}: copy {copy_bw / 1e9:.0f} GB/s (read + write)")
    print(f"{'batch':>5} {'context':>7} | {'triton us':>9} {'GB/s':>6} | {'torch us':>9} {'GB/s':>6} | "
          f"speedup | kernel alone, us, (keys per split, keys at once, stages, warps, whole, "
          f"heads first) = "
          + " ".join(str(v) for v in VARIANTS))
    for batch, ctx_len in ((1, 544), (1, 8192), (8, 1024), (64, 544), (64, 2048), (256, 1024)):
        per_seq = -(-ctx_len // BLOCK)
        num_blocks = batch * per_seq + 1
        gen = torch.Generator(device="cuda").manual_seed(batch)
        shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        k = torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)
        v = torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)
        q = torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
        perm = torch.randperm(num_blocks - 1, device="cpu") + 1
        tables = [perm[b * per_seq:(b + 1) * per_seq].tolist() for b in range(batch)]
        lens = [ctx_len] * batch
        slots = [t[-1] * BLOCK + (ctx_len - 1) % BLOCK for t in tables]
        ctx = build_context([1] * batch, lens, tables, slots, torch.device("cuda"))
        kv_bytes = batch * ctx_len * 2 * KV_HEADS * HEAD_DIM * 2

        def run():
            with forward_context(ctx):
                return paged_attention(q, k, v, HEAD_DIM ** -0.5)

        times = {}
        for variant in VARIANTS:  # the kernel alone in each variant, beside the chosen one
            split, sub, stages, warps, whole, first = variant
            times[variant] = graph_time(
                lambda split=split, sub=sub, stages=stages, warps=warps, whole=whole, first=first:
                paged_decode(q, k, v, ctx.block_tables, ctx.context_lens, HEAD_DIM ** -0.5,
                             use_kernel=True, num_warps=warps, sub_tokens=sub, stages=stages,
                             split_tokens=split, whole=whole, heads_first=first), 50)
        for mode in ("triton", "torch"):
            os.environ["PD_ATTENTION"] = mode
            times[mode] = graph_time(run, 50)
        os.environ.pop("PD_ATTENTION")
        print(f"{batch:>5} {ctx_len:>7} | {times['triton'] * 1e6:>9.1f} {kv_bytes / times['triton'] / 1e9:>6.0f} | "
              f"{times['torch'] * 1e6:>9.1f} {kv_bytes / times['torch'] / 1e9:>6.0f} | "
              f"{times['torch'] / times['triton']:>6.1f}x | "
              + " ".join(f"{times[v] * 1e6:6.1f}" for v in VARIANTS))


if __name__ == "__main__":
    main()
