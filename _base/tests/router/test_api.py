"""The router's OpenAI API over real HTTP with the official `openai` client (scripted backend)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from prometheus_client.parser import text_string_to_metric_families

from tests.router.conftest import MODEL, ScriptedBackend, echo_script


def sample(text: str, name: str, **labels) -> float | None:
    """The value of the sample `name` whose labels include `labels` (None: no such sample)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and labels.items() <= s.labels.items():
                return s.value
    return None

TEXT = "def format(self, value): return value + 42"


@pytest.fixture
def backend(tokenizer):
    return ScriptedBackend(echo_script(tokenizer, TEXT), tokenizer.eos_token_id)


@pytest.fixture
def client(backend, make_server):
    return make_server(backend).client()


def test_completion_streamed_equals_not_streamed(client, backend, tokenizer):
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=100, temperature=0)
    assert r.choices[0].text == TEXT
    assert r.choices[0].finish_reason == "stop"
    n_out = len(tokenizer.encode(TEXT)) + 1  # the EOS is counted, not shown
    assert r.usage.prompt_tokens == len(tokenizer.encode("hello"))
    assert r.usage.completion_tokens == n_out
    assert r.usage.total_tokens == r.usage.prompt_tokens + n_out
    chunks = list(client.completions.create(model=MODEL, prompt="hello", max_tokens=100,
                                            temperature=0, stream=True))
    assert len(chunks) > 5
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_length_finish(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    assert r.choices[0].text == tokenizer.decode(tokenizer.encode(TEXT)[:3])


def test_chat_streamed_and_not(client, backend, tokenizer):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=100)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == TEXT
    templated = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    assert templated.endswith("<|im_start|>assistant\n")
    assert backend.requests[-1].prompt_ids == tokenizer.encode(templated, add_special_tokens=False)
    assert r.usage.prompt_tokens == len(backend.requests[-1].prompt_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == TEXT
    assert chunks[-1].choices[0].finish_reason == "stop"
    # no max_tokens: the rest of the context
    assert backend.requests[-1].params.max_tokens == 256 - r.usage.prompt_tokens


def test_stop_string_across_tokens(client, backend, tokenizer):
    stop = "value +"
    ids = tokenizer.encode(TEXT)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert stop not in pieces  # the stop string spans several tokens
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(model=MODEL, prompt="x", max_tokens=50,
                                                    stop=[stop, "zzz"], stream=True))
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            r = client.completions.create(model=MODEL, prompt="x", max_tokens=50, stop=stop)
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert text == TEXT[:TEXT.index(stop)]
        assert finish == "stop"
        # the backend stream was closed early: the nodes got an abort
        assert backend.requests[-1].req_id in backend.closed_early


def test_stop_token_ids(client, backend, tokenizer):
    ids = tokenizer.encode(TEXT)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=50,
                                  extra_body={"stop_token_ids": [ids[4]]})
    assert backend.requests[-1].params.stop_token_ids == (ids[4],)
    # the node stops on the id; the router shows the text before it and names it
    assert r.choices[0].text == tokenizer.decode(ids[:4])
    assert r.choices[0].stop_reason == ids[4] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 5
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=50)
    assert r.choices[0].stop_reason is None and r.choices[0].finish_reason == "stop"  # EOS


def test_utf8_split_across_tokens(tokenizer, make_server):
    text = "héllo → 世界 🙂 ok"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # some tokens split characters
    eos = tokenizer.eos_token_id
    client = make_server(ScriptedBackend(lambda req: ids, eos)).client()
    chunks = list(client.completions.create(model=MODEL, prompt="x", max_tokens=64, stream=True))
    parts = [c.choices[0].text for c in chunks]
    assert all("\ufffd" not in p for p in parts)
    assert "".join(parts) == text
    # every token event streams as it comes, a held part of a character as empty text
    assert len(chunks) == len(ids) + 1 and "" in parts[:-1]  # + the EOS's closing chunk
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].message.content == text
    chunks = list(client.chat.completions.create(model=MODEL, stream=True,
                                                 messages=[{"role": "user", "content": "x"}]))
    contents = [c.choices[0].delta.content for c in chunks[1:]]  # after the role chunk
    assert len(contents) == len(ids) + 1 and "" in contents[:-1]
    assert "".join(c or "" for c in contents) == text


def test_completion_logprobs_shape(client, tokenizer):
    n = len(tokenizer.encode(TEXT))
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=n, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert "".join(lp.tokens) == TEXT
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    assert all(len(d) <= 3 and all(v <= 0 for v in d.values()) for d in lp.top_logprobs)
    assert all(v < 0 for v in lp.token_logprobs)
    chunks = list(client.completions.create(model=MODEL, prompt="x", max_tokens=n, logprobs=3,
                                            stream=True))
    streamed = [t for c in chunks for t in (c.choices[0].logprobs.tokens or [])]
    assert streamed == lp.tokens


def test_chat_logprobs_shape(client, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       logprobs=True, top_logprobs=2, max_tokens=5)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for e in content:
        assert e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 2 and e.logprob <= 0
        assert all(t.bytes == list(t.token.encode()) for t in e.top_logprobs)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].logprobs is None


def test_n2_and_include_usage(client, backend, tokenizer):
    chunks = list(client.completions.create(
        model=MODEL, prompt="hello", n=2, seed=7, max_tokens=100, stream=True,
        stream_options={"include_usage": True}))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    for i in (0, 1):
        assert "".join(c.choices[0].text for c in chunks
                       if c.choices and c.choices[0].index == i) == TEXT
    assert sorted(r.params.seed for r in backend.requests[-2:]) == [7, 8]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 2 * (len(tokenizer.encode(TEXT)) + 1)
    assert last.usage.prompt_tokens == len(tokenizer.encode("hello"))
    assert all(c.usage is None for c in chunks[:-1])
    r = client.chat.completions.create(model=MODEL, n=2,
                                       messages=[{"role": "user", "content": "x"}])
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content == TEXT for c in r.choices)


def test_models_health_metrics(client, backend, make_server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    client.completions.create(model=MODEL, prompt="hello", stream=True).close()
    list(client.completions.create(model=MODEL, prompt="hello", max_tokens=4, stream=True))
    url = str(client.base_url).removesuffix("/v1/")
    assert httpx.get(url + "/health").json()["status"] == "ok"
    text = httpx.get(url + "/metrics").text
    for name in ("pd_time_to_first_token_seconds_count", "pd_inter_token_latency_seconds_count",
                 "pd_e2e_request_latency_seconds_count", "pd_request_queue_time_seconds_count",
                 "pd_prompt_tokens_total", "pd_generation_tokens_total",
                 "pd_num_requests_running"):
        assert name in text
    assert sample(text, "pd_router_healthy_nodes", role="decode") == 1.0
    assert sample(text, "pd_http_requests_total", endpoint="/v1/completions", status="200") >= 1
    assert sample(text, "pd_time_to_first_token_seconds_count", role="router") >= 1
    backend.nodes["decode"] = 0
    h = httpx.get(url + "/health")
    assert h.status_code == 503 and h.json()["decode"] == 0


def test_api_key(backend, make_server):
    s = make_server(backend, api_key="s3cret")
    with pytest.raises(openai.AuthenticationError):
        s.client("wrong").models.list()
    assert s.client("s3cret").models.list().data[0].id == MODEL
    assert httpx.get(s.url + "/health").status_code == 200  # probes need no key


def test_retry_once_before_first_token(client, backend):
    backend.fail_first = 1
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=100)
    assert r.choices[0].text == TEXT
    assert len(backend.requests) == 2
    assert backend.requests[0].req_id != backend.requests[1].req_id
    backend.fail_first = 2  # fails again on the retry: a clear error, no hang
    with pytest.raises(openai.InternalServerError, match="prefill node died"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=100)


def test_disconnect_closes_backend_stream(tokenizer, make_server):
    eos = tokenizer.eos_token_id
    backend = ScriptedBackend(lambda req: [5] * 200, eos, delay=0.02)
    s = make_server(backend)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
    deadline = time.monotonic() + 5
    while not backend.closed_early and time.monotonic() < deadline:
        time.sleep(0.02)
    assert backend.closed_early == [backend.requests[0].req_id]
    # a non-streamed request whose client gives up is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(s.url + "/v1/completions", json={**body, "stream": False}, timeout=0.2)
    deadline = time.monotonic() + 5
    while len(backend.closed_early) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert backend.closed_early[1] == backend.requests[1].req_id
    metrics = httpx.get(s.url + "/metrics").text
    assert sample(metrics, "pd_request_aborts_total", reason="client_disconnect") == 2.0


def test_client_gone_between_two_writes_ends_like_a_disconnect(tokenizer, make_server,
                                                               monkeypatch, caplog):
    """The client can leave while a chunk is written, before its handler is cancelled: the
    write raises, and the request must end as a disconnect (aborted, 499), with no error."""
    from aiohttp import web
    from aiohttp.client_exceptions import ClientConnectionResetError

    backend = ScriptedBackend(lambda req: [5] * 50, tokenizer.eos_token_id, delay=0.005)
    s = make_server(backend)
    writes, write = 0, web.StreamResponse.write

    async def write_then_reset(self, data):
        nonlocal writes
        writes += 1
        if writes == 3:
            raise ClientConnectionResetError("Cannot write to closing transport")
        return await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", write_then_reset)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True}
    with caplog.at_level("ERROR"):
        with httpx.stream("POST", s.url + "/v1/completions", json=body) as r:
            lines = list(r.iter_lines())
        deadline = time.monotonic() + 5
        while not backend.closed_early and time.monotonic() < deadline:
            time.sleep(0.02)
    assert len([x for x in lines if x.startswith("data: {")]) == 2 and "data: [DONE]" not in lines
    assert backend.closed_early == [backend.requests[0].req_id]
    metrics = httpx.get(s.url + "/metrics").text
    assert sample(metrics, "pd_http_requests_total", status="499") == 1.0
    assert sample(metrics, "pd_request_aborts_total", reason="client_disconnect") == 1.0
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
