"""On a host with two or more GPUs: tensor parallelism's parity and its decode step.

- parity (`--check`): the tiny test model in float32 and bfloat16, greedy, with CUDA graphs:
  two ranks (cuda:0, cuda:1) give one rank's tokens, plain and with MTP (k=2);
- the step: a Llama-3.1-8B-shaped model (random bf16 weights, `--layers` of its 32), the decode
  loop as a decode node runs it (overlap on, CUDA graphs), requests joined with `--prompt-len`
  tokens of KV, at each `--batch`: the step time with one rank and with N ranks, side by side,
  and their ratio (the goal: N=2 at most 0.6x of one rank).

    python benchmarks/gpu/bench_tp.py [--check] [--tp 2] [--batch 1 64] [--layers 32]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_overlap import run_once  # noqa: E402

from pd.config import EngineConfig  # noqa: E402
from pd.engine.engine import Engine  # noqa: E402
from pd.engine.llm import LLM  # noqa: E402
from pd.testing.tiny import write_tiny_checkpoint  # noqa: E402
from pd.wire.sampling_params import SamplingParams  # noqa: E402

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8,
                head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                rope_theta=500000.0, tie_word_embeddings=False)


def check(tp: int) -> bool:
    model = write_tiny_checkpoint(tempfile.mkdtemp(prefix="pd-tp-tiny-"), "llama", mtp=True,
                                  num_layers=4, hidden_size=128, num_heads=8, num_kv_heads=4,
                                  intermediate_size=256)
    prompts = [[5, 17, 42, 99, 3], [7], list(range(100, 160)), list(range(3, 40, 2))]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    ok = True
    for dtype in ("float32", "bfloat16"):
        outs = {}
        for name, kw in (("1 rank", {}), (f"{tp} ranks", dict(tensor_parallel_size=tp)),
                         (f"{tp} ranks MTP k=2", dict(tensor_parallel_size=tp,
                                                      num_speculative_tokens=2))):
            with LLM(model, device="cuda", dtype=dtype, num_blocks=256, **kw) as llm:
                outs[name] = [o.token_ids for o in llm.generate(prompts, params)]
        ref = outs["1 rank"]
        for name, toks in outs.items():
            same = sum(a == b for a, b in zip(ref, toks))
            print(f"parity {dtype:>8} {name:>16}: {same}/{len(ref)} prompts equal one rank's")
            # NOTE: bf16 sums in another order may flip a near tie: informative only
            ok &= dtype != "float32" or same == len(ref)
    return ok


def step_times(model: str, tp: int, batches: list[int], args) -> dict[int, tuple[float, float]]:
    """{batch: (step seconds, device busy seconds)} of the decode loop at `tp` ranks."""
    max_ctx = args.prompt_len + args.steps + 16
    t = time.perf_counter()
    engine = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16",
                                 max_num_seqs=max(batches), max_model_len=4096,
                                 num_blocks=max(batches) * max_ctx // 16 + 64,
                                 tensor_parallel_size=tp))
    print(f"{tp} rank(s): engine up in {time.perf_counter() - t:.1f} s", flush=True)
    out = {}
    try:
        for batch in batches:
            run_once(engine, True, batch, args, 1)  # warm-up (captures)
            runs = sorted((run_once(engine, True, batch, args, 1) for _ in range(args.repeat)),
                          key=lambda r: r[0])
            tps, _, _, _, busy = runs[len(runs) // 2]
            out[batch] = (batch / tps, busy)
    finally:
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="parity first (tiny model)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}")
    ok = check(args.tp) if args.check else True
    t = time.perf_counter()
    model = str(write_tiny_checkpoint(tempfile.mkdtemp(prefix="pd-llama8b-"), "llama", mtp=False,
                                      dtype="bfloat16", num_layers=args.layers, **LLAMA_8B))
    print(f"8B-shaped checkpoint ({args.layers} layers) written in {time.perf_counter() - t:.0f} s",
          flush=True)
    one = step_times(model, 1, args.batch, args)
    many = step_times(model, args.tp, args.batch, args)
    print(f"\n{'batch':>5} | {'1 rank ms':>9} {'busy':>7} | {args.tp} ranks ms {'busy':>7} | ratio")
    for b in args.batch:
        print(f"{b:>5} | {one[b][0] * 1e3:>9.3f} {one[b][1] * 1e3:>7.3f} | "
              f"{many[b][0] * 1e3:>10.3f} {many[b][1] * 1e3:>7.3f} | {many[b][0] / one[b][0]:.3f}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
