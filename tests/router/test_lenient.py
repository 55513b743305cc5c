"""What vLLM clients send and expect: unknown fields accepted, ignored and named in a header;
`model` optional; `/v1/models/{id}`, `/tokenize`, `/detokenize` and `/version` (the official
`openai` client where it reaches them); the structured-output fields (`response_format` and
vLLM's) read into one spec, malformed ones refused naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest

from router.completions import IGNORED_HEADER
from tests.router.conftest import MODEL, ScriptedBackend, echo_script

TEXT = "return value"


@pytest.fixture
def server(tokenizer, make_server):
    return make_server(ScriptedBackend(echo_script(tokenizer, TEXT), tokenizer.eos_token_id))


def test_unknown_fields_are_ignored_and_named(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="hi",
        extra_body={"skip_special_tokens": True, "priority": 3, "store": False})
    assert raw.parse().choices[0].text == TEXT
    assert raw.headers[IGNORED_HEADER] == "priority, skip_special_tokens, store"
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
        extra_body={"chat_template_kwargs": {}, "\u001f\n": 1})
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == TEXT
    assert raw.headers[IGNORED_HEADER] == "chat_template_kwargs, 1 more"
    plain = client.completions.with_raw_response.create(model=MODEL, prompt="hi")
    assert IGNORED_HEADER not in plain.headers


def test_model_may_be_left_out_but_not_wrong(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 200 and r.json()["model"] == MODEL
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["model"] == MODEL
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="x").completions.create(
            model="other", prompt="hi")


def test_model_by_id(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_tokenize_and_detokenize_round_trip(server, tokenizer):
    text = "def f(x):\n    return x"
    r = httpx.post(server.url + "/tokenize", json={"prompt": text})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] > 0
    r = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"] == tokenizer.decode(body["tokens"])
    chat = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": chat})
    assert r.json()["tokens"] == tokenizer.encode_chat(chat, add_generation_prompt=True)
    for path, bad, param in [("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"),
                             ("/tokenize", {"prompt": "x", "add_special_tokens": "no"},
                              "add_special_tokens"),
                             ("/tokenize", {"messages": [{"role": "robot"}]}, "messages"),
                             ("/detokenize", {"tokens": [-1]}, "tokens"),
                             ("/detokenize", {"tokens": "abc"}, "tokens")]:
        r = httpx.post(server.url + path, json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), (bad, r.text)
    r = httpx.post(server.url + "/tokenize", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404


def test_version(server):
    r = httpx.get(server.url + "/version")
    assert r.status_code == 200 and isinstance(r.json()["version"], str) and r.json()["version"]


def test_continuous_usage_stats_count_every_chunk(server, tokenizer):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    chunks = list(client.completions.create(
        model=MODEL, prompt="hi", stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counted = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counted == sorted(counted) and counted[0] >= 1 and len(counted) > 1
    assert all(c.usage.prompt_tokens == len(tokenizer.encode("hi")) for c in chunks)
    assert chunks[-1].usage.completion_tokens == counted[-1]  # the final usage chunk agrees
    plain = list(client.completions.create(model=MODEL, prompt="hi", stream=True,
                                           stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain if c.choices)


def test_completion_top_logprobs_hold_the_sampled_token():
    """Legacy completions, as OpenAI and vLLM: the sampled token is among its top_logprobs even
    when it is not in the top k (then k + 1 entries); chat keeps exactly k."""
    from router.choice import TokenLogprob
    from router.responses import chat_logprobs, completion_logprobs

    inside = TokenLogprob("a", 1, -0.1, [("a", 1, -0.1), ("b", 2, -2.0)], 0)
    outside = TokenLogprob("c", 3, -5.0, [("a", 1, -0.1), ("b", 2, -2.0)], 1)
    tops = completion_logprobs([inside, outside])["top_logprobs"]
    assert tops == [{"a": -0.1, "b": -2.0}, {"a": -0.1, "b": -2.0, "c": -5.0}]
    assert [len(e["top_logprobs"]) for e in chat_logprobs([inside, outside])["content"]] == [2, 2]


@pytest.mark.parametrize("body,spec", [
    ({"response_format": {"type": "json_object"}}, ("json_object", "")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     ("json", '{"type": "object"}')),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, ("json_object", "")),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": '{"type": "integer"}'}, ("json", '{"type": "integer"}')),
    ({"guided_regex": "[0-9]+"}, ("regex", "[0-9]+")),
    ({"guided_choice": ["a", "ü"]}, ("choice", '["a", "ü"]')),
    ({"guided_grammar": 'root ::= "a"'}, ("grammar", 'root ::= "a"')),
    ({"structured_outputs": {"regex": "x+"}}, ("regex", "x+")),
    ({"structured_outputs": {"json_object": True}}, ("json_object", "")),
])
def test_structured_output_fields_become_one_spec(body, spec):
    from router.chat_request import parse_chat
    from router.protocol import parse_completion

    for req in (parse_completion({"prompt": "x", **body}),
                parse_chat({"messages": [{"role": "user", "content": "x"}], **body})):
        assert req.sampling.get("structured_output") == spec
        assert req.sampling_params(4, 0).structured_output == spec


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_json": "not json"}, "guided_json"), ({"guided_json": [1]}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"), ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 3]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "grammar": "b"}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_grammar": "x" * (256 * 1024 + 1)}, "guided_grammar"),
])
def test_malformed_structured_output_is_a_400_naming_the_field(body, param):
    from router.protocol import parse_completion

    with pytest.raises(Exception) as e:
        parse_completion({"prompt": "x", **body})
    assert getattr(e.value, "status", None) == 400 and e.value.param == param
