"""What structured output costs: decode tokens/s of the same requests with no grammar, a regex
and a JSON schema, greedy, at the batch sizes given, in one run (`pd.LLM`, the embedded model
unless `--synthetic-1b`: the Llama-3.2-1B shape with random bf16 weights and a tokenizer of
128,256 trained tokens, as Llama 3's: `pd.testing.tiny.full_vocab_tokenizer`; the embedded
tokenizer padded to that many ids made each grammar walk cost 20 us instead of 1).

    python benchmarks/bench_structured.py [--device cuda] [--synthetic-1b [--layers N]]
                                          [--batch 1 32] [--max-tokens 128] [--repeats 3]
                                          [--grammars none regex json json-masked]
                                          [--overlap auto|on|off] [--narrow 0.5]

Where a step has 16 or more of them, greedy rows check each token against the grammar after
sampling (the step runs as a plain one) and sample under the mask only where a token was
refused ("taken back": the refusals per 1000 tokens; the masked steps after a refusal run as
plain steps and sample those rows again under their masks late, "late" per 1000 tokens), below
that they are masked; the `-masked` rows (PD_CHECKED_GRAMMAR=0) fill each mask on the host per
request per step for the sampler, the overlap loop waiting for each step's tokens before the
next mask (its forward runs meanwhile). The table shows the decode loop's steps (a refusal
costs its request one), the cost beside the plain rate, and the wall time per step with the
decode loop's host time per step by phase. The rows run in turn, `--repeats` rounds (a host whose speed drifts slows every row of a round alike): each row's
fastest run counts, and "per round" lists each round's ratio to the first row. Timings only,
no assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))

from pd.engine.checked_grammar import CheckedSampling  # noqa: E402
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
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--synthetic-1b", action="store_true",
                   help="the Llama-3.2-1B shape, random bf16, a 128,256-token tokenizer "
                        "(default: the embedded model)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="batch sizes to run")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="tokens per request (min_tokens too)")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds of the rows in turn; each row's fastest run counts")
    p.add_argument("--grammars", nargs="+", choices=list(SPECS), default=list(SPECS),
                   help="which rows to run (the ratio is to the first one run)")
    p.add_argument("--layers", type=int, default=None,
                   help="with --synthetic-1b: this many layers instead of 16 (a CPU run's "
                        "steps and refusals in less time)")
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="the overlap loop (auto: on CUDA only); on the CPU `on` samples masked "
                        "rows late as the GPU does")
    p.add_argument("--narrow", type=float, default=CheckedSampling.NARROW,
                   help="a late mask allowing tokens in under this share of the vocabulary's "
                        "64-token stretches keeps its row masked (`CheckedSampling.NARROW`; "
                        "0: never)")
    args = p.parse_args()
    CheckedSampling.NARROW = args.narrow
    model = None
    if args.synthetic_1b:
        from bench_decode import LLAMA_1B

        from pd.testing.tiny import write_tiny_checkpoint

        shape = dict(LLAMA_1B, num_layers=args.layers or LLAMA_1B["num_layers"])
        model = write_tiny_checkpoint(tempfile.mkdtemp(prefix="pd-1b-"), "llama", mtp=False,
                                      dtype="bfloat16", full_vocab=True, **shape)
    overlap = {"auto": None, "on": True, "off": False}[args.overlap]
    llm = LLM(model, device=args.device, num_blocks=4096, overlap=overlap)
    prompts = ["def fibonacci(n):", "# a JSON object:\n", "class Stack:", "import os\n"]
    print(f"device {args.device}, {'1B shape' if args.synthetic_1b else 'embedded model'}, greedy, "
          f"up to {args.max_tokens} tokens, best of {args.repeats} rounds of the grammars in turn")
    # the decode loop's host time per step by phase (`pd.engine.loop_stats.HostTimes`), in us
    host = llm.engine.loop.times
    print(f"{'batch':>5} {'grammar':>12} {'tokens':>7} {'steps':>5} {'seconds':>8} {'tok/s':>9} "
          f"{'vs none':>8} "
          f"{'us/step':>7} " + " ".join(f"{k:>8}" for k in PHASES)
          + f" {'back/1k':>7} {'late/1k':>7}  per round")
    for batch in args.batch:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        for name in args.grammars:  # warm-up at the measured batch: graphs, kernels, compiles
            os.environ["PD_CHECKED_GRAMMAR"] = "0" if name.endswith("-masked") else "1"
            llm.generate(batch_prompts, SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0,
                                                       structured_output=SPECS[name]))
        # NOTE: the grammars in turn, `repeats` rounds: a host whose speed drifts slows every
        # row of a round alike; each row's fastest run counts, and each round's ratio is listed
        runs = {name: [] for name in args.grammars}
        for _ in range(args.repeats):
            for name in args.grammars:
                runs[name].append(one_run(llm, batch_prompts, name, args.max_tokens, host))
        base = None
        for name in args.grammars:
            tokens, secs, phases, back, late, steps = max(runs[name], key=lambda r: r[0] / r[1])
            tps = tokens / secs
            base = base or tps
            rounds = [(r[0] / r[1]) / (b[0] / b[1])
                      for r, b in zip(runs[name], runs[args.grammars[0]])]
            print(f"{batch:>5} {name:>12} {tokens:>7} {steps:>5} {secs:>8.3f} {tps:>9.0f} "
                  f"{tps / base:>7.2f}x {secs / args.max_tokens * 1e6:>7.0f} "
                  + " ".join(f"{phases[k]:>8.0f}" for k in PHASES)
                  + f" {back:>7.1f} {late:>7.1f}  " + " ".join(f"{x:.2f}" for x in rounds))


def one_run(llm, prompts: list[str], name: str, max_tokens: int, host) -> tuple:
    """One generate of the grammar's requests: (tokens, seconds, host us per step by phase,
    refusals and late rows per 1000 tokens, the decode loop's steps)."""
    # NOTE: min_tokens keeps every request going as long (a grammar may let EOS in early)
    os.environ["PD_CHECKED_GRAMMAR"] = "0" if name.endswith("-masked") else "1"
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0,
                            structured_output=SPECS[name])
    loop = llm.engine.loop
    before, back, late = dict(host.total), loop.num_taken_back, loop.num_resampled
    steps = loop.num_steps
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    secs = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    phases = {k: (host.total[k] - before[k]) / max_tokens * 1e6 for k in PHASES}
    return (tokens, secs, phases, (loop.num_taken_back - back) / tokens * 1000,
            (loop.num_resampled - late) / tokens * 1000, loop.num_steps - steps)


if __name__ == "__main__":
    main()
