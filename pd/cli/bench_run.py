"""One client's run of `pd bench` (`run`): prompts sent streamed at their arrival times under
the concurrency limit, each stream's chunks timed as they come (TTFT, ITL, end-to-end), and, with
`--multi-turn`, each conversation's next turn built from the last answer and a new message. `pd
bench` runs one in its process, or one in each of its client processes (`bench_clients.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass

import numpy as np

from pd.cli.bench_report import RequestOutput


@dataclass
class Prompt:
    prompt: str | list[int]  # text, or token ids (sent as they are to /v1/completions)
    prompt_len: int
    output_len: int


def load_tokenizer(args: argparse.Namespace):
    from pd.config import default_model_dir
    from pd.text.tokenizer import Tokenizer

    return Tokenizer.from_dir(args.tokenizer or default_model_dir())


def new_message(tok, rng: np.random.Generator, n: int) -> str:
    """A user message of about `n` random tokens, as text (a conversation's next turn)."""
    allowed = [i for i in range(tok.vocab_size) if i not in tok.all_special_ids]
    return tok.decode(rng.choice(allowed, size=n).tolist())


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
