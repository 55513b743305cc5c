"""Fixtures for the router tests: a tokenizer directory, a scripted backend, a live server.

`ScriptedBackend` is a fake of the node side, used only to test the router alone: it answers
each request with the token ids its `script` gives for the prompt, in events of `chunk` ids,
with made-up logprobs, and records which requests were closed before they finished (the
router's aborts). The server runs for real (aiohttp on uvloop, loopback) in a thread, so the
official `openai` client talks to it over HTTP.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Callable

import pytest

from pd.testing.tiny import tiny_tokenizer, write_tokenizer_files
from pd.text.tokenizer import Tokenizer
from router.backend import Backend, BackendUnavailable, GenerateRequest, TokenEvent
from router.main import start
from router.config import ServerConfig
from router.server import RouterServer

MODEL = "tiny"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("router-tok")
    write_tokenizer_files(path, tiny_tokenizer(), model_max_length=512)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


class ScriptedBackend(Backend):
    def __init__(self, script: Callable[[GenerateRequest], list[int]], eos_id: int,
                 chunk: int = 1, delay: float = 0.0, max_len: int = 256) -> None:
        self.script = script
        self.eos_id = eos_id
        self.chunk = chunk
        self.delay = delay
        self.max_len = max_len
        self.nodes = {"prefill": 1, "decode": 1}
        self.requests: list[GenerateRequest] = []
        self.closed_early: list[str] = []
        self.fail_first: int = 0  # this many requests fail before their first token
        self.fail_error = "prefill node died"  # with this error
        self.unavailable = False
        self.started = threading.Event()  # set when a request is running

    def health(self) -> dict:
        return dict(self.nodes)

    def max_model_len(self) -> int:
        return self.max_len

    async def generate(self, req: GenerateRequest):
        if self.unavailable:
            raise BackendUnavailable("all decode nodes are down")
        self.requests.append(req)
        if self.fail_first > 0:
            self.fail_first -= 1
            yield TokenEvent([], error=self.fail_error, first_token_sent=False)
            return
        ids = list(self.script(req))[:req.params.max_tokens]
        finish = "length"
        stop_at = [i for i, t in enumerate(ids) if t in req.params.stop_token_ids]
        if stop_at:
            ids, finish = ids[:stop_at[0] + 1], "stop"
        elif len(ids) < req.params.max_tokens:
            ids.append(self.eos_id)
            finish = "stop"
        k = req.params.logprobs
        finished = False
        try:
            self.started.set()
            for i in range(0, len(ids), self.chunk):
                part = ids[i:i + self.chunk]
                if self.delay:
                    await asyncio.sleep(self.delay)
                lps = tops = None
                if k is not None:
                    lps = [-0.25 * (1 + (t % 7)) for t in part]
                    tops = [[((t + j) % 500, lp - j) for j in range(k)] for t, lp in zip(part, lps)]
                last = i + self.chunk >= len(ids)
                yield TokenEvent(part, lps, tops, finish if last else None)
            finished = True
        finally:
            if not finished:
                self.closed_early.append(req.req_id)


class LiveServer:
    """A RouterServer on a loopback port, run on uvloop in a thread of its own."""

    def __init__(self, backend: Backend, tokenizer, **config) -> None:
        import uvloop

        self.server = RouterServer(backend, tokenizer, ServerConfig(MODEL, **config))
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(start(self.server, "127.0.0.1", 0), self.loop)
        self.runner = fut.result(10)
        self.port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "none"):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0,
                             timeout=20)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def echo_script(tokenizer, text: str) -> Callable[[GenerateRequest], list[int]]:
    """Every request is answered with `text`'s token ids."""
    ids = tokenizer.encode(text)
    return lambda req: ids


@pytest.fixture
def make_server(tokenizer):
    servers = []

    def make(backend: Backend, **config) -> LiveServer:
        s = LiveServer(backend, tokenizer, **config)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()
