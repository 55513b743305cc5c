"""OpenAI response shapes for completions and chat, streamed and not.

`ResponseFormat` turns `Delta`s (see `choice.py`) into the JSON objects of one endpoint:
`chunk(delta)` for an SSE chunk, `role_chunk(index)` for chat's opening chunk,
`usage_chunk(usage)` for `stream_options.include_usage`, and `Accumulator` gathers deltas
into the single non-streamed response. Logprobs take each endpoint's own shape (completions:
tokens / token_logprobs / top_logprobs / text_offset; chat: content entries with bytes).
`sse_chunk(delta)` is a chunk as SSE bytes: the router writes one per token per stream, so a
chunk without logprobs or usage is filled into bytes made once per request instead of being
built and serialised whole. Writing to the socket is left to the server.
"""

from __future__ import annotations

import json
import math
import time

from router.choice import Delta, TokenLogprob

_MIN_LOGPROB = -9999.0  # JSON has no -inf


def _lp(v: float | None) -> float | None:
    return v if v is None or math.isfinite(v) else _MIN_LOGPROB


def dumps(obj) -> bytes:
    """Compact JSON, UTF-8 (the router's one serialisation)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse(obj) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(entries: list[TokenLogprob]) -> dict:
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [_lp(e.logprob) for e in entries],
        "top_logprobs": [_top_with_sampled(e) for e in entries],
        "text_offset": [e.text_offset for e in entries],
    }


def _top_with_sampled(e: TokenLogprob) -> dict | None:
    """A completion token's top logprobs, with the sampled token among them even when it is
    not in the top k (as OpenAI's legacy completions and vLLM have it: up to k + 1 entries);
    None for an echoed prompt's first token."""
    if e.top is None:
        return None
    top = {t: _lp(v) for t, _, v in e.top}
    if all(i != e.token_id for _, i, _ in e.top):
        top.setdefault(e.token, _lp(e.logprob))
    return top


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    return {"content": [
        {"token": e.token, "logprob": _lp(e.logprob), "bytes": list(e.token.encode()),
         "top_logprobs": [{"token": t, "logprob": _lp(v), "bytes": list(t.encode())}
                          for t, _, v in e.top]}
        for e in entries
    ]}


class ResponseFormat:
    def __init__(self, endpoint: str, request_id: str, model: str, want_logprobs: bool,
                 include_usage: bool = False, continuous_usage: bool = False) -> None:
        self.chat = endpoint == "chat"
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage  # each chunk carries its choice's usage so far
        # a plain chunk's bytes around its index, text and finish reason (`sse_chunk`)
        head = dumps({"id": self.id, "object": "chat.completion.chunk" if self.chat
                      else "text_completion", "created": self.created, "model": self.model})
        self._head = b"data: " + head[:-1] + b',"choices":[{"index":'
        self._tail = b'}]' + (b',"usage":null' if include_usage else b"") + b"}\n\n"

    def _envelope(self, obj: str, choices: list, u: dict | None = None) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "choices": choices}
        if self.include_usage:
            out["usage"] = u if self.continuous_usage else None
        return out

    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if not self.want_logprobs:
            return None
        return chat_logprobs(entries) if self.chat else completion_logprobs(entries)

    def role_chunk(self, index: int, u: dict | None = None) -> dict:
        choice = {"index": index, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice], u)

    def chunk(self, d: Delta, u: dict | None = None) -> dict:
        """The SSE chunk of a delta; `u`: its choice's usage so far (continuous usage)."""
        lp = self._logprobs(d.logprobs) if d.logprobs or not self.chat else None
        if self.chat:
            delta = {"content": d.text} if d.text or not (d.finish_reason or d.tool_calls) else {}
            if d.tool_calls:
                delta["tool_calls"] = [{"index": d.first_tool_call + k, **call}
                                       for k, call in enumerate(d.tool_calls)]
            choice = {"index": d.index, "delta": delta, "logprobs": lp,
                      "finish_reason": d.finish_reason}
            return self._envelope("chat.completion.chunk", [choice], u)
        choice = {"index": d.index, "text": d.text, "logprobs": lp,
                  "finish_reason": d.finish_reason}
        return self._envelope("text_completion", [choice], u)

    def sse_chunk(self, d: Delta, u: dict | None = None) -> bytes:
        """`chunk(d, u)` as an SSE event."""
        if d.logprobs or (self.want_logprobs and not self.chat) or self.continuous_usage \
                or d.tool_calls:
            return sse(self.chunk(d, u))
        text = dumps(d.text)
        if self.chat:
            body = b',"delta":{"content":' + text + b"}," if d.text or not d.finish_reason \
                else b',"delta":{},'
        else:
            body = b',"text":' + text + b","
        return b"".join((self._head, str(d.index).encode(), body, b'"logprobs":null,"finish_reason":',
                         b"null" if d.finish_reason is None else dumps(d.finish_reason), self._tail))

    def usage_chunk(self, u: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [], "usage": u}


class Accumulator:
    """Deltas of every choice, folded into one non-streamed response."""

    def __init__(self, fmt: ResponseFormat, num_choices: int) -> None:
        self.fmt = fmt
        self.texts: list[list[str]] = [[] for _ in range(num_choices)]
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in range(num_choices)]
        self.finish: list[str | None] = [None] * num_choices
        self.stop_reason: list[str | int | None] = [None] * num_choices
        self.tool_calls: list[list[dict]] = [[] for _ in range(num_choices)]

    def add(self, d: Delta) -> None:
        self.texts[d.index].append(d.text)
        self.logprobs[d.index].extend(d.logprobs)
        self.tool_calls[d.index].extend(d.tool_calls)
        if d.finish_reason:
            self.finish[d.index] = d.finish_reason

    def response(self, u: dict) -> dict:
        fmt = self.fmt
        choices = []
        for i, parts in enumerate(self.texts):
            text = "".join(parts)
            lp = fmt._logprobs(self.logprobs[i])
            if fmt.chat:
                message = {"role": "assistant", "content": text}
                if self.tool_calls[i]:  # as OpenAI: no content when the reply is only calls
                    message = {"role": "assistant", "content": text or None,
                               "tool_calls": self.tool_calls[i]}
                choices.append({"index": i, "message": message,
                                "logprobs": lp, "finish_reason": self.finish[i],
                                "stop_reason": self.stop_reason[i]})
            else:
                choices.append({"index": i, "text": text, "logprobs": lp,
                                "finish_reason": self.finish[i],
                                "stop_reason": self.stop_reason[i]})
        obj = "chat.completion" if fmt.chat else "text_completion"
        return {"id": fmt.id, "object": obj, "created": fmt.created, "model": fmt.model,
                "choices": choices, "usage": u}
