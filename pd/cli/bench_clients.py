"""`pd bench --client-processes N`: one run split among N client processes, so that the client
is not what the figures measure. One Python process reads every stream's events and parses each
chunk's JSON; at tens of thousands of tokens per second it is near a whole core (0.8-0.96 on the
H100 host at concurrency 64 and 256), and then its own queueing shows as inter-token gaps and
TTFT.

Prompts go round-robin to the processes (prompt j to process j mod N), and so do the
concurrency (each takes its share of `--max-concurrency`, the first ones one more) and the
request rate (each a Poisson stream of rate / N: together, one of the whole rate). Each process
sets itself up (its tokenizer, HTTP session; the first one sends the test request), all start
at once, and the run's duration is from the first start to the last end (one monotonic clock
for the host). Outputs come back in prompt order.
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import queue
import time

CHILD_SETUP_S = 120.0  # a process's tokenizer and session, and the test request


def split(args: argparse.Namespace, prompts: list, n: int) -> list[tuple[argparse.Namespace, list]]:
    """Each process's arguments and prompts."""
    if n > len(prompts):
        raise ValueError(f"--client-processes {n} is more than the {len(prompts)} prompts")
    conc = args.max_concurrency
    if conc is not None and conc < n:
        raise ValueError(f"--max-concurrency {conc} cannot be shared by {n} client processes")
    # NOTE: the flags' values only (the command line's parser leaves its handler in args)
    plain = argparse.Namespace(**{k: v for k, v in vars(args).items()
                                  if isinstance(v, (str, int, float, bool, list, type(None)))})
    out = []
    for i in range(n):
        a = copy.copy(plain)
        a.client_processes = 1
        a.max_concurrency = None if conc is None else conc // n + (i < conc % n)
        a.request_rate = args.request_rate / n
        a.seed = args.seed + i  # its own arrival draws
        a.no_test_request = args.no_test_request or i > 0
        a.disable_progress = True
        out.append((a, prompts[i::n]))
    return out


def _client(index: int, args: argparse.Namespace, prompts: list, barrier, results) -> None:
    from pd.cli.bench_run import load_tokenizer, run
    from router.main import run_loop

    start = []

    def ready() -> None:  # every process is set up: start together
        barrier.wait(CHILD_SETUP_S)
        start.append(time.monotonic())

    try:
        outputs, duration, model = run_loop(run(args, prompts, load_tokenizer(args), ready))
        results.put((index, outputs, start[0], start[0] + duration, model, None))
    except BaseException as e:  # noqa: BLE001 (told to the parent)
        barrier.abort()
        results.put((index, [], 0.0, 0.0, None, f"client process {index}: {type(e).__name__}: {e}"))


def run_processes(args: argparse.Namespace, prompts: list, n: int) -> tuple[list, float, str]:
    """`pd.cli.bench_run.run` over `n` processes: (outputs in prompt order, duration, model)."""
    ctx = mp.get_context("spawn")  # NOTE: not fork: the tokenizer's threads may be running
    parts = split(args, prompts, n)
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(i, a, p, barrier, results), daemon=True)
             for i, (a, p) in enumerate(parts)]
    for p in procs:
        p.start()
    got: dict[int, tuple] = {}
    try:
        while len(got) < n:
            try:
                r = results.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if i not in got and not p.is_alive()]
                if dead:  # ended without a word (killed)
                    raise RuntimeError(f"client process {dead[0]} died (exit code "
                                       f"{procs[dead[0]].exitcode})") from None
                continue
            got[r[0]] = r
    finally:
        for p in procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
    errors = [r[5] for r in got.values() if r[5]]
    if errors:
        raise RuntimeError("; ".join(errors))
    outputs: list = [None] * len(prompts)
    for i, outs, *_ in got.values():
        outputs[i::n] = outs
    start = min(r[2] for r in got.values())
    end = max(r[3] for r in got.values())
    return outputs, end - start, got[0][4]
