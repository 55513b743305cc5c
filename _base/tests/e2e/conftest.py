"""Real node processes on loopback for end-to-end tests.

`shared_launch` is one `pd launch` for the modules that only read from it.
`cluster(...)` starts decode and prefill nodes (`python -m pd decode|prefill`) on free ports and
stops them at the end of the test module; every test gets a fresh `NodeClient` as the router
stand-in. `PD_TEST_DEVICE=cuda` runs the nodes (and `DEVICE_KWARGS` the references) on the GPU in
float32, for `benchmarks/gpu/run_all.sh`.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from pd.service.client import NodeClient
from pd.service.procs import Launch, spawn_node


DEVICE = os.environ.get("PD_TEST_DEVICE", "cpu")
DEVICE_ARGS = ["--device", DEVICE, "--dtype", "float32"] if DEVICE != "cpu" else []
DEVICE_KWARGS = {"device": DEVICE, "dtype": "float32"} if DEVICE != "cpu" else {}


def wait_idle(client: NodeClient, node, timeout: float = 10.0) -> dict:
    """Ping the node (`node.addr`) until every KV block is free again, or `timeout` passes;
    returns its last load."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.ping(node.addr).stats
        if stats["free_blocks"] == stats["total_blocks"] or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


class Cluster:
    def __init__(self, model_dir, tmp_path) -> None:
        self.model_dir = str(model_dir)
        self.tmp_path = tmp_path
        self.nodes = []

    def decode(self, *extra: str, model: str | None = None, env: dict | None = None,
               wait: bool = True):
        """A decode node; with `wait=False` it is only started (`ready` waits for several)."""
        node = spawn_node("decode", ["--model", model or self.model_dir, "--port", "0", "--kv-port", "0",
                                     "--num-blocks", "256", *DEVICE_ARGS, *extra], log_dir=str(self.tmp_path),
                          env=env)
        self.nodes.append(node)
        return self.ready(node) if wait else node

    def prefill(self, *extra: str, model: str | None = None, wait: bool = True):
        node = spawn_node("prefill", ["--model", model or self.model_dir, "--port", "0",
                                      "--num-blocks", "256", *DEVICE_ARGS, *extra],
                          log_dir=str(self.tmp_path))
        self.nodes.append(node)
        return self.ready(node) if wait else node

    @staticmethod
    def ready(*nodes):
        """Wait for nodes started with `wait=False` (they start together: sooner on few cores)."""
        for node in nodes:
            node.wait_ready(60.0)
            node.addr = f"tcp://127.0.0.1:{node.info['port']}"
            if "kv_addr" in node.info:
                node.kv_addr = node.info["kv_addr"]
        return nodes[0] if len(nodes) == 1 else nodes

    def stop(self) -> None:
        # NOTE: every node drains at once, then each is waited for
        for node in self.nodes:
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes:
            node.stop()


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    c = Cluster(tiny_model_dir, tmp_path_factory.mktemp("nodes"))
    yield c
    c.stop()


@pytest.fixture
def client():
    c = NodeClient()
    yield c
    c.close()


@pytest.fixture(scope="session")
def shared_launch(tiny_model_dir):
    """One `pd launch` on the embedded-style tiny model for the test modules that only read
    from it (the API tests, `pd bench`): started once, stopped at the end of the session, and
    checked then to have exited cleanly with no node left behind."""
    launch = Launch(tiny_model_dir, "--num-blocks", "512", "--tool-call-parser", "hermes")
    yield launch
    assert launch.stop() == 0
    for node in launch.nodes.values():
        try:
            os.kill(node["pid"], 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"node pid {node['pid']} outlived pd launch")
