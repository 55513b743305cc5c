"""The OpenAI API through `pd launch` (router + prefill node + decode node as real processes),
driven by the official `openai` client; outputs compared with single-process generation."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import time

import httpx
import openai
import pytest

from pd.cli.launch import cpu_share
from pd.engine.llm import LLM
from pd.wire.sampling_params import SamplingParams

from pd.service.procs import Launch

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range(10):"]


@pytest.fixture(scope="module")
def server(shared_launch):
    return shared_launch


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return LLM(tiny_model_dir, num_blocks=256)


@pytest.fixture(scope="module")
def model_name(tiny_model_dir):
    return tiny_model_dir.name


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def greedy_text(reference, prompt: str, max_tokens: int) -> str:
    return reference.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].text


def test_nodes_on_the_cpu_share_its_cores(server):
    """`pd launch` on the CPU gives each of its two nodes half the cores (`--threads`;
    `cpu_share`'s own figures are checked in `tests/service/test_threads.py`)."""
    share = cpu_share(2)
    assert f"nodes on the CPU: {share} torch thread{'s' * (share > 1)} each" in server.output()
    assert len(server.nodes) == 2
    for node in server.nodes.values():
        with open(f"/proc/{node['pid']}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert argv[argv.index(b"--threads") + 1] == str(share).encode()


def test_completion_equals_single_process_streamed_or_not(api, reference, model_name):
    for prompt in PROMPTS:
        want = greedy_text(reference, prompt, 24)
        full = api.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=0)
        assert full.choices[0].text == want
        assert full.usage.completion_tokens == len(reference.generate(
            [prompt], SamplingParams(max_tokens=24, temperature=0.0))[0].token_ids)
        chunks = api.completions.create(model=model_name, prompt=prompt, max_tokens=24,
                                        temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want


def test_chat_streamed_and_not(api, reference, model_name):
    messages = [{"role": "user", "content": "write a loop"}]
    ids = reference.tokenizer.encode_chat(messages)
    want = reference.generate([ids], SamplingParams(max_tokens=16, temperature=0.0))[0].text
    full = api.chat.completions.create(model=model_name, messages=messages, max_tokens=16,
                                       temperature=0)
    assert full.choices[0].message.content == want
    stream = api.chat.completions.create(model=model_name, messages=messages, max_tokens=16,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_logprobs_match_single_process(api, reference, model_name):
    prompt = PROMPTS[0]
    ref = reference.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, logprobs=3))[0]
    out = api.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0,
                                 logprobs=3)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    chat = api.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    assert all(len(c.top_logprobs) == 2 for c in chat.choices[0].logprobs.content)


def test_echo_scores_the_prompt_as_single_process(api, reference, model_name):
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 0) and echo with a
    completion, streamed or not: the prompt's logprobs are the prefill node's, equal to
    single-process ones; the first prompt token has none."""
    tok = reference.tokenizer
    for prompt in PROMPTS[:2]:
        ids = tok.encode(prompt)
        ref = reference.generate([ids], SamplingParams(max_tokens=4, temperature=0.0,
                                                       prompt_logprobs=1, logprobs=1))[0]
        scored = api.completions.create(model=model_name, prompt=prompt, max_tokens=0,
                                        echo=True, logprobs=1, temperature=0)
        c = scored.choices[0]
        assert c.text == prompt and c.finish_reason == "length"
        assert scored.usage.completion_tokens == 0
        assert len(c.logprobs.tokens) == len(ids) and c.logprobs.token_logprobs[0] is None
        assert c.logprobs.top_logprobs[0] is None
        assert c.logprobs.token_logprobs[1:] == pytest.approx(
            [v for v, _, _ in ref.prompt_logprobs], abs=1e-4)
        for got, (_, _, top) in zip(c.logprobs.top_logprobs[1:], ref.prompt_logprobs):
            assert tok.decode([top[0][0]]) in got
        with_completion = api.completions.create(model=model_name, prompt=prompt, max_tokens=4,
                                                 echo=True, logprobs=1, temperature=0)
        c = with_completion.choices[0]
        assert c.text == prompt + ref.text
        assert c.logprobs.token_logprobs[1:len(ids)] == pytest.approx(  # through the decode node
            [v for v, _, _ in ref.prompt_logprobs], abs=1e-4)
        assert c.logprobs.token_logprobs[len(ids):] == pytest.approx(ref.logprobs, abs=1e-4)
        assert c.logprobs.text_offset[len(ids)] == len(prompt)
        streamed = api.completions.create(model=model_name, prompt=prompt, max_tokens=4,
                                          echo=True, temperature=0, stream=True)
        assert "".join(ch.choices[0].text for ch in streamed) == prompt + ref.text
        # lm-eval's own request: token ids, echo, logprobs 1, max_tokens 1; it reads the prompt
        # part of token_logprobs and whether each equals its top entry
        harness = api.completions.create(model=model_name, prompt=ids, max_tokens=1, echo=True,
                                         logprobs=1, temperature=0).choices[0].logprobs
        assert len(harness.token_logprobs) == len(ids) + 1
        assert harness.token_logprobs[1:-1] == pytest.approx(
            [v for v, _, _ in ref.prompt_logprobs], abs=1e-4)
        assert [v == max(top.values()) for v, top in zip(harness.token_logprobs[1:-1],
                                                         harness.top_logprobs[1:-1])] == [
            rank == 1 for _, rank, _ in ref.prompt_logprobs]


def test_chat_with_tools_through_pd_launch(api, reference, model_name):
    """`pd launch --tool-call-parser hermes`: a chat request with tools (LangChain's bind_tools
    shape) is served; the tiny model writes no call, so its reply is the greedy text."""
    tools = [{"type": "function", "function": {"name": "get_time", "description": "the time",
                                                "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "what time is it?"}]
    out = api.chat.completions.create(model=model_name, messages=messages, tools=tools,
                                      max_tokens=8, temperature=0)
    plain = api.chat.completions.create(model=model_name, messages=messages, max_tokens=8,
                                        temperature=0)
    choice = out.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    # this model's template renders no tools: the same prompt, the same greedy reply
    assert choice.message.content == plain.choices[0].message.content


def test_langchain_bind_tools(server, model_name):
    """LangChain's ChatOpenAI with bind_tools (it sends its tools and tool_choice unset) against
    `pd launch`: served; the tiny model calls nothing, so the message has no tool calls and the
    same text as without tools."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_time(city: str) -> str:
        """The time in a city."""
        return "noon"

    llm = ChatOpenAI(model=model_name, base_url=server.url + "/v1", api_key="unused",
                     temperature=0, max_tokens=8, max_retries=0, timeout=60)
    msg = llm.bind_tools([get_time]).invoke("what time is it in Paris?")
    assert msg.tool_calls == [] and msg.content == llm.invoke("what time is it in Paris?").content


def test_stop_string(api, reference, model_name):
    prompt = PROMPTS[1]
    free = greedy_text(reference, prompt, 24)
    stop = free[6:9]
    out = api.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=0,
                                 stop=[stop])
    assert out.choices[0].text == free[: free.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_n2_seeded_sampling(api, model_name):
    out = api.completions.create(model=model_name, prompt=PROMPTS[2], max_tokens=12,
                                 temperature=1.0, n=2, seed=7)
    again = api.completions.create(model=model_name, prompt=PROMPTS[2], max_tokens=12,
                                   temperature=1.0, n=2, seed=7)
    assert len(out.choices) == 2
    assert [c.text for c in out.choices] == [c.text for c in again.choices]


@pytest.mark.parametrize("kwargs, status", [
    ({"max_tokens": 0}, 400), ({"max_tokens": -3}, 400), ({"logprobs": 21}, 400),
    ({"temperature": -1}, 400), ({"prompt": "x " * 2000}, 400), ({"model": "nope"}, 404),
])
def test_bad_input_is_4xx_and_the_server_keeps_serving(api, model_name, kwargs, status):
    args = {"model": model_name, "prompt": "hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as e:
        api.completions.create(**args)
    assert e.value.status_code == status
    assert api.completions.create(model=model_name, prompt="ok", max_tokens=2).choices


def test_more_sequences_than_the_decode_node_holds_are_refused_at_once(api, reference, model_name):
    """512 blocks of 16 tokens at the decode node: 9 sequences of ~1000 tokens cannot fit
    (they used to wait there for the KV timeout)."""
    max_tokens = min(1000, reference.engine.max_model_len - 8)
    n = 8192 // max_tokens + 1
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=model_name, prompt="hello", max_tokens=max_tokens, n=n)
    assert time.monotonic() - t0 < 5 and e.value.code == "kv_capacity_exceeded"
    assert api.completions.create(model=model_name, prompt="ok", max_tokens=2, n=n).choices


def test_concurrent_streaming_load(api, reference, model_name):
    prompts = [f"{PROMPTS[i % 4]} # {i}" for i in range(200)]
    want = {p: greedy_text(reference, p, 12) for p in prompts[:8]}

    def one(prompt: str) -> str:
        stream = api.completions.create(model=model_name, prompt=prompt, max_tokens=12,
                                        temperature=0, stream=True)
        return "".join(c.choices[0].text for c in stream if c.choices)

    with cf.ThreadPoolExecutor(32) as pool:
        texts = list(pool.map(one, prompts))
    assert all(texts)
    for p in prompts[:8]:
        assert texts[prompts.index(p)] == want[p]


def test_killing_a_decode_node_fails_only_its_requests(tiny_model_dir, reference):
    # vLLM's spelling (`pd serve DIR`), with vLLM's name for the GPU memory flag
    launch = Launch(tiny_model_dir, "--num-decode", "2", "--num-blocks", "512",
                    "--gpu-memory-utilization", "0.5", serve=True)
    try:
        api = openai.OpenAI(base_url=launch.url + "/v1", api_key="x", max_retries=0, timeout=60)
        name = tiny_model_dir.name
        victim = launch.nodes["decode-0"]["pid"]

        chunks = [0] * 16  # text chunks each stream has received so far

        def one(i: int):
            try:
                stream = api.completions.create(model=name, prompt=f"x = {i}", max_tokens=480,
                                                temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
                text = []
                for c in stream:
                    if c.choices:
                        text.append(c.choices[0].text)
                        chunks[i] += 1
                return "".join(text), None
            except openai.APIError as e:
                return None, e

        with cf.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(one, i) for i in range(16)]
            # Kill once every stream is under way, not after a fixed sleep: on a fast machine
            # all of them could finish before a timer fires.
            deadline = time.monotonic() + 60
            while min(chunks) < 3 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert min(chunks) >= 3, f"streams not all under way: {chunks}"
            os.kill(victim, 9)
            results = [f.result(timeout=120) for f in futures]
        failed = [e for _, e in results if e is not None]
        done = [t for t, _ in results if t is not None]
        assert failed and done, f"{len(failed)} failed, {len(done)} completed"
        assert all("decode" in str(e) for e in failed)
        # New requests go to the surviving decode node, once the router has taken the dead one out.
        deadline = time.monotonic() + 30
        while httpx.get(launch.url + "/health").json().get("decode") != 1:
            assert time.monotonic() < deadline, "the router never took the dead decode node out"
            time.sleep(0.05)
        for i in range(4):
            out = api.completions.create(model=name, prompt=f"y = {i}", max_tokens=8, temperature=0)
            assert out.choices[0].text == greedy_text(reference, f"y = {i}", 8)
    finally:
        launch.stop()


def test_logit_bias_reaches_both_nodes(api, reference, model_name):
    """The bias applies to the prefill node's first token and the decode node's others: the
    output is the single process's under the same bias."""
    prompt = PROMPTS[0]
    bias = {"77": 100, "3": -100}
    out = api.completions.create(model=model_name, prompt=prompt, max_tokens=6, temperature=0,
                                 logit_bias=bias, logprobs=0)
    ref = reference.generate([prompt], SamplingParams(
        max_tokens=6, temperature=0.0, logit_bias=[(77, 100.0), (3, -100.0)]))[0]
    assert ref.token_ids == [77] * 6
    assert out.choices[0].text == reference.tokenizer.decode(ref.token_ids)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        api.completions.create(model=model_name, prompt=prompt, logit_bias={"10000000": 1})


def test_structured_output_equals_single_process(api, reference, model_name):
    """response_format and vLLM's guided_* / structured_outputs through P and D: the prefill
    node samples the first token under the grammar, the decode node's matcher takes it from
    there; the tokens equal single-process generation under the same grammar."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    cases = [
        (dict(response_format={"type": "json_schema",
                               "json_schema": {"name": "r", "schema": schema}}),
         ("json", json.dumps(schema))),
        (dict(response_format={"type": "json_object"}), ("json_object", "")),
        (dict(extra_body={"guided_regex": "[a-d]{3}-[0-9]{2,4}"}), ("regex", "[a-d]{3}-[0-9]{2,4}")),
        (dict(extra_body={"guided_choice": ["yes", "no"]}), ("choice", '["yes", "no"]')),
        (dict(extra_body={"structured_outputs": {"grammar": 'root ::= "a" "b"+'}}),
         ("grammar", 'root ::= "a" "b"+')),
    ]
    messages = [{"role": "user", "content": "answer in JSON"}]
    chat_ids = reference.tokenizer.encode_chat(messages)
    for kwargs, spec in cases:
        chat = "response_format" in kwargs  # the OpenAI field (chat); vLLM's on completions
        want = reference.generate([chat_ids] if chat else PROMPTS[0], SamplingParams(
            max_tokens=12, temperature=0.0, structured_output=spec))[0]
        if chat:
            got = api.chat.completions.create(model=model_name, messages=messages, max_tokens=12,
                                              temperature=0, **kwargs).choices[0]
            text = got.message.content
        else:
            got = api.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=12,
                                         temperature=0, **kwargs).choices[0]
            text = got.text
        assert text == want.text, spec
        assert got.finish_reason == ("stop" if want.finish_reason == "stop" else "length")
    choice = api.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "agree?"}], max_tokens=8,
        temperature=0, stream=True, extra_body={"guided_choice": ["yes", "no"]})
    assert "".join(c.choices[0].delta.content or "" for c in choice if c.choices) in ("yes", "no")


@pytest.mark.parametrize("extra", [{"guided_regex": "(ab"}, {"guided_grammar": "root ::= nothing"},
                                   {"guided_json": {"type": 12}}])
def test_a_grammar_that_does_not_compile_is_400(api, model_name, extra):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            api.completions.create(model=model_name, prompt="x", max_tokens=4, stream=stream,
                                   extra_body=extra)
        assert "structured output" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # checked by the router itself
        api.completions.create(model=model_name, prompt="x", max_tokens=4,
                               extra_body={"guided_regex": "a", "guided_choice": ["b"]})
    assert "only one" in e.value.message
    assert api.completions.create(model=model_name, prompt="ok", max_tokens=2).choices


def test_forced_tool_choice_through_pd_launch(api, reference, model_name):
    """A named tool choice reaches the nodes as its function's parameter schema: the reply is
    single-process generation under that schema, returned as the call's arguments (or, cut
    short by max_tokens before the JSON closes, as text)."""
    from router.tool_calls import tool_choice_schema

    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
    messages = [{"role": "user", "content": "pick a number"}]
    ids = reference.tokenizer.encode_chat(messages, tools=[tool])
    schema = tool_choice_schema([tool], "function:pick")
    want = reference.generate([ids], SamplingParams(max_tokens=16, temperature=0.0,
                                                    structured_output=("json_compact", json.dumps(schema))))[0]
    out = api.chat.completions.create(model=model_name, messages=messages, tools=[tool],
                                      tool_choice={"type": "function", "function": {"name": "pick"}},
                                      max_tokens=16, temperature=0).choices[0]
    if out.message.tool_calls:
        assert [c.function.name for c in out.message.tool_calls] == ["pick"]
        assert out.message.tool_calls[0].function.arguments == want.text.strip()
    else:
        assert out.message.content == want.text and want.finish_reason == "length"
