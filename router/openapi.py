"""The router's OpenAPI 3.1 document, as data: served at `GET /openapi.json`, read by fuzzers.

`openapi_document(served_model_name, max_model_len, vocab_size)` describes one router instance:
the request bodies say what `protocol.py` accepts (field types and bounds, unknown fields
refused, unsupported OpenAI fields only at their neutral values), with the instance's own
limits (the one model name served, token ids below the vocabulary size, `max_tokens` below the
context length, `stream_options` only with `stream`). What a schema cannot say is left to the
handlers and answered with a 400: `min_tokens` above `max_tokens`, prompts x n above
`MAX_CHOICES`, a prompt plus `max_tokens` past the context length, `best_of` other than `n`.
Keeping this in step with `protocol.py` is this file's job; `tests/router/test_openapi.py`
checks that the examples here pass the validation and that the fields listed are the ones
accepted.
"""

from __future__ import annotations

from pd.wire.sampling_params import MAX_LOGIT_BIAS, MAX_STRUCTURED_SPEC, MAX_TOP_LOGPROBS
from router.chat_request import CHAT_ROLES, MAX_TOOLS
from router.protocol import MAX_CHOICES, MAX_STOP_STRINGS

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _only_with(name: str, flag: str) -> dict:
    """A `dependentSchemas` entry: a non-null `name` needs `flag` set to true."""
    return {name: {"anyOf": [{"properties": {name: {"type": "null"}}},
                             {"required": [flag], "properties": {flag: {"const": True}}}]}}


def _sampling_properties(max_model_len: int, vocab_size: int) -> dict:
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    non_empty = {"type": "string", "minLength": 1}
    return {
        "max_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": max_model_len - 1}),
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_CHOICES}),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({
            "type": "object", "additionalProperties": False,
            "properties": {"include_usage": _nullable({"type": "boolean"}),
                           "continuous_usage_stats": _nullable({"type": "boolean"})}}),
        "stop": _nullable({"anyOf": [non_empty, {"type": "array", "items": non_empty,
                                                 "maxItems": MAX_STOP_STRINGS}]}),
        "stop_token_ids": _nullable({"type": "array", "items": token_id}),
        "seed": _nullable({"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX}),
        "temperature": _nullable({"type": "number", "minimum": 0}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1,
                            "description": "-1 or 0: no top-k cut"}),
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0}),
        "ignore_eos": _nullable({"type": "boolean"}),
        "min_tokens": _nullable({"type": "integer", "minimum": 0,
                                 "description": "at most max_tokens"}),
        "user": _nullable({"type": "string"}),
        "logit_bias": _nullable({
            "type": "object", "maxProperties": MAX_LOGIT_BIAS,
            "propertyNames": {"pattern": "^[0-9]{1,10}$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            "description": "token id (a string) -> bias added to its logit"}),
        **_structured_properties(),
    }


def _structured_properties() -> dict:
    """Structured output (at most one per request; a spec that does not compile is a 400)."""
    spec = {"type": "string", "minLength": 1, "maxLength": MAX_STRUCTURED_SPEC}
    schema = {"anyOf": [{"type": "object"}, {"type": "boolean"}, spec],
              "description": "a JSON schema (or its JSON text)"}
    choices = {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}
    return {
        "response_format": _nullable({"anyOf": [
            {"type": "object", "required": ["type"],
             "properties": {"type": {"type": "string", "enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"], "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {"type": "object", "properties": {
                    "name": {"type": "string"}, "description": {"type": "string"},
                    "schema": {"type": "object"}, "strict": _nullable({"type": "boolean"})}}}}]}),
        "guided_json": _nullable(schema),
        "guided_regex": _nullable({**spec, "description": "a regular expression"}),
        "guided_choice": _nullable(choices),
        "guided_grammar": _nullable({**spec, "description": "an EBNF grammar"}),
        "structured_outputs": _nullable({
            "type": "object", "minProperties": 1, "maxProperties": 1,
            "additionalProperties": False, "properties": {
                "json": schema, "regex": spec, "choice": choices, "grammar": spec,
                "json_object": {"const": True}}}),
    }


def completion_request(model: str, max_model_len: int, vocab_size: int) -> dict:
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    ids = {"type": "array", "items": token_id, "minItems": 1}
    text = {"type": "string", "minLength": 1}
    return {
        "type": "object", "required": ["prompt"],
        "description": "fields not listed are accepted and ignored (X-PD-Ignored-Fields)",
        "properties": {
            "model": {"type": "string", "enum": [model], "description": "default: the served model"},
            "prompt": {"anyOf": [text, ids, {"type": "array", "items": text, "minItems": 1},
                                 {"type": "array", "items": ids, "minItems": 1}]},
            **_sampling_properties(max_model_len, vocab_size),
            "max_tokens": _nullable({"type": "integer", "minimum": 0,
                                     "maximum": max_model_len - 1,
                                     "description": "0 only with echo (the prompt alone)"}),
            "logprobs": _nullable({"type": "integer", "minimum": 0,
                                   "maximum": MAX_TOP_LOGPROBS}),
            "echo": _nullable({"type": "boolean", "description": "the prompt comes back before "
                               "the completion, with its tokens' logprobs when logprobs is set"}),
            "suffix": _nullable({"type": "string", "enum": [""]}),
            "best_of": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_CHOICES,
                                  "description": "must equal n"}),
        },
        "dependentSchemas": {
            **_only_with("stream_options", "stream"),
            # max_tokens 0 only with echo
            "max_tokens": {"anyOf": [{"properties": {"max_tokens": {"not": {"const": 0}}}},
                                     {"required": ["echo"], "properties": {"echo": {"const": True}}}]},
        },
        "example": {"model": model, "prompt": "def fibonacci(n):", "max_tokens": 8,
                    "temperature": 0},
    }


def chat_request(model: str, max_model_len: int, vocab_size: int) -> dict:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]},
                           "text": {"type": "string"}}}
    content = [{"type": "string"}, {"type": "array", "items": part}]

    def message(roles: list[str], content: list[dict], required: list[str]) -> dict:
        return {"type": "object", "required": ["role", *required],
                "properties": {"role": {"type": "string", "enum": roles},
                               "content": {"anyOf": content}, "name": {"type": "string"}}}

    others = [r for r in CHAT_ROLES if r != "assistant"]
    messages = {"type": "array", "minItems": 1, "items": {"anyOf": [
        message(others, content, ["content"]),
        message(["assistant"], [*content, {"type": "null"}], [])]}}
    max_tokens = _nullable({"type": "integer", "minimum": 1, "maximum": max_model_len - 1})
    return {
        "type": "object", "required": ["messages"],
        "description": "fields not listed are accepted and ignored (X-PD-Ignored-Fields)",
        "properties": {
            "model": {"type": "string", "enum": [model], "description": "default: the served model"},
            "messages": messages,
            **_sampling_properties(max_model_len, vocab_size),
            "max_completion_tokens": max_tokens,
            "logprobs": _nullable({"type": "boolean"}),
            "top_logprobs": _nullable({"type": "integer", "minimum": 0,
                                       "maximum": MAX_TOP_LOGPROBS}),
            "tools": _nullable({"type": "array", "maxItems": MAX_TOOLS, "items": {
                "type": "object", "required": ["type", "function"], "properties": {
                    "type": {"const": "function"},
                    "function": {"type": "object", "required": ["name"], "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "description": {"type": "string"}, "parameters": {"type": "object"}}}}}}),
            "tool_choice": _nullable({"anyOf": [
                {"type": "string", "enum": ["none", "auto", "required"]},
                {"type": "object", "required": ["type", "function"], "properties": {
                    "type": {"const": "function"},
                    "function": {"type": "object", "required": ["name"],
                                 "properties": {"name": {"type": "string"}}}}}],
                "description": "auto (the default with tools) needs the router's "
                               "--tool-call-parser; required and a named function need tools "
                               "and constrain the reply (no other structured output)"}),
            "parallel_tool_calls": _nullable({"type": "boolean"}),
        },
        "dependentSchemas": {**_only_with("stream_options", "stream"),
                             **_only_with("top_logprobs", "logprobs")},
        "example": {"model": model, "messages": [{"role": "user", "content": "write a loop"}],
                    "max_tokens": 8, "temperature": 0},
    }


_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}},
}
_RESPONSE = {
    "type": "object", "required": ["id", "object", "created", "model", "choices"],
    "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                   "created": {"type": "integer"}, "model": {"type": "string"},
                   "choices": {"type": "array", "items": {"type": "object"}},
                   "usage": {"type": "object"}},
}


def _error(description: str) -> dict:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _generate(summary: str, request: str) -> dict:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{request}"}}}},
        "responses": {
            "200": {"description": "the completion; an SSE stream of chunks ending with "
                                   "`data: [DONE]` when stream is true",
                    "content": {"application/json": {"schema": _RESPONSE},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            "400": _error("invalid request: the message and `param` name the bad field"),
            "401": _error("missing or invalid API key (when the router has one)"),
            "404": _error("the model named is not the one served"),
            "429": _error("the admission queue is full"),
            "500": _error("a generation failed on the nodes after it started"),
            "503": _error("no healthy prefill or decode node"),
        },
    }


def openapi_document(served_model_name: str, max_model_len: int, vocab_size: int) -> dict:
    return {
        "openapi": "3.1.0",
        "info": {"title": "pd router", "version": "1",
                 "description": "OpenAI-compatible API of a prefill/decode serving system."},
        "paths": {
            "/v1/completions": {"post": _generate("text completion", "CompletionRequest")},
            "/v1/chat/completions": {"post": _generate("chat completion", "ChatRequest")},
            "/v1/models": {"get": {
                "summary": "the one model served",
                "responses": {
                    "200": {"description": "a list of one model", "content": {
                        "application/json": {"schema": {
                            "type": "object", "required": ["object", "data"],
                            "properties": {"object": {"type": "string", "enum": ["list"]},
                                           "data": {"type": "array", "items": {
                                               "type": "object", "required": ["id"]}}}}}}},
                    "401": _error("missing or invalid API key (when the router has one)")}}},
            "/v1/models/{model_id}": {"get": {
                "summary": "the model served, by name",
                "parameters": [{"name": "model_id", "in": "path", "required": True,
                                "schema": {"type": "string"}}],
                "responses": {
                    "200": {"description": "the model", "content": {"application/json": {
                        "schema": {"type": "object", "required": ["id", "object"]}}}},
                    "401": _error("missing or invalid API key (when the router has one)"),
                    "404": _error("not the model served")}}},
            "/tokenize": {"post": {
                "summary": "token ids of a prompt, or of a chat rendered by the template",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "properties": {
                        "model": {"type": "string", "enum": [served_model_name]},
                        "prompt": {"type": "string"},
                        "messages": {"type": "array"},
                        "add_special_tokens": {"type": "boolean"},
                        "add_generation_prompt": {"type": "boolean"}}}}}},
                "responses": {
                    "200": {"description": "the ids", "content": {"application/json": {"schema": {
                        "type": "object", "required": ["count", "max_model_len", "tokens"]}}}},
                    "400": _error("neither a prompt nor a valid chat"),
                    "404": _error("the model named is not the one served")}}},
            "/detokenize": {"post": {
                "summary": "the text of token ids",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["tokens"], "properties": {
                        "model": {"type": "string", "enum": [served_model_name]},
                        "tokens": {"type": "array", "items": {
                            "type": "integer", "minimum": 0, "maximum": vocab_size - 1}}}}}}},
                "responses": {
                    "200": {"description": "the text", "content": {"application/json": {
                        "schema": {"type": "object", "required": ["prompt"]}}}},
                    "400": _error("not a list of token ids"),
                    "404": _error("the model named is not the one served")}}},
            "/version": {"get": {
                "summary": "the server's version",
                "responses": {"200": {"description": "the version", "content": {
                    "application/json": {"schema": {"type": "object",
                                                    "required": ["version"]}}}}}}},
            "/health": {"get": {
                "summary": "healthy when at least one prefill and one decode node answer",
                "responses": {
                    "200": {"description": "healthy", "content": {"application/json": {
                        "schema": {"type": "object", "required": ["status"]}}}},
                    "503": {"description": "no healthy prefill or decode node", "content": {
                        "application/json": {"schema": {"type": "object",
                                                        "required": ["status"]}}}}}}},
            "/metrics": {"get": {
                "summary": "Prometheus metrics of the router",
                "responses": {"200": {"description": "Prometheus text format", "content": {
                    "text/plain": {"schema": {"type": "string"}}}}}}},
        },
        "components": {
            "schemas": {
                "CompletionRequest": completion_request(served_model_name, max_model_len,
                                                        vocab_size),
                "ChatRequest": chat_request(served_model_name, max_model_len, vocab_size),
                "Error": _ERROR,
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "only when the router has --api-key"}},
        },
        "security": [{}, {"bearer": []}],
    }
