"""Pick the router's HTTP stack (aiohttp vs FastAPI+uvicorn, both on uvloop) and measure
the router's own cost per streamed token.

Each server runs in its own subprocess and answers a stream of N small SSE chunks
(`data: {...}\\n\\n`) and a final `data: [DONE]`. An aiohttp client on uvloop opens C concurrent
streams, R requests in all, and the table shows chunks/s over the run and the median and p99
request latency. `aiohttp` and `fastapi` rows are the bare stacks (`GET /stream?n=N`); the
`router` row is the real `RouterServer` (validation, tokenization, detokenization, stop-string
scan, OpenAI chunks, metrics) serving `POST /v1/completions` with `stream: true` over a
zero-latency in-process backend that yields one token per event, so the difference to the
`aiohttp` row is what the router adds per token on top of the bare stack.

    .venv/bin/python benchmarks/bench_http.py [--chunks 256] [--requests 200] [--concurrency 1 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHUNK = {"id": "cmpl-x", "object": "text_completion", "choices": [{"index": 0, "text": "tok"}]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_aiohttp(port: int) -> None:
    import uvloop
    from aiohttp import web

    async def stream(request: web.Request) -> web.StreamResponse:
        n = int(request.query.get("n", "16"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(n):
            await resp.write(b"data: " + json.dumps(CHUNK).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/stream", stream)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def serve_router(port: int) -> None:
    import tempfile
    from pathlib import Path

    import uvloop

    from pd.testing.tiny import tiny_tokenizer, write_tokenizer_files
    from pd.text.tokenizer import Tokenizer
    from router.backend import Backend, TokenEvent
    from router.main import start
    from router.config import ServerConfig
    from router.server import RouterServer

    class NullBackend(Backend):
        """Answers at once with one token per event: only the router's own cost remains."""

        def __init__(self, ids: list[int]) -> None:
            self.ids = ids

        async def generate(self, req):
            n = req.params.max_tokens
            for i in range(n):
                yield TokenEvent([self.ids[i % len(self.ids)]],
                                 finish_reason="length" if i == n - 1 else None)

        def health(self) -> dict:
            return {"prefill": 1, "decode": 1}

        def max_model_len(self) -> int:
            return 1 << 20

    path = Path(tempfile.mkdtemp())
    write_tokenizer_files(path, tiny_tokenizer(), model_max_length=1 << 20)
    tok = Tokenizer.from_dir(path)
    ids = tok.encode("def format_field(self, value, format_spec): return format(value)")
    server = RouterServer(NullBackend(ids), tok, ServerConfig("bench"))

    async def main() -> None:
        await start(server, "127.0.0.1", port)
        await asyncio.Event().wait()

    uvloop.run(main())


def serve_fastapi(port: int) -> None:
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.get("/stream")
    async def stream(n: int = 16):
        async def gen():
            for _ in range(n):
                yield b"data: " + json.dumps(CHUNK).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", log_level="warning",
                access_log=False)


async def _client(port: int, chunks: int, requests: int, concurrency: int,
                  router: bool) -> tuple[float, list]:
    import aiohttp

    base = f"http://127.0.0.1:{port}"
    body = {"model": "bench", "prompt": "x", "max_tokens": chunks, "stream": True}
    latencies: list[float] = []
    left = requests

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            t0 = time.perf_counter()
            req = (session.post(base + "/v1/completions", json=body) if router
                   else session.get(f"{base}/stream?n={chunks}"))
            async with req as r:
                got = 0
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        got += 1
                if got != chunks:
                    raise RuntimeError(f"got {got} chunks, expected {chunks}")
            latencies.append(time.perf_counter() - t0)

    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return time.perf_counter() - t0, latencies


def _wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"server on port {port} did not start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=256, help="SSE chunks per request")
    p.add_argument("--requests", type=int, default=200, help="requests per measurement")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--stacks", nargs="+", default=["aiohttp", "fastapi", "router"],
                   choices=["aiohttp", "fastapi", "router"])
    p.add_argument("--serve", choices=["aiohttp", "fastapi", "router"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        {"aiohttp": serve_aiohttp, "fastapi": serve_fastapi, "router": serve_router}[a.serve](a.port)
        return
    import uvloop

    print(f"{'stack':<18}{'conc':>6}{'chunks/s':>12}{'p50 ms':>10}{'p99 ms':>10}")
    for stack in a.stacks:
        port = _free_port()
        proc = subprocess.Popen([sys.executable, __file__, "--serve", stack, "--port", str(port)],
                                cwd=Path(__file__).resolve().parents[1])
        try:
            _wait_port(port)
            for c in a.concurrency:
                r = stack == "router"
                uvloop.run(_client(port, a.chunks, max(c, a.requests // 10), c, r))  # warm-up
                wall, lat = uvloop.run(_client(port, a.chunks, a.requests, c, r))
                lat.sort()
                p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
                print(f"{stack + '+uvloop':<18}{c:>6}{a.requests * a.chunks / wall:>12.0f}"
                      f"{statistics.median(lat) * 1e3:>10.2f}{p99 * 1e3:>10.2f}")
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
