"""The router's generation endpoints, `POST /v1/completions` and `POST /v1/chat/completions`
(`Completions`, which `RouterServer` serves them with): a request parsed (`protocol.py`), its
model checked, its prompts tokenized (chat through the chat template) and checked against the
context length, admitted through the bounded queue, run on the backend as one `Generation` (a
backend request per prompt and choice), and written out as SSE chunks (ending with `data:
[DONE]`) or as one response. A request's unknown fields are ignored and named in the
`X-PD-Ignored-Fields` header and a log line. A client that stops reading its stream for the
write timeout is treated as gone; a handler cancelled because its client went away closes the
generation, which aborts the request on the nodes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from typing import Awaitable, Callable, Protocol, Sequence

from aiohttp import web

from pd.service.trace import trace
from pd.wire.messages import is_invalid, is_timeout
from router import capacity
from router.admission import Admission, QueueFull, TooLarge
from router.backend import Backend, BackendOverloaded, BackendUnavailable, GenerateRequest
from router.choice import Choice, Delta
from router.config import ServerConfig
from router.errors import APIError, bad_param, model_not_found, overloaded, unavailable
from router.generation import Generation
from router.metrics import RequestTimer, RouterMetrics
from router.protocol import ApiRequest
from router.responses import Accumulator, ResponseFormat, dumps, sse, usage
from router.tool_calls import ToolCallParser

log = logging.getLogger(__name__)
MAX_PROMPT_LOGPROB_ENTRIES = 200_000  # echoed prompt tokens x (logprobs + 1) in one request
CLIENT_GONE = web.RequestKey("pd_client_gone", bool)  # left while its answer was written
MAX_BYTES_PER_TOKEN = 64  # no token of a real vocabulary is longer (characters or bytes)
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}
# a write that leaves less than this in the client's send buffer cannot wait on the client
# (the transport pauses at its high-water mark, 64 KiB by default): it skips the timeout's timer
_UNTIMED_WRITE_BYTES = 16 * 2**10
IGNORED_HEADER = "X-PD-Ignored-Fields"  # the request's fields this server ignored


_FIELD_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def ignored_header(names: list[str]) -> str:
    """The header's value: the ignored fields' names that are plain words (a client's field
    name may hold anything, a header may not), and how many others there were."""
    plain = [n for n in names if _FIELD_NAME.fullmatch(n)][:16]
    rest = len(names) - len(plain)
    return ", ".join(plain + ([f"{rest} more"] if rest else []))


class Tokenizer(Protocol):
    """What the router uses of `pd.text.tokenizer.Tokenizer`."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]: ...


class Completions:
    """The generation endpoints of one router: its backend, tokenizer, configuration, metrics
    and admission queue, and how it reads a request's body (`read_body`, the body timeout's)."""

    def __init__(self, backend: Backend, tokenizer: Tokenizer, config: ServerConfig,
                 metrics: RouterMetrics, admission: Admission,
                 read_body: Callable[[web.Request], Awaitable[dict]]) -> None:
        self.backend, self.tokenizer, self.config = backend, tokenizer, config
        self.metrics, self.admission, self._body = metrics, admission, read_body

    def _check_text_length(self, req: ApiRequest) -> None:
        """Refuse text that cannot fit the context whatever it tokenizes to, before tokenizing
        it (a token is never longer than MAX_BYTES_PER_TOKEN characters here)."""
        limit = self.backend.max_model_len()
        if req.endpoint == "chat":
            texts = [json.dumps(req.messages, ensure_ascii=False)]
        else:
            texts = [p for p in req.prompts if isinstance(p, str)]
        for text in texts:
            if len(text) > limit * MAX_BYTES_PER_TOKEN:
                raise bad_param("messages" if req.endpoint == "chat" else "prompt",
                                f"this model's maximum context length is {limit} tokens; the "
                                f"prompt has {len(text)} characters, more than {limit} tokens "
                                f"can hold", "context_length_exceeded")

    def _prompts(self, req: ApiRequest) -> list[list[int]]:
        tok = self.tokenizer
        if req.endpoint == "chat":
            try:
                extra = {"tools": req.tools} if req.tools else {}
                prompts = [tok.encode_chat(req.messages, add_generation_prompt=True, **extra)]
            except Exception as e:  # a template that refuses the conversation
                raise bad_param("messages", f"the chat template failed: {e}")
        else:
            prompts = [tok.encode(p) if isinstance(p, str) else p for p in req.prompts]
        param = "messages" if req.endpoint == "chat" else "prompt"
        checked = [(param, ids) for ids in prompts] + [
            ("logit_bias", [t for t, _ in req.sampling.get("logit_bias", ())]),
            ("stop_token_ids", req.stop_token_ids)]
        for name, ids in checked:
            if name == param and not ids:
                raise bad_param(param, "the prompt has no tokens")
            if ids and max(ids) >= tok.vocab_size:
                raise bad_param(name, f"token id {max(ids)} is outside the vocabulary "
                                      f"(size {tok.vocab_size})")
        return prompts

    def _max_tokens(self, req: ApiRequest, prompt_len: int) -> int:
        limit = self.backend.max_model_len()
        param = "messages" if req.endpoint == "chat" else "prompt"
        if prompt_len >= limit:
            raise bad_param(param, f"this model's maximum context length is {limit} tokens; "
                                   f"the prompt has {prompt_len} tokens", "context_length_exceeded")
        if req.max_tokens is None:
            return limit - prompt_len
        if prompt_len + req.max_tokens > limit:
            raise bad_param("max_tokens", f"this model's maximum context length is {limit} "
                                          f"tokens; you requested {prompt_len + req.max_tokens} "
                                          f"({prompt_len} in the prompt, {req.max_tokens} for the "
                                          f"completion)", "context_length_exceeded")
        return req.max_tokens

    async def __call__(self, request: web.Request, parse) -> web.StreamResponse:
        """Answer a generation request whose body `parse` reads (`protocol.parse_completion`,
        `parse_chat`)."""
        t_arrival, t_traced = time.perf_counter(), time.monotonic()
        req = parse(await self._body(request))
        if req.model is None:
            req.model = self.config.served_model_name
        elif req.model != self.config.served_model_name:
            raise model_not_found(req.model, self.config.served_model_name)
        if req.tool_choice == "auto" and self.config.tool_call_parser is None:
            raise bad_param("tool_choice", "tool calls need the router started with "
                                           "--tool-call-parser (or tool_choice none)", "unsupported")
        headers = {}
        if req.ignored:  # as vLLM: accepted, not acted on, and said so
            log.warning("request fields ignored (not known to this server): %r", req.ignored[:16])
            headers[IGNORED_HEADER] = ignored_header(req.ignored)
        self._check_text_length(req)
        # NOTE: tokenizing and templating of long text run in a worker thread, not on the event
        # loop; prompts of token ids and short text here (a thread's round trip, its result
        # waiting for the GIL behind the loop, cost more than they do: see `_inline`)
        if _inline(req):
            prompts = self._prompts(req)
        else:
            prompts = await asyncio.to_thread(self._prompts, req)
        choices, greqs = [], []
        for p, ids in enumerate(prompts):
            max_tokens = self._max_tokens(req, len(ids))
            if req.echo and req.logprobs is not None and \
                    len(ids) * (req.logprobs + 1) > MAX_PROMPT_LOGPROB_ENTRIES:
                # NOTE: they travel in one message from node to node (m.MAX_MESSAGE_BYTES)
                raise bad_param("logprobs", f"echo with logprobs {req.logprobs} on a prompt of "
                                            f"{len(ids)} tokens: more than prompt tokens x "
                                            f"(logprobs + 1) = {MAX_PROMPT_LOGPROB_ENTRIES}")
            echo = None
            if req.echo:  # the prompt as given (token ids: their text), once for its n choices
                given = req.prompts[p]
                echo = given if isinstance(given, str) else self.tokenizer.decode(given)
            for s in range(req.n):
                index = p * req.n + s
                try:
                    params = req.sampling_params(max_tokens, s, self.config.sampling_defaults)
                except ValueError as e:
                    raise bad_param("", str(e))
                parser = None
                if req.tool_choice == "auto":
                    parser = ToolCallParser(self.config.tool_call_parser)
                elif req.tool_choice == "required":
                    parser = ToolCallParser("required")
                elif req.tool_choice.startswith("function:"):
                    parser = ToolCallParser("named", req.tool_choice.removeprefix("function:"))
                choices.append(Choice(index, self.tokenizer, ids, req.stop,
                                      req.logprobs is not None, req.stop_token_ids, echo=echo,
                                      prompt_only=req.echo and req.max_tokens == 0,
                                      tool_parser=parser))
                greqs.append(GenerateRequest(uuid.uuid4().hex, ids, params))
                trace("router_arrive", greqs[-1].req_id, t_traced)
        kv_tokens = capacity.kv_tokens([len(g.prompt_ids) for g in greqs], req.max_tokens,
                                       self.backend.kv_blocks())
        h = self.backend.health()
        if h.get("prefill", 0) < 1 or h.get("decode", 0) < 1:
            raise unavailable(f"no healthy prefill or decode node ({h.get('prefill', 0)} "
                              f"prefill, {h.get('decode', 0)} decode)")
        prefix = "chatcmpl-" if req.endpoint == "chat" else "cmpl-"
        fmt = ResponseFormat(req.endpoint, prefix + uuid.uuid4().hex, req.model,
                             req.logprobs is not None, req.stream and req.include_usage,
                             req.stream and req.continuous_usage)
        if self.config.log_requests:
            log.info("%s %s: %d choice(s), prompt tokens %s, params %s", fmt.id, req.endpoint,
                     len(choices), [len(p) for p in prompts], greqs[0].params)
        try:
            self.metrics.waiting.inc()
            try:
                # NOTE: clients take turns in the queue: the request's `user`, else its address
                client = f"user:{req.user}" if req.user else f"addr:{request.remote or ''}"
                waited = await self.admission.acquire(len(greqs), client, kv_tokens)
            finally:
                self.metrics.waiting.dec()
        except QueueFull as e:
            raise overloaded(str(e))
        except TooLarge as e:
            raise bad_param("n", str(e), "too_many_sequences")
        self.metrics.queue_time.observe(waited)
        self.metrics.running.inc()
        m = self.metrics
        gen = Generation(self.backend, choices, greqs, on_retry=m.retries.inc,
                         on_abort=lambda r: m.aborts.labels(r).inc())
        num_prompt_tokens = sum(len(p) for p in prompts)
        released = False

        def release() -> None:
            # NOTE: called once the nodes are done with the request, before the final [DONE]
            # write: a client that sends its next request on reading [DONE] finds the slot free.
            nonlocal released
            if not released:
                released = True
                m.running.dec()
                self.admission.release(len(greqs), kv_tokens)

        try:
            gen.start()
            try:
                first = await gen.__anext__()
                trace("router_first_delta", greqs[first.index].req_id)
            except BackendUnavailable as e:
                raise unavailable(str(e) or "no healthy prefill or decode node")
            except BackendOverloaded as e:
                raise overloaded(str(e) or "the nodes are overloaded")
            if first.error and is_invalid(first.error):  # before any output: a plain 400
                raise _generation_failed(first)
            m.prompt_tokens.inc(num_prompt_tokens)
            timer = RequestTimer(self.metrics, t_arrival)
            if req.stream:
                return await self._stream(request, gen, first, fmt, choices, num_prompt_tokens,
                                          timer, release, headers)
            return await self._collect(gen, first, fmt, choices, num_prompt_tokens, timer, headers)
        except (asyncio.CancelledError, ConnectionResetError):
            await gen.close("client_disconnect")
            raise
        finally:
            await gen.close("error")
            release()

    async def _stream(self, request: web.Request, gen: Generation, first: Delta,
                      fmt: ResponseFormat, choices: list[Choice], num_prompt_tokens: int,
                      timer: RequestTimer, release: Callable[[], None],
                      headers: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**_SSE_HEADERS, **headers})
        def so_far(index: int) -> dict | None:  # continuous usage: the choice's counts so far
            return usage(num_prompt_tokens, choices[index].num_generated) \
                if fmt.continuous_usage else None

        out = [sse(fmt.role_chunk(c.index, so_far(c.index))) for c in choices] if fmt.chat else []
        d = first
        try:
            await resp.prepare(request)
            while d is not None:
                # NOTE: the deltas already here go out in one write (several only when this
                # loop fell behind the stream); then wait for the next. A delta whose tokens
                # show no text yet (part of a character, a possible stop string, held tool
                # text) still goes out, with empty text: the client sees every step as it
                # comes, not a burst once the text completes (as vLLM streams).
                for d in (d, *gen.ready()):
                    timer.observe(d)
                    if d.num_tokens or d.text or d.finish_reason or d.logprobs:
                        out.append(fmt.sse_chunk(d, so_far(d.index)))
                    if d.error:
                        out.append(sse(_generation_failed(d).body()))
                if out:
                    await self._write(request, resp, b"".join(out))
                    out.clear()
                d = await anext(gen, None)
            release()
            timer.done()
            if fmt.include_usage:
                u = usage(num_prompt_tokens, sum(c.num_generated for c in choices))
                out.append(sse(fmt.usage_chunk(u)))
            out.append(b"data: [DONE]\n\n")
            await self._write(request, resp, b"".join(out))
            await resp.write_eof()
        except ConnectionResetError:
            # NOTE: the client left before the handler was cancelled for it; same ending.
            request[CLIENT_GONE] = True
            await gen.close("client_disconnect")
        return resp

    async def _write(self, request: web.Request, resp: web.StreamResponse, data: bytes) -> None:
        """Write to a streaming client; one that stops reading for `write_timeout` is treated
        as gone (its connection closed, its request aborted, its admission slot freed)."""
        transport = request.transport
        if transport is not None and \
                transport.get_write_buffer_size() + len(data) < _UNTIMED_WRITE_BYTES:
            await resp.write(data)  # the common case: the client keeps up
            return
        try:
            await asyncio.wait_for(resp.write(data), self.config.write_timeout)
        except asyncio.TimeoutError:
            log.warning("a client stopped reading its stream for %g s: dropped",
                        self.config.write_timeout)
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError("the client stopped reading") from None

    async def _collect(self, gen: Generation, first: Delta, fmt: ResponseFormat,
                       choices: list[Choice], num_prompt_tokens: int,
                       timer: RequestTimer, headers: dict) -> web.Response:
        acc = Accumulator(fmt, len(choices))
        d = first
        while d is not None:
            timer.observe(d)
            if d.error:
                raise _generation_failed(d)
            acc.add(d)
            d = await anext(gen, None)
        timer.done()
        acc.stop_reason = [c.stop_reason for c in choices]
        u = usage(num_prompt_tokens, sum(c.num_generated for c in choices))
        return web.Response(body=dumps(acc.response(u)), content_type="application/json",
                            headers=headers)


INLINE_TEXT_CHARS = 2048  # prompt text up to this is tokenized on the event loop (~0.1 ms)


def _inline(req: ApiRequest) -> bool:
    """Whether a request's prompts are tokenized on the event loop: token ids, or completions'
    text of at most INLINE_TEXT_CHARS in all (chat goes through its template: a thread)."""
    if req.endpoint == "chat":
        return False
    return sum(len(p) for p in req.prompts if isinstance(p, str)) <= INLINE_TEXT_CHARS


def _generation_failed(d: Delta) -> APIError:
    if is_invalid(d.error):  # the request's own content (a grammar that does not compile)
        return APIError(400, d.error, type="invalid_request_error", code="invalid_request")
    if is_timeout(d.error):  # the nodes are up but did not get to it in time
        return APIError(504, f"choice {d.index} failed: {d.error}", type="timeout",
                        code="node_timeout")
    return APIError(500, f"choice {d.index} failed: {d.error}", type="server_error",
                    code="generation_failed")
