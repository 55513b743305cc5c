"""The OpenAPI document (`router/openapi.py`) against the validation it describes."""

from __future__ import annotations

import httpx
import jsonschema
import pytest

from router.openapi import openapi_document
from router.chat_request import parse_chat
from router.protocol import CHAT_FIELDS, COMPLETION_FIELDS, parse_completion
from tests.router.conftest import MODEL, ScriptedBackend, echo_script

DOC = openapi_document(MODEL, max_model_len=256, vocab_size=512)
SCHEMAS = DOC["components"]["schemas"]


def validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({**SCHEMAS[name], "components": DOC["components"]})


def test_fields_are_the_accepted_ones():
    assert set(SCHEMAS["CompletionRequest"]["properties"]) == COMPLETION_FIELDS
    assert set(SCHEMAS["ChatRequest"]["properties"]) == CHAT_FIELDS


@pytest.mark.parametrize("name,parse", [("CompletionRequest", parse_completion),
                                        ("ChatRequest", parse_chat)])
def test_example_is_valid_and_accepted(name, parse):
    example = SCHEMAS[name]["example"]
    validator(name).validate(example)
    parse(example)


@pytest.mark.parametrize("body", [
    {"prompt": "x", "max_tokens": 255, "n": 128, "seed": -(2**63), "top_p": 1, "top_k": -1,
     "min_p": 0, "presence_penalty": -2, "frequency_penalty": 2, "logprobs": 20, "stop": ["a"],
     "stop_token_ids": [0, 511], "echo": False, "suffix": "", "best_of": 128, "logit_bias": {}},
    {"prompt": "x", "max_tokens": 0, "echo": True, "logprobs": 1},
    {"prompt": [[1, 2], [511]], "temperature": 0, "repetition_penalty": 1e-9, "min_tokens": 0,
     "stream": True, "stream_options": {"include_usage": True}, "user": ""},
])
def test_bounds_agree_with_validation_completion(body):
    body = {"model": MODEL, **body}
    validator("CompletionRequest").validate(body)
    parse_completion(body)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("n", 129), ("top_p", 0), ("top_k", -2), ("min_p", 1.5),
    ("presence_penalty", 2.5), ("repetition_penalty", 0), ("logprobs", 21), ("stop", ""),
    ("stop", ["a"] * 17), ("echo", "yes"), ("suffix", "s"), ("logit_bias", {"1": 200}),
    ("seed", 2**63), ("temperature", -1), ("best_of", 0),
])
def test_schema_and_validation_refuse_alike(field, value):
    body = {"model": MODEL, "prompt": "x", field: value}
    assert not validator("CompletionRequest").is_valid(body)
    with pytest.raises(Exception) as e:
        parse_completion(body)
    assert getattr(e.value, "status", None) == 400


def test_chat_bounds():
    parts = [{"type": "text", "text": "a"}]
    ok = {"model": MODEL, "messages": [{"role": "assistant", "content": None},
                                       {"role": "user", "content": parts}],
          "max_completion_tokens": 1, "logprobs": True, "top_logprobs": 20,
          "response_format": {"type": "text"}, "tools": [], "tool_choice": "none"}
    validator("ChatRequest").validate(ok)
    parse_chat(ok)
    with_tools = {**ok, "tools": [{"type": "function", "function": {"name": "f"}}],
                  "tool_choice": "auto"}
    validator("ChatRequest").validate(with_tools)
    parse_chat(with_tools)
    for bad in ({"tools": [{}]}, {"tool_choice": "sometimes"}, {"top_logprobs": 21},
                {"messages": []}, {"messages": [{"role": "robot", "content": "x"}]}):
        assert not validator("ChatRequest").is_valid({**ok, **bad})


def test_served_at_openapi_json(tokenizer, make_server):
    server = make_server(ScriptedBackend(echo_script(tokenizer, "x"), tokenizer.eos_token_id))
    r = httpx.get(server.url + "/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}
    model = doc["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
    assert model["enum"] == [MODEL]


def test_whole_floats_are_integers_as_json_schema_says():
    body = {"model": MODEL, "prompt": [1.0, 2.0], "max_tokens": 4.0, "n": 2.0, "top_k": 3.0,
            "min_tokens": 1.0, "seed": 7.0, "stop_token_ids": [5.0], "logprobs": 2.0}
    validator("CompletionRequest").validate(body)
    req = parse_completion(body)
    params = req.sampling_params(4, 1)
    values = [*req.prompts[0], req.max_tokens, req.n, *req.stop_token_ids, req.logprobs,
              params.top_k, params.min_tokens, params.seed]
    assert values == [1, 2, 4, 2, 5, 2, 3, 1, 8]
    assert all(type(v) is int for v in values)
    with pytest.raises(Exception, match="must be an integer"):
        parse_completion({**body, "max_tokens": 4.5})
    with pytest.raises(Exception, match="must be an integer"):
        parse_completion({**body, "n": True})
