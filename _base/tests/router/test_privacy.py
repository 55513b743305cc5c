"""What the router gives away: request ids are random (uuid4, 122 bits), never counters, and
its logs (at debug level) never hold a prompt: without --log-requests nothing of the request,
with it one line naming the request, its prompt length and parameters, still not the prompt."""

from __future__ import annotations

import logging
import uuid

import pytest

from tests.router.conftest import MODEL, ScriptedBackend, echo_script

PROMPT = "zebra_quartz_canary = 'hunter2'"


@pytest.fixture
def backend(tokenizer):
    return ScriptedBackend(echo_script(tokenizer, "ok"), tokenizer.eos_token_id)


def is_uuid4(hex_id: str) -> bool:
    return uuid.UUID(hex=hex_id).version == 4 and len(hex_id) == 32


def test_request_ids_are_random(backend, make_server):
    client = make_server(backend).client()
    out = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=2)
           for _ in range(3)]
    node_ids = [r.req_id for r in backend.requests]
    assert len(node_ids) == 6 and len(set(node_ids)) == 6
    assert all(is_uuid4(i) for i in node_ids)
    assert all(r.id.startswith("cmpl-") and is_uuid4(r.id[len("cmpl-"):]) for r in out)


@pytest.mark.parametrize("log_requests", [False, True])
def test_logs_never_hold_the_prompt(backend, make_server, tokenizer, caplog, log_requests):
    client = make_server(backend, log_requests=log_requests).client()
    with caplog.at_level(logging.DEBUG):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        client.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "user", "content": PROMPT}])
    text = "\n".join(rec.getMessage() for rec in caplog.records)
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    for form in (PROMPT, "zebra_quartz", "hunter2", ", ".join(map(str, ids))):
        assert form not in text
    assert (r.id in text) == log_requests
