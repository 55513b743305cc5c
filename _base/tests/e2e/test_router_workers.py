"""Several router processes on one port (`pd launch --router-workers 2`), driven by the
official `openai` client over many connections: the answers equal single-process generation,
/metrics sums both workers, and a worker killed outright leaves the other serving."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time
import urllib.request

import openai
import pytest

from pd.engine.llm import LLM
from pd.service.procs import Launch
from pd.wire.sampling_params import SamplingParams

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range(10):"]
MAX_TOKENS = 12


def listeners(port: int) -> int:
    """Listening TCP sockets on `port` (IPv4, this host)."""
    count = 0
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
            count += 1
    return count


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def served_by(pid: int) -> float:
    """Requests one worker finished, from its own file of the shared metrics directory."""
    from prometheus_client.multiprocess import MultiProcessCollector

    env = dict(item.split("=", 1) for item in open(f"/proc/{pid}/environ").read().split("\0") if "=" in item)
    path = os.path.join(env["PROMETHEUS_MULTIPROC_DIR"], f"counter_{pid}.db")
    return sum(s.value for m in MultiProcessCollector.merge([path]) for s in m.samples
               if s.name == "pd_request_success_total")


def ask(url: str, prompt: str) -> str:
    """One streamed completion on a connection of its own."""
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as api:
        stream = api.completions.create(model=None, prompt=prompt, max_tokens=MAX_TOKENS,
                                        temperature=0, stream=True)
        return "".join(c.choices[0].text for c in stream)


@pytest.fixture(scope="module")
def launch(tiny_model_dir):
    lau = Launch(tiny_model_dir, "--router-workers", "2", "--num-blocks", "512")
    yield lau
    lau.stop()


def test_two_workers_answer_on_one_port_and_metrics_sum_both(launch, tiny_model_dir):
    assert len(launch.router_pids) == 2 and listeners(launch.port) == 2
    ref = LLM(tiny_model_dir, num_blocks=256)
    expected = {p: o.text for p, o in zip(PROMPTS, ref.generate(
        PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0)))}
    prompts = PROMPTS * 8
    with cf.ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(lambda p: ask(launch.url, p), prompts))
    assert texts == [expected[p] for p in prompts]
    # both workers took some of the 32 connections, and every request is counted once,
    # whichever worker answers /metrics
    mine = [served_by(pid) for pid in launch.router_pids]
    assert all(n > 0 for n in mine) and sum(mine) == len(prompts)
    for _ in range(4):
        assert metric(launch.url, "pd_request_success_total") == len(prompts)
        assert metric(launch.url, "pd_num_requests_running") == 0


def test_a_killed_worker_leaves_the_other_serving(launch):
    before = metric(launch.url, "pd_request_success_total")
    os.kill(launch.router_pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while listeners(launch.port) != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert listeners(launch.port) == 1
    with cf.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda p: ask(launch.url, p), PROMPTS * 4))
    assert all(texts)
    assert metric(launch.url, "pd_request_success_total") == before + len(PROMPTS) * 4
    deadline = time.monotonic() + 5
    while "router worker pd-router-0" not in launch.output() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f"pid {launch.router_pids[0]}) exited" in launch.output()
