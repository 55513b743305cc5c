"""Bad input on every ZMQ socket that a node or the router binds, against real node processes.

The sockets: the prefill node's and the decode node's control ROUTER, the decode node's KV
ingest ROUTER, and the router's event PULL (a `RouterServer` over the ZMQ backend, in this
process). Each gets garbage bytes, truncated msgpack, a msgpack non-map, an unknown `type`, a
wrong `version`, a message over the decoder's size limit, wrong frame counts, and well-formed
messages that the socket does not take or whose fields are wrong (addresses a node cannot
connect to, records of no request, a doorbell without a ring). Each must be refused and counted
(`pd_messages_refused`, `pd_ring_records_refused`, `pd_router_messages_refused` in the /metrics
of the process that refused it); afterwards every process still runs and a greedy completion
through the router equals single-process generation. A message over the socket's hard cap
(ZMQ_MAXMSGSIZE) is dropped by libzmq with the sender's connection, before a node sees it:
that one is checked for the node still serving, not for a count.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import msgpack
import pytest
import torch
import zmq
from prometheus_client.parser import text_string_to_metric_families

from pd.wire import messages as m
from pd.config import ModelConfig
from pd.wire.geometry import geometry
from pd.engine.llm import LLM
from pd.wire.sampling_params import SamplingParams
from pd.text.tokenizer import Tokenizer
from router.main import start
from router.config import ServerConfig
from router.server import RouterServer
from router.zmq_backend import ZmqBackend
from shm_ipc import control, header
from shm_ipc.header import Flag
from shm_ipc.receiver import MAX_FRAME_BYTES
from shm_ipc.records import FirstTokenRecord, encode as encode_record

MODEL = "tiny"
PROMPT = "def fibonacci(n):"
HARD_CAP = m.MAX_MESSAGE_BYTES + 4096


def packb(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def common_bad(ok: bytes) -> dict[str, list[bytes]]:
    """What every msgpack socket must refuse, one refusal each; `ok` is a message it takes."""
    return {
        "garbage": [b"\xc1\xffnot msgpack at all"],
        "empty": [b""],
        "truncated": [ok[:-1]],
        "trailing_bytes": [ok + b"\x00"],
        "non_map": [packb([1, 2, 3])],
        "non_str_keys": [packb({1: 2})],
        "deep_nesting": [b"\x91" * 100_000 + b"\x00"],
        "unknown_type": [packb({"type": "no_such_type", "version": 1})],
        "no_type": [packb({"version": 1, "seq": 1})],
        "wrong_version": [packb({**msgpack.unpackb(ok), "version": 99})],
        "string_version": [packb({**msgpack.unpackb(ok), "version": "1"})],
        "over_limit": [ok + b" " * (m.MAX_MESSAGE_BYTES + 1 - len(ok))],
        "two_frames": [ok, ok],
        "three_frames": [ok, b"", ok],
    }


def metric(url: str, name: str, **labels) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


def wait_for(fn, want: float, timeout: float = 15.0) -> float:
    deadline = time.monotonic() + timeout
    while (got := fn()) < want and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


class RouterThread:
    """A router over the ZMQ backend, served on loopback from a thread of this process."""

    def __init__(self, backend: ZmqBackend, tokenizer: Tokenizer) -> None:
        self.server = RouterServer(backend, tokenizer, ServerConfig(MODEL))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = asyncio.run_coroutine_threadsafe(
            start(self.server, "127.0.0.1", 0), self.loop).result(10)
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Stranger:
    """A peer with no business on the socket: sends frames, reads what comes back."""

    def __init__(self, kind: int, addr: str) -> None:
        self.sock = zmq.Context.instance().socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout: float = 5.0) -> list[bytes] | None:
        return self.sock.recv_multipart() if self.sock.poll(int(timeout * 1000)) else None

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def nodes(cluster):
    decode, prefill = cluster.ready(
        cluster.decode("--metrics-port", "0", "--node-id", "bad-input-d", wait=False),
        cluster.prefill("--metrics-port", "0", "--node-id", "bad-input-p", wait=False))
    for node in (decode, prefill):
        node.metrics = f"http://127.0.0.1:{node.info['metrics_port']}"
    return prefill, decode


@pytest.fixture(scope="module")
def router(nodes, tiny_model_dir):
    prefill, decode = nodes
    backend = ZmqBackend([prefill.addr.removeprefix("tcp://")],
                         [decode.addr.removeprefix("tcp://")], max_model_len=256)
    server = RouterThread(backend, Tokenizer.from_dir(tiny_model_dir))
    deadline = time.monotonic() + 30
    while httpx.get(server.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, "router never saw both nodes healthy"
        time.sleep(0.1)
    yield server
    server.close()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_blocks=64)
    return llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0))[0].text


def complete(router) -> str:
    r = httpx.post(router.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def assert_serving(nodes, router, reference) -> None:
    for node in nodes:
        assert node.proc.poll() is None, f"{node.role} node died:\n{node.log_tail()}"
        with open(node.log_path) as f:
            assert "Traceback" not in f.read(), node.log_tail()
    assert complete(router) == reference


def control_cases(role: str) -> dict[str, list[bytes]]:
    ping = m.encode(m.Ping(7))
    cases = common_bad(ping)
    cases.update({
        "bad_field_type": [packb({"type": "ping", "version": 1, "seq": "seven"})],
        "unknown_field": [packb({"type": "ping", "version": 1, "seq": 1, "evil": True})],
        "not_for_this_socket": [m.encode(m.KVAck("x"))],
        "pong_to_a_node": [m.encode(m.Pong(1, "decode", "x", {}))],
    })
    if role == "prefill":
        cases["missing_field"] = [packb({"type": "prefill_request", "version": 1, "req_id": "r"})]
        cases["reply_to_not_an_endpoint"] = [m.encode(m.PrefillRequest(
            "bad-reply", [1, 2, 3], {"max_tokens": 2}, "tcp://127.0.0.1:1", "not an endpoint"))]
        cases["decode_addr_not_an_endpoint"] = [m.encode(m.PrefillRequest(
            "bad-decode", [1, 2, 3], {"max_tokens": 2}, "garbage", "tcp://127.0.0.1:1"))]
    return cases


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_control_socket_refuses_bad_input(role, nodes, router, reference):
    node = nodes[0] if role == "prefill" else nodes[1]
    refused = lambda: metric(node.metrics, "pd_messages_refused_total", role=role,
                             socket="control")
    before = refused()
    peer = Stranger(zmq.DEALER, node.addr)
    try:
        cases = control_cases(role)
        for frames in cases.values():
            peer.send(frames)
        got = wait_for(refused, before + len(cases))
        assert got == before + len(cases), f"{got - before} of {len(cases)} refusals counted"
        assert peer.recv(0.2) is None  # nothing answered but refusals' silence
        peer.send([m.encode(m.Ping(8))])
        pong = m.decode(peer.recv()[0])
        assert isinstance(pong, m.Pong) and pong.seq == 8 and pong.role == role
        peer.send([bytes(HARD_CAP + 1)])  # libzmq drops this connection
    finally:
        peer.close()
    assert_serving(nodes, router, reference)


def data(flag: int, body: bytes, *raw: bytes) -> list[bytes]:
    return [header.to_bytes(flag), body, *raw]


def test_kv_ingest_refuses_bad_input(nodes, router, reference, tiny_model_dir):
    prefill, decode = nodes
    kv_refused = lambda: metric(decode.metrics, "pd_messages_refused_total", role="decode",
                                socket="kv")
    ring_refused = lambda: metric(decode.metrics, "pd_ring_records_refused_total")
    total = lambda: kv_refused() + ring_refused()
    before = total()
    hello = m.to_dict(m.Hello("stranger", {}))
    ok = control.encode(hello)
    cases = common_bad(ok)
    cases["over_limit"] = [ok + b" " * (control.MAX_CONTROL_BYTES + 1 - len(ok))]
    cases.pop("two_frames")  # a control message with a ring position: see bad_doorbell below
    word, body = encode_record(FirstTokenRecord("nobody", 1, -0.5, 1))
    cases.update({
        "unpaired_meta": [control.encode(m.to_dict(m.RequestMeta(
            "r", [1, 2], {}, "tcp://127.0.0.1:1", 1)))],
        "reserved_byte": data(word | 1 << 24, body),
        "unknown_flag": data(99, body),
        "topk_above_max": data(header.pack(Flag.FIRST_TOKEN, 60000), body),
        "short_header": [b"\x02\x00\x00", body],
        "truncated_record": data(word, body[:-2]),
        "record_of_no_request": data(word, body),
        "pad_outside_ring": data(0, b""),
        "kv_bad_meta": data(header.pack(Flag.KV, 0), b"\xff" * 120, b"\x00" * 64),
        "raw_frame_on_small_record": data(word, body, b"raw"),
        "doorbell_without_ring": [b"", (64).to_bytes(8, "little")],
        "bad_doorbell": [ok, b"\x01\x02"],
        "five_frames": [b"a" * 5, b"b", b"c", b"d", b"e"],
        "attach_bad_name": [control.encode({"type": control.SHM_ATTACH, "version": 1,
                                            "segment": "../../etc/passwd"})],
        "attach_a_directory": [control.encode({"type": control.SHM_ATTACH, "version": 1,
                                               "segment": ".."})],
    })
    peer = Stranger(zmq.DEALER, decode.kv_addr)
    try:
        for frames in cases.values():
            peer.send(frames)
        want = before + len(cases) - 2  # the attaches are answered, not counted
        got = wait_for(total, want)
        assert got == want, f"{got - before} of {len(cases) - 2} refusals counted"
        replies = []
        while (r := peer.recv(0.5)) is not None:
            replies.append(control.decode(r[0]))
        assert [r["type"] for r in replies] == [control.SHM_REFUSED] * 2

        # a paired stranger: its requests name a router that is not an endpoint
        geo = geometry(ModelConfig.from_dir(tiny_model_dir), torch.float32, 16, False)
        peer.send([control.encode(m.to_dict(m.Hello("stranger", geo)))])
        assert m.from_dict(control.decode(peer.recv()[0])).__class__ is m.HelloOk
        before = kv_refused()
        peer.send([control.encode(m.to_dict(m.RequestMeta(
            "bad-reply", [1, 2], {"max_tokens": 2}, "not an endpoint", 1)))])
        peer.send([control.encode(m.to_dict(m.RequestMeta(
            "bad-params", [1, 2], {"max_tokens": "two"}, "not an endpoint", 1)))])
        assert wait_for(kv_refused, before + 2) == before + 2
        peer.send([bytes(MAX_FRAME_BYTES + 1)])  # over the ingest socket's cap
    finally:
        peer.close()
    assert_serving(nodes, router, reference)


def test_router_event_socket_refuses_bad_input(nodes, router, reference):
    backend = router.server.backend
    refused = lambda: metric(router.url, "pd_router_messages_refused_total", socket="events")
    before = refused()
    ok = m.encode(m.TokenStream("nobody", [1], finish_reason="stop"))
    cases = common_bad(ok)
    cases["not_for_this_socket"] = [m.encode(m.Ping(1))]
    cases["bad_field_type"] = [packb({**msgpack.unpackb(ok), "token_ids": "abc"})]
    peer = Stranger(zmq.PUSH, backend.reply_to)
    try:
        for frames in cases.values():
            peer.send(frames)
        got = wait_for(refused, before + len(cases))
        assert got == before + len(cases), f"{got - before} of {len(cases)} refusals counted"
        peer.send([bytes(HARD_CAP + 1)])
    finally:
        peer.close()
    assert_serving(nodes, router, reference)
