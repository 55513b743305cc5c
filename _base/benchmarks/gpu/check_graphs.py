"""On a CUDA machine: decode through CUDA graphs (the default) against --enforce-eager.

For the shipped model and a random-weight Llama of 12 layers (hidden 1024), greedy generation of
48 prompts of mixed lengths (so batches shrink step by step and cross graph sizes), in float32
(tokens must be equal) and bfloat16 (equal tokens counted: padding changes matmul shapes, so
bf16 rounding may differ), then the time of one generate call each way.

    python benchmarks/gpu/check_graphs.py
"""

from __future__ import annotations

import random
import sys
import tempfile
import time

import torch

from pd.config import EngineConfig, default_model_dir
from pd.engine.engine import Engine
from pd.wire.sampling_params import SamplingParams
from pd.testing.tiny import write_tiny_checkpoint

SMALL = dict(hidden_size=1024, intermediate_size=2816, num_layers=12, num_heads=16, num_kv_heads=4,
             vocab_size=32000, max_position_embeddings=2048)


def run(model: str, dtype: str, eager: bool, prompts, params) -> tuple[list[list[int]], float, int]:
    engine = Engine(EngineConfig(model=model, device="cuda", dtype=dtype, enforce_eager=eager,
                                 num_blocks=4096))
    engine.generate(prompts[:4], params[:4])  # warm-up (and first captures)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = [r.output_token_ids for r in engine.generate(prompts, params)]
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    graphs = engine.runner.graphs
    return outs, dt, len(graphs.graphs) if graphs else 0


def main() -> int:
    rng = random.Random(0)
    small = write_tiny_checkpoint(tempfile.mkdtemp(prefix="pd-graphs-"), "llama", mtp=False,
                                  dtype="float32", **SMALL)
    failed = False
    print(f"{'model':>10} {'dtype':>9} | {'equal':>7} | {'eager s':>8} {'graphs s':>8} {'speedup':>7} | graphs")
    for name, model in (("tiny-code", str(default_model_dir())), ("small", str(small))):
        vocab = 4000  # below both models' vocabularies
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.choice([3, 17, 40, 150, 600]))]
                   for _ in range(48)]
        params = [SamplingParams(max_tokens=rng.randrange(8, 96), temperature=0.0, ignore_eos=True)
                  for _ in prompts]
        for dtype in ("float32", "bfloat16"):
            eager, t_eager, _ = run(model, dtype, True, prompts, params)
            graph, t_graph, n = run(model, dtype, False, prompts, params)
            same = sum(a == b for a, b in zip(eager, graph))
            if dtype == "float32" and same != len(prompts):
                failed = True
            print(f"{name:>10} {dtype:>9} | {same:>3}/{len(prompts):<3} | {t_eager:>8.3f} {t_graph:>8.3f} "
                  f"{t_eager / t_graph:>6.2f}x | {n}")
    print("FAILED: float32 tokens differ between graphs and eager" if failed else "float32: graphs == eager")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
