"""Decode throughput and step gap with the overlap scheduler on and off, side by side: the decode
loop alone (`pd.engine.decode_loop.DecodeLoop`, as a decode node runs it, without sockets), requests
injected as a decode node joins them after a KV import (KV blocks filled with random values,
`num_computed_tokens` = prompt length), greedy, `--steps` tokens each.

    .venv/bin/python benchmarks/bench_overlap.py [--device cuda] [--model DIR | --synthetic NAME]
        [--batch 1 8 64] [--steps 64] [--prompt-len 128] [--repeat 3] [--check-sync] [--parity 64]

For each batch size and mode it prints tokens/s (median of --repeat runs after a warm-up run)
and the step gap (device idle time between two steps: CUDA events on a GPU, the worker's wall
clock on CPU) p50/p99 over all steps of those runs, then the on/off throughput ratio; both
modes' tokens are compared (they must be equal). `--check-sync` runs one overlap pass with
`torch.cuda.set_sync_debug_mode("error")` around the launches to show no launch waits on the GPU.
Timings only, no assertions in the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from pd.config import EngineConfig, default_model_dir
from pd.engine.engine import Engine
from pd.engine.decode_loop import DecodeLoop
from pd.engine.request import Req
from pd.wire.sampling_params import SamplingParams

# Random-weight Llama checkpoints written by pd.testing.tiny for timing (no quality claims).
SYNTHETIC = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2),
    "small": dict(hidden_size=1024, intermediate_size=2816, num_layers=12, num_heads=16,
                  num_kv_heads=4, vocab_size=32000, max_position_embeddings=2048),
}


def inject(engine: Engine, batch: int, prompt_len: int, steps: int, seed: int) -> list[Req]:
    """Join `batch` requests as a decode node does after their KV arrived."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    kv = engine.runner.kv_cache.kv
    reqs = []
    for i in range(batch):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        req = Req(f"r{i}", prompt, params)
        req.append_token(int(torch.randint(3, vocab, (1,), generator=gen)))  # the first token
        req.block_ids = engine.allocator.allocate(engine.scheduler.blocks_needed(req, req.num_tokens))
        # its "imported" KV: random, a function of the request alone (not of which blocks)
        shape = (kv.shape[0], 2, len(req.block_ids)) + tuple(kv.shape[3:])
        kv[:, :, req.block_ids] = torch.randn(shape, generator=gen).mul_(0.5).to(kv.device, kv.dtype)
        req.num_computed_tokens = prompt_len
        engine.scheduler.add_running(req)
        reqs.append(req)
    return reqs


def run_once(engine: Engine, overlap: bool, batch: int, args, seed: int, check_sync: bool = False):
    loop = DecodeLoop(engine.runner, engine.scheduler, overlap=overlap)
    reqs = inject(engine, batch, args.prompt_len, args.steps, seed)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    if check_sync:
        torch.cuda.set_sync_debug_mode("error")
    start = time.perf_counter()
    try:
        while loop.has_work:
            loop.step()
    finally:
        if check_sync:
            torch.cuda.set_sync_debug_mode(0)
    elapsed = time.perf_counter() - start
    loop.close()
    engine.allocator.check_integrity()
    tokens = sum(r.num_output_tokens - 1 for r in reqs)  # the first came with the KV
    return (tokens / elapsed, list(loop.gaps.window), [r.output_token_ids for r in reqs],
            elapsed / max(1, len(loop.busy)), statistics.median(loop.busy))


def parity(engine_of, num: int, seed: int = 0) -> None:
    """`num` greedy requests of mixed prompt/output lengths arriving at random steps, prefilled
    and decoded by the loop: tokens with overlap vs without (must be equal), and vs the
    single-process engine running them all at once (batch composition differs: informative)."""
    import random

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.choice([1, 5, 16, 17, 60, 150]))]
               for _ in range(num)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0.0, ignore_eos=True)
              for _ in range(num)]
    arrivals = sorted(rng.randrange(0, 100) for _ in range(num))
    outputs = {}
    for overlap in (False, True):
        engine = engine_of()
        loop = DecodeLoop(engine.runner, engine.scheduler, overlap=overlap)
        reqs = [Req(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        step = k = 0
        while k < num or loop.has_work:
            while k < num and arrivals[k] <= step:
                engine.scheduler.add(reqs[k])
                k += 1
            loop.step()
            step += 1
        loop.close()
        engine.allocator.check_integrity()
        outputs[overlap] = [r.output_token_ids for r in reqs]
    engine = engine_of()
    refs = engine.generate(prompts, params)
    same_ref = sum(r.output_token_ids == o for r, o in zip(refs, outputs[True]))
    print(f"parity: {num} requests, overlap == no-overlap: {outputs[True] == outputs[False]}; "
          f"equal to the single-process engine: {same_ref}/{num}")


def model_dir(args) -> str:
    if args.synthetic:
        from pd.testing.tiny import write_tiny_checkpoint

        out = tempfile.mkdtemp(prefix=f"pd-bench-{args.synthetic}-")
        dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
        return str(write_tiny_checkpoint(out, "llama", mtp=False, dtype=dtype, **SYNTHETIC[args.synthetic]))
    return args.model or str(default_model_dir())


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e6 if xs else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default=None, help="model directory (default: embedded pd-tiny-code)")
    p.add_argument("--synthetic", choices=sorted(SYNTHETIC), default=None,
                   help="time a random-weight checkpoint of this size instead")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--steps", type=int, default=64, help="decode steps per run")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no decode CUDA graphs")
    p.add_argument("--check-sync", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="print the host time of the top torch ops of one overlap run and exit")
    p.add_argument("--parity", type=int, default=0, metavar="N",
                   help="first compare tokens with and without overlap for N requests")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = model_dir(args)
    max_tokens = max(args.batch) * (args.prompt_len + args.steps + 16)
    if args.parity:
        parity(lambda: Engine(EngineConfig(model=model, device=args.device, num_blocks=1024,
                                           enforce_eager=args.enforce_eager)),
               args.parity)
    engine = Engine(EngineConfig(model=model, device=args.device, max_num_seqs=max(args.batch),
                                 num_blocks=max_tokens // 16 + 8, max_num_batched_tokens=4096,
                                 enforce_eager=args.enforce_eager))
    mc = engine.model_config
    print(f"model {mc.model_id}: {mc.num_layers} layers, hidden {mc.hidden_size}, vocab "
          f"{mc.vocab_size}, {engine.runner.dtype} on {args.device}"
          f"{' (CUDA graphs)' if engine.runner.graphs else ''}; prompt {args.prompt_len}, "
          f"{args.steps} steps, median of {args.repeat}")
    if args.profile:
        from torch.profiler import profile

        run_once(engine, True, max(args.batch), args, 5)
        with profile() as prof:
            run_once(engine, True, max(args.batch), args, 5)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        return
    if args.check_sync and args.device.startswith("cuda"):
        run_once(engine, True, max(args.batch), args, 99)  # warm-up outside the check
        probe = Engine(engine.config)  # a failed check leaves requests behind: not in this engine
        run_once(probe, True, max(args.batch), args, 99)
        try:
            run_once(probe, True, max(args.batch), args, 99, check_sync=True)
            print("sync check: no synchronizing CUDA call in an overlap run")
        except RuntimeError as e:
            print(f"sync check: FAILED: {e}")
        del probe
    rows = []
    for batch in args.batch:
        result = {}
        for overlap in (False, True):
            run_once(engine, overlap, batch, args, 1)  # warm-up
            runs = [run_once(engine, overlap, batch, args, 1) for _ in range(args.repeat)]
            tps = statistics.median(r[0] for r in runs)
            gaps = [g for r in runs for g in r[1]]
            result[overlap] = (tps, pct(gaps, 0.5), pct(gaps, 0.99), runs[0][2],
                               statistics.median(r[3] for r in runs) * 1e6,
                               statistics.median(r[4] for r in runs) * 1e6,
                               all(r[2] == runs[0][2] for r in runs))
        same = result[False][3] == result[True][3]
        rows.append((batch, result, same))
    print("\nstep = wall time per step; busy = device time per step (start to end event, or the "
          "worker's run); same: on==off / off==off / on==on over the runs")
    print(f"{'batch':>5} | {'off tok/s':>9} {'gap p50':>7} {'gap p99':>7} {'step us':>7} {'busy us':>7} | "
          f"{'on tok/s':>9} {'gap p50':>7} {'gap p99':>7} {'step us':>7} {'busy us':>7} | {'on/off':>6} | same")
    for batch, r, same in rows:
        off, on = r[False], r[True]
        print(f"{batch:>5} | {off[0]:>9.0f} {off[1]:>7.1f} {off[2]:>7.1f} {off[4]:>7.0f} {off[5]:>7.0f} | "
              f"{on[0]:>9.0f} {on[1]:>7.1f} {on[2]:>7.1f} {on[4]:>7.0f} {on[5]:>7.0f} | "
              f"{on[0] / off[0]:>6.2f} | {same}/{off[6]}/{on[6]}")


if __name__ == "__main__":
    main()
