"""A request's grammar state (`pd.engine.grammar.GrammarState`) and a step's grammar work
(`step_masks`, `fill_masks`): a choice's strings are matched exactly, an expanded regex masks as
the regex does, an MTP step's masks along its drafts are the masks of walking them, appended
tokens walk the grammar in order, a step's walks and masks at once (on one thread or several)
equal each alone, the masks get the threads their recent cost pays for, and `terminated`
follows the matcher through walks and rollbacks."""

from __future__ import annotations

import json

import pytest
import torch

from pd.engine.grammar import fill_masks
from pd.wire.sampling_params import SamplingParams as SP
from tests.engine.test_grammar import SCHEMA, SPECS, allowed_ids


def test_a_choice_matches_exactly_its_strings(grammars, tiny_model_dir):
    from pd.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    choices = ['say "hi"', "back\\slash", "two\nlines", "ünï"]
    for c in choices:
        state = grammars.matcher(("choice", json.dumps(choices)))
        assert all(state.accept(t) for t in tok.encode(c, add_special_tokens=False)), c
        assert state.accept(tok.eos_token_ids[0]) and state.terminated
    state = grammars.matcher(("choice", json.dumps(choices)))
    assert all(state.accept(t) for t in tok.encode("say", add_special_tokens=False))
    assert not state.terminated
    assert not state.accept(tok.eos_token_ids[0])  # "say" is not one of them
    assert state.terminated  # a refused token ends the request


def test_an_expanded_regex_gives_the_masks_of_the_regex(grammars, tiny_model_dir):
    """The matcher of `expand_plus(regex)` (what `Grammars` compiles) allows exactly the tokens
    the regex's own matcher allows, at every step of a walk."""
    import xgrammar

    from pd.engine.grammar import GrammarState

    regex = "[a-z0-9 ,.()=+]+"
    own = GrammarState(xgrammar.GrammarMatcher(grammars._compiler.compile_regex(regex)),
                       grammars.vocab_size)
    ours = grammars.matcher(("regex", regex))
    g = torch.Generator().manual_seed(0)
    for step in range(24):
        mask = own.mask()
        assert torch.equal(mask, ours.mask()), step
        ids = sorted(allowed_ids(mask, grammars.vocab_size))
        token = ids[int(torch.randint(len(ids), (1,), generator=g))]
        assert own.accept(token) and ours.accept(token)
        if own.terminated:
            break
    assert ours.terminated == own.terminated


def test_masks_along_drafts_equal_walking_them(grammars, tiny_model_dir):
    from pd.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    spec = ("json", json.dumps(SCHEMA))
    text = '{"name": "ab", "n": 12}'
    ids = tok.encode(text, add_special_tokens=False)
    state = grammars.matcher(spec)
    assert state.accept(ids[0])
    before = state.mask()
    drafts = ids[1:4] + [tok.encode("]", add_special_tokens=False)[0]]  # the last one refused
    masks = state.masks_along(drafts, 6)
    assert len(masks) == 6 and torch.equal(state.mask(), before)  # rolled back
    walker = grammars.matcher(spec)
    walker.accept(ids[0])
    for j in range(4):
        assert torch.equal(masks[j], walker.mask()), j
        if j < 3:
            assert walker.accept(drafts[j])
    assert torch.equal(masks[4], masks[3]) and torch.equal(masks[5], masks[3])


def test_appended_tokens_walk_the_grammar_in_order(grammars, tiny_model_dir):
    from pd.engine.request import Req
    from pd.text.tokenizer import Tokenizer

    ids = Tokenizer.from_dir(tiny_model_dir).encode('{"name": "ab", "n": 12}',
                                                    add_special_tokens=False)
    spec = ("json", json.dumps(SCHEMA))
    walker = grammars.matcher(spec)
    req = Req("r", [5, 6], SP(structured_output=spec))
    req.grammar = grammars.matcher(spec)
    for t in ids[:5]:
        assert walker.accept(t)
        req.append_token(t)
    assert torch.equal(req.grammar.mask(), walker.mask())
    assert not req.grammar.terminated and req.check_stop(1000) is None


@pytest.mark.parametrize("workers", [1, 3])
def test_a_steps_masks_and_walks_at_once_equal_each_alone(grammars, tiny_model_dir, workers,
                                                          monkeypatch):
    """`step_masks` and `fill_masks`, their masks on one thread or several: each state walks
    its token and fills its row as it would alone; `accept` then takes the walk's result without
    walking again; a refused walk ends the request as a refused accept does; accepting another token
    than the one walked undoes the walk first."""
    from pd.engine import grammar
    from pd.text.tokenizer import Tokenizer

    # the masks in as many parts as there may be threads (their cost would decide)
    monkeypatch.setattr(grammar._FILLER, "per_mask", 1.0 if workers > 1 else 0.0)
    tok = Tokenizer.from_dir(tiny_model_dir)
    eos = tok.eos_token_ids[0]
    states = [grammars.matcher(spec) for spec in SPECS] + [None, grammars.matcher(SPECS[3])]
    done = grammars.matcher(("grammar", 'root ::= ""'))
    assert done.accept(eos) and done.terminated
    states.append(done)
    out = torch.full((len(states), states[0].num_words), 7, dtype=torch.int32)
    filled = fill_masks(states, out)
    assert filled[len(SPECS)] is None
    for got, st in zip(filled, states):
        if st is not None:
            assert torch.equal(got, st.mask())
    assert (filled[-1] == -1).all()  # terminated: everything (the request ends on its own)

    spec = ("json", json.dumps(SCHEMA))
    ids = tok.encode('{"name": "ab", "n": 12}', add_special_tokens=False)
    walkers = [grammars.matcher(spec) for _ in range(4)]
    alone = [grammars.matcher(spec) for _ in range(4)]
    refused = tok.encode("]", add_special_tokens=False)[0]
    for step, t in enumerate(ids[:4]):
        tokens = [t, t, refused if step == 2 else t, None]  # state 2 is refused at step 2
        out = torch.zeros((4, walkers[0].num_words), dtype=torch.int32)
        grammar.step_masks([(w, tokens[j], 3 - j) for j, w in enumerate(walkers)], out)
        for j, (w, a) in enumerate(zip(walkers, alone)):
            if tokens[j] is not None:
                assert w.accept(tokens[j]) == a.accept(tokens[j]), (step, j)
            assert w.terminated == a.terminated and torch.equal(out[3 - j], a.mask()), (step, j)
    assert walkers[2].terminated and not walkers[0].terminated
    # another token than the one walked: the walk is undone, the state follows the accept
    w, a = grammars.matcher(spec), grammars.matcher(spec)
    w.walk(refused)
    assert w.terminated  # the refused walk, until it is taken or undone
    assert w.accept(ids[0]) and a.accept(ids[0]) and not w.terminated
    w.walk(ids[1])
    assert w.accept(ids[1]) and a.accept(ids[1])
    w.walk(ids[3])
    assert w.accept(ids[2]) and a.accept(ids[2])
    assert torch.equal(w.mask(), a.mask())


def test_a_steps_masks_get_the_threads_their_recent_cost_pays_for(grammars, tiny_model_dir):
    """Cheap masks (a regex's few us) are filled on the calling thread alone; costly ones (a
    JSON string's ~100 us) in parts on up to `WORKERS` threads, each timing its own part."""
    from pd.engine.grammar import WORK_PER_THREAD, WORKERS, _Filler

    filler = _Filler()
    assert filler.parts(32) == 1  # nothing measured yet
    filler.add(32 * 3e-6, 32)
    assert filler.parts(32) == 1
    for _ in range(8):
        filler.add(32 * 100e-6, 32)
    assert 32 * filler.per_mask / WORK_PER_THREAD >= 8  # ~16 threads' worth: all it may use
    assert filler.parts(32) == WORKERS and filler.parts(1) == 1
    # filled in parts, the masks equal each state's own
    states = [grammars.matcher(("json", json.dumps(SCHEMA))) for _ in range(5)]
    out = torch.zeros((6, states[0].num_words), dtype=torch.int32)
    filler.fill([st._m for st in states], out, [5, 3, 1, 0, 2])
    for st, row in zip(states, [5, 3, 1, 0, 2]):
        assert torch.equal(out[row], st.mask())
    assert not out[4].any()


def test_masks_started_alone_go_to_a_thread_unless_cheaper_than_the_handoff(grammars):
    """`_Filler.start` fills masks cheaper all together than a hand-off (`HANDOFF`) at once on
    the calling thread, and more (one part's worth or several) on the pool's threads, the
    caller going on until it joins; either way the masks equal each state's own."""
    import threading

    from pd.engine import grammar
    from pd.engine.grammar import HANDOFF, WORK_PER_THREAD, _Filler

    if grammar.WORKERS == 1:
        pytest.skip("one CPU: every mask is filled at once")
    states = [grammars.matcher(("json", json.dumps(SCHEMA))) for _ in range(4)]
    filler = _Filler()
    on = []
    fill = filler._fill
    filler._fill = lambda *a: on.append(threading.current_thread()) or fill(*a)
    # at once; one part's worth, on one thread; several parts' worth
    for per_mask, here, parts in ((HANDOFF / 8, True, 1), (HANDOFF / 2, False, 1),
                                  (WORK_PER_THREAD, False, 4)):
        filler.per_mask, on[:] = per_mask, []
        assert filler.parts(len(states)) == min(parts, grammar.WORKERS)
        out = torch.zeros((4, states[0].num_words), dtype=torch.int32)
        join = filler.start([st._m for st in states], out, [3, 2, 1, 0])
        assert (join is grammar._nothing) == here
        join()
        assert on and all((t is threading.main_thread()) == here for t in on)
        for st, row in zip(states, [3, 2, 1, 0]):
            assert torch.equal(out[row], st.mask())


def test_terminated_follows_the_matcher_through_walks_and_rollbacks(grammars, tiny_model_dir):
    """`GrammarState.terminated`, kept rather than asked of xgrammar each time, is the
    matcher's own `is_terminated` after each way the state moves: walks (one or a step's
    batch), accepts of walked and unwalked tokens, the stop token, the drafts' masks (walked
    and rolled back), and an accept of another token than the one walked (rolled back)."""
    from pd.engine.grammar import step_masks
    from pd.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    eos = tok.eos_token_ids[0]
    ids = tok.encode('{"name": "ab", "n": 12}', add_special_tokens=False)
    spec = ("json", json.dumps(SCHEMA))

    def same(state):
        assert state.terminated == state._m.is_terminated()
        return state.terminated

    state, other = grammars.matcher(spec), grammars.matcher(spec)
    for t in ids:
        step_masks([(state, t, None), (other, t, None)], None)  # one batch of walks
        assert not same(state) and not same(other)
        assert state.accept(t) and other.accept(t)
    state.masks_along([eos], 2)  # walks the stop token, rolls it back
    assert not same(state)
    assert other.accept(eos) and same(other)  # not walked first
    state.walk(eos)
    assert same(state)
    # another token than the one walked: the walk is rolled back, then that token refused
    assert not state.accept(ids[0])
    assert state.terminated and state.failed and not state._m.is_terminated()
