"""Several router processes on one port (`--router-workers N`).

One router process writes every stream's tokens (detokenize, format, write a chunk per token);
past some tens of thousands of tokens per second it is the bottleneck. With N workers, N
router processes listen on the same --host:--port (SO_REUSEPORT: the kernel spreads new
connections over them); each is a whole router (its own node registry and heartbeats, its own
event endpoint the decode nodes stream to, its share of the admission limits, see
`router.main.server_config`). A connection stays with the worker that accepted it.

`/metrics`, whichever worker answers it, sums every worker's samples (prometheus_client's
multiprocess mode over a private directory made here). The parent only starts, watches and
stops the workers: a worker that dies is reported and the others keep serving.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import queue
import shutil
import tempfile
import time
from typing import Callable

from router.metrics import MULTIPROCESS_ENV

log = logging.getLogger("router")


def serve_workers(args: argparse.Namespace, prefill: list[str], decode: list[str], *,
                  ready_timeout: float, healthy: bool = True,
                  on_ready: Callable[[list[int]], None] | None = None,
                  watch: Callable[[], None] | None = None) -> None:
    """Run `args.router_workers` router processes until interrupted (KeyboardInterrupt), then
    stop them. `on_ready(pids)` once every worker serves (with `healthy`, once each also sees
    every node healthy); `watch()` every half second after (the caller's own checks)."""
    count = args.router_workers
    # what a worker needs of the command line (not the handlers argparse keeps beside it)
    args = argparse.Namespace(**{k: v for k, v in vars(args).items()
                                 if isinstance(v, (str, int, float, bool, list, tuple, type(None)))})
    metrics_dir = tempfile.mkdtemp(prefix="pd-router-metrics-")
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    procs = []
    saved = os.environ.get(MULTIPROCESS_ENV)
    os.environ[MULTIPROCESS_ENV] = metrics_dir  # the workers inherit it at their start
    try:
        for index in range(count):
            proc = ctx.Process(target=_worker, args=(args, prefill, decode, index, count, ready,
                                                     ready_timeout if healthy else 0.0),
                               name=f"pd-router-{index}", daemon=True)
            proc.start()
            procs.append(proc)
        _wait_ready(procs, ready, ready_timeout)
        if on_ready is not None:
            on_ready([p.pid for p in procs])
        reported = set()
        while True:
            for proc in procs:
                if proc.exitcode is not None and proc.pid not in reported:
                    reported.add(proc.pid)
                    _forget(proc.pid)
                    log.error("router worker %s (pid %d) exited with status %s; the others "
                              "keep serving", proc.name, proc.pid, proc.exitcode)
            if len(reported) == len(procs):
                raise RuntimeError("every router worker exited")
            if watch is not None:
                watch()
            time.sleep(0.5)
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.terminate()
        for proc in procs:
            proc.join(timeout=10)
            if proc.exitcode is None:
                proc.kill()
        if saved is None:
            os.environ.pop(MULTIPROCESS_ENV, None)
        else:
            os.environ[MULTIPROCESS_ENV] = saved
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _wait_ready(procs, ready, timeout: float) -> None:
    waiting, deadline = {p.name for p in procs}, time.monotonic() + timeout
    while waiting:
        try:
            name, error = ready.get(timeout=0.2)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode is not None]
            if dead:
                raise RuntimeError(f"router worker {dead[0].name} exited with status "
                                   f"{dead[0].exitcode} before serving")
            if time.monotonic() > deadline:
                raise RuntimeError(f"router workers not ready after {timeout}s: {sorted(waiting)}")
            continue
        if error:
            raise RuntimeError(f"router worker {name}: {error}")
        waiting.discard(name)


def _forget(pid: int) -> None:
    """A dead worker's gauges leave the sums (its counters stay counted)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)


def _worker(args: argparse.Namespace, prefill: list[str], decode: list[str], index: int,
            count: int, ready, ready_timeout: float) -> None:
    import asyncio
    import signal

    from pd.service.procs import _die_with_parent, freeze_heap
    from pd.text.tokenizer import Tokenizer
    from pd.wire.security import configure_from_args
    from router.zmq_backend import make_backend
    from router.main import run_loop, server_config, start, wait_healthy
    from router.server import RouterServer

    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[{index}]: %(message)s")
    name = multiprocessing.current_process().name
    die = _die_with_parent()  # a parent killed outright (SIGKILL) leaves no worker behind
    if die is not None:
        die()
    try:
        configure_from_args(args)
        backend = make_backend(args, prefill, decode)
        server = RouterServer(backend, Tokenizer.from_dir(args.model), server_config(args, count))
    except Exception as e:  # noqa: BLE001 (told to the parent, which stops with it)
        ready.put((name, f"{type(e).__name__}: {e}"))
        return

    async def main() -> None:
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):  # the parent's terminate(), a terminal's ^C
            asyncio.get_running_loop().add_signal_handler(signum, stop.set)
        try:
            runner = await start(server, args.host, args.port, reuse_port=True)
        except OSError as e:
            ready.put((name, f"cannot serve on {args.host}:{args.port}: {e.strerror or e}"))
            return
        freeze_heap()
        # ready_timeout 0: ready once serving
        ready.put((name, await wait_healthy(backend, prefill, decode, ready_timeout)
                   if ready_timeout else None))
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
            await backend.close()

    run_loop(main())
