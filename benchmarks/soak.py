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
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

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
    from pd.llm import LLM
    from pd.sampling_params import SamplingParams

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
    from pd.procs import Launch

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


def checks(report: dict, args: argparse.Namespace) -> list[str]:
    """What failed, in words; empty when every check passed."""
    bad = []
    s, o, a = report["soak"], report["overload"], report["after"]
    if s.correct != args.requests:
        bad.append(f"soak: {s.correct} of {args.requests} correct ({s.wrong} wrong text, "
                   f"{s.refused} refused, errors {s.errors})")
    if o.refused == 0:
        bad.append(f"overload: no 429 for {args.overload} requests at once")
    if o.wrong or o.errors or o.correct + o.refused != args.overload:
        bad.append(f"overload: {o.wrong} wrong text, errors {o.errors}")
    if o.max_waiting > args.max_queue:
        bad.append(f"overload: {o.max_waiting:.0f} waiting, more than --max-queue {args.max_queue}")
    if a.correct != 1:
        bad.append(f"after the overload a request did not succeed: {a.errors or 'wrong text'}")
    bad += [f"{name} exited during the run" for name, ok in report["alive"].items() if not ok]
    return bad


def slope_per_1k(samples: list[Sample], name: str) -> float | None:
    """Least-squares RSS growth in MiB per 1000 requests done, over `samples`."""
    pts = [(x.done, x.rss[name] / 1024) for x in samples if x.rss.get(name) is not None]
    if len({d for d, _ in pts}) < 2:
        return None
    md, mr = statistics.fmean(d for d, _ in pts), statistics.fmean(r for _, r in pts)
    var = sum((d - md) ** 2 for d, _ in pts)
    return 1000 * sum((d - md) * (r - mr) for d, r in pts) / var


def mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.1f}"


def print_report(report: dict, args: argparse.Namespace) -> None:
    s, o = report["soak"], report["overload"]
    print(f"\npd launch --model {report['model']} --max-running {args.max_running} --max-queue "
          f"{args.max_queue} {args.launch_args}".rstrip())
    print(f"soak: {args.requests} streamed completions at concurrency {args.concurrency}, "
          f"max_tokens {args.max_tokens}, {len(report['want'])} prompts, model {report['model']}")
    print(f"  {s.correct} correct, {s.wrong} wrong, {s.refused} refused (429), "
          f"{sum(s.errors.values())} errors {s.errors or ''} in {s.seconds:.1f} s "
          f"({args.requests / s.seconds:.1f} req/s)")
    warm, end, last = report["warm"], report["end"], report["last"]
    after_warm = [x for x in report["samples"] if x.t >= warm.t]
    soaking = [x for x in after_warm if x.t <= end.t]
    print(f"\nRSS (MiB); warm-up = first {warm.done} requests, ended at {warm.t:.0f} s; "
          f"soak ended at {end.t:.0f} s")
    print(f"{'process':<12}{'pid':>8}{'start':>9}{'warm-up':>9}{'peak after':>12}{'soak end':>10}"
          f"{'overload':>10}{'growth':>9}{'growth %':>10}{'MiB/1k req':>12}")
    for name, pid in report["pids"].items():
        w, e = warm.rss.get(name), end.rss.get(name)
        peak = max((x.rss.get(name) or 0 for x in after_warm), default=0)
        growth = "-" if w is None or e is None else f"{(e - w) / 1024:+.1f}"
        pct = "-" if not w or e is None else f"{100 * (e - w) / w:+.1f}"
        slope = slope_per_1k(soaking, name)
        slope = "-" if slope is None else f"{slope:+.2f}"
        print(f"{name:<12}{pid:>8}{mib(report['first'].rss.get(name)):>9}{mib(w):>9}"
              f"{mib(peak):>12}{mib(e):>10}{mib(last.rss.get(name)):>10}{growth:>9}{pct:>10}"
              f"{slope:>12}")
    samples = report["samples"]
    step = max(1, len(samples) // args.series_rows)
    rows = [x for i, x in enumerate(samples) if i % step == 0 or x.label]
    names = list(report["pids"])
    print("\nRSS over time (MiB)")
    print(f"{'t (s)':>7}{'done':>7}" + "".join(f"{n:>12}" for n in names) + "  event")
    for x in rows:
        print(f"{x.t:>7.0f}{x.done:>7}" + "".join(f"{mib(x.rss.get(n)):>12}" for n in names)
              + f"  {x.label}")
    med = statistics.median(o.refused_seconds) * 1000 if o.refused_seconds else float("nan")
    print(f"\noverload: {args.overload} streamed requests at once against --max-running "
          f"{args.max_running} --max-queue {args.max_queue}")
    print(f"  {o.correct} served (all correct: {o.wrong == 0 and not o.errors}), {o.refused} "
          f"answered 429 (median {med:.1f} ms), other {sum(o.errors.values())}; router waiting "
          f"gauge peak {o.max_waiting:.0f} (bound {args.max_queue}); {o.seconds:.1f} s; "
          f"request after it: {'ok' if report['after'].correct == 1 else 'FAILED'}")
    print("\nengine steps (whole run): " + ", ".join(
        f"{name} {n} steps, {over1} over 1 s, {over25} over 2.5 s"
        for name, (n, over1, over25) in report["steps"].items()))
    warnings = report["warnings"]
    print(f"pd launch logged {len(warnings)} warning(s)/error(s)"
          + "".join(f"\n  {w[:160]}" for w in warnings[:8])
          + (f"\n  ... {len(warnings) - 8} more" if len(warnings) > 8 else ""))


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
