"""Wire messages: round trips, and refusals of what a decoder must not accept."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd.wire import messages as m

SAMPLES = [
    m.PrefillRequest("r1", [1, 2, 3], {"max_tokens": 4}, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"),
    m.Abort("r1", "client"),
    m.Ping(7),
    m.Pong(7, "decode", "d0", {"free_blocks": 10}, kv_addr="tcp://127.0.0.1:3"),
    m.TokenStream("r1", [5], logprobs=[-0.5], top_logprobs=[[[5, -0.5]]], finish_reason="stop"),
    m.Hello("p0", {"model_id": "x", "block_size": 16}),
    m.HelloRefused("d0", "block_size differs"),
    m.RequestMeta("r1", [1, 2], {"max_tokens": 2}, "tcp://127.0.0.1:2", 1),
    m.KVAccept("r1"), m.KVDone("r1", 3), m.KVAck("r1"), m.KVRefuse("r1", "timeout"),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(msg):
    assert m.decode(m.encode(msg)) == msg


@pytest.mark.parametrize(
    "payload, match",
    [
        ({"type": "nope", "version": 1}, "unknown message type"),
        ({"version": 1}, "unknown message type"),
        ({"type": "ping", "version": 9}, "version"),
        ({"type": "abort", "version": 1}, "missing field"),
        ({"type": "ping", "version": 1, "extra": 1}, "unknown field"),
        ({"type": "abort", "version": 1, "req_id": 5}, "type int"),
        ({"type": "kv_done", "version": 1, "req_id": "a", "num_records": True}, "type bool"),
        ({**m.to_dict(SAMPLES[0]), "reply_to": "not an endpoint"}, "reply_to is not a ZMQ endpoint"),
        ({**m.to_dict(SAMPLES[0]), "decode_addr": "tcp://127.0.0.1"}, "decode_addr is not"),
        ({**m.to_dict(SAMPLES[0]), "deadline_s": float("nan")}, "deadline_s"),
        ({**m.to_dict(SAMPLES[7]), "deadline_s": 0.0}, "deadline_s"),
        ({**m.to_dict(SAMPLES[3]), "kv_addr": "tcp://h:70000"}, "kv_addr is not"),
    ],
)
def test_refusals(payload, match):
    with pytest.raises(m.MessageError, match=match):
        m.decode(msgpack.packb(payload))


def test_endpoints():
    for ok in ("tcp://127.0.0.1:5555", "tcp://node-3.example:1", "tcp://[::1]:80", "tcp://*:9",
               "ipc:///tmp/pd.sock"):
        assert m.is_endpoint(ok), ok
    for bad in ("", "garbage", "tcp://127.0.0.1", "tcp://h:0", "tcp://h:65536", "tcp://:1",
                "tcp://a b:1", "http://h:1"):
        assert not m.is_endpoint(bad), bad
    assert m.decode(m.encode(m.Pong(1, "prefill", "p0", {}))).kv_addr == ""


def test_size_limit_and_non_map():
    big = m.encode(m.PrefillRequest("r", list(range(5000)), {}, "tcp://a:1", "tcp://b:2"))
    with pytest.raises(m.MessageError, match="exceeds"):
        m.decode(big, max_bytes=1000)
    with pytest.raises(m.MessageError, match="not a map"):
        m.decode(msgpack.packb([1, 2]))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_never_crash(data):
    try:
        m.decode(data)
    except m.MessageError:
        pass


def test_token_streams_columns_round_trip_and_are_checked():
    a = m.TokenStream("a" * 32, [1, 2], num_prompt_tokens=5, num_output_tokens=4)
    b = m.TokenStream("b" * 32, [3], logprobs=[-0.5], top_logprobs=[[[3, -0.5]]], finish_reason="stop",
                      num_prompt_tokens=7, num_output_tokens=9)
    cols = dict(req_ids=[a.req_id, b.req_id], counts=[2, 1], token_ids=[1, 2, 3],
                num_prompt_tokens=[5, 7], num_output_tokens=[4, 9], ended=[[1, "stop"]],
                logprobs=[[1, [-0.5], [[[3, -0.5]]]]])
    got = m.unpack_streams(m.decode(m.encode(m.TokenStreams(**cols))))
    assert got == [a, b]
    assert m.unpack_streams(a) == [a]
    for bad in (dict(counts=[2, 2]), dict(counts=[2]), dict(req_ids=[a.req_id, 5]),
                dict(token_ids=[1, 2, "x"]), dict(num_output_tokens=[4, -1]),
                dict(ended=[[2, "stop"]]), dict(ended=[[1]]), dict(logprobs=[[1, [-0.5, -1.0], [[], []]]]),
                dict(logprobs=[[0, [-0.5], [[]]]])):
        with pytest.raises(m.MessageError, match="token_streams"):
            m.unpack_streams(m.decode(m.encode(m.TokenStreams(**{**cols, **bad}))))
    with pytest.raises(m.MessageError, match="on the event socket"):
        m.unpack_streams(m.Ping(1))
