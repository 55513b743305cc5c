"""Whole-system figures on CPU through `pd launch`, and the router's cost per streamed token.

1. Router overhead: one long greedy stream read directly from the decode node (the node
   protocol, `pd.service.client.NodeClient`) and the same stream through the router's HTTP SSE (the
   official `openai` client); the gap between inter-token times is the router's cost per token.
2. Throughput: requests/s and generated tokens/s at each --concurrency, streaming requests of
   --max-tokens tokens through the router.

    python benchmarks/bench_router.py --concurrency 1 8 64
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import openai

from pd.service.client import NodeClient
from pd.config import default_model_dir
from pd.service.procs import Launch
from pd.wire.sampling_params import SamplingParams


def per_token_direct(launch: Launch, prompt_ids: list[int], n: int, repeats: int) -> float:
    p = launch.nodes["prefill-0"]["control"]
    d_kv = launch.nodes["decode-0"]["kv"]
    client = NodeClient()
    gaps = []
    try:
        for _ in range(repeats):
            rid = client.submit(f"tcp://{p}", d_kv, prompt_ids,
                                SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            r = client.wait([rid], timeout=120)[0]
            gaps.append((time.perf_counter() - r.first_token_time) / (n - 1))
    finally:
        client.close()
    return statistics.median(gaps)


def per_token_router(api: openai.OpenAI, name: str, prompt_ids: list[int], n: int, repeats: int) -> float:
    gaps = []
    for _ in range(repeats):
        stream = api.completions.create(model=name, prompt=prompt_ids, max_tokens=n, temperature=0,
                                        stream=True, extra_body={"ignore_eos": True})
        first = None
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter()
        gaps.append((time.perf_counter() - first) / (n - 1))
    return statistics.median(gaps)


async def load(url: str, name: str, concurrency: int, num_requests: int, max_tokens: int) -> tuple:
    api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    queue = list(range(num_requests))
    tokens = 0

    async def worker():
        nonlocal tokens
        while queue:
            i = queue.pop()
            stream = await api.completions.create(
                model=name, prompt=f"def f{i}(x):", max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    await api.close()
    return num_requests / elapsed, tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir (default: the embedded model)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-level", type=int, default=128)
    ap.add_argument("--stream-tokens", type=int, default=256)
    args = ap.parse_args()
    model = args.model or str(default_model_dir())
    # --insecure: the direct measurement reads the decode node over a plain socket
    launch = Launch(model, "--num-blocks", "4096", "--max-num-seqs", "128", "--insecure")
    try:
        name = launch.served_model_name
        api = openai.OpenAI(base_url=launch.url + "/v1", api_key="x", max_retries=0, timeout=300)
        prompt = [5, 6, 7, 8, 9]
        per_token_router(api, name, prompt, 16, 1)  # warm up
        direct = per_token_direct(launch, prompt, args.stream_tokens, 5)
        routed = per_token_router(api, name, prompt, args.stream_tokens, 5)
        print(f"model {model}")
        print("| stream of %d tokens | direct from decode node | through router | router cost per token |"
              % args.stream_tokens)
        print("|---|---|---|---|")
        print(f"| inter-token time, median of 5 | {direct * 1e6:.0f} µs | {routed * 1e6:.0f} µs | "
              f"{(routed - direct) * 1e6:.0f} µs |")
        print()
        print(f"| concurrency | requests/s | generated tokens/s ({args.max_tokens} per request) |")
        print("|---|---|---|")
        for c in args.concurrency:
            n = max(args.requests_per_level, 2 * c)
            rps, tps = asyncio.run(load(launch.url, name, c, n, args.max_tokens))
            print(f"| {c} | {rps:.2f} | {tps:.1f} |")
    finally:
        launch.stop()


if __name__ == "__main__":
    main()
