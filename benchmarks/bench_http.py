"""Pick the router's HTTP stack: aiohttp vs FastAPI+uvicorn, both on uvloop, serving SSE.

Each server runs in its own subprocess and answers `GET /stream?n=N` with N small SSE chunks
(`data: {...}\\n\\n`) and a final `data: [DONE]`. An aiohttp client on uvloop opens C concurrent
streams, R requests in all, and the table shows chunks/s over the run and the median and p99
request latency. Nothing here touches the router itself; it only measures the two stacks.

    .venv/bin/python benchmarks/bench_http.py [--chunks 256] [--requests 400] [--concurrency 1 16]
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


async def _client(port: int, chunks: int, requests: int, concurrency: int) -> tuple[float, list]:
    import aiohttp

    url = f"http://127.0.0.1:{port}/stream?n={chunks}"
    latencies: list[float] = []
    left = requests

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            t0 = time.perf_counter()
            async with session.get(url) as r:
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
    p.add_argument("--serve", choices=["aiohttp", "fastapi"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        (serve_aiohttp if a.serve == "aiohttp" else serve_fastapi)(a.port)
        return
    import uvloop

    print(f"{'stack':<18}{'conc':>6}{'chunks/s':>12}{'p50 ms':>10}{'p99 ms':>10}")
    for stack in ("aiohttp", "fastapi"):
        port = _free_port()
        proc = subprocess.Popen([sys.executable, __file__, "--serve", stack, "--port", str(port)])
        try:
            _wait_port(port)
            for c in a.concurrency:
                uvloop.run(_client(port, a.chunks, max(c, a.requests // 10), c))  # warm-up
                wall, lat = uvloop.run(_client(port, a.chunks, a.requests, c))
                lat.sort()
                p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
                print(f"{stack + '+uvloop':<18}{c:>6}{a.requests * a.chunks / wall:>12.0f}"
                      f"{statistics.median(lat) * 1e3:>10.2f}{p99 * 1e3:>10.2f}")
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
