"""The router's command line: `build_parser()` for its flags, `run(args, backend)` to serve.

`run` loads the tokenizer of `--model` (`pd.text.tokenizer.Tokenizer`), builds the `RouterServer`
over the given backend and serves it on uvloop until interrupted. Building the backend from
`--prefill`, `--decode` and `--policy` (the ZMQ backend, the node registry) is left to the
caller that owns it (`pd router`, `pd launch`); `start()` is the piece tests use to serve on
a loop of their own.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from pathlib import Path

from aiohttp import web

from pd.service.flags import at_least_one
from pd.wire import security
from router.backend import Backend
from router.policies import POLICIES
from router.config import ServerConfig
from router.server import RouterServer
from router.tool_calls import PARSERS


def _address(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT")
    return value


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(
        prog="pd router", description="OpenAI-compatible HTTP front for prefill/decode nodes.")
    p.add_argument("--model", required=parser is None,
                   help="model directory; the router reads its tokenizer and chat template")
    p.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error"), help="(default: %(default)s)")
    add_router_arguments(p)
    return p


def add_router_arguments(p, with_nodes: bool = True) -> None:
    """The router's own flags (not --model and --log-level, which `pd launch` shares)."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients put in 'model' (default: the model directory's name)")
    p.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                   help="how the model writes tool calls: 'hermes' (<tool_call>{...}</tool_call>: "
                        "Hermes, Qwen 2.5/3) or 'llama3_json' (a JSON object: Llama 3.1+); "
                        "chat requests with tools then get tool_calls (tool_choice auto). "
                        "Without it tools need tool_choice none (default: none)")
    if with_nodes:
        p.add_argument("--prefill", nargs="+", type=_address, default=[], metavar="HOST:PORT",
                       help="prefill nodes' control addresses")
        p.add_argument("--decode", nargs="+", type=_address, default=[], metavar="HOST:PORT",
                       help="decode nodes' control addresses")
    p.add_argument("--policy", choices=tuple(POLICIES), default="load",
                   help="node choice: 'load' (prefill: least outstanding prefill tokens; decode: "
                        "most free KV blocks; power of two choices among equals), "
                        "'round_robin', 'random', or 'cache_aware' (the node most likely to "
                        "hold the prompt's prefix in its prefix cache, balanced against load) "
                        "(default: %(default)s)")
    p.add_argument("--cache-threshold", type=float, default=0.5,
                   help="cache_aware: route by cache when the best node holds at least this "
                        "fraction of the prompt, else to the least busy node (default: %(default)s)")
    p.add_argument("--balance-abs-threshold", type=int, default=32,
                   help="cache_aware: the least busy node takes the request, cached prefix or "
                        "not, when the busiest node has more than this many requests more than "
                        "it and more than --balance-rel-threshold times as many (default: "
                        "%(default)s)")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5,
                   help="cache_aware: see --balance-abs-threshold (default: %(default)s)")
    p.add_argument("--max-running", type=int, default=512,
                   help="sequences in flight to the nodes at once: a request counts its "
                        "prompts x n; one that asks for more is refused with HTTP 400 "
                        "(default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="requests waiting for --max-running before new ones get HTTP 429; "
                        "clients (a request's 'user', else its address) take turns in it "
                        "(default: %(default)s)")
    p.add_argument("--max-queue-per-client", type=int, default=None,
                   help="requests one client may have waiting before its next gets HTTP 429 "
                        "(default: half of --max-queue, so another client always finds room)")
    p.add_argument("--api-key", default=os.environ.get("PD_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $PD_API_KEY; "
                        "none: open). On the command line every local user can read it (ps): "
                        "prefer PD_API_KEY or --api-key-file")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from the first line of PATH (instead of --api-key)")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults for requests that omit temperature, top_p, top_k, "
                        "min_p or repetition_penalty: 'auto' takes them from the model's "
                        "generation_config.json, 'vllm' uses none (temperature 1), a directory "
                        "reads its generation_config.json (default: %(default)s)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds to receive a request body before answering 408 "
                        "(default: %(default)s)")
    p.add_argument("--write-timeout", type=float, default=60.0,
                   help="seconds a streaming client may stop reading before it is dropped and "
                        "its request aborted (default: %(default)s)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a new connection has to send its first request line and "
                        "headers before it is closed (default: %(default)s)")
    p.add_argument("--keepalive-timeout", type=float, default=75.0,
                   help="seconds an idle kept-alive connection stays open (default: %(default)s)")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open client connections at most; past it a new one is answered 503 "
                        "and closed (default: the open-file limit less 256)")
    p.add_argument("--router-workers", type=at_least_one("processes"), default=1, metavar="N",
                   help="router processes sharing --port (the kernel spreads connections over "
                        "them, SO_REUSEPORT), for more streams than one process can write: "
                        "each admits its share of --max-running, --max-queue and "
                        "--max-connections, and /metrics sums all of them (default: %(default)s)")
    p.add_argument("--log-requests", action="store_true",
                   help="log each request's id, prompt length and sampling parameters")
    security.add_arguments(p)


def api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file, PD_API_KEY or --api-key; warns when it was given in argv."""
    log = logging.getLogger("router")
    if args.api_key_file:
        if args.api_key and args.api_key != os.environ.get("PD_API_KEY"):
            raise SystemExit("give the API key once: --api-key or --api-key-file, not both")
        lines = Path(args.api_key_file).read_text().splitlines()
        key = lines[0].strip() if lines else ""
        if not key:
            raise SystemExit(f"--api-key-file {args.api_key_file}: the first line is empty")
        return key
    if args.api_key and args.api_key != os.environ.get("PD_API_KEY"):
        log.warning("--api-key on the command line is visible to every local user (ps); "
                    "prefer PD_API_KEY or --api-key-file")
    return args.api_key


def server_config(args: argparse.Namespace, share: int = 1) -> ServerConfig:
    """The server's configuration; `share` > 1: one of that many router workers, which admits
    its share of the limits."""
    from pd.wire.sampling_params import generation_defaults

    def part(limit: int | None) -> int | None:
        return None if limit is None else max(1, -(-limit // share))

    name = args.served_model_name or Path(args.model).resolve().name
    defaults = generation_defaults(args.model, args.generation_config)
    if defaults:
        logging.getLogger("router").info("sampling defaults from the generation config: %s",
                                         defaults)
    return ServerConfig(served_model_name=name, max_running=part(args.max_running),
                        max_queue=part(args.max_queue),
                        max_queue_per_client=part(args.max_queue_per_client),
                        api_key=api_key(args),
                        log_requests=args.log_requests, sampling_defaults=defaults,
                        body_timeout=args.body_timeout, write_timeout=args.write_timeout,
                        header_timeout=args.header_timeout,
                        keepalive_timeout=args.keepalive_timeout,
                        max_connections=part(args.max_connections), kv_share=1 / share,
                        tool_call_parser=args.tool_call_parser)


def run_loop(main):
    """Run coroutine `main` to the end on uvloop where installed, else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def start(server: RouterServer, host: str, port: int,
                reuse_port: bool = False) -> web.AppRunner:
    """Serve `server` on the running loop behind the connection guard (`router.guard`);
    returns the runner (`await runner.cleanup()`). `reuse_port`: several router processes
    listen on the port (`router.workers`)."""
    from router.guard import ConnectionGuard, GuardedSite, default_max_connections

    config, metrics = server.config, server.metrics
    # NOTE: handler_cancellation makes a client disconnect cancel its handler, which closes
    # the generation and aborts the request on the nodes even while no token is flowing.
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None,
                           keepalive_timeout=config.keepalive_timeout)
    await runner.setup()
    guard = ConnectionGuard(config.max_connections or default_max_connections(),
                            config.header_timeout,
                            on_refused=metrics.connections_refused.inc,
                            on_timeout=metrics.header_timeouts.inc)
    await GuardedSite(runner, host, port, guard, reuse_port=reuse_port).start()
    return runner


async def wait_healthy(backend: Backend, prefill: list[str], decode: list[str],
                       timeout: float) -> str | None:
    """Wait until the backend sees every given node healthy; None then, else (after `timeout`
    seconds) what is wrong."""
    want = {"prefill": len(prefill), "decode": len(decode)}
    deadline = time.monotonic() + timeout
    while backend.health() != want:
        if time.monotonic() > deadline:
            return f"nodes not healthy after {timeout}s: {backend.health()}"
        await asyncio.sleep(0.05)
    return None


def run(args: argparse.Namespace, backend: Backend) -> None:
    from pd.service.procs import freeze_heap
    from pd.text.tokenizer import Tokenizer

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = RouterServer(backend, Tokenizer.from_dir(args.model), server_config(args))

    async def main() -> None:
        runner = await start(server, args.host, args.port)
        freeze_heap()
        logging.getLogger("router").info("serving %s on http://%s:%d/v1",
                                         server.config.served_model_name, args.host, args.port)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        run_loop(main())
    except KeyboardInterrupt:
        pass
