"""On a host with two or more GPUs: tensor parallelism's parity and its decode step.

- parity (`--check`): the tiny test model in float32 and bfloat16, greedy, with CUDA graphs:
  two ranks (cuda:0, cuda:1) give one rank's tokens, plain and with MTP (k=2);
- the step: a Llama-3.1-8B-shaped model (random bf16 weights, `--layers` of its 32), the decode
  loop as a decode node runs it (overlap on, CUDA graphs), requests joined with `--prompt-len`
  tokens of KV, at each `--batch`: the step time with one rank and with N ranks, side by side,
  and their ratio (the goal: N=2 at most 0.6x of one rank); with `--profile`, rank 0's kernels
  per step at N ranks.

Each configuration runs in a process of its own under `--timeout`, so one that does not end
(a tensor-parallel group that hangs on close) loses no figure it printed.

    python benchmarks/gpu/bench_tp.py [--check] [--profile] [--tp 2] [--batch 1 64] [--layers 32]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
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
# the harness's own smoke test (`--shape small --device cpu`): the same proportions, tiny
SMALL = dict(LLAMA_8B, hidden_size=256, intermediate_size=896, num_heads=8, num_kv_heads=2,
             head_dim=32, vocab_size=4096)


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
    engine = Engine(EngineConfig(model=model, device=args.device, dtype="bfloat16",
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
            if args.profile and tp > 1:
                profile_kernels(engine, batch, args)
    finally:
        engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def profile_kernels(engine: Engine, batch: int, args, top: int = 12) -> None:
    """Rank 0's device time per decode step by kernel (torch.profiler over one run, its
    requests' set-up included: the copies of their KV show as pageable host-to-device copies)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_once(engine, True, batch, args, 2)
    torch.cuda.synchronize()
    steps = args.steps
    rows = sorted(((e.device_time_total, e.count, e.key) for e in prof.key_averages()
                   if e.device_time_total > 0), reverse=True)[:top]
    print(f"rank 0's kernels at batch {batch}, per step (of {steps}):", flush=True)
    for total, count, key in rows:
        print(f"  {total / steps / 1e3:8.3f} ms {count / steps:6.1f}x  {key[:90]}", flush=True)


def child(args) -> None:
    """One configuration in a process of its own (`--child`): a hang at its end (a tensor
    parallel group that does not close) costs its timeout, not the figures it printed."""
    if args.child == "check":
        sys.exit(0 if check(args.tp) else 1)
    times = step_times(args.model_dir, int(args.child), args.batch, args)
    print("RESULT " + json.dumps({str(b): t for b, t in times.items()}), flush=True)


def run_child(what: str, args, timeout: float) -> tuple[dict | None, object]:
    """Run configuration `what` ("check", or a rank count) in a child process; its figures
    ({batch: (step s, busy s)}, or None) and its exit code ("timeout" past `timeout`)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", what, "--tp", str(args.tp),
           "--batch", *map(str, args.batch), "--prompt-len", str(args.prompt_len),
           "--steps", str(args.steps), "--repeat", str(args.repeat), "--device", args.device]
    if args.profile:
        cmd.append("--profile")
    if args.model_dir:
        cmd += ["--model-dir", args.model_dir]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        out, code = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, code = e.stdout or "", "timeout"
        out = out.decode() if isinstance(out, bytes) else out
    for line in out.splitlines():
        if not line.startswith("RESULT "):
            print(f"  [{what}] {line}")
    found = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    print(f"  [{what}] exit {code}", flush=True)
    return ({int(b): tuple(t) for b, t in found[0].items()} if found else None), code


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="parity first (tiny model)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--timeout", type=float, default=240, help="seconds per configuration")
    p.add_argument("--profile", action="store_true",
                   help="N ranks: rank 0's kernels per step, by device time")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of this script")
    p.add_argument("--shape", choices=["8b", "small"], default="8b",
                   help="the model: Llama-3.1-8B's shape, or a small one of its proportions")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.model_dir = args.model_dir or None
    if args.child:
        child(args)
        return
    if args.device == "cuda":
        print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}", flush=True)
    ok = True
    if args.check:
        ok = run_child("check", args, args.timeout)[1] == 0
    t = time.perf_counter()
    args.model_dir = str(write_tiny_checkpoint(tempfile.mkdtemp(prefix="pd-llama8b-"), "llama",
                                               mtp=False, dtype="bfloat16",
                                               num_layers=args.layers,
                                               **(LLAMA_8B if args.shape == "8b" else SMALL)))
    print(f"{args.shape}-shaped checkpoint ({args.layers} layers) written in {time.perf_counter() - t:.0f} s",
          flush=True)
    one, _ = run_child("1", args, args.timeout)
    many, _ = run_child(str(args.tp), args, args.timeout)
    if one is None or many is None:
        print("no step table: a configuration gave no figures (see its lines above)")
        sys.exit(1)
    print(f"\n{'batch':>5} | {'1 rank ms':>9} {'busy':>7} | {args.tp} ranks ms {'busy':>7} | ratio")
    for b in args.batch:
        print(f"{b:>5} | {one[b][0] * 1e3:>9.3f} {one[b][1] * 1e3:>7.3f} | "
              f"{many[b][0] * 1e3:>10.3f} {many[b][1] * 1e3:>7.3f} | {many[b][0] / one[b][0]:.3f}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
