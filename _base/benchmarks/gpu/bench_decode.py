"""On a CUDA machine: pd's decode step and prefill for a Llama-3.2-1B-shaped model (random bf16
weights) beside their floors and beside Hugging Face `transformers` `generate()` on the same
weights, in one run.

- ceilings, measured here: device-to-device copy bandwidth (bytes read + written over time, a
  1 GiB copy) and the bf16 matmul rate (8192^3);
- decode: the decode loop as a decode node runs it (overlap on, CUDA graphs unless
  --enforce-eager), requests joined with `--prompt-len` tokens of KV, `--steps` steps; the step
  time beside the bandwidth floor = (weight bytes + KV bytes read in a step) / copy bandwidth,
  with the device's busy time per step (start to end event, median) and the idle gap between
  steps (p50): a gap near zero means the device, not the host, sets the step;
- HF: `generate()` (greedy, `--steps` new tokens, same prompts' length) decode tokens/s, its
  prefill subtracted (a generate of one new token timed alone);
- prefill: one prompt of 1k and 8k tokens through the engine (first token), tokens/s beside the
  matmul floor = (2 * non-embedding params * T + 2 * T^2 * hidden * layers + LM head) / rate.

    python benchmarks/gpu/bench_decode.py [--batch 1 8 64] [--prompt-len 512] [--steps 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_overlap import run_once  # noqa: E402

from pd.config import EngineConfig  # noqa: E402
from pd.engine.engine import Engine  # noqa: E402
from pd.wire.sampling_params import SamplingParams  # noqa: E402
from pd.testing.tiny import write_tiny_checkpoint  # noqa: E402

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                num_kv_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=16384,
                rope_theta=500000.0, tie_word_embeddings=True)


def timed(fn, repeat: int = 5) -> float:
    """Median seconds of `fn` over `repeat` runs after one warm-up, CUDA events."""
    fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


def graph_time(fn, repeat: int = 20) -> float:
    """Median seconds of one replay of a CUDA graph of `fn()`: warmed up on a side stream
    (compilation, the allocator), captured, then `timed`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timed(graph.replay, repeat)


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, counting bytes read and written."""
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB of float32
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), 20)


def ceilings() -> tuple[float, float]:
    copy_bw = copy_bandwidth()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    rate = 2 * 8192**3 / timed(lambda: a @ b, 20)
    del a, b
    torch.cuda.empty_cache()
    return copy_bw, rate


def hf_decode_tps(model_dir: str, batch: int, prompt_len: int, steps: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32000, (batch, prompt_len), generator=gen).cuda()
    mask = torch.ones_like(ids)

    def run(n):
        return lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                      min_new_tokens=n, do_sample=False, pad_token_id=0)

    t_prefill = timed(run(1), 3)
    t_all = timed(run(steps), 3)
    del model
    torch.cuda.empty_cache()
    return batch * (steps - 1) / (t_all - t_prefill)


def prefill_seconds(engine: Engine, prompt_len: int, repeat: int = 3) -> float:
    """Median seconds of a prefill (the first token) of a fresh prompt (so that no prefix is
    cached), the prompts made before the clock starts."""
    gen = torch.Generator().manual_seed(prompt_len)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompts = iter([torch.randint(3, 32000, (prompt_len,), generator=gen).tolist()
                    for _ in range(repeat + 1)])

    def run():
        engine.generate([next(prompts)], [params])

    return timed(run, repeat)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prefill", type=int, nargs="*", default=[1024, 8192],
                   help="prompt lengths to time prefill at (none: skip prefill)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-hf", action="store_true", help="skip transformers generate()")
    args = p.parse_args()
    args.repeat = 3
    model = str(write_tiny_checkpoint(tempfile.mkdtemp(prefix="pd-llama1b-"), "llama", mtp=False,
                                      dtype="bfloat16", **LLAMA_1B))
    copy_bw, rate = ceilings()
    print(f"device {torch.cuda.get_device_name()}: copy {copy_bw / 1e12:.2f} TB/s (read + write), "
          f"bf16 matmul {rate / 1e12:.0f} TFLOP/s")

    max_ctx = args.prompt_len + args.steps + 16
    engine = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16",
                                 max_num_seqs=max(args.batch), max_model_len=16384,
                                 num_blocks=max(max(args.batch) * max_ctx // 16 + 64, 8192 // 16 + 64),
                                 max_num_batched_tokens=max([8192, *args.prefill]),
                                 enforce_eager=args.enforce_eager))
    mc = engine.model_config
    params = sum(t.numel() for t in engine.runner.model.parameters())
    embed = mc.vocab_size * mc.hidden_size
    weight_bytes = params * 2  # tied: the embedding matrix is read once, as the LM head
    kv_per_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 2
    print(f"model: {params / 1e9:.3f}B params ({weight_bytes / 2**30:.2f} GiB bf16), {mc.num_layers} "
          f"layers, KV {kv_per_token / 1024:.0f} KiB per token; "
          f"{'eager' if args.enforce_eager else 'CUDA graphs'}\n")

    print(f"{'batch':>5} | {'step ms':>8} {'busy ms':>8} {'gap us':>7} {'floor ms':>8} {'ratio':>6} | "
          f"{'pd tok/s':>9} {'HF tok/s':>9} {'pd/HF':>6}")
    for batch in args.batch:
        run_once(engine, True, batch, args, 1)  # warm-up (captures)
        runs = sorted((run_once(engine, True, batch, args, 1) for _ in range(args.repeat)),
                      key=lambda r: r[0])
        tps, gaps, _, _, busy = runs[len(runs) // 2]
        gap = sorted(gaps)[len(gaps) // 2] if gaps else float("nan")
        step = batch / tps
        ctx = args.prompt_len + args.steps / 2  # mean context over the run
        floor = (weight_bytes + batch * ctx * kv_per_token) / copy_bw
        hf = float("nan") if args.no_hf else hf_decode_tps(model, batch, args.prompt_len, args.steps)
        print(f"{batch:>5} | {step * 1e3:>8.3f} {busy * 1e3:>8.3f} {gap * 1e6:>7.1f} "
              f"{floor * 1e3:>8.3f} {step / floor:>6.2f} | {tps:>9.0f} {hf:>9.0f} {tps / hf:>6.1f}")

    if args.prefill:
        print(f"\n{'prompt':>6} | {'prefill ms':>10} {'tok/s':>9} | {'floor ms':>8} {'ratio':>6}")
    for n in args.prefill:
        secs = prefill_seconds(engine, n)
        flops = (2 * (params - embed) * n + 2 * n * n * mc.hidden_size * mc.num_layers
                 + 2 * embed)
        floor = flops / rate
        print(f"{n:>6} | {secs * 1e3:>10.2f} {n / secs:>9.0f} | {floor * 1e3:>8.2f} {secs / floor:>6.2f}")


if __name__ == "__main__":
    main()
