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
the table are `bench_report.py`'s. `--client-processes N` splits the run among N client
processes (`bench_clients.py`), for token rates one Python process cannot read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from datetime import datetime

import numpy as np

from pd.cli.bench_report import RequestOutput, parse_goodput, per_request, plot, summarize, table


@dataclass
class Prompt:
    prompt: str | list[int]  # text, or token ids (sent as they are to /v1/completions)
    prompt_len: int
    output_len: int


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


def load_tokenizer(args: argparse.Namespace):
    from pd.config import default_model_dir
    from pd.text.tokenizer import Tokenizer

    return Tokenizer.from_dir(args.tokenizer or default_model_dir())


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


def new_message(tok, rng: np.random.Generator, n: int) -> str:
    """A user message of about `n` random tokens, as text (a conversation's next turn)."""
    allowed = [i for i in range(tok.vocab_size) if i not in tok.all_special_ids]
    return tok.decode(rng.choice(allowed, size=n).tolist())


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


async def arrivals(prompts: list[Prompt], rate: float, burstiness: float, seed: int):
    """Yield prompts at Poisson (gamma, shape=burstiness) arrival times of mean rate `rate`."""
    rng = np.random.default_rng(seed + 1)
    for p in prompts:
        yield p
        if rate != float("inf"):
            await asyncio.sleep(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))


async def send(session, args, model: str, p: Prompt, tok, messages: list | None = None,
               turn: int = 0) -> RequestOutput:
    chat = args.endpoint.endswith("chat/completions")
    body = {"model": model, "max_tokens": p.output_len, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        text = p.prompt if isinstance(p.prompt, str) else tok.decode(p.prompt)
        body["messages"] = messages or [{"role": "user", "content": text}]
    else:
        body["prompt"] = p.prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    out = RequestOutput(prompt_len=p.prompt_len, turn=turn)
    usage = None
    start = last = time.perf_counter()
    try:
        async with session.post(args.base_url.rstrip("/") + args.endpoint, json=body) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return out
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = json.dumps(chunk["error"])[:300]
                    return out
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices")
                if not choices:
                    continue
                c = choices[0]
                delta = c.get("delta", {})
                if chat and set(delta) <= {"role"} and not c.get("finish_reason"):
                    continue  # the role chunk carries no token
                now = time.perf_counter()
                if out.ttft == 0.0:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last = now
                out.generated_text += (delta.get("content") if chat else c.get("text")) or ""
        out.latency = last - start
        out.output_len = (usage or {}).get("completion_tokens") or len(
            tok.encode(out.generated_text, add_special_tokens=False))
        if (usage or {}).get("prompt_tokens"):
            out.prompt_len = usage["prompt_tokens"]
        out.success = out.ttft > 0
        if not out.success:
            out.error = "the stream ended without a token"
    except Exception as e:  # a failed request is counted, never the end of the run
        out.error = f"{type(e).__name__}: {e}"
    return out


class Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled, self.t0 = total, 0, enabled, time.perf_counter()

    def step(self) -> None:
        self.done += 1
        if self.enabled:
            n = int(30 * self.done / self.total)
            sys.stderr.write(f"\r[{'#' * n}{'.' * (30 - n)}] {self.done}/{self.total} "
                             f"{time.perf_counter() - self.t0:6.1f}s")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def run(args: argparse.Namespace, prompts: list[Prompt], tok,
              ready=None) -> tuple[list, float, str]:
    """Send every prompt; (outputs in prompt order, duration, model). `ready()` (optional) is
    called once set up, just before the clock starts (`bench_clients` starts its processes
    together with it)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        model = args.model
        if model is None:
            async with session.get(args.base_url.rstrip("/") + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
        if not args.no_test_request:
            test = await send(session, args, model, Prompt(
                prompts[0].prompt, prompts[0].prompt_len, min(prompts[0].output_len, 4)), tok)
            if not test.success:
                raise RuntimeError(f"the test request failed: {test.error}")
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = Progress(len(prompts) * args.multi_turn, not args.disable_progress)

        async def one(p: Prompt, messages=None, turn: int = 0) -> RequestOutput:
            if sem is None:
                out = await send(session, args, model, p, tok, messages, turn)
            else:
                async with sem:
                    out = await send(session, args, model, p, tok, messages, turn)
            bar.step()
            return out

        async def conversation(p: Prompt, index: int) -> list[RequestOutput]:
            rng = np.random.default_rng([args.seed, index])
            text = p.prompt if isinstance(p.prompt, str) else tok.decode(p.prompt)
            messages = [{"role": "user", "content": text}]
            outs = []
            for turn in range(args.multi_turn):
                out = await one(Prompt(text, p.prompt_len, p.output_len), messages, turn)
                outs.append(out)
                if not out.success:
                    break
                message = new_message(tok, rng, args.random_input_len)
                text += out.generated_text + message
                messages += [{"role": "assistant", "content": out.generated_text},
                             {"role": "user", "content": message}]
            return outs

        if ready is not None:
            ready()
        t0 = time.perf_counter()
        if args.multi_turn > 1:
            starts = arrivals(prompts, args.request_rate, args.burstiness, args.seed)
            tasks = [asyncio.create_task(conversation(p, i)) async for i, p in _enumerate(starts)]
            outputs = [o for outs in await asyncio.gather(*tasks) for o in outs]
        else:
            tasks = [asyncio.create_task(one(p)) async for p in
                     arrivals(prompts, args.request_rate, args.burstiness, args.seed)]
            outputs = await asyncio.gather(*tasks)
        return list(outputs), time.perf_counter() - t0, model


async def _enumerate(items):
    i = 0
    async for item in items:
        yield i, item
        i += 1


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
