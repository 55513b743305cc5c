"""Chat tool calls: the parsers (`router.tool_calls`) on text split at every character, and the
router with `--tool-call-parser`: tools and earlier calls reach the chat template, a reply that
calls a tool comes back as `tool_calls` (streamed or not) through the official openai client,
the forced choices (required, a named function: the reply constrained by structured output
and read back as calls), and the refusals. The nodes are a scripted backend
answering with a fixed text: the tiny test models do not call tools."""

from __future__ import annotations

import json

import openai
import pytest

from pd.testing.tiny import tiny_tokenizer, write_tokenizer_files
from pd.text.tokenizer import Tokenizer
from router.tool_calls import ToolCallParser, tool_choice_schema
from tests.router.conftest import MODEL, LiveServer, ScriptedBackend, echo_script

# A Hermes-style template: the tools listed in a system turn, earlier calls and tool results
# rendered in the model's own format.
TEMPLATE = """\
{%- if tools %}<|im_start|>system
Tools:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}
{%- for call in message.get('tool_calls', []) %}<tool_call>{{ call['function'] | tojson }}</tool_call>
{%- endfor %}
{%- if message.get('tool_call_id') %} (for {{ message['tool_call_id'] }}){% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def parse(kind: str, text: str, step: int = 1) -> tuple[str, list]:
    p, shown, calls = ToolCallParser(kind), "", []
    for i in range(0, len(text), step):
        s, c = p.push(text[i:i + step])
        shown, calls = shown + s, calls + c
    s, c = p.finish()
    return shown + s, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                       for c in calls + c]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_hermes_calls_are_taken_out_of_the_text(step):
    assert parse("hermes", "Let me look. " + CALL + CALL, step) == (
        "Let me look. ", [("get_weather", {"city": "Paris"})] * 2)
    assert parse("hermes", "a < b and <tool_call> never closed", step) == (
        "a < b and <tool_call> never closed", [])
    assert parse("hermes", "<tool_call>{no json}</tool_call> ok", step) == (
        "<tool_call>{no json}</tool_call> ok", [])


@pytest.mark.parametrize("step", [1, 1000])
def test_llama3_json_reply_is_a_call_or_text(step):
    call = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    assert parse("llama3_json", call, step) == ("", [("get_weather", {"city": "Rome"})])
    assert parse("llama3_json", "<|python_tag|>" + call + "; " + call, step)[1] == [
        ("get_weather", {"city": "Rome"})] * 2
    assert parse("llama3_json", "It is sunny.", step) == ("It is sunny.", [])
    assert parse("llama3_json", "{not json", step) == ("{not json", [])


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tool-tok")
    write_tokenizer_files(path, tiny_tokenizer(), model_max_length=512, chat_template=TEMPLATE)
    return Tokenizer.from_dir(path)


@pytest.fixture
def serve(tool_tokenizer):
    servers = []

    def make(reply: str, **config) -> tuple[LiveServer, ScriptedBackend]:
        backend = ScriptedBackend(echo_script(tool_tokenizer, reply), tool_tokenizer.eos_token_id,
                                  chunk=2, max_len=512)
        servers.append(LiveServer(backend, tool_tokenizer, **config))
        return servers[-1], backend

    yield make
    for s in servers:
        s.close()


def test_a_reply_calling_a_tool_comes_back_as_tool_calls(serve, tool_tokenizer):
    server, backend = serve("Checking. " + CALL, tool_call_parser="hermes")
    client = server.client()
    history = [{"role": "user", "content": "weather in Paris?"}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                         max_tokens=200)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking. "
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"} and call.id.startswith("call_")
    # the tools reached the template
    assert '"name": "get_weather"' in tool_tokenizer.decode(backend.requests[-1].prompt_ids)
    streamed = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                              max_tokens=200, stream=True)
    text, calls, finish = "", {}, None
    for chunk in streamed:
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for c in delta.tool_calls or []:
            calls[c.index] = (c.function.name, json.loads(c.function.arguments))
        finish = chunk.choices[0].finish_reason or finish
    assert (text, calls, finish) == ("Checking. ", {0: ("get_weather", {"city": "Paris"})},
                                     "tool_calls")
    # the second turn: the call and its result go back to the template
    history += [{"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.id, "type": "function",
                     "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=8)
    prompt = tool_tokenizer.decode(backend.requests[-1].prompt_ids)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert f"sunny, 21 C (for {call.id})" in prompt


def test_tools_without_a_parser_are_refused(serve):
    server, _ = serve("It is sunny.")
    client = server.client()
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:  # auto by default: needs the parser
        client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert e.value.body["param"] == "tool_choice"
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                         tool_choice="none", max_tokens=8)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "length"
    parsed, _ = serve("It is sunny.", tool_call_parser="hermes")
    with pytest.raises(openai.BadRequestError) as e:
        parsed.client().chat.completions.create(model=MODEL, messages=messages,
                                                tools=[{"type": "function"}])
    assert e.value.body["param"] == "tools"
    plain = parsed.client().chat.completions.create(model=MODEL, messages=messages,
                                                    tools=[WEATHER], max_tokens=200)
    assert plain.choices[0].message.content == "It is sunny."
    assert plain.choices[0].message.tool_calls is None


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_choices_constrain_the_reply_and_come_back_as_calls(serve, stream):
    """required: the reply is constrained to a JSON array of calls; a named function: to its
    arguments. No parser flag is needed; the constraint reaches the nodes as structured output."""
    messages = [{"role": "user", "content": "weather?"}]
    cases = [("required", '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
              {"city": "Paris"}),
             ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Rome"}',
              {"city": "Rome"})]
    for choice, reply, args in cases:
        server, backend = serve(reply)
        out = server.client().chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER], tool_choice=choice, max_tokens=200,
            stream=stream)
        if stream:
            chunks = list(out)
            calls = [c for ch in chunks if ch.choices for c in (ch.choices[0].delta.tool_calls or [])]
            content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert content == "" and chunks[-1].choices[0].finish_reason == "tool_calls"
        else:
            msg = out.choices[0].message
            calls, content = msg.tool_calls, msg.content
            assert content is None and out.choices[0].finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", args)]
        kind, schema = backend.requests[-1].params.structured_output
        name = "required" if choice == "required" else "function:get_weather"
        assert kind == "json_compact" and json.loads(schema) == tool_choice_schema([WEATHER], name)
    assert json.loads(schema) == WEATHER["function"]["parameters"]


def test_forced_tool_choices_that_cannot_hold_are_refused(serve):
    server, _ = serve("x")
    client = server.client()
    messages = [{"role": "user", "content": "hi"}]
    for kwargs in (dict(tool_choice="required"),  # no tools
                   dict(tools=[WEATHER], tool_choice={"type": "function",
                                                      "function": {"name": "nope"}}),
                   dict(tools=[WEATHER], tool_choice="required",
                        response_format={"type": "json_object"})):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, **kwargs)
        assert e.value.body["param"] == "tool_choice", kwargs


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(serve, method):
    """LangChain's with_structured_output: "function_calling" forces its schema's tool by name,
    "json_schema" sends response_format; either way the constraint reaches the nodes and the
    (scripted) reply comes back as the pydantic object."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: str
        degrees: int

    server, backend = serve('{"city": "Oslo", "degrees": 4}')
    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="unused",
                     max_tokens=200, max_retries=0, timeout=30)
    got = llm.with_structured_output(Weather, method=method).invoke("weather in Oslo?")
    assert got == Weather(city="Oslo", degrees=4)
    kind, schema = backend.requests[-1].params.structured_output
    assert kind == ("json_compact" if method == "function_calling" else "json")
    assert set(json.loads(schema)["properties"]) == {"city", "degrees"}
