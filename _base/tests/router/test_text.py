"""Detokenizer, stop strings and Choice on the byte-level tiny tokenizer (no server)."""

from __future__ import annotations

import random

import pytest

from router.backend import TokenEvent
from router.choice import Choice
from pd.text.detokenizer import IncrementalDetokenizer
from router.stop import StopStrings

SAMPLES = ["plain ascii text, with spaces", "naïve café → 東京 🙂🙃 done", "€€€ 🧪x 한국어"]


@pytest.mark.parametrize("text", SAMPLES)
def test_detokenizer_never_emits_broken_utf8(tokenizer, text):
    ids = tokenizer.encode(text)
    rng = random.Random(0)
    for _ in range(5):
        detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt: "))
        out, i = [], 0
        while i < len(ids):
            k = rng.randint(1, 3)
            out.append(detok.push(ids[i:i + k]))
            i += k
        out.append(detok.flush())
        assert all("\ufffd" not in o for o in out)
        assert "".join(out) == text


def test_detokenizer_flushes_an_incomplete_tail(tokenizer):
    ids = tokenizer.encode("ok 🙂")
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids[:-1]) == ""  # the emoji's last byte is missing: all held
    tail = detok.flush()  # the stream ended: what is there, as is
    assert tail.startswith("ok ") and tail.endswith("\ufffd")


@pytest.mark.parametrize("chunks,stops,shown,hit", [
    (["hello wor", "ld and more"], ["world"], "hello ", "world"),
    (["a", "b", "c", "d"], ["bc", "cd"], "a", "bc"),
    (["xx#", "#", "#y"], ["###"], "xx", "###"),
    (["no stop ", "here #", "#"], ["###"], "no stop here ##", None),
    (["STOP at start"], ["STOP"], "", "STOP"),
])
def test_stop_strings(chunks, stops, shown, hit):
    s = StopStrings(stops)
    out = "".join(s.push(c) for c in chunks) + s.flush()
    assert (out, s.hit) == (shown, hit)


def test_stop_holds_back_only_possible_prefixes():
    s = StopStrings(["<end>"])
    assert s.push("abc<e") == "abc"
    assert s.push("x") == "<ex"
    assert s.push("<") == ""
    assert s.push("<en") == "<"


def test_choice_stop_string_over_tokens_and_eos(tokenizer):
    ids = tokenizer.encode("one two three four")
    c = Choice(0, tokenizer, [], ["three"], want_logprobs=False)
    deltas = []
    for t in ids:
        deltas.append(c.process(TokenEvent([t])))
        if c.done:
            break
    assert "".join(d.text for d in deltas) == "one two "
    assert deltas[-1].finish_reason == "stop" and c.stop_reason == "three"
    with pytest.raises(RuntimeError):
        c.process(TokenEvent([1]))
    c = Choice(1, tokenizer, [], [], want_logprobs=True)
    eos = tokenizer.eos_token_id
    d = c.process(TokenEvent(ids + [eos], [-0.5] * (len(ids) + 1),
                             [[(eos, -0.5)]] * (len(ids) + 1), finish_reason="stop"))
    assert d.text == "one two three four" and d.finish_reason == "stop"
    assert len(d.logprobs) == len(ids) and c.num_generated == len(ids) + 1
    assert [e.text_offset for e in d.logprobs] == [
        len(tokenizer.decode(ids[:i])) for i in range(len(ids))]
