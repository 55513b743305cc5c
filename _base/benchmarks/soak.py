"""Soak: thousands of streamed completions through `pd launch`, with every process's RSS watched.

Starts `pd launch` (router + nodes; --model, or the embedded default model) with the router's
bounded queue set by --max-running/--max-queue, then runs three phases:

1. soak: --requests streamed /v1/completions at --concurrency (aiohttp), greedy with a fixed
   --max-tokens, over --num-prompts distinct prompts; every text must equal single-process
   generation (`pd.LLM`, once per distinct prompt).
2. RSS, throughout: the router (the `pd launch` process) and every node (its children) are read
   from /proc/PID/status every --sample-interval seconds. The tables show each process at the
   end of the warm-up (the first --warmup fraction of the requests), its peak after it, at the
   end of the soak and after the overload, with the growth since the warm-up and its
   least-squares slope over the soak (MiB per 1000 requests), then the samples over time.
3. overload: --overload requests at once, more than --max-running + --max-queue can hold: the
   excess must be answered 429 (never queued: the router's waiting gauge,
   pd_num_requests_waiting, scraped from /metrics meanwhile, must never pass --max-queue), the
   accepted ones must be correct, and a request sent afterwards must succeed. The 429s' median
   latency is printed; it is the router's event loop delay under that load.

Prints the tables and exits 1 when a check fails. RSS growth is reported, not judged.

    .venv/bin/python benchmarks/soak.py [--requests 2000] [--concurrency 256] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shlex
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from soak_report import checks, print_report  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range(10):",
           "def main():\n    ", "# read a file line by line\n", "x = [", "while True:\n"]
_WAITING = re.compile(r"^pd_num_requests_waiting(?:\{[^}]*\})? (\S+)$", re.M)
_STEP = re.compile(r'^pd_step_duration_seconds_(bucket|count)\{([^}]*)\} (\S+)$', re.M)


# -- RSS ----------------------------------------------------------------------------------------
def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return sorted(out)


@dataclass
class Sample:
    t: float
    done: int
    rss: dict[str, int | None]
    label: str = ""


class RssSampler:
    """Reads the RSS of named processes every `interval` seconds in a daemon thread."""

    def __init__(self, pids: dict[str, int], interval: float) -> None:
        self.pids, self.interval = pids, interval
        self.samples: list[Sample] = []
        self.done = 0
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self, label: str = "") -> Sample:
        s = Sample(time.monotonic() - self.t0, self.done,
                   {name: rss_kib(pid) for name, pid in self.pids.items()}, label)
        with self._lock:
            self.samples.append(s)
        return s

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# -- HTTP ---------------------------------------------------------------------------------------
@dataclass
class Reply:
    status: int
    text: str = ""
    error: str | None = None
    seconds: float = 0.0


async def stream_completion(session: aiohttp.ClientSession, url: str, model: str, prompt: str,
                            max_tokens: int) -> Reply:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    t0 = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return Reply(resp.status, error=(await resp.text())[:200],
                             seconds=time.perf_counter() - t0)
            parts, error, finished = [], None, False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    finished = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = str(chunk["error"])[:200]
                for choice in chunk.get("choices", []):
                    parts.append(choice.get("text") or "")
            if not finished and error is None:
                error = "stream ended without [DONE]"
            return Reply(200, "".join(parts), error, time.perf_counter() - t0)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return Reply(0, error=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)


@dataclass
class Tally:
    sent: int = 0
    correct: int = 0
    wrong: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    refused: int = 0  # HTTP 429
    refused_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0
    max_waiting: float = 0.0

    def add(self, reply: Reply, want: str) -> None:
        self.sent += 1
        if reply.status == 429:
            self.refused += 1
            self.refused_seconds.append(reply.seconds)
        elif reply.status != 200 or reply.error is not None:
            key = f"{reply.status}: {reply.error}"
            self.errors[key] = self.errors.get(key, 0) + 1
        elif reply.text == want:
            self.correct += 1
        else:
            self.wrong += 1


async def soak(url: str, model: str, prompts: list[str], want: dict[str, str], n: int,
               concurrency: int, max_tokens: int, sampler: RssSampler, warmup_n: int,
               timeout: float) -> Tally:
    tally, next_i = Tally(), iter(range(n))
    conn = aiohttp.TCPConnector(limit=concurrency)
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async def worker() -> None:
            while (i := next(next_i, None)) is not None:
                prompt = prompts[i % len(prompts)]
                tally.add(await stream_completion(session, url, model, prompt, max_tokens),
                          want[prompt])
                sampler.done = tally.sent
                if tally.sent == warmup_n:
                    sampler.sample("warm-up end")

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    tally.seconds = time.perf_counter() - t0
    return tally


async def overload(url: str, model: str, prompts: list[str], want: dict[str, str], n: int,
                   max_tokens: int, timeout: float) -> Tally:
    """`n` requests at once; the router's waiting gauge is scraped meanwhile."""
    tally = Tally()
    conn = aiohttp.TCPConnector(limit=n + 1)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        done = asyncio.Event()

        async def scrape() -> None:
            while not done.is_set():
                try:
                    async with session.get(url + "/metrics") as resp:
                        found = _WAITING.search(await resp.text())
                    if found:
                        tally.max_waiting = max(tally.max_waiting, float(found.group(1)))
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)

        async def one(i: int) -> None:
            prompt = prompts[i % len(prompts)]
            reply = await stream_completion(session, url, model, prompt, max_tokens)
            tally.add(reply, want[prompt])

        scraper = asyncio.create_task(scrape())
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        tally.seconds = time.perf_counter() - t0
        done.set()
        await scraper
    return tally


# -- the run ------------------------------------------------------------------------------------
def reference_texts(model_dir: str, prompts: list[str], max_tokens: int) -> dict[str, str]:
    from pd.engine.llm import LLM
    from pd.wire.sampling_params import SamplingParams

    llm = LLM(model_dir, num_blocks=256)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return {p: o.text for p, o in zip(prompts, outs)}


def process_names(launch) -> dict[str, int]:
    """The router (pd launch itself) and every node, named by node id; nodes are its children."""
    by_pid = {info["pid"]: name for name, info in launch.nodes.items()}
    pids = {"router": launch.proc.pid}
    for pid in children(launch.proc.pid):
        pids[by_pid.get(pid, f"child-{pid}")] = pid
    return pids


def slow_steps(launch) -> dict[str, tuple[int, int, int]]:
    """Per node, from its /metrics: (steps, steps over 1 s, steps over 2.5 s). A step longer
    than the router's heartbeat timeout (3 s under pd launch) gets the node marked down."""
    out = {}
    for line in launch.lines:
        found = re.match(r"node (\S+) pid \d+ .* metrics (\S+)", line)
        if not found:
            continue
        try:
            with urllib.request.urlopen(f"http://{found.group(2)}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        le, count = {}, 0
        for kind, labels, value in _STEP.findall(text):
            if kind == "count":
                count += int(float(value))
            else:
                bound = re.search(r'le="([^"]+)"', labels).group(1)
                le[bound] = le.get(bound, 0) + int(float(value))
        out[found.group(1)] = (count, count - le.get("1.0", count), count - le.get("2.5", count))
    return out


def run(args: argparse.Namespace) -> dict:
    from pd.config import default_model_dir
    from pd.service.procs import Launch

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    model = str(args.model or default_model_dir())
    prompts = PROMPTS[: args.num_prompts]
    want = reference_texts(model, prompts, args.max_tokens)
    launch = Launch(model, "--max-running", str(args.max_running), "--max-queue",
                    str(args.max_queue), *shlex.split(args.launch_args))
    try:
        url, name = launch.url, launch.served_model_name
        pids = process_names(launch)
        sampler = RssSampler(pids, args.sample_interval)
        first = sampler.sample("start")
        warmup_n = max(1, int(args.requests * args.warmup))
        soaked = asyncio.run(soak(url, name, prompts, want, args.requests, args.concurrency,
                                  args.max_tokens, sampler, warmup_n, args.request_timeout))
        end = sampler.sample("soak end")
        over = asyncio.run(overload(url, name, prompts, want, args.overload, args.max_tokens,
                                    args.request_timeout))
        after = asyncio.run(overload(url, name, prompts, want, 1, args.max_tokens,
                                     args.request_timeout))
        last = sampler.sample("after overload")
        sampler.stop()
        steps = slow_steps(launch)
        alive = {n: launch.proc.poll() is None if n == "router" else rss_kib(p) is not None
                 for n, p in pids.items()}
    finally:
        launch.stop()
    warm = next((s for s in sampler.samples if s.label == "warm-up end"), first)
    warnings = [ln.rstrip() for ln in launch.lines if " WARNING " in ln or " ERROR " in ln]
    return {"model": Path(model).name, "pids": pids, "alive": alive, "soak": soaked,
            "steps": steps, "warnings": warnings,
            "overload": over, "after": after, "samples": sampler.samples, "first": first,
            "warm": warm, "end": end, "last": last, "want": want}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--requests", type=int, default=2000, help="soak requests (default: 2000)")
    p.add_argument("--concurrency", type=int, default=256,
                   help="soak requests in flight (default: 256)")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="per request, greedy (default: 32)")
    p.add_argument("--num-prompts", type=int, default=len(PROMPTS),
                   choices=range(1, len(PROMPTS) + 1),
                   metavar="N", help=f"distinct prompts (default: {len(PROMPTS)})")
    p.add_argument("--max-running", type=int, default=256,
                   help="router --max-running (default: 256)")
    p.add_argument("--max-queue", type=int, default=64, help="router --max-queue (default: 64)")
    p.add_argument("--overload", type=int, default=None,
                   help="requests at once in the overload phase (default: 2 x (max-running + "
                        "max-queue))")
    p.add_argument("--warmup", type=float, default=0.1,
                   help="fraction of the soak counted as warm-up (default: 0.1)")
    p.add_argument("--sample-interval", type=float, default=2.0, help="seconds (default: 2)")
    p.add_argument("--series-rows", type=int, default=30, help="rows of the over-time table")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--launch-args", default="", help="more `pd launch` flags, one string")
    args = p.parse_args(argv)
    if args.overload is None:
        args.overload = 2 * (args.max_running + args.max_queue)
    if args.concurrency > args.max_running + args.max_queue:
        p.error("--concurrency above --max-running + --max-queue would be refused during the soak")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    print_report(report, args)
    bad = checks(report, args)
    for line in bad:
        print(f"FAILED: {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
