"""Where a structured-output step's time goes on the GPU: the host's calls and the device's work
of each decode step on one clock, `LLM.generate` of greedy requests on the Llama-3.2-1B shape
(random bf16, the 128,256-token tokenizer), `--max-tokens` tokens each, per grammar.

The runner's step (`ModelRunner.execute`) and late sampling (`ModelRunner.resample`) are
bracketed by CUDA events on the device, and every call below by `perf_counter` on the host;
events are read against one recorded at the start (the host's clock read just after it ran),
so host and device times line up within a few microseconds. Printed per grammar: tokens/s and
steps; the device time of a step and of a late sampling, and the device's gaps between them
(a gap: the device waiting for the host); how long before the device finished a step's forward
the host had queued the late sampling after it ("lead": negative, the device waited for the
host); then, with --timeline, three steps' calls in order. The events cost ~6 us of host each.

    python benchmarks/gpu/profile_structured.py [--batch 32] [--grammars json none] [--timeline]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import pd.engine.decode_loop as decode_loop  # noqa: E402
import pd.engine.executor as executor  # noqa: E402
import pd.engine.grammar_steps as grammar_steps  # noqa: E402
import pd.engine.runner as runner  # noqa: E402
from bench_decode import LLAMA_1B  # noqa: E402
from bench_structured import SPECS  # noqa: E402
from pd.engine.llm import LLM  # noqa: E402
from pd.testing.tiny import write_tiny_checkpoint  # noqa: E402
from pd.wire.sampling_params import SamplingParams  # noqa: E402

LOG: list[tuple[str, float, torch.cuda.Event | None]] = []  # (call and edge, host, event)
ON = [False]
# (class, method, bracketed by events on the device too)
TIMED = ((runner.ModelRunner, "execute", True), (runner.ModelRunner, "resample", True),
         (executor.CudaCompletion, "wait", False),
         (grammar_steps.GrammarSteps, "walk_grammars", False),
         (grammar_steps.GrammarSteps, "settle_late", False),
         (grammar_steps.GrammarSteps, "fill_masks", False),
         (decode_loop.DecodeLoop, "process", False), (decode_loop.DecodeLoop, "launch", False))


def _event() -> torch.cuda.Event:
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def _wrap(cls, name: str, device: bool) -> None:
    f = getattr(cls, name)

    def timed(*a, **k):
        if not ON[0]:
            return f(*a, **k)
        LOG.append((name + "<", time.perf_counter(), _event() if device else None))
        try:
            return f(*a, **k)
        finally:
            LOG.append((name + ">", time.perf_counter(), _event() if device else None))

    setattr(cls, name, staticmethod(timed) if isinstance(cls.__dict__.get(name), staticmethod)
            else timed)


def _quantiles(values: list[float]) -> str:
    if not values:
        return "none"
    v = sorted(values)
    return (f"n {len(v)}, p10 {v[len(v) // 10]:.0f}, p50 {v[len(v) // 2]:.0f}, "
            f"p90 {v[9 * len(v) // 10]:.0f}, mean {sum(v) / len(v):.0f} us")


def report(rows: list[tuple[str, float, float | None]], timeline: bool) -> None:
    """rows: (call and edge, host us, device us or None), in the host's order."""
    device = [(k, d) for k, _, d in rows if d is not None]
    spans, gaps = defaultdict(list), defaultdict(list)
    for (k1, d1), (k2, d2) in zip(device, device[1:]):
        if k1.endswith("<") and k2 == k1[:-1] + ">":
            spans[k1[:-1]].append(d2 - d1)
        elif k1.endswith(">") and k2.endswith("<"):
            gaps[f"{k1[:-1]} -> {k2[:-1]}"].append(d2 - d1)
    lead = []  # device end of a forward minus host end of queueing the late sampling after it
    for i, (k, _, d) in enumerate(rows):
        if k == "execute>":
            for k2, h2, _ in rows[i + 1:]:
                if k2 == "execute<":
                    break
                if k2 == "resample>":
                    lead.append(d - h2)
                    break
    for name, v in spans.items():
        print(f"  device, {name}: {_quantiles(v)}")
    for name, v in gaps.items():
        print(f"  device gap, {name}: {_quantiles(v)}")
    print(f"  host lead of the late sampling over the forward's end: {_quantiles(lead)}")
    if timeline:
        middle = next(i for i, r in enumerate(rows)
                      if r[0] == "launch<" and r[1] > rows[-1][1] / 2)
        for k, h, d in rows[middle:middle + 60]:
            print(f"    {k:16s} host {h:9.0f}" + (f"  device {d:9.0f}" if d is not None else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32, help="requests, all at once")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="tokens per request (min_tokens too)")
    p.add_argument("--grammars", nargs="+", choices=list(SPECS), default=["json", "none"],
                   help="which requests to run, in turn")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per grammar")
    p.add_argument("--timeline", action="store_true",
                   help="also print three steps' calls, host and device, of the last run")
    args = p.parse_args()
    for cls, name, device in TIMED:
        _wrap(cls, name, device)
    model = write_tiny_checkpoint(tempfile.mkdtemp(prefix="pd-1b-"), "llama", mtp=False,
                                  dtype="bfloat16", full_vocab=True, **LLAMA_1B)
    llm = LLM(model, device="cuda", num_blocks=4096)
    texts = ["def fibonacci(n):", "# a JSON object:\n", "class Stack:", "import os\n"]
    prompts = [texts[i % len(texts)] for i in range(args.batch)]
    for name in args.grammars:
        os.environ["PD_CHECKED_GRAMMAR"] = "0" if name.endswith("-masked") else "1"
        params = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens,
                                temperature=0.0, structured_output=SPECS[name])
        llm.generate(prompts, params)  # warm-up: graphs, kernels, the grammar's compile
        for rep in range(args.repeats):
            LOG.clear()
            loop = llm.engine.loop
            steps = len(loop.busy)
            torch.cuda.synchronize()
            start = _event()
            torch.cuda.synchronize()
            host0 = time.perf_counter()
            ON[0] = True
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            secs = time.perf_counter() - t
            ON[0] = False
            torch.cuda.synchronize()
            tokens = sum(len(o.token_ids) for o in outs)
            print(f"{name}, run {rep + 1}: {tokens / secs:.0f} tok/s, {len(loop.busy) - steps} "
                  f"steps for {args.max_tokens} tokens, batch {args.batch}")
            report([(k, (h - host0) * 1e6, start.elapsed_time(e) * 1e3 if e is not None else None)
                    for k, h, e in LOG], args.timeline and rep == args.repeats - 1)


if __name__ == "__main__":
    main()
