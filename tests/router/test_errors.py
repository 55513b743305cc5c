"""Bad input and unavailable nodes: each a clear error in the OpenAI shape, the router still up."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
from aiohttp import web

from router.backend import TokenEvent
from tests.router.conftest import MODEL, ScriptedBackend, echo_script

TEXT = "return value"


@pytest.fixture
def backend(tokenizer):
    return ScriptedBackend(echo_script(tokenizer, TEXT), tokenizer.eos_token_id, max_len=64)


@pytest.fixture
def server(backend, make_server):
    return make_server(backend)


def _post(server, path: str, body, raw: bool = False) -> httpx.Response:
    if raw:
        return httpx.post(server.url + path, content=body,
                          headers={"Content-Type": "application/json"})
    return httpx.post(server.url + path, json=body)


CMPL = {"model": MODEL, "prompt": "hi"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
BAD = [
    # (path, body, status, param)
    ("/v1/completions", {**CMPL, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**CMPL, "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {**CMPL, "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {**CMPL, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {**CMPL, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {**CMPL, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**CMPL, "top_k": 1.5}, 400, "top_k"),
    ("/v1/completions", {**CMPL, "n": 0}, 400, "n"),
    ("/v1/completions", {**CMPL, "n": True}, 400, "n"),
    ("/v1/completions", {**CMPL, "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {**CMPL, "stop": 5}, 400, "stop"),
    ("/v1/completions", {**CMPL, "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {**CMPL, "seed": "abc"}, 400, "seed"),
    ("/v1/completions", {**CMPL, "echo": "yes"}, 400, "echo"),
    ("/v1/completions", {**CMPL, "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {**CMPL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {**CMPL, "prompt": [1, -2]}, 400, "prompt"),
    ("/v1/completions", {**CMPL, "prompt": [10**6]}, 400, "prompt"),
    ("/v1/completions", {**CMPL, "prompt": "word " * 100}, 400, "prompt"),
    ("/v1/completions", {**CMPL, "max_tokens": 64}, 400, "max_tokens"),
    ("/v1/completions", {"model": "", "prompt": "hi"}, 400, "model"),
    ("/v1/completions", {**CMPL, "model": "gpt-9"}, 404, "model"),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 3}]}, 400,
     "messages"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, 400, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {**CHAT, "model": "other"}, 404, "model"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "w " * 100}]},
     400, "messages"),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_input(server, backend, path, body, status, param):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"]
    assert err["type"] == "invalid_request_error"
    assert backend.requests == []  # nothing reached the nodes
    ok = _post(server, "/v1/completions", {**CMPL, "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


@pytest.mark.parametrize("raw", [
    b"{not json", b"", b'{"model": "tiny", "prompt": "x"', b"\xff\xfe",
    b"[" * 100_000, b'{"model": "tiny", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"model": "tiny", "prompt": "\\ud800"}',
    b'{"model": "tiny", "prompt": "x", "stop": "a\\udfff"}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}]}',
    b'{"model": "tiny", "prompt": "x", "\\ud800": 1}'])
def test_malformed_json(server, raw):
    r = _post(server, "/v1/completions", raw, raw=True)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_json"
    assert _post(server, "/v1/completions", {**CMPL, "max_tokens": 2}).status_code == 200


def test_surrogate_pair_escapes_are_unicode(server):
    raw = b'{"model": "tiny", "prompt": "\\ud83d\\ude00 hi", "max_tokens": 2}'
    assert _post(server, "/v1/completions", raw, raw=True).status_code == 200


def test_unknown_route_is_openai_shaped(server):
    r = httpx.get(server.url + "/v1/engines")
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_openai_client_sees_bad_request(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_503_when_no_healthy_node(server, backend):
    backend.nodes["decode"] = 0
    r = _post(server, "/v1/completions", CMPL)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    backend.nodes["decode"] = 1
    backend.unavailable = True  # the backend itself finds no node when it picks one
    for stream in (False, True):
        r = _post(server, "/v1/completions", {**CMPL, "stream": stream})
        assert r.status_code == 503, r.text
    backend.unavailable = False
    assert _post(server, "/v1/completions", CMPL).status_code == 200


def test_429_when_queue_full(tokenizer, make_server):
    backend = ScriptedBackend(lambda req: [7] * 50, tokenizer.eos_token_id, delay=0.02)
    s = make_server(backend, max_running=1, max_queue=1)
    body = {**CMPL, "max_tokens": 50}
    results = []
    threads = [threading.Thread(target=lambda: results.append(_post(s, "/v1/completions", body)))
               for _ in range(2)]
    for t in threads:
        t.start()
    assert backend.started.wait(5)
    deadline = time.monotonic() + 5
    while s.server.admission.num_waiting < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    r = _post(s, "/v1/completions", body)  # one running, one waiting: full
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    for t in threads:
        t.join(10)
    assert [x.status_code for x in results] == [200, 200]
    assert _post(s, "/v1/completions", body).status_code == 200


def test_a_stream_frees_its_slot_before_its_done_line(tokenizer, make_server, monkeypatch):
    """At the limit (one running, no queue), a client that sends its next request the moment it
    reads [DONE] is never refused: the slot is free before [DONE] is written. The end of each
    response is held back 0.3 s (as a slow connection's last flush can be), so a slot released
    only when the handler returns would still be taken."""
    write_eof = web.StreamResponse.write_eof

    async def slow_write_eof(self, *args, **kwargs):
        await asyncio.sleep(0.3)
        return await write_eof(self, *args, **kwargs)

    monkeypatch.setattr(web.StreamResponse, "write_eof", slow_write_eof)
    backend = ScriptedBackend(lambda req: [7] * 8, tokenizer.eos_token_id)
    s = make_server(backend, max_running=1, max_queue=0)
    body = {**CMPL, "max_tokens": 8, "stream": True}
    with httpx.Client(timeout=10) as http:
        for _ in range(3):
            with http.stream("POST", s.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        assert s.server.admission.num_running == 0
                        nxt = http.post(s.url + "/v1/completions", json={**CMPL, "max_tokens": 2})
                        assert nxt.status_code == 200, nxt.text


def test_error_mid_stream_is_an_error_event(tokenizer, make_server):
    class Failing(ScriptedBackend):
        async def generate(self, req):
            self.requests.append(req)
            yield TokenEvent(tokenizer.encode("hello"))
            await asyncio.sleep(0)
            yield TokenEvent([], error="decode node tcp://127.0.0.1:1 stopped answering")

    s = make_server(Failing(lambda r: [], tokenizer.eos_token_id))
    got = []
    with pytest.raises(openai.APIError, match="decode node"):
        for c in s.client().completions.create(model=MODEL, prompt="x", stream=True):
            got.append(c.choices[0].text)
    assert "".join(got) == "hello"  # what was sent stays, then the error: no silent truncation
    with pytest.raises(openai.InternalServerError, match="decode node"):
        s.client().completions.create(model=MODEL, prompt="x")
    r = httpx.post(s.url + "/v1/completions", json={**CMPL, "stream": True})
    assert r.text.rstrip().endswith("data: [DONE]") and '"error"' in r.text


def test_bodies_must_be_json(server):
    """text/plain (which a web page may post to a local server without a preflight) and bodies
    without a type are refused with 415; a charset parameter is fine."""
    raw = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        r = httpx.post(server.url + "/v1/completions", content=raw,
                       headers={"Content-Type": ctype} if ctype else {})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", ctype
    r = httpx.post(server.url + "/v1/completions", content=raw,
                   headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_authorization_that_is_not_utf8_is_401(tokenizer, make_server):
    backend = ScriptedBackend(lambda req: [7, 8], tokenizer.eos_token_id)
    s = make_server(backend, api_key="sekrit")
    r = httpx.post(s.url + "/v1/completions", json={**CMPL, "max_tokens": 2},
                   headers={"Authorization": b"Bearer \xff\xfe\xc3"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(s.url + "/v1/completions", json={**CMPL, "max_tokens": 2},
                   headers={"Authorization": "Bearer sekrit"})
    assert r.status_code == 200


def test_text_longer_than_any_context_is_refused_before_tokenizing(tokenizer, make_server):
    backend = ScriptedBackend(lambda req: [7, 8], tokenizer.eos_token_id, max_len=256)
    s = make_server(backend)
    assert s.server.body_limit() == 2**20
    t0 = time.monotonic()
    r = _post(s, "/v1/completions", {**CMPL, "prompt": "a" * (256 * 64 + 1)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = _post(s, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "b" * 20000}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = _post(s, "/v1/completions", {**CMPL, "prompt": "c" * (3 * 2**20)})  # over the body limit
    assert r.status_code == 413 and r.json()["error"]["message"]
    assert time.monotonic() - t0 < 5
    assert not backend.requests  # nothing reached the nodes
    assert _post(s, "/v1/completions", {**CMPL, "max_tokens": 2}).status_code == 200


def test_admission_counts_sequences(tokenizer, make_server):
    """A request takes prompts x n slots of --max-running: more than all of them is a 400 naming
    the limit; two requests that do not fit together run one after the other."""
    backend = ScriptedBackend(lambda req: [7] * 20, tokenizer.eos_token_id, delay=0.02)
    s = make_server(backend, max_running=4, max_queue=4)
    r = _post(s, "/v1/completions", {**CMPL, "n": 5, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences"
    assert "--max-running" in r.json()["error"]["message"]
    results = []
    body = {**CMPL, "n": 3, "max_tokens": 20}
    first = threading.Thread(target=lambda: results.append(_post(s, "/v1/completions", body)))
    first.start()
    assert backend.started.wait(5)
    second = threading.Thread(target=lambda: results.append(_post(s, "/v1/completions", body)))
    second.start()
    deadline = time.monotonic() + 5
    while s.server.admission.num_waiting < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert s.server.admission.num_waiting == 1 and s.server.admission.num_running == 3
    first.join(10)
    second.join(10)
    assert [x.status_code for x in results] == [200, 200]
    assert s.server.admission.num_running == 0


def test_a_client_that_stops_reading_loses_its_slot(tokenizer, make_server, monkeypatch):
    """A stream whose client stops reading (its writes block) is dropped after --write-timeout:
    the request is aborted on the nodes and its admission slot freed for the next client."""
    from aiohttp import web

    backend = ScriptedBackend(lambda req: [7] * 200, tokenizer.eos_token_id, delay=0.005)
    s = make_server(backend, max_running=1, max_queue=0, write_timeout=0.3)
    real_write = web.StreamResponse.write
    stuck = threading.Event()

    async def write(self, data):
        if self.content_type == "text/event-stream" and stuck.is_set():
            await asyncio.sleep(3600)  # the socket's buffers are full: the client stopped reading
        return await real_write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", write)
    # NOTE: a write that leaves little in the send buffer skips the timer (it cannot block);
    # here the blocking is simulated above the socket, so every write must take the timed path
    monkeypatch.setattr("router.completions._UNTIMED_WRITE_BYTES", 0)
    t0 = time.monotonic()
    with httpx.stream("POST", s.url + "/v1/completions", json={**CMPL, "max_tokens": 200,
                                                                 "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        stuck.set()
        with pytest.raises(httpx.HTTPError):
            for _ in lines:
                pass
    assert time.monotonic() - t0 < 5
    deadline = time.monotonic() + 5
    while s.server.admission.num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.server.admission.num_running == 0
    assert backend.closed_early, "the request was not aborted on the nodes"
    stuck.clear()
    assert _post(s, "/v1/completions", {**CMPL, "max_tokens": 2}).status_code == 200


def test_a_body_that_never_arrives_is_408(tokenizer, make_server):
    import socket

    backend = ScriptedBackend(lambda req: [7], tokenizer.eos_token_id)
    s = make_server(backend, body_timeout=0.3)
    with socket.create_connection(("127.0.0.1", s.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\":")
        sock.settimeout(5)
        t0 = time.monotonic()
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 3


def test_a_node_timeout_is_504_and_not_retried(tokenizer, make_server):
    """A node that timed out a request (queued too long, no blocks, no KV) is alive and loaded:
    the router answers 504 at once instead of retrying elsewhere and doubling the wait; a node
    that died is still retried once."""
    backend = ScriptedBackend(lambda req: [7, 8], tokenizer.eos_token_id)
    s = make_server(backend)
    backend.fail_first, backend.fail_error = 1, "timed out queued at the prefill node"
    r = _post(s, "/v1/completions", {**CMPL, "max_tokens": 2})
    assert r.status_code == 504 and r.json()["error"]["code"] == "node_timeout"
    assert len(backend.requests) == 1
    backend.fail_first, backend.fail_error = 1, "prefill node died"
    assert _post(s, "/v1/completions", {**CMPL, "max_tokens": 2}).status_code == 200
    assert len(backend.requests) == 3  # the retry


def test_requests_wait_for_kv_room_beside_those_in_flight(tokenizer, make_server):
    """Two requests each within the decode node's KV but not both at once: the second reaches
    the nodes only after the first is done (before, both went and the second waited at the
    decode node for blocks, up to its KV timeout); two that fit together run at once."""
    arrived: list[tuple[float, int]] = []
    backend = ScriptedBackend(lambda req: arrived.append((time.monotonic(), req.params.max_tokens))
                              or [7] * 8, tokenizer.eos_token_id, delay=0.05)
    backend.kv_blocks = lambda: [(8, 16)]  # 128 tokens
    s = make_server(backend)

    def both(max_tokens: int) -> list[float]:
        arrived.clear()
        ends = []

        def one():
            assert _post(s, "/v1/completions", {**CMPL, "max_tokens": max_tokens}).status_code == 200
            ends.append(time.monotonic())

        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return sorted(t for t, _ in arrived), sorted(ends)

    starts, ends = both(70)  # 5 blocks each: 10 > 8
    assert starts[1] >= ends[0] - 0.05, (starts, ends)
    starts, ends = both(20)  # 2 blocks each
    assert starts[1] < ends[0], (starts, ends)


def test_a_request_the_decode_nodes_can_never_hold_is_400_up_front(tokenizer, make_server):
    backend = ScriptedBackend(lambda req: [7, 8], tokenizer.eos_token_id, max_len=256)
    backend.kv_blocks = lambda: [(8, 16)]  # one decode node of 8 blocks: 128 tokens
    s = make_server(backend)
    r = _post(s, "/v1/completions", {**CMPL, "max_tokens": 200})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "kv_capacity_exceeded" and err["param"] == "max_tokens"
    assert "128" in err["message"]
    r = _post(s, "/v1/completions", {**CMPL, "max_tokens": 40, "n": 4})  # 3 blocks each, 12 > 8
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "kv_capacity_exceeded" and err["param"] == "n"
    assert not backend.requests  # nothing reached the nodes
    # without max_tokens a sequence counts its prompt and one token
    assert _post(s, "/v1/completions", {**CMPL, "n": 4}).status_code == 200
    backend.kv_blocks = lambda: [(8, 16), (8, 16)]  # two nodes hold the four sequences
    assert _post(s, "/v1/completions", {**CMPL, "max_tokens": 40, "n": 4}).status_code == 200
    backend.kv_blocks = lambda: None  # unknown: not checked
    assert _post(s, "/v1/completions", {**CMPL, "max_tokens": 200}).status_code == 200


def test_echoed_prompt_logprobs_past_one_message_are_a_400(server, monkeypatch):
    import router.completions
    monkeypatch.setattr(router.completions, "MAX_PROMPT_LOGPROB_ENTRIES", 40)
    ids = list(range(3, 23))  # 20 tokens: logprobs 1 fits (40 entries), 2 does not
    ok = _post(server, "/v1/completions", {**CMPL, "prompt": ids, "echo": True, "logprobs": 1,
                                           "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    r = _post(server, "/v1/completions", {**CMPL, "prompt": ids, "echo": True, "logprobs": 2,
                                          "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
