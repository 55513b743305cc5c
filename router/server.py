"""The router's HTTP server: the OpenAI-compatible API on aiohttp (run on uvloop).

Routes: `POST /v1/completions` and `POST /v1/chat/completions` (`completions.py`: SSE when
`stream` is true), `GET /v1/models`, `GET /v1/models/{id}`, vLLM's `POST /tokenize`, `POST
/detokenize` and `GET /version`, `GET /health`, `GET /metrics`, and `GET /openapi.json` (the
document of `openapi.py`). The server checks the API key and the content type of every request
(a middleware that also counts each answer by endpoint and status), bounds and times a request
body's reading, and answers every error in the OpenAI shape with its status. Handlers are
cancelled when the client goes away.

aiohttp was picked over FastAPI+uvicorn by `benchmarks/bench_http.py` (2-3x the SSE chunk
rate on loopback). Picking nodes and talking to them is the backend's job.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from aiohttp import web

from router import capacity
from router.admission import Admission
from router.backend import Backend
from router.completions import CLIENT_GONE, MAX_BYTES_PER_TOKEN, Completions, Tokenizer
from router.config import ServerConfig
from router.errors import APIError, bad_param, model_not_found, unauthorized
from router.metrics import CONTENT_TYPE_LATEST, RouterMetrics
from router.openapi import openapi_document
from router.chat_request import parse_chat
from router.protocol import decode_body, parse_completion
from router.responses import dumps

log = logging.getLogger(__name__)
MAX_BODY = 64 * 2**20  # a request body is never larger than this, whatever the context


def pd_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pd")
    except PackageNotFoundError:  # run from a checkout without installing
        return "0+checkout"


def error_response(e: APIError) -> web.Response:
    return web.Response(status=e.status, body=dumps(e.body()), content_type="application/json")


class RouterServer:
    def __init__(self, backend: Backend, tokenizer: Tokenizer, config: ServerConfig) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = RouterMetrics(health=backend.health)
        self.admission = Admission(
            config.max_running, config.max_queue, config.max_queue_per_client,
            kv_budget=lambda: capacity.budget(backend.kv_blocks(), config.kv_share))
        self._created = int(time.time())
        self.generate = Completions(backend, tokenizer, config, self.metrics, self.admission,
                                    self._body)

    def body_limit(self) -> int:
        """Bytes a request body may have: enough for prompts filling the context several times
        over (MAX_BYTES_PER_TOKEN a token), checked by aiohttp before anything is parsed."""
        return min(MAX_BODY, max(2**20, 4 * MAX_BYTES_PER_TOKEN * self.backend.max_model_len()))

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=self.body_limit())
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id}", self.model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_get("/openapi.json", self.openapi)
        app.on_startup.append(lambda _: self.backend.start())
        app.on_cleanup.append(lambda _: self.backend.close())
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        status = 499  # the client went away before an answer
        try:
            if self.config.api_key and request.path.startswith("/v1/"):
                given = request.headers.get("Authorization", "")
                # NOTE: a header of bytes that are not UTF-8 arrives with surrogates
                if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                           f"Bearer {self.config.api_key}".encode()):
                    raise unauthorized()
            if (request.method == "POST" and request.match_info.route.resource is not None
                    and request.content_type != "application/json"):
                # a web page may post text/plain to a local server without a preflight
                raise APIError(415, f"Content-Type must be application/json, not "
                                    f"{request.content_type or 'none'}", code="unsupported_media_type")
            resp = await handler(request)
            status = 499 if request.get(CLIENT_GONE) else resp.status
            return resp
        except APIError as e:
            status = e.status
            return error_response(e)
        except web.HTTPException as e:
            status = e.status
            return error_response(APIError(e.status, f"{e.reason}: {request.method} "
                                                     f"{request.path}", code=str(e.status)))
        finally:
            resource = request.match_info.route.resource
            endpoint = resource.canonical if resource is not None else "other"
            self.metrics.http_requests.labels(endpoint, str(status)).inc()

    def _model_card(self) -> dict:
        return {"id": self.config.served_model_name, "object": "model", "created": self._created,
                "owned_by": "pd", "max_model_len": self.backend.max_model_len()}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model_id"]
        if name != self.config.served_model_name:
            raise model_not_found(name, self.config.served_model_name)
        return web.json_response(self._model_card())

    async def _utility_body(self, request: web.Request) -> dict:
        """The JSON object of a /tokenize or /detokenize request, its model (if named) checked."""
        body = await self._body(request)
        if not isinstance(body, dict):
            raise bad_param("", "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.config.served_model_name:
            raise model_not_found(str(model), self.config.served_model_name)
        return body

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: `prompt` (text; `add_special_tokens`, default true) or `messages`
        (a chat, rendered by the template; `add_generation_prompt`, default true)."""
        body = await self._utility_body(request)
        flags = {name: body.get(name, True) for name in ("add_special_tokens", "add_generation_prompt")}
        for name, v in flags.items():
            if not isinstance(v, bool):
                raise bad_param(name, "must be a boolean")
        if "messages" in body:
            messages = parse_chat({"messages": body["messages"]}).messages
            encode = lambda: self.tokenizer.encode_chat(  # noqa: E731
                messages, add_generation_prompt=flags["add_generation_prompt"])
        elif isinstance(body.get("prompt"), str):
            limit = self.backend.max_model_len() * MAX_BYTES_PER_TOKEN
            if len(body["prompt"]) > limit:
                raise bad_param("prompt", f"is longer than {limit} characters")
            encode = lambda: self.tokenizer.encode(  # noqa: E731
                body["prompt"], add_special_tokens=flags["add_special_tokens"])
        else:
            raise bad_param("prompt", "give 'prompt' (a string) or 'messages' (a chat)")
        try:
            ids = await asyncio.to_thread(encode)
        except Exception as e:  # a template that refuses the conversation
            raise bad_param("messages", f"the chat template failed: {e}")
        return web.json_response({"count": len(ids), "max_model_len": self.backend.max_model_len(),
                                  "tokens": ids})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._utility_body(request)
        ids = body.get("tokens")
        vocab = self.tokenizer.vocab_size
        if (not isinstance(ids, list) or len(ids) > self.backend.max_model_len()
                or not all(type(t) is int and 0 <= t < vocab for t in ids)):
            raise bad_param("tokens", f"must be a list of at most {self.backend.max_model_len()} "
                                      f"token ids in [0, {vocab})")
        return web.json_response({"prompt": self.tokenizer.decode(ids)})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": pd_version()})

    async def health(self, request: web.Request) -> web.Response:
        h = self.backend.health()
        ok = h.get("prefill", 0) > 0 and h.get("decode", 0) > 0
        return web.json_response({"status": "ok" if ok else "unavailable", **h},
                                 status=200 if ok else 503)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document(
            self.config.served_model_name, self.backend.max_model_len(), self.tokenizer.vocab_size))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, parse_completion)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, parse_chat)

    async def _body(self, request: web.Request) -> dict:
        try:
            raw = await asyncio.wait_for(request.read(), self.config.body_timeout)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within "
                                f"{self.config.body_timeout:g} s", code="request_timeout")
        return decode_body(raw)

