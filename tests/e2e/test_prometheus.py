"""A real Prometheus server scrapes `pd launch` (router, prefill node, decode node) and holds the
TTFT and ITL samples of the requests this test sent, plus the nodes' own series.

Prometheus comes from Debian's `prometheus` package, installed when missing (or the test skips
loudly where it cannot be). It runs on loopback with a config generated for the ports
`pd launch` printed; every wait is bounded."""

from __future__ import annotations

import json
import re
import subprocess
import time

import httpx
import pytest
import yaml

from pd.service.procs import Launch, free_port
from tests.deploy.deploy_files import prometheus_bins

NUM_REQUESTS, MAX_TOKENS = 4, 6


@pytest.fixture(scope="module")
def launch(tiny_model_dir):
    prometheus_bins()  # skip before starting anything when Prometheus cannot be had
    lg = Launch(tiny_model_dir, "--num-blocks", "256", "--transport", "zmq")
    yield lg
    lg.stop()


def node_metrics_addrs(lg: Launch) -> dict[str, str]:
    out = {}
    for line in lg.lines:
        m = re.match(r"node (\S+) pid \d+ .* metrics (\S+) log", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


@pytest.fixture(scope="module")
def prometheus(launch, tmp_path_factory):
    prom, _ = prometheus_bins()
    tmp = tmp_path_factory.mktemp("prometheus")
    nodes = node_metrics_addrs(launch)
    assert set(nodes) == {"prefill-0", "decode-0"}, launch.output()
    targets = [{"targets": [launch.url.removeprefix("http://")], "labels": {"service": "router"}}]
    targets += [{"targets": [addr], "labels": {"service": name.split("-")[0]}}
                for name, addr in nodes.items()]
    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
              "scrape_configs": [{"job_name": "pd", "static_configs": targets}]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(tmp / "prometheus.log", "w")
    proc = subprocess.Popen([prom, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("prometheus did not start:\n" + (tmp / "prometheus.log").read_text()[-3000:])
        time.sleep(0.2)
    yield url
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def query(url: str, expr: str) -> list[dict]:
    r = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=5).json()
    assert r["status"] == "success", r
    return r["data"]["result"]


def wait_value(url: str, expr: str, want: float, timeout: float = 20.0) -> float:
    """Wait (bounded) until `expr` is one series with value >= want; returns the value."""
    deadline = time.monotonic() + timeout
    got = None
    while time.monotonic() < deadline:
        res = query(url, expr)
        if len(res) == 1:
            got = float(res[0]["value"][1])
            if got >= want:
                return got
        time.sleep(0.3)
    pytest.fail(f"{expr}: wanted {want}, Prometheus has {got}")


def test_prometheus_scrapes_every_service_and_holds_ttft_and_itl(launch, prometheus, tiny_model_dir):
    model = tiny_model_dir.name
    for i in range(NUM_REQUESTS):
        with httpx.stream("POST", launch.url + "/v1/completions", timeout=60, json={
                "model": model, "prompt": f"def f{i}(x):", "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    up = wait_value(prometheus, 'sum(up{job="pd"})', 3)
    assert up == 3
    # exactly the requests sent: one TTFT each, one ITL sample per later token
    ttft = wait_value(prometheus, 'sum(pd_time_to_first_token_seconds_count{role="router"})',
                      NUM_REQUESTS)
    itl = wait_value(prometheus, 'sum(pd_inter_token_latency_seconds_count{role="router"})',
                     NUM_REQUESTS * (MAX_TOKENS - 1))
    assert (ttft, itl) == (NUM_REQUESTS, NUM_REQUESTS * (MAX_TOKENS - 1))
    p50 = query(prometheus, 'histogram_quantile(0.5, sum by (le) '
                            '(pd_time_to_first_token_seconds_bucket{role="router"}))')
    assert 0 < float(p50[0]["value"][1]) < 60
    # the nodes' own series, labelled with their role and node
    assert wait_value(prometheus, 'sum(pd_kv_transfer_seconds_count{role="prefill",node="prefill-0"})',
                      NUM_REQUESTS) == NUM_REQUESTS
    assert wait_value(prometheus, 'sum(pd_kv_received_bytes_total{role="decode",node="decode-0"})', 1) > 0
    # one transfer per request on each side, labelled with its tier (this launch: --transport zmq)
    for role in ("prefill", "decode"):
        assert wait_value(prometheus, f'sum(pd_kv_transfer_bytes_count{{role="{role}",tier="zmq"}})',
                          NUM_REQUESTS) == NUM_REQUESTS
    assert wait_value(prometheus, 'sum(pd_kv_transfer_seconds_count{role="decode",tier="zmq"})',
                      NUM_REQUESTS) == NUM_REQUESTS
    assert wait_value(prometheus, 'sum(pd_request_join_seconds_count{role="decode",node="decode-0"})',
                      NUM_REQUESTS) == NUM_REQUESTS
    assert wait_value(prometheus, 'sum(pd_decode_step_device_seconds_count{role="decode"})', 1) > 0
    assert wait_value(prometheus, 'sum(pd_token_send_interval_seconds_count{role="decode"})', 1) > 0
    # a first token each: as the decode node got it, and the nodes' part as the router read it
    assert wait_value(prometheus, 'sum(pd_first_token_receive_seconds_count{role="decode"})',
                      NUM_REQUESTS) == NUM_REQUESTS
    assert wait_value(prometheus, 'sum(pd_router_first_token_nodes_seconds_count{role="router"})',
                      NUM_REQUESTS) == NUM_REQUESTS
    assert wait_value(prometheus, 'sum(pd_generation_tokens_total{role="decode"})',
                      NUM_REQUESTS * (MAX_TOKENS - 1)) == NUM_REQUESTS * (MAX_TOKENS - 1)
    healthy = query(prometheus, 'pd_router_healthy_nodes{service="router"}')
    assert {r["metric"]["role"]: float(r["value"][1]) for r in healthy} == {"prefill": 1, "decode": 1}
