"""Across hosts, on one machine: the prefill node in one network namespace, the decode node in
another, joined by a veth pair that carries the ZMQ KV transport. The test process (the router
stand-in) reaches each namespace over a veth of its own, so cutting the P-D link
(`ip link set down`) leaves the router's paths up, as when one link between two hosts fails.

While requests are being handed over, the P-D link is cut, held down past the hand-off
timeouts, and restored: every request either completes with the single-process tokens or ends
with an error within its timeouts (no hang), both nodes free every KV block, and a request
sent after the restore succeeds. The nodes bind 0.0.0.0 in their namespaces (each has two
links); the prefill node is given the decode node's address on the P-D link. Needs `ip` and the
right to make namespaces (root); skipped otherwise.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from pd.service.client import NodeClient
from pd.engine.llm import LLM
from pd.service.procs import start_node
from pd.wire.sampling_params import SamplingParams
from tests.e2e.conftest import wait_idle

HANDOFF_TIMEOUT = 3.0  # prefill node: first token -> KV acknowledged
KV_TIMEOUT = 3.0       # decode node: request announced -> KV complete
QUEUE_TIMEOUT = 20.0   # prefill node: arrival -> prefilled
OUTAGE_S = 4.0         # longer than both hand-off timeouts: the requests caught in it fail
SLACK_S = 10.0         # decoding after the hand-off, a loaded 2-core machine

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="network namespaces are Linux only")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=10)


class Netns:
    """Namespaces A and B with a P-D veth pair between them, and one veth from this namespace
    to each. Names and the 10.x.y.0/24 subnets are unique per run."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.a, self.b = f"pd{tag}A", f"pd{tag}B"
        self.pd_a, self.pd_b = f"pd{tag}pa", f"pd{tag}pb"  # the P-D veth pair's ends
        self.root_a, self.root_b = f"pd{tag}ra", f"pd{tag}rb"  # this namespace's ends
        used = ip("-o", "addr").stdout
        while True:
            x, y = random.randrange(100, 250), random.randrange(0, 250, 3)
            if f" 10.{x}." not in used:
                break
        self.pd_net, net_ra, net_rb = (f"10.{x}.{y + i}" for i in range(3))
        self.a_pd, self.b_pd = f"{self.pd_net}.1", f"{self.pd_net}.2"  # the P-D link
        self.router_a, self.a_router = f"{net_ra}.1", f"{net_ra}.2"  # this namespace <-> A
        self.router_b, self.b_router = f"{net_rb}.1", f"{net_rb}.2"  # this namespace <-> B
        self.created: list[str] = []

    def add_namespaces(self) -> None:
        for ns in (self.a, self.b):
            ip("netns", "add", ns)
            self.created.append(ns)

    def add_links(self) -> None:
        ip("link", "add", self.pd_a, "netns", self.a, "type", "veth", "peer", "name", self.pd_b,
           "netns", self.b)
        ip("link", "add", self.root_a, "type", "veth", "peer", "name", "r0", "netns", self.a)
        ip("link", "add", self.root_b, "type", "veth", "peer", "name", "r0", "netns", self.b)
        for ns, dev, addr in ((self.a, self.pd_a, self.a_pd), (self.b, self.pd_b, self.b_pd),
                              (self.a, "r0", self.a_router), (self.b, "r0", self.b_router),
                              (None, self.root_a, self.router_a),
                              (None, self.root_b, self.router_b)):
            where = ("-n", ns) if ns else ()
            ip(*where, "addr", "add", f"{addr}/24", "dev", dev)
            ip(*where, "link", "set", dev, "up")
        for ns in (self.a, self.b):
            ip("-n", ns, "link", "set", "lo", "up")
        # NOTE: the router stand-in listens on router_a; B reaches it through this namespace.
        ip("-n", self.b, "route", "add", f"{self.router_a}/32", "via", self.router_b)

    def link(self, up: bool) -> None:
        ip("-n", self.a, "link", "set", self.pd_a, "up" if up else "down")

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def teardown(self) -> None:
        for ns in self.created:
            ip("netns", "del", ns, check=False)
        for dev in (self.root_a, self.root_b):
            ip("link", "del", dev, check=False)


@pytest.fixture
def netns():
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    net = Netns()
    try:
        try:
            net.add_namespaces()
        except subprocess.CalledProcessError as e:
            pytest.skip(f"`ip netns add` is not permitted here (needs CAP_SYS_ADMIN and "
                        f"CAP_NET_ADMIN): {e.stderr.strip()}")
        net.add_links()
        yield net
    finally:
        net.teardown()


@pytest.fixture
def nodes(netns, tiny_model_dir, tmp_path):
    """(prefill, decode) running in namespaces A and B; the prefill node sends KV over ZMQ."""
    started = []
    common = ["--model", str(tiny_model_dir), "--host", "0.0.0.0", "--port", "0",
              "--num-blocks", "256", "--insecure"]  # the namespaces' links only
    try:
        decode = start_node("decode", [*common, "--kv-port", "0", "--kv-timeout", str(KV_TIMEOUT)],
                            log_dir=str(tmp_path), prefix=netns.exec_prefix(netns.b))
        started.append(decode)
        decode.addr = f"tcp://{netns.b_router}:{decode.info['port']}"
        decode.kv_addr = f"tcp://{netns.b_pd}:{decode.info['kv_addr'].rsplit(':', 1)[1]}"
        prefill = start_node("prefill", [*common, "--transport", "zmq",
                                         "--handoff-timeout", str(HANDOFF_TIMEOUT),
                                         "--queue-timeout", str(QUEUE_TIMEOUT)],
                             log_dir=str(tmp_path), prefix=netns.exec_prefix(netns.a))
        started.append(prefill)
        prefill.addr = f"tcp://{netns.a_router}:{prefill.info['port']}"
        yield prefill, decode
    finally:
        for node in reversed(started):
            node.stop()


@pytest.fixture
def client(netns):
    c = NodeClient(host=netns.router_a)
    yield c
    c.close()


def long_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(300, 480))] for _ in range(n)]


def wait_timed(client: NodeClient, req_ids: list[str], bound: float) -> list:
    """Wait for every request, each within `bound` seconds of its sending: no hang."""
    pending = set(req_ids)
    while pending:
        client.poll(0.05)
        now = time.perf_counter()
        for rid in list(pending):
            res = client.results[rid]
            if res.done:
                pending.discard(rid)
            else:
                assert now - res.sent_time < bound, f"request {rid} unfinished after {bound}s"
    return [client.results[r] for r in req_ids]


def test_link_cut_mid_transfer_fails_or_completes_and_frees_kv(netns, nodes, client,
                                                                tiny_model_dir):
    prefill, decode = nodes
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = long_prompts(40, seed=7)
    after = long_prompts(1, seed=8)[0]
    expected = LLM(tiny_model_dir, num_blocks=512).generate([*prompts, after], params)
    want = {tuple(p): e.token_ids for p, e in zip([*prompts, after], expected)}

    first = client.wait([client.submit(prefill.addr, decode.kv_addr, prompts[0], params)], 30)[0]
    assert first.error is None and first.token_ids == want[tuple(prompts[0])]

    # Feed requests steadily; cut the link while the prefill node has hand-offs in flight.
    ids: dict[str, list[int]] = {}
    cut_at = restored_at = None
    at_cut: dict = {}
    start = next_submit = time.monotonic()
    while restored_at is None:
        now = time.monotonic()
        if cut_at is None and now - start > 20:
            pytest.fail("no hand-off was ever in flight to cut")
        if len(ids) < len(prompts) - 1 and now >= next_submit:
            p = prompts[1 + len(ids)]
            ids[client.submit(prefill.addr, decode.kv_addr, p, params)] = p
            next_submit = now + 0.04
        client.poll(0.005)
        if cut_at is None and len(ids) >= 6:
            stats = client.ping(prefill.addr).stats
            if stats["handing_off"] > 0:
                netns.link(up=False)
                cut_at = time.monotonic()
                at_cut = {"prefill": stats, "decode": client.ping(decode.addr).stats}
        elif cut_at is not None and now - cut_at > OUTAGE_S:
            netns.link(up=True)
            restored_at = time.monotonic()
    assert at_cut["prefill"]["handing_off"] > 0, at_cut

    while len(ids) < len(prompts) - 1:
        p = prompts[1 + len(ids)]
        ids[client.submit(prefill.addr, decode.kv_addr, p, params)] = p
    results = wait_timed(client, list(ids), bound=QUEUE_TIMEOUT + HANDOFF_TIMEOUT + SLACK_S)
    failed = [r for r in results if r.error]
    assert failed, "no request was caught by the outage"
    for r in results:
        if r.error is None:
            assert r.token_ids == want[tuple(ids[r.req_id])] and r.finish_reason == "length"

    for node in (prefill, decode):
        stats = wait_idle(client, node, timeout=15.0)
        assert stats["free_blocks"] == stats["total_blocks"], (node.role, stats)
        assert stats["running"] == 0 and stats["queue_len"] == 0
    assert client.ping(prefill.addr).stats["handing_off"] == 0
    assert client.ping(decode.addr).stats["incoming"] == 0

    res = client.wait([client.submit(prefill.addr, decode.kv_addr, after, params)], 30)[0]
    assert res.error is None and res.token_ids == want[tuple(after)]
    for node in (prefill, decode):
        assert node.proc.poll() is None, node.log_tail()
