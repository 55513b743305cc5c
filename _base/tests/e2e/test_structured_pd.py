"""Structured output and forced tool calls through `pd launch` on the embedded model (trained:
its JSON closes, unlike the random test models'), with MTP on and off, driven by the official
`openai` client and LangChain's `ChatOpenAI`: the JSON parses and holds its schema, equals
single-process generation under the same grammar, and a forced tool call round-trips through a
two-turn conversation."""

from __future__ import annotations

import json

import openai
import pytest

from pd.config import default_model_dir
from pd.engine.llm import LLM
from pd.service.procs import Launch
from pd.wire.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def reference():
    return LLM()


@pytest.fixture(scope="module", params=[0, 2], ids=["no-mtp", "mtp2"])
def served(request):
    mtp = request.param
    launch = Launch(default_model_dir(), "--num-blocks", "512",
                    *(("--num-speculative-tokens", str(mtp)) if mtp else ()))
    yield launch
    assert launch.stop() == 0


def test_json_schema_output_parses_holds_its_schema_and_equals_single_process(served, reference):
    api = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for content in ("# a JSON object:", "def fibonacci(n):"):
        messages = [{"role": "user", "content": content}]
        out = api.chat.completions.create(
            model=served.served_model_name, messages=messages, max_tokens=80, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}})
        text = out.choices[0].message.content
        value = json.loads(text)
        assert set(value) == {"name", "n"} and isinstance(value["n"], int)
        assert isinstance(value["name"], str) and len(value["name"]) <= 6
        want = reference.generate([reference.tokenizer.encode_chat(messages)], SamplingParams(
            max_tokens=80, temperature=0.0, structured_output=("json", json.dumps(SCHEMA))))[0]
        assert text == want.text and out.choices[0].finish_reason == "stop"


def test_langchain_with_structured_output(served):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Thing(BaseModel):
        name: str = Field(max_length=6)
        n: int

    llm = ChatOpenAI(model=served.served_model_name, base_url=served.url + "/v1",
                     api_key="unused", temperature=0, max_tokens=80, max_retries=0, timeout=60)
    got = llm.with_structured_output(Thing, method="json_schema").invoke("# a JSON object:")
    assert isinstance(got, Thing) and len(got.name) <= 6


def test_a_forced_tool_call_round_trips_through_two_turns(served):
    api = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    history = [{"role": "user", "content": "weather in Paris?"}]
    first = api.chat.completions.create(model=served.served_model_name, messages=history,
                                        tools=[WEATHER], tool_choice="required", max_tokens=80,
                                        temperature=0).choices[0]
    calls = first.message.tool_calls
    assert calls, (first.message, first.finish_reason)
    assert calls[0].function.name == "get_weather"
    args = json.loads(calls[0].function.arguments)
    assert set(args) == {"city"} and len(args["city"]) <= 8
    history += [{"role": "assistant", "content": None, "tool_calls": [
                    {"id": calls[0].id, "type": "function",
                     "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}]},
                {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 21 C"}]
    second = api.chat.completions.create(model=served.served_model_name, messages=history,
                                         tools=[WEATHER], tool_choice="none", max_tokens=16,
                                         temperature=0).choices[0]
    assert isinstance(second.message.content, str) and second.message.tool_calls is None
