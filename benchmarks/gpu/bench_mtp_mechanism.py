"""On a CUDA machine: what the MTP machinery itself costs, on the Llama-3.2-1B shape (random
bf16 weights, where real acceptance is meaningless). A perfect drafter proposes the target's
own greedy continuation (`SpecGraphs.oracle`), so every verify step can keep k + 1 tokens;
tokens/s with MTP k against plain decoding of the same prompt in the same run, overlap on, CUDA
graphs. Drafters: "perfect" replaces the MTP layer (the step's machinery alone: verify,
acceptance, bookkeeping, the next step's inputs); "mtp+perf" runs the MTP layer and its k LM-head
passes, then proposes the perfect drafts (what MTP costs with full acceptance).

    python benchmarks/gpu/bench_mtp_mechanism.py [--ks 1 3] [--batch 1] [--max-tokens 256]

The ratio is at most k + 1 (k + 1 tokens per step). Where bf16 verify rows round differently
from plain decode rows, a draft can be rejected: the mean acceptance length shows it. Two more
rows show the fallback to plain steps (`--spec-fallback`): a drafter whose every draft is wrong,
without the fallback (MTP steps only: slower than plain) and with it (plain steps once measured
faster).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import LLAMA_1B, timed  # noqa: E402

from pd.engine.llm import LLM  # noqa: E402
from pd.spec.verify import SpecStats  # noqa: E402
from pd.testing.tiny import write_tiny_checkpoint  # noqa: E402
from pd.wire.sampling_params import SamplingParams  # noqa: E402


def timed_generate(llm: LLM, prompts, params, repeats: int):
    best, outs = float("inf"), None
    for _ in range(repeats):
        if llm.engine.spec is not None:
            llm.engine.spec.stats = SpecStats()
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, outs


@torch.inference_mode()
def device_times(llm: LLM, k: int) -> None:
    """Device time of each captured verify / draft / advance graph (CUDA events, median of 5)."""
    for (slots, width), g in sorted(llm.engine.spec.graphs.graphs.items()):
        times, saved = [], g.inputs.clone()
        for _ in range(5):
            g.inputs.copy_(saved)  # advance moves the inputs past the blocks the steps had
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            ev[0].record()
            g.verify()
            ev[1].record()
            g.draft()
            ev[2].record()
            g.advance()
            ev[3].record()
            torch.cuda.synchronize()
            times.append([ev[i].elapsed_time(ev[i + 1]) for i in range(3)])
        v, d, a = sorted(times)[2]
        print(f"  k={k} graphs for {slots} slots x {width} blocks: verify {v:.3f} ms, draft "
              f"{d:.3f} ms, advance {a:.3f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 3])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    model = str(write_tiny_checkpoint(tempfile.mkdtemp(prefix="pd-llama1b-mtp-"), "llama", mtp=True,
                                      dtype="bfloat16", **LLAMA_1B))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 32000, (args.prompt_len,), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    common = dict(device="cuda", dtype="bfloat16", num_blocks=4096, max_num_seqs=64)
    plain = LLM(model, **common)  # overlap on (CUDA)
    plain.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    print(f"Llama-3.2-1B shape, bf16, {torch.cuda.get_device_name()}, prompt {args.prompt_len} "
          f"tokens, {args.max_tokens} new tokens, greedy, best of {args.repeats}, overlap on")
    rows, continuation = {}, {}
    for batch in args.batch:
        secs, outs = timed_generate(plain, [prompt] * batch, params, args.repeats)
        continuation[batch] = outs[0].token_ids
        rows[batch, 0] = (batch * args.max_tokens / secs, 1.0, True)
    for (batch, width), (graph, _) in sorted(plain.engine.runner.graphs.graphs.items()):
        plain.engine.runner.graphs.pad_inputs((batch, width))  # the graph reads its own layout
        print(f"  plain decode graph for {batch} rows x {width} blocks: "
              f"{timed(graph.replay) * 1e3:.3f} ms (LM head and argmax included)")
    del plain
    torch.cuda.empty_cache()
    runs = ([(k, "perfect", False) for k in args.ks] + [(k, "mtp+perf", False) for k in args.ks]
            + [(3, "wrong", False), (3, "wrong", True)])
    for k, drafter, fallback in runs:
        llm = LLM(model, num_speculative_tokens=k, spec_fallback=fallback, **common)
        oracle = torch.tensor(continuation[args.batch[0]], dtype=torch.int64, device="cuda")
        llm.engine.spec.graphs.oracle = oracle
        llm.engine.spec.graphs.oracle_only = drafter == "perfect"
        llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
        for batch in args.batch:
            # NOTE: bf16 rows of another batch size may round to another continuation
            cont = torch.tensor(continuation[batch], dtype=torch.int64)
            oracle.copy_((cont + 1) % LLAMA_1B["vocab_size"] if drafter == "wrong" else cont)
            secs, outs = timed_generate(llm, [prompt] * batch, params, args.repeats)
            same = all(o.token_ids == continuation[batch] for o in outs)
            rows[batch, k, drafter, fallback] = (batch * args.max_tokens / secs,
                                                 llm.engine.spec.stats.mean_acceptance_length, same)
        if drafter != "wrong":
            print(f"  drafter {drafter}:")
            device_times(llm, k)
        del llm
        torch.cuda.empty_cache()
    print(f"{'batch':>5} {'k':>2} {'drafter':>8} {'fallback':>8} {'tok/s':>9} {'vs plain':>8} "
          f"{'accept_len':>10} {'same tokens':>11}")
    for batch in args.batch:
        base = rows[batch, 0][0]
        print(f"{batch:>5} {0:>2} {'-':>8} {'-':>8} {base:>9.1f} {1:>7.2f}x {1:>10.2f} {'True':>11}")
        for k, drafter, fallback in runs:
            tps, mal, same = rows[batch, k, drafter, fallback]
            print(f"{batch:>5} {k:>2} {drafter:>8} {'on' if fallback else 'off':>8} {tps:>9.1f} "
                  f"{tps / base:>7.2f}x {mal:>10.2f} {str(same):>11}")

if __name__ == "__main__":
    main()
