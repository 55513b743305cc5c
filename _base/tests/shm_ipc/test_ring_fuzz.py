"""Fuzz: random bytes as records and as ring contents never crash the reader or read past a record."""

from __future__ import annotations

import itertools
import os

from hypothesis import HealthCheck, given, settings, strategies as st

from shm_ipc import records
from shm_ipc.records import FirstTokenRecord, KVRecord, RecordError, TokensRecord, decode
from shm_ipc.ring import Ring
from shm_ipc.segment import PREFIX

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_n = itertools.count()
words = st.one_of(st.integers(1, 0xFFFFFFFF), st.integers(1, 5).map(lambda f: f | 0x100),
                  st.sampled_from([1, 2, 3, 4, 5]))


def _name() -> str:
    return f"{PREFIX}fuzz_{os.getpid()}_{next(_n)}"


def _decode_or_refuse(word, body):
    try:
        return decode(word, body, max_topk=64)
    except RecordError as e:
        assert e.reason
        return e


@FUZZ
@given(st.lists(st.tuples(words, st.binary(max_size=600)), min_size=1, max_size=40))
def test_random_records_are_decoded_or_refused_within_their_bytes(items):
    with Ring.create(_name(), 8192) as prod, Ring.attach(prod.name) as cons:
        got = []
        for word, payload in items:
            prod.publish(word, payload)
            rec = cons.next_record()
            assert rec is not None and rec[0] == word and bytes(rec[1]) == payload
            view = rec[1]
            result = _decode_or_refuse(word, view)
            # decoding the view equals decoding a private copy: nothing outside the record is read
            again = _decode_or_refuse(word, payload)
            if isinstance(result, KVRecord):
                assert result.payload.nbytes <= len(payload)
                assert bytes(result.payload) == bytes(again.payload)
            elif isinstance(result, RecordError):
                assert type(again) is RecordError and again.reason == result.reason
            else:
                assert result == again
            got.append(result)
            cons.release()
        assert cons.next_record() is None and len(got) == len(items)


@FUZZ
@given(st.binary(min_size=1, max_size=4096), st.integers(0, 64), st.integers(1, 60))
def test_scribbled_ring_never_reads_past_the_published_bytes(junk, start, num_records):
    with Ring.create(_name(), 4096) as prod, Ring.attach(prod.name) as cons:
        for i in range(num_records):
            prod.publish(1 + i % 5, bytes([i]) * (i * 7 % 300))
            if prod.write_pos - cons.read_pos > 3000:
                while cons.next_record() is not None:
                    pass
                cons.release()
        end = start * 64 + len(junk)
        prod._data[start * 64:min(end, 4096)] = junk[:4096 - start * 64]  # a buggy producer
        limit = prod.write_pos
        while True:
            before = cons._cursor
            rec = cons.next_record(limit)
            assert cons._cursor <= limit
            if rec is None:
                break
            word, view = rec
            assert view.nbytes + 8 <= cons._cursor - before  # the view lies inside what it consumed
            _decode_or_refuse(word, view)
        cons.release()
        assert cons.read_pos == limit  # resynchronised at the last published position


@FUZZ
@given(st.data())
def test_mutated_valid_records_are_decoded_or_refused(data):
    k = data.draw(st.integers(0, 5))
    rec = data.draw(st.sampled_from([
        FirstTokenRecord("req-1", 7, -0.5, 2, [(i, -float(i)) for i in range(k)]),
        TokensRecord("req-2", list(range(k + 1)), [-1.0] * (k + 1), [1] * (k + 1),
                     [[(3, -3.0)] * k for _ in range(k + 1)]),
        records.AbortRecord("req-3", "client went away")]))
    word, body = records.encode(rec)
    assert decode(word, body) == rec  # the values chosen are exact in float32
    body = bytearray(body)
    for _ in range(data.draw(st.integers(1, 4))):
        if data.draw(st.booleans()) and body:
            body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
        else:
            body = body[:data.draw(st.integers(0, len(body)))]
    word ^= data.draw(st.sampled_from([0, 0, 1 << 8, 1 << 24, 0xFF]))
    _decode_or_refuse(word, bytes(body))
