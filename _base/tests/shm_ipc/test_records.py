"""Record encodings: round trips, exactly top-k columns, and refusals of malformed bodies."""

from __future__ import annotations

import pytest

from shm_ipc import header
from shm_ipc.header import Flag
from shm_ipc.records import (AbortRecord, FirstTokenRecord, KV_DATA_OFFSET, RecordError,
                             TokensRecord, decode, encode, kv_meta)


@pytest.mark.parametrize("k", [0, 1, 20])
def test_first_token_round_trip_with_exactly_k_pairs(k):
    rec = FirstTokenRecord("0123456789abcdef0123456789abcdef", 151643, -0.125, 3,
                           [(1000 + i, -0.5 * i) for i in range(k)])
    word, body = encode(rec)
    assert header.unpack(word) == (Flag.FIRST_TOKEN, k)
    assert len(body) == 1 + 32 + 12 + 8 * k  # no padding to a maximum top-k
    assert decode(word, body) == rec


def test_first_token_with_wrong_length_for_its_count_is_refused():
    word, body = encode(FirstTokenRecord("r", 1, -1.0, 1, [(2, -2.0), (3, -3.0)]))
    with pytest.raises(RecordError, match="expected"):
        decode(header.pack(Flag.FIRST_TOKEN, 3), body)
    with pytest.raises(RecordError):
        decode(word, body[:-1])


@pytest.mark.parametrize("flag", [Flag.TARGET_TOKENS, Flag.DRAFT_TOKENS])
def test_tokens_round_trip(flag):
    with_lp = TokensRecord("r", [5, 6, 7], [-0.5, -1.5, -2.5], [1, 2, 3],
                           [[(9, -0.25), (8, -4.0)]] * 3, flag=flag)
    ids_only = TokensRecord("r", [5, 6], flag=flag)
    for rec in (with_lp, ids_only):
        word, body = encode(rec)
        assert decode(word, body) == rec
    assert header.unpack(encode(with_lp)[0]) == (flag, 2)
    assert header.unpack(encode(ids_only)[0]) == (flag, 0)


def test_tokens_with_ragged_top_are_refused_at_encode():
    with pytest.raises(ValueError, match="same top-k"):
        encode(TokensRecord("r", [1, 2], [-1.0, -2.0], [1, 1], [[(1, -1.0)], []]))


def test_abort_round_trip_and_req_id_limits():
    rec = AbortRecord("r" * 64, "client disconnected")
    assert decode(*encode(rec)) == rec
    with pytest.raises(ValueError, match="1..64"):
        encode(AbortRecord("r" * 65))
    with pytest.raises(ValueError, match="1..64"):
        encode(AbortRecord(""))


def test_kv_meta_and_payload():
    meta = kv_meta("req", 2, 4, 8, 3, "bfloat16")
    assert len(meta) == KV_DATA_OFFSET
    raw = bytes(range(2 * 2 * 3 * 4))
    rec = decode(header.pack(Flag.KV), meta + raw)
    assert (rec.req_id, rec.layer_start, rec.layer_end, rec.block_start, rec.num_blocks,
            rec.dtype, bytes(rec.payload)) == ("req", 2, 4, 8, 3, "bfloat16", raw)
    split = decode(header.pack(Flag.KV), meta, raw=raw)  # ZMQ: meta and raw in separate frames
    assert bytes(split.payload) == raw


@pytest.mark.parametrize("word,body,reason", [
    (header.pack(Flag.KV, 1), kv_meta("r", 0, 1, 0, 1, "float32") + b"\0" * 8, "malformed"),
    (header.pack(Flag.KV), kv_meta("r", 1, 1, 0, 1, "float32") + b"\0" * 8, "malformed"),
    (header.pack(Flag.KV), kv_meta("r", 0, 1, 0, 1, "float32") + b"\0" * 3, "length"),
    (header.pack(Flag.KV), b"\x01r", "length"),
    (header.pack(Flag.PAD), b"", "pad"),
    (header.pack(Flag.ABORT), b"\x00", "length"),
    (header.pack(Flag.ABORT), b"\x41r", "length"),
    (header.pack(Flag.ABORT), b"\x02\xff\xfe", "malformed"),
    (header.pack(Flag.TARGET_TOKENS, 2), encode(TokensRecord("r", [1]))[1], "malformed"),
    (0x01000002, b"", "reserved"),
])
def test_malformed_bodies_are_refused(word, body, reason):
    with pytest.raises(RecordError) as e:
        decode(word, body)
    assert e.value.reason == reason
