"""The HTTP API fuzzed from its own OpenAPI document (schemathesis), against real nodes.

`pd launch` runs the router with a prefill and a decode node on the tiny model (context cut to
64 tokens so that every accepted request generates little); the document is read from the
router's `GET /openapi.json`. Each operation gets a bounded run of schema-conforming cases
(most reach the nodes and generate) and each POST operation a run of schema-violating ones
(wrong types, missing and unknown fields, out-of-range values). Every answer must pass
schemathesis' `not_a_server_error` check; afterwards the router's own count of 5xx answers must
be zero, its log free of tracebacks, the router alive, and a greedy completion the same as
before the run. The number of cases tried is printed and recorded as the test's
`fuzz_cases` property. `PD_FUZZ_EXAMPLES` (cases per operation and mode, default 30) and
`PD_FUZZ_SEED` (default 0) change the run.
"""

from __future__ import annotations

import collections
import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from prometheus_client.parser import text_string_to_metric_families
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from pd.service.procs import Launch

EXAMPLES = int(os.environ.get("PD_FUZZ_EXAMPLES", "30"))
SEED = int(os.environ.get("PD_FUZZ_SEED", "0"))
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    launch = Launch(tiny_model_dir, "--num-blocks", "256", "--max-model-len", str(MAX_MODEL_LEN),
                    "--log-level", "warning")
    yield launch
    launch.stop()


def fuzz(operation, mode: GenerationMode, base_url: str, statuses: collections.Counter) -> int:
    tried = 0

    @seed(SEED)
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(mode))
    def run(case):
        nonlocal tried
        tried += 1
        response = case.call_and_validate(base_url=base_url, checks=[not_a_server_error],
                                          timeout=60)
        statuses[response.status_code] += 1

    run()
    return tried


def server_errors(metrics_text: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(metrics_text) for s in f.samples
               if s.name == "pd_http_requests_total" and s.labels["status"].startswith("5"))


def greedy(server) -> str:
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": server.served_model_name, "prompt": "def f(x):", "max_tokens": 12,
        "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_fuzzed_api_answers_no_5xx_and_keeps_serving(server, record_property):
    before = greedy(server)
    doc = httpx.get(server.url + "/openapi.json").json()
    schema = schemathesis.openapi.from_dict(doc)
    statuses: dict[str, collections.Counter] = {}
    tried = 0
    for result in schema.get_all_operations():
        op = result.ok()
        modes = [GenerationMode.POSITIVE]
        if op.method.upper() == "POST":
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            counts = statuses.setdefault(f"{op.label} {mode.value}", collections.Counter())
            tried += fuzz(op, mode, server.url, counts)
    print(f"\nfuzz: {tried} cases (seed {SEED}, {EXAMPLES} per operation and mode)")
    for label, counts in statuses.items():
        print(f"  {label}: {dict(sorted(counts.items()))}")
    record_property("fuzz_cases", tried)
    generated = sum(c[200] for label, c in statuses.items() if "completions positive" in label)
    assert generated >= EXAMPLES // 2, f"too few fuzz cases reached the nodes: {statuses}"

    assert server_errors(httpx.get(server.url + "/metrics").text) == 0
    assert httpx.get(server.url + "/health").status_code == 200
    assert greedy(server) == before
    assert server.proc.poll() is None
    assert "Traceback" not in server.output(), server.output()[-4000:]
