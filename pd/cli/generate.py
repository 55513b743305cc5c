"""Generate from one or more prompts in a single process and print the result.

With --json, one JSON object per prompt, one per line: token_ids (generated ids), logprobs (the
sampled tokens' logprobs), top_logprobs (per step, a list of [id, logprob] pairs), text,
finish_reason. The figures line (tokens/s) goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pd.service.flags import add_engine_arguments, engine_config, limit_host_threads


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.set_defaults(log_level="warning")
    g = p.add_argument_group("prompts and sampling")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a text prompt (repeat for a batch)")
    src.add_argument("--prompt-ids", action="append",
                     help="a prompt as comma-separated token ids, e.g. 1,2,3 (repeat for a batch)")
    g.add_argument("--repeat", type=int, default=1,
                   help="run each prompt this many times in one batch (for throughput figures)")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the generation config's, else 0)")
    g.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling threshold (default: the generation config's, else 1)")
    g.add_argument("--top-k", type=int, default=None,
                   help="top-k sampling, 0 = off (default: the generation config's, else 0)")
    g.add_argument("--min-p", type=float, default=None,
                   help="min-p sampling threshold (default: the generation config's, else 0)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="where omitted sampling flags come from: 'auto' the model's "
                        "generation_config.json, 'vllm' none, or DIR/generation_config.json "
                        "(default: auto)")
    g.add_argument("--top-logprobs", type=int, default=None,
                   help="return the sampled token's logprob and this many top logprobs (0..20)")
    g.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def main(args: argparse.Namespace) -> int:
    from pd.config import ModelConfig
    from pd.service.flags import model_dir
    from pd.wire.sampling_params import SamplingParams, generation_defaults

    # a checkpoint pd would compute wrongly: refused before torch is loaded
    ModelConfig.from_dir(model_dir(args))
    from pd.engine.llm import LLM

    try:
        # NOTE: pd generate is greedy unless the generation config or a flag says otherwise
        sampling = {"temperature": 0.0, **generation_defaults(model_dir(args), args.generation_config)}
        given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                 "min_p": args.min_p}
        sampling.update({k: v for k, v in given.items() if v is not None})
        params = SamplingParams(max_tokens=args.max_tokens, seed=args.seed,
                                logprobs=args.top_logprobs, ignore_eos=args.ignore_eos, **sampling)
        if args.prompt_ids:
            try:
                prompts = [[int(t) for t in s.split(",") if t.strip()] for s in args.prompt_ids]
            except ValueError:
                raise ValueError("--prompt-ids takes comma-separated integers, e.g. 1,2,3") from None
        else:
            prompts = list(args.prompt)
        prompts = [p for p in prompts for _ in range(max(1, args.repeat))]
        cfg = engine_config(args)
        if args.threads is not None:
            limit_host_threads(cfg, args.threads)
        llm = LLM(cfg.model, num_speculative_tokens=args.num_speculative_tokens, **{k: getattr(cfg, k) for k in (
            "device", "dtype", "block_size", "num_blocks", "kv_cache_memory",
            "gpu_memory_fraction", "max_num_seqs", "max_num_batched_tokens", "max_model_len")})
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    except (ValueError, FileNotFoundError) as e:
        print(f"pd generate: error: {e}", file=sys.stderr)
        return 2
    for out in outputs:
        if args.json:
            d = out.to_dict()
            print(json.dumps({k: d[k] for k in
                              ("token_ids", "logprobs", "top_logprobs", "text", "finish_reason")}))
        else:
            print(out.text)
    num_tokens = sum(len(o.token_ids) for o in outputs)
    print(f"{len(outputs)} prompt(s), {num_tokens} tokens in {elapsed:.3f}s: "
          f"{num_tokens / elapsed:.1f} tokens/s", file=sys.stderr)
    return 0
