"""The header word: round trips, refusals when packing and unpacking, and the refusal counter."""

from __future__ import annotations

import pytest

from shm_ipc import header
from shm_ipc.header import Flag, HeaderError, pack, unpack
from shm_ipc.metrics import refused_count


def test_flag_values_are_fixed():
    assert [int(f) for f in Flag] == [0, 1, 2, 3, 4, 5]
    assert (header.PAD, header.KV, header.FIRST_TOKEN, header.TARGET_TOKENS, header.DRAFT_TOKENS,
            header.ABORT) == (0, 1, 2, 3, 4, 5)


@pytest.mark.parametrize("topk", [0, 1, 20, 65535])
def test_every_flag_and_count_round_trips(topk):
    for flag in range(256):
        word = pack(flag, topk)
        assert word == flag | topk << 8 and word >> 24 == 0
        assert header.from_bytes(header.to_bytes(word)) == word
        if flag in iter(Flag):
            assert unpack(word, max_topk=65535) == (flag, topk)
        else:
            with pytest.raises(ValueError, match="unknown flag"):
                unpack(word, max_topk=65535)


@pytest.mark.parametrize("flag,topk", [(256, 0), (-1, 0), (1, 65536), (1, -1), (1.0, 0)])
def test_pack_refuses_out_of_range(flag, topk):
    with pytest.raises(ValueError):
        pack(flag, topk)


@pytest.mark.parametrize("word,reason", [
    (0x01000001, "reserved"), (0xFF000002, "reserved"), (0x00000006, "unknown_flag"),
    (0x000000FF, "unknown_flag"), (pack(2, 21), "topk"), (1 << 32, "word")])
def test_unpack_refuses(word, reason):
    with pytest.raises(HeaderError) as e:
        unpack(word, max_topk=20)
    assert e.value.reason == reason


def test_count_at_the_configured_maximum_is_accepted():
    assert unpack(pack(Flag.FIRST_TOKEN, 20), max_topk=20) == (Flag.FIRST_TOKEN, 20)


def test_reader_counts_refusals_and_carries_on(seg_name):
    from shm_ipc.records import FirstTokenRecord, RecordError, decode, encode
    from shm_ipc.metrics import refuse
    from shm_ipc.ring import Ring
    good_word, good_body = encode(FirstTokenRecord("r", 1, -0.1, 1, [(2, -0.2)]))
    before = {r: refused_count(r) for r in ("reserved", "unknown_flag", "topk")}
    with Ring.create(seg_name, 1 << 14) as prod, Ring.attach(seg_name) as cons:
        for word in (good_word | 1 << 24, 0x07, pack(Flag.FIRST_TOKEN, 30), good_word):
            prod.publish(word, good_body)
        decoded = []
        while (rec := cons.next_record()) is not None:
            try:
                decoded.append(decode(rec[0], rec[1], max_topk=20))
            except RecordError as e:
                refuse(e.reason, str(e))
    assert decoded == [FirstTokenRecord("r", 1, pytest.approx(-0.1), 1, [(2, pytest.approx(-0.2))])]
    for r in before:
        assert refused_count(r) == before[r] + 1
