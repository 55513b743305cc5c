"""Serving throughput through `pd launch` (router, one prefill and one decode node): `pd bench`
at one concurrency, and beside it the decode node's mean step time and batch size from its own
metrics, so that the serving path can be held against the engine.

    python benchmarks/bench_serving.py                                  # CPU, the embedded model
    python benchmarks/bench_serving.py --device cuda --synthetic-1b     # random Llama-3.2-1B shape
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))

from bench_prefix_cache import launch, mean_seconds, run_bench  # noqa: E402
from pd.config import default_model_dir  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(default_model_dir()))
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--synthetic-1b", action="store_true",
                   help="a random bf16 Llama-3.2-1B-shaped checkpoint with the tiny tokenizer's "
                        "512-token vocabulary")
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    args = p.parse_args()
    if args.synthetic_1b:
        from bench_decode import LLAMA_1B

        from pd.testing.tiny import write_tiny_checkpoint

        args.model = str(write_tiny_checkpoint(tempfile.mkdtemp(prefix="pd-serving-"), "llama",
                                               mtp=False, dtype="bfloat16",
                                               **{**LLAMA_1B, "vocab_size": 512}))
    lau = launch(args)
    try:
        r = run_bench(lau, args, "--num-prompts", str(args.num_prompts),
                      "--random-input-len", str(args.input_len),
                      "--random-output-len", str(args.output_len),
                      "--max-concurrency", str(args.concurrency), "--seed", "3")
        step = mean_seconds(lau, "decode", "pd_step_duration_seconds")
        batch = mean_seconds(lau, "decode", "pd_batch_size") / 1000
    finally:
        lau.stop()
    print(f"{args.device}: {args.num_prompts} prompts of {args.input_len} tokens, "
          f"{args.output_len} out, concurrency {args.concurrency}: "
          f"{r['output_throughput']:.0f} output tok/s, TPOT p50 {r['median_tpot_ms']:.2f} ms, "
          f"ITL p50 / p99 {r['median_itl_ms']:.2f} / {r['p99_itl_ms']:.2f} ms; decode node: "
          f"step {step:.2f} ms, batch {batch:.1f}", flush=True)


if __name__ == "__main__":
    main()
