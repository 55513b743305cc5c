"""`pd bench`: a serving benchmark against the router, or any OpenAI-compatible server.

It builds prompts (`--dataset random`: random token ids of given input/output lengths, a range
ratio and shared prefixes, one or `--random-num-prefixes` of them; `--dataset jsonl`: one
{"prompt": ..., "output_len": ...} per line), or conversations (`--multi-turn T`: each prompt
opens one, and each next turn sends the previous turn's prompt, its answer and a new message of
`--random-input-len` tokens, as text; the table adds TTFT per turn),
sends them streamed to /v1/completions (or /v1/chat/completions) at `--request-rate` (Poisson
arrivals, gamma-distributed with `--burstiness`; inf sends all at once) under
`--max-concurrency`, and prints the figures of `vllm bench serve`: completed and failed
requests, duration, request and token throughput, TTFT/TPOT/ITL/E2EL mean, median and
percentiles, and goodput against `--goodput ttft:MS tpot:MS`. `--result-json` keeps every
figure and per-request arrays; `--plot` draws the latency CDFs (matplotlib). The meanings and
the table are `bench_report.py`'s; sending and timing the requests is `bench_run.py`'s.
`--client-processes N` splits the run among N client processes (`bench_clients.py`), for token
rates one Python process cannot read.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime

import numpy as np

from pd.cli.bench_report import parse_goodput, per_request, plot, summarize, table
from pd.cli.bench_run import Prompt, load_tokenizer, run


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL (default: %(default)s)")
    g.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"], help="(default: %(default)s)")
    g.add_argument("--model", default=None, help="model name in requests (default: the server's first model)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer directory for prompt building and token counts (default: the "
                        "embedded pd-tiny-code model)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", default="random", choices=["random", "jsonl"], help="(default: random)")
    g.add_argument("--dataset-path", default=None, help="JSONL file for --dataset jsonl")
    g.add_argument("--num-prompts", type=int, default=100, help="requests to send (default: 100)")
    g.add_argument("--random-input-len", type=int, default=128, help="(default: 128)")
    g.add_argument("--random-output-len", type=int, default=64, help="(default: 64)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly in [len*(1-r), len*(1+r)] (default: 0)")
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="random tokens shared by every prompt, before its own (default: 0)")
    g.add_argument("--random-num-prefixes", type=int, default=1,
                   help="distinct shared prefixes of --random-prefix-len tokens (system prompts); "
                        "prompt i starts with prefix i mod N (default: 1)")
    g.add_argument("--multi-turn", type=int, default=1, metavar="T",
                   help="turns per conversation: each of --num-prompts prompts opens one, and "
                        "each next turn sends the whole conversation so far plus a new message "
                        "(default: 1, single requests)")
    g.add_argument("--output-len", type=int, default=None,
                   help="jsonl: max_tokens for lines without output_len (default: 64)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps; 1 is Poisson, lower is burstier")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    g.add_argument("--ignore-eos", action="store_true", help="ask the server to ignore EOS")
    g.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--client-processes", type=int, default=1, metavar="N",
                   help="split the run among N client processes (prompts, concurrency and rate "
                        "shared round-robin), so that one process reading every stream is not "
                        "what is measured at high token rates (default: 1)")
    g.add_argument("--no-test-request", action="store_true",
                   help="skip the one short request sent (and not counted) before the run")
    g = p.add_argument_group("report")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    g.add_argument("--metric-percentiles", default="90,99", help="(default: 90,99)")
    g.add_argument("--result-json", default=None, metavar="FILE", help="write every figure here")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="latency CDFs (needs matplotlib)")
    g.add_argument("--disable-progress", action="store_true", help="no progress bar on stderr")


def random_prompts(tok, num: int, input_len: int, output_len: int, range_ratio: float,
                   prefix_len: int, seed: int, num_prefixes: int = 1) -> list[Prompt]:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    allowed = np.array([i for i in range(tok.vocab_size) if i not in tok.all_special_ids])

    def lengths(n: int) -> np.ndarray:
        lo, hi = int(np.floor(n * (1 - range_ratio))), int(np.ceil(n * (1 + range_ratio)))
        return rng.integers(max(lo, 1), max(hi, 1) + 1, size=num)

    if num_prefixes < 1:
        raise ValueError(f"--random-num-prefixes must be at least 1, got {num_prefixes}")
    prefixes = [rng.choice(allowed, size=prefix_len).tolist() for _ in range(num_prefixes)]
    ins, outs = lengths(input_len), lengths(output_len)
    return [Prompt(prefixes[i % num_prefixes] + rng.choice(allowed, size=int(n)).tolist(),
                   prefix_len + int(n), int(o))
            for i, (n, o) in enumerate(zip(ins, outs))]


def jsonl_prompts(tok, path: str, num: int, output_len: int | None) -> list[Prompt]:
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: each line must be an object with a 'prompt' string")
            n = int(row.get("output_len") or row.get("max_tokens") or output_len or 64)
            out.append(Prompt(row["prompt"], len(tok.encode(row["prompt"])), n))
    if not out:
        raise ValueError(f"{path} holds no prompt")
    return [out[i % len(out)] for i in range(num)]


def main(args: argparse.Namespace) -> int:
    from router.main import run_loop

    try:
        goodput = parse_goodput(args.goodput)
        percentiles = [float(x) for x in args.metric_percentiles.split(",")]
        if args.num_prompts < 1 or args.burstiness <= 0 or args.request_rate <= 0:
            raise ValueError("--num-prompts, --burstiness and --request-rate must be positive")
        if args.multi_turn < 1:
            raise ValueError(f"--multi-turn must be at least 1, got {args.multi_turn}")
        if args.client_processes < 1:
            raise ValueError(f"--client-processes must be at least 1, got {args.client_processes}")
        if args.client_processes > 1 and args.multi_turn > 1:
            raise ValueError("--client-processes takes single requests, not --multi-turn")
        tok = load_tokenizer(args)
        if args.dataset == "jsonl":
            if not args.dataset_path:
                raise ValueError("--dataset jsonl needs --dataset-path")
            prompts = jsonl_prompts(tok, args.dataset_path, args.num_prompts, args.output_len)
        else:
            prompts = random_prompts(tok, args.num_prompts, args.random_input_len,
                                     args.random_output_len, args.random_range_ratio,
                                     args.random_prefix_len, args.seed,
                                     args.random_num_prefixes)
        # NOTE: on uvloop where installed: the client reads every stream's events, and the
        # faster loop keeps its own cost off the figures
        if args.client_processes > 1:
            from pd.cli.bench_clients import run_processes

            outputs, duration, model = run_processes(args, prompts, args.client_processes)
        else:
            outputs, duration, model = run_loop(run(args, prompts, tok))
    except (ValueError, OSError, RuntimeError) as e:
        print(f"pd bench: {e}", file=sys.stderr)
        return 1
    s = summarize(outputs, duration, percentiles, goodput)
    print(table(s, percentiles), flush=True)
    for err in sorted({o.error for o in outputs if o.error})[:5]:
        print(f"error: {err}", file=sys.stderr)
    if args.result_json:
        result = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "base_url": args.base_url,
                  "endpoint": args.endpoint, "model_id": model, "num_prompts": args.num_prompts,
                  "request_rate": args.request_rate, "burstiness": args.burstiness,
                  "max_concurrency": args.max_concurrency, "goodput_slos_ms": goodput,
                  "client_processes": args.client_processes,
                  **s, **per_request(outputs)}
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(outputs, args.plot, f"pd bench: {model}, {args.num_prompts} prompts, rate "
                                 f"{args.request_rate:g}/s, concurrency {args.max_concurrency or 'unlimited'}")
    return 0 if s["completed"] else 1
