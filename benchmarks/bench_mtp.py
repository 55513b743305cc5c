"""MTP speculative decoding in one process: tokens/s and mean acceptance length with and without
MTP, per batch size, logprobs setting (off, top_logprobs 0, top_logprobs 5) and decode loop
(overlap on / off).

Greedy decoding of code prompts with the shipped model (trained MTP layer) by default, every
request generating exactly --max-tokens tokens (ignore_eos). The figures are end-to-end
`LLM.generate` wall time, prefill included; speedup is against k = 0 at the same batch size,
logprobs setting and overlap; "vs off" is overlap on against off for the same k. Mean
acceptance length = 1 + accepted drafts / verify steps (vLLM's meaning). gap p50: the device's
idle time between steps (CUDA events), median over the run.

    python benchmarks/bench_mtp.py                      # CPU
    python benchmarks/bench_mtp.py --device cuda        # GPU (bfloat16)
"""

from __future__ import annotations

import argparse
import time

import torch

from pd.engine.llm import LLM
from pd.wire.sampling_params import SamplingParams
from pd.spec.verify import SpecStats

PHASES = ("schedule", "launch", "wait", "process")

PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):",
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "def read_lines(path):\n    with open(path) as f:",
    "import json\n\n\ndef load(path):",
    "def is_prime(n):\n    if n < 2:",
    "for i in range(10):",
    "def parse_args():\n    parser = argparse.ArgumentParser(",
]
LOGPROBS = {"off": None, "top0": 0, "top5": 5}


def run(llm: LLM, batch: int, logprobs: int | None, max_tokens: int):
    """One generate of `batch` prompts: (tokens, seconds, mean acceptance, gap p50, per step)."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    spec, loop = llm.engine.spec, llm.engine.loop
    if spec is not None:
        spec.stats = SpecStats()
    loop.gaps.window.clear()
    loop.busy.clear()
    before = dict(loop.times.total)
    if llm.engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    if llm.engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    secs = time.perf_counter() - start
    # per decode-loop step, us: wall, device busy, idle gaps, and the host's phases
    n = max(1, len(loop.busy))
    per_step = {"steps": len(loop.busy), "wall": secs / n * 1e6,
                "busy": sum(loop.busy) / n * 1e6, "gaps": sum(loop.gaps.window) / n * 1e6}
    per_step.update({ph: (loop.times.total[ph] - before[ph]) / n * 1e6 for ph in PHASES})
    mal = spec.stats.mean_acceptance_length if spec is not None else 1.0
    return sum(len(o.token_ids) for o in outs), secs, mal, loop.gaps.quantile(0.5), per_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the shipped pd-tiny-code)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--ks", default="0,1,2,3,4", help="speculative token counts (0 = no MTP)")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--logprobs", default="off,top0,top5")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="rounds of every logprobs mode in turn; each cell's fastest run counts")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--overlap", default="on,off", help="decode loops to run: on, off or both")
    p.add_argument("--spec-fallback", choices=("on", "off"), default="off",
                   help="plain steps where they measure faster (off: MTP steps only, what MTP "
                        "itself gives; bench_mtp_mechanism.py shows the fallback)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: no CUDA graphs (plain decode and MTP steps eager)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    modes = args.logprobs.split(",")
    overlaps = [o == "on" for o in args.overlap.split(",")]
    results = {}
    for k in ks:
        for overlap in overlaps:
            llm = LLM(args.model, num_speculative_tokens=k, device=args.device, dtype=args.dtype,
                      enforce_eager=args.enforce_eager, num_blocks=1024, overlap=overlap,
                      spec_fallback=args.spec_fallback == "on")
            llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
            for b in sizes:
                # the logprobs modes in turn, `repeats` rounds: a host whose speed drifts
                # slows every mode of a round alike; the fastest run of each counts
                for _ in range(args.repeats):
                    for mode in modes:
                        res = run(llm, b, LOGPROBS[mode], args.max_tokens)
                        if (k, overlap, b, mode) not in results or res[1] < results[k, overlap, b, mode][1]:
                            results[k, overlap, b, mode] = res
            llm.engine.close()
            del llm
    print(f"device {args.device}{' (eager)' if args.enforce_eager else ''}, dtype "
          f"{args.dtype or 'default'}, max_tokens {args.max_tokens}, spec fallback "
          f"{args.spec_fallback}, "
          f"greedy, best of {args.repeats}, torch threads {torch.get_num_threads()}")
    print(f"{'batch':>5} {'logprobs':>8} {'overlap':>7} {'k':>2} {'tokens':>7} {'seconds':>8} "
          f"{'tok/s':>9} {'speedup':>7} {'vs off':>6} {'accept_len':>10} {'gap p50':>8}")
    for b in sizes:
        for mode in modes:
            for overlap in overlaps:
                base = results.get((0, overlap, b, mode))
                for k in ks:
                    tokens, secs, mal, gap, _ = results[k, overlap, b, mode]
                    speed = f"{(tokens / secs) / (base[0] / base[1]):.2f}x" if base else "-"
                    off = results.get((k, False, b, mode))
                    vs_off = f"{off[1] / secs:.2f}x" if overlap and off else "-"
                    print(f"{b:>5} {mode:>8} {'on' if overlap else 'off':>7} {k:>2} {tokens:>7} "
                          f"{secs:>8.3f} {tokens / secs:>9.1f} {speed:>7} {vs_off:>6} {mal:>10.2f} "
                          f"{gap * 1e6:>6.0f}us")
    for (k, overlap, b, mode), res in sorted(results.items()):
        off = results.get((k, overlap, b, "off"))
        if mode != "off" and off:
            print(f"logprobs {mode} at k={k} batch {b} overlap {'on' if overlap else 'off'}: "
                  f"{(res[1] / res[0]) / (off[1] / off[0]) - 1:+.1%} time per token vs none")
    print("per decode-loop step (us; busy: the device's time by CUDA events, gaps: its idle time "
          "between steps; the host's phases as pd_decode_host_seconds_total)")
    cols = ("steps", "wall", "busy", "gaps") + PHASES
    print(f"{'batch':>5} {'logprobs':>8} {'overlap':>7} {'k':>2} " + " ".join(f"{c:>8}" for c in cols))
    for (k, overlap, b, mode), res in sorted(results.items(), key=lambda kv: (kv[0][2], kv[0][3], kv[0][0])):
        per = res[4]
        print(f"{b:>5} {mode:>8} {'on' if overlap else 'off':>7} {k:>2} "
              + " ".join(f"{per.get(c, 0):>8.0f}" for c in cols))


if __name__ == "__main__":
    main()
