"""On a CUDA machine: a fresh prompt's prefill time (1k and 8k tokens, the 1B shape) with prefix
caching on and off in one run, and where the host time of one goes (profiler, CPU side)."""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_decode import LLAMA_1B, prefill_seconds  # noqa: E402
from pd.config import EngineConfig  # noqa: E402
from pd.engine.engine import Engine  # noqa: E402
from pd.testing.tiny import write_tiny_checkpoint  # noqa: E402

model = str(write_tiny_checkpoint(tempfile.mkdtemp(prefix="pd-llama1b-"), "llama", mtp=False,
                                  dtype="bfloat16", **LLAMA_1B))
for caching in (False, True):
    engine = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", max_num_seqs=64,
                                 max_model_len=16384, num_blocks=3300, max_num_batched_tokens=8192,
                                 enable_prefix_caching=caching))
    figures = {n: prefill_seconds(engine, n) * 1000 for n in (1024, 8192)}
    print(f"caching {'on ' if caching else 'off'}: " +
          ", ".join(f"{n}: {ms:.2f} ms" for n, ms in figures.items()), flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        prefill_seconds(engine, 8192)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8,
                                    max_name_column_width=50))
    engine.close()
    del engine
    torch.cuda.empty_cache()
