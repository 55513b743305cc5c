"""What structured output costs: decode tokens/s of the same requests with no grammar, a regex
and a JSON schema, greedy, at the batch sizes given, in one run (`pd.LLM`, the embedded model
unless `--synthetic-1b`: the Llama-3.2-1B shape with random bf16 weights and a tokenizer of
128,256 trained tokens, as Llama 3's: `pd.testing.tiny.full_vocab_tokenizer`; the embedded
tokenizer padded to that many ids made each grammar walk cost 20 us instead of 1).

    python benchmarks/bench_structured.py [--device cuda] [--synthetic-1b] [--batch 1 32]
                                          [--max-tokens 128] [--repeats 3]
                                          [--grammars none regex json json-masked]

Where a step has 16 or more of them, greedy rows check each token against the grammar after
sampling (the step runs as a plain one) and sample under the mask only where a token was
refused ("taken back": the refusals per 1000 tokens; the masked steps after a refusal run as
plain steps and sample those rows again under their masks late, "late" per 1000 tokens), below
that they are masked; the `-masked` rows (PD_CHECKED_GRAMMAR=0) fill each mask on the host per
request per step for the sampler, the overlap loop waiting for each step's tokens before the
next mask (its forward runs meanwhile). The table shows the cost beside the plain rate, and the
wall time per step with the decode loop's host time per step by phase. Timings only, no
assertions; best of `--repeats`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))

from pd.engine.llm import LLM  # noqa: E402
from pd.wire.sampling_params import SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "size": {"type": "integer"}}, "required": ["name", "tags", "size"]}
SPECS = {"none": None, "regex": ("regex", "[a-z0-9 ,.()=+]+"),
         "json": ("json", json.dumps(SCHEMA))}
# the same grammars with every token sampled under its mask (PD_CHECKED_GRAMMAR=0), where the
# rows above check greedy tokens after sampling (`pd.engine.checked_grammar.CheckedSampling`)
SPECS.update({f"{k}-masked": v for k, v in list(SPECS.items()) if v is not None})
PHASES = ("schedule", "launch", "wait", "process")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--synthetic-1b", action="store_true")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--grammars", nargs="+", choices=list(SPECS), default=list(SPECS),
                   help="which rows to run (the ratio is to the first one run)")
    args = p.parse_args()
    model = None
    if args.synthetic_1b:
        from bench_decode import LLAMA_1B

        from pd.testing.tiny import write_tiny_checkpoint

        model = write_tiny_checkpoint(tempfile.mkdtemp(prefix="pd-1b-"), "llama", mtp=False,
                                      dtype="bfloat16", full_vocab=True, **LLAMA_1B)
    llm = LLM(model, device=args.device, num_blocks=4096)
    prompts = ["def fibonacci(n):", "# a JSON object:\n", "class Stack:", "import os\n"]
    print(f"device {args.device}, {'1B shape' if args.synthetic_1b else 'embedded model'}, greedy, "
          f"up to {args.max_tokens} tokens, best of {args.repeats}")
    # the decode loop's host time per step by phase (`pd.engine.loop_stats.HostTimes`), in us
    host = llm.engine.loop.times
    print(f"{'batch':>5} {'grammar':>12} {'tokens':>7} {'seconds':>8} {'tok/s':>9} {'vs none':>8} "
          f"{'us/step':>7} " + " ".join(f"{k:>8}" for k in PHASES)
          + f" {'back/1k':>7} {'late/1k':>7}")
    for batch in args.batch:
        base = None
        for name in args.grammars:
            spec = SPECS[name]
            os.environ["PD_CHECKED_GRAMMAR"] = "0" if name.endswith("-masked") else "1"
            # NOTE: min_tokens keeps every request going as long (a grammar may let EOS in early)
            params = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens,
                                    temperature=0.0, structured_output=spec)
            batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
            # warm-up at the measured batch: its graphs, kernels and the grammar's compile
            llm.generate(batch_prompts, SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0,
                                                       structured_output=spec))
            best = None
            for _ in range(args.repeats):
                loop = llm.engine.loop
                before, back, late = dict(host.total), loop.num_taken_back, loop.num_resampled
                start = time.perf_counter()
                outs = llm.generate(batch_prompts, params)
                secs = time.perf_counter() - start
                tokens = sum(len(o.token_ids) for o in outs)
                phases = {k: (host.total[k] - before[k]) / args.max_tokens * 1e6 for k in PHASES}
                back = (loop.num_taken_back - back) / tokens * 1000
                late = (loop.num_resampled - late) / tokens * 1000
                if best is None or tokens / secs > best[0] / best[1]:
                    best = (tokens, secs, phases, back, late)
            tps = best[0] / best[1]
            base = base or tps
            step_us = best[1] / args.max_tokens * 1e6
            print(f"{batch:>5} {name:>12} {best[0]:>7} {best[1]:>8.3f} {tps:>9.0f} "
                  f"{tps / base:>7.2f}x {step_us:>7.0f} "
                  + " ".join(f"{best[2][k]:>8.0f}" for k in PHASES)
                  + f" {best[3]:>7.1f} {best[4]:>7.1f}")


if __name__ == "__main__":
    main()
