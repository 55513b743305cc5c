"""OpenAI request validation for `/v1/completions` and `/v1/chat/completions` (the chat
request's own parts, its messages and tools, in `router.chat_request`).

`decode_body(raw)` turns the request's bytes into JSON (400 for what is not JSON, nested past
Python's recursion limit, or holds a string that is not Unicode: a lone surrogate escape).
`parse_completion(body)` and `parse_chat(body)` turn a decoded JSON body into an `ApiRequest`
or raise `APIError` (400) naming the bad parameter. Types are checked strictly (a bool is not
an int, a string is not a number; a whole float such as 2.0 is the integer 2, as JSON Schema
has it, and is passed on as an int). Fields this server does not know are accepted and ignored,
as vLLM does, and listed in `ApiRequest.ignored` (the server logs them and names them in the
`X-PD-Ignored-Fields` response header); the OpenAI fields it knows but does not implement are
accepted only at their neutral values. `logit_bias` ({"token id": bias}) is passed on. `model` may be left out: the served model answers.
vLLM's extra sampling fields (`top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`,
`ignore_eos`, `min_tokens`) are accepted too. The structured-output fields are read by
`router.structured` into `SamplingParams.structured_output`; a forced `tool_choice` becomes one
too. Tokenization, the context-length check and the
model-name check are left to the handlers, which know the tokenizer and the backend.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from pd.wire.sampling_params import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams
from router.errors import bad_param
from router.structured import STRUCTURED_FIELDS, parse_structured

MAX_CHOICES = 128  # prompts x n in one request
MAX_STOP_STRINGS = 16
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens")
_COMMON = {"model", "max_tokens", "n", "stream", "stream_options", "stop", "stop_token_ids",
           "seed", "logprobs", "user", "logit_bias", *_SAMPLING_FIELDS, *STRUCTURED_FIELDS}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                         "tool_choice", "parallel_tool_calls"}


@dataclass
class ApiRequest:
    endpoint: str  # "completions" or "chat"
    model: str | None  # None: not given, the served model
    prompts: list[str | list[int]] = field(default_factory=list)  # completions
    messages: list[dict] = field(default_factory=list)  # chat, contents as plain strings
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    max_tokens: int | None = None  # None: up to the context length
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = None  # top logprobs per token; None: no logprobs at all
    sampling: dict = field(default_factory=dict)  # the other SamplingParams fields given
    ignored: list[str] = field(default_factory=list)  # unknown fields, accepted and ignored
    user: str | None = None  # OpenAI's end-user id: the client, for the admission queue's turns
    echo: bool = False  # completions: the prompt comes back before the completion (its
    # logprobs too, when logprobs is asked); max_tokens may then be 0 (the prompt alone)
    tools: list[dict] | None = None  # chat: function tools for the chat template
    tool_choice: str = "none"  # chat: "none", "auto" (calls parsed from the reply),
    # "required" or "function:<name>" (the reply constrained to calls, `tool_choice_schema`)

    @property
    def num_choices(self) -> int:
        return max(1, len(self.prompts)) * self.n

    def sampling_params(self, max_tokens: int, index: int,
                        defaults: dict | None = None) -> SamplingParams:
        """Parameters for choice `index`; each choice gets its own seed when one is given.
        `defaults` (the checkpoint's generation config) fill the fields the request omits."""
        seed = None if self.seed is None else self.seed + index
        # NOTE: max_tokens 0 (echo) runs as 1 and the token is dropped: the nodes always sample
        # the first token (`Choice` leaves it out)
        return SamplingParams(max_tokens=max(max_tokens, 1), seed=seed, logprobs=self.logprobs,
                              prompt_logprobs=self.logprobs if self.echo else None,
                              stop_token_ids=tuple(self.stop_token_ids),
                              **{**(defaults or {}), **self.sampling})


def decode_body(raw: bytes):
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_param("", f"the request body is not valid JSON: {e}", "invalid_json")
    except RecursionError:
        raise bad_param("", "the request body is nested too deeply", "invalid_json")
    if b"\\u" in raw and not _is_unicode(body):
        raise bad_param("", "the request body has a string that is not valid Unicode (a lone "
                            "surrogate escape)", "invalid_json")
    return body


def _is_unicode(body) -> bool:
    """Every string (and key) in `body` encodes to UTF-8; walked without recursion."""
    todo = [body]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            todo += v.keys()
            todo += v.values()
        elif isinstance(v, list):
            todo += v
        elif isinstance(v, str):
            try:
                v.encode()
            except UnicodeEncodeError:
                return False
    return True


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _as_int(v) -> int | None:
    """`v` as an int when JSON means an integer by it (2 or 2.0), else None."""
    if _is_int(v):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


def _token_ids(v) -> list[int] | None:
    """`v` as a list of non-negative token ids, else None."""
    if not isinstance(v, list):
        return None
    ids = [_as_int(t) for t in v]
    return ids if all(t is not None and t >= 0 for t in ids) else None


def _num(body: dict, name: str, lo: float, hi: float, *, lo_open: bool = False) -> None:
    v = body.get(name)
    if v is None:
        return
    if not (_is_int(v) or isinstance(v, float)) or not math.isfinite(v):
        raise bad_param(name, f"must be a number, got {v!r}")
    if v < lo or v > hi or (lo_open and v == lo):
        if math.isinf(hi):
            raise bad_param(name, f"must be {'>' if lo_open else '>='} {lo:g}, got {v!r}")
        raise bad_param(name, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}")


def int_param(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if _as_int(v) is None:
        raise bad_param(name, f"must be an integer, got {v!r}")
    v = _as_int(v)
    if v < lo or (hi is not None and v > hi):
        raise bad_param(name, f"must be an integer >= {lo}" + (f" and <= {hi}" if hi is not None
                                                               else "") + f", got {v}")
    return v


def bool_param(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad_param(name, f"must be a boolean, got {v!r}")
    return v


def _neutral(body: dict, name: str, *allowed) -> None:
    v = body.get(name)
    if v is not None and v not in allowed:
        raise bad_param(name, f"is not supported by this server (got {v!r})", "unsupported")


def common_request(body: dict, allowed: set[str], endpoint: str) -> ApiRequest:
    if not isinstance(body, dict):
        raise bad_param("", "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad_param("model", "must be a non-empty string (or left out: the served model)")
    req = ApiRequest(endpoint=endpoint, model=model, ignored=sorted(set(body) - allowed))
    # NOTE: 0 passes here; only echo takes it (`parse_completion`, `_check_tokens`)
    req.max_tokens = int_param(body, "max_tokens", 0)
    req.n = int_param(body, "n", 1, MAX_CHOICES) or 1
    req.stream = bool(bool_param(body, "stream"))
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise bad_param("stream_options", "must be an object with 'include_usage'")
        if not req.stream:
            raise bad_param("stream_options", "is only allowed when stream is true")
        req.include_usage = bool(bool_param(opts, "include_usage"))
        req.continuous_usage = req.include_usage and bool(bool_param(opts, "continuous_usage_stats"))
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
                or not all(isinstance(s, str) and s for s in stop)):
            raise bad_param("stop", f"must be a non-empty string or a list of at most "
                                    f"{MAX_STOP_STRINGS} non-empty strings")
        req.stop = stop
    if body.get("stop_token_ids") is not None:
        ids = _token_ids(body["stop_token_ids"])
        if ids is None:
            raise bad_param("stop_token_ids", "must be a list of non-negative integers")
        req.stop_token_ids = ids
    req.seed = int_param(body, "seed", -(2**63), 2**63 - 1)
    _num(body, "temperature", 0.0, math.inf)
    _num(body, "top_p", 0.0, 1.0, lo_open=True)
    ints = {"top_k": int_param(body, "top_k", -1)}
    _num(body, "min_p", 0.0, 1.0)
    _num(body, "presence_penalty", -2.0, 2.0)
    _num(body, "frequency_penalty", -2.0, 2.0)
    _num(body, "repetition_penalty", 0.0, math.inf, lo_open=True)
    bool_param(body, "ignore_eos")
    ints["min_tokens"] = int_param(body, "min_tokens", 0)
    req.sampling = {k: ints.get(k, body[k]) for k in _SAMPLING_FIELDS if body.get(k) is not None}
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_param("user", "must be a string")
    req.user = user
    logit_bias = body.get("logit_bias")
    if logit_bias:
        req.sampling["logit_bias"] = _logit_bias(logit_bias)
    structured = parse_structured(body)
    if structured is not None:
        req.sampling["structured_output"] = structured
    return req


def _logit_bias(v) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}, at most MAX_LOGIT_BIAS entries."""
    if not isinstance(v, dict) or len(v) > MAX_LOGIT_BIAS:
        raise bad_param("logit_bias", f"must be an object of at most {MAX_LOGIT_BIAS} token ids")
    pairs = []
    for key, bias in v.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise bad_param("logit_bias", f"keys must be token ids, got {key[:32]!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad_param("logit_bias", f"biases must be numbers in [-100, 100], got {bias!r}")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def check_tokens(req: ApiRequest, max_tokens_name: str) -> None:
    if req.max_tokens == 0 and not req.echo:
        raise bad_param(max_tokens_name, "must be >= 1 (0 only with echo: the prompt alone)")
    min_tokens = req.sampling.get("min_tokens", 0)
    if req.max_tokens is not None and min_tokens > req.max_tokens:
        raise bad_param("min_tokens", f"must be <= {max_tokens_name} ({req.max_tokens})")
    if req.num_choices > MAX_CHOICES:
        raise bad_param("n", f"prompts x n must be <= {MAX_CHOICES}, got {req.num_choices}")


def parse_completion(body: dict) -> ApiRequest:
    req = common_request(body, COMPLETION_FIELDS, "completions")
    if req.max_tokens is None and "max_tokens" not in body:
        req.max_tokens = 16  # the OpenAI default for completions
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and _as_int(prompt[0]) is not None):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad_param("prompt", "is required: a string, a list of strings, a list of token "
                                  "ids or a list of lists of token ids")
    prompts = []
    for p in prompt:
        p = p if isinstance(p, str) else _token_ids(p)
        if not p:
            raise bad_param("prompt", "each prompt must be a non-empty string or a non-empty "
                                      "list of non-negative token ids")
        prompts.append(p)
    req.prompts = prompts
    lp = int_param(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    req.logprobs = lp
    req.echo = bool(bool_param(body, "echo"))
    _neutral(body, "suffix", "")
    best_of = int_param(body, "best_of", 1)
    if best_of is not None and best_of != req.n:
        raise bad_param("best_of", "must equal n (best_of > n is not supported)", "unsupported")
    check_tokens(req, "max_tokens")
    return req
