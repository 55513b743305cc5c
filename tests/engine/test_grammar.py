"""Structured output (`pd.engine.grammar`, the sampler's mask): specs that do not compile are
refused by name, a choice's strings are matched exactly, an MTP step's masks along its drafts
are the masks of walking them, the sampler masks exactly the tokens a grammar refuses, and
greedy decoding under a grammar equals the greedy argmax of transformers' logits masked by a
matcher of its own, with MTP and with the overlap loop too. `PD_TEST_DEVICE=cuda` runs the
engines on the GPU."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pd.engine.grammar import GrammarError, Grammars, fill_masks
from pd.engine.grammar_masks import apply_grammar
from pd.engine.sampler import SamplingRow
from pd.wire.sampling_params import SamplingParams as SP

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
SPECS = [("json", json.dumps(SCHEMA)), ("json_object", ""), ("regex", r"[a-c]{2,5}-[0-9]+"),
         ("choice", json.dumps(["red", "green", "blue"])),
         ("grammar", 'root ::= "x" ("ab" | "c")* "."'), ("json_compact", json.dumps(SCHEMA))]
DEVICE = os.environ.get("PD_TEST_DEVICE", "cpu")  # cuda: the engine on the GPU, float32


@pytest.fixture(scope="module")
def grammars(tiny_model_dir):
    from pd.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    return Grammars(tiny_model_dir, config["vocab_size"], tuple(tok.eos_token_ids))


def allowed_ids(bits: torch.Tensor, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(bits[t >> 5]) >> (t & 31)) & 1}


@pytest.mark.parametrize("spec,words", [
    (("json", '{"type": 12}'), "json"), (("regex", "(ab"), "regex"),
    (("grammar", "root ::= undefined_rule"), "grammar"), (("choice", "[]"), "choice"),
    (("choice", '"red"'), "choice")])
def test_specs_that_do_not_compile_are_refused_by_kind(grammars, spec, words):
    with pytest.raises(GrammarError, match=words):
        grammars.matcher(spec)
    assert isinstance(GrammarError("x"), ValueError)  # the nodes refuse ValueErrors


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
    """`step_masks` and `fill_masks`, on one xgrammar thread or several: each state walks its
    token and fills its row as it would alone; `accept` then takes the walk's result without
    walking again; a refused walk ends the request as a refused accept does; accepting another token
    than the one walked undoes the walk first."""
    from pd.engine import grammar
    from pd.text.tokenizer import Tokenizer

    import xgrammar

    monkeypatch.setattr(grammar, "_batch", lambda: xgrammar.BatchGrammarMatcher(workers))
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


def test_sampler_masks_exactly_the_refused_tokens():
    vocab = 70  # not a multiple of 32: the last word is partial
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=gen)
    bits = torch.randint(-2**31, 2**31 - 1, (2, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    for width in (3, 2):  # 2 words: tokens 64.. are past the mask, not allowed
        rows = [SamplingRow(SP(), [], [], 0, allowed=bits[0, :width]),
                SamplingRow(SP(), [], [], 0),
                SamplingRow(SP(), [], [], 0, allowed=bits[1, :width])]
        x = logits.clone()
        apply_grammar(x, rows)
        for i, b in ((0, 0), (2, 1)):
            ok = allowed_ids(bits[b, :width], min(vocab, 32 * width))
            for t in range(vocab):
                assert x[i, t] == (logits[i, t] if t in ok else -torch.inf), (width, i, t)
        assert torch.equal(x[1], logits[1])
    # rows of one buffer (as the runner fills them) go as one block, the same result
    block = bits.clone()
    rows = [SamplingRow(SP(), [], [], 0, allowed=block[j]) for j in range(2)]
    x, y = logits[:2].clone(), logits[:2].clone()
    apply_grammar(x, rows)
    apply_grammar(y, [SamplingRow(SP(), [], [], 0, allowed=bits[j].clone()) for j in range(2)])
    assert torch.equal(x, y) and (x == -torch.inf).any()


def test_scattered_masks_of_one_buffer_travel_as_that_buffer():
    """Some rows masked (the others' grammars checked after sampling, or none), their masks
    rows of one buffer: on CUDA the whole buffer goes, the other rows allowing every token
    (`_whole_buffer`), with the result of the masks stacked (the CPU's way)."""
    from pd.engine.grammar_masks import _whole_buffer

    vocab, gen = 70, torch.Generator().manual_seed(1)
    logits = torch.randn(4, vocab, generator=gen)
    buf = torch.randint(-2**31, 2**31 - 1, (8, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    want = buf.clone()
    whole = _whole_buffer([buf[1], buf[3]], [1, 3], 4)
    assert whole.data_ptr() == buf.data_ptr() and whole.shape == (4, 3)
    assert torch.equal(whole[[1, 3]], want[[1, 3]]) and (whole[[0, 2]] == -1).all()
    assert torch.equal(buf[4:], want[4:])  # rows past the step's are not touched
    assert _whole_buffer([buf[1], buf[3]], [2, 3], 4) is None  # not rows 2 and 3 of a buffer
    assert _whole_buffer([buf[6]], [0], 4) is None  # rows 6..9 of an 8-row buffer

    def rows(masks):
        return [SamplingRow(SP(), [], [], 0, allowed=masks[j] if j % 2 else None)
                for j in range(4)]

    x, y = logits.to(DEVICE), logits.clone()
    apply_grammar(x, rows(want.clone()))  # rows 1 and 3 of one buffer
    apply_grammar(y, rows({1: want[1].clone(), 3: want[3].clone()}))
    assert torch.equal(x.cpu(), y) and (y == -torch.inf).any()


def masked_greedy_reference(model_dir, grammars, prompt, spec, max_tokens, eos) -> list[int]:
    """transformers' logits of the whole sequence, masked by a fresh matcher, argmax."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = grammars.matcher(spec)
    vocab = model.config.vocab_size
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ok = torch.zeros(vocab, dtype=torch.bool)
            ok[sorted(allowed_ids(state.mask(), vocab))] = True
            t = int(logits.masked_fill(~ok, -torch.inf).argmax())
            out.append(t)
            ids.append(t)
            state.accept(t)
            if t in eos or state.terminated:
                break
    return out


@pytest.mark.parametrize("mtp", [0, 2])
def test_greedy_under_a_grammar_equals_masked_reference(tiny_model_dir, grammars, mtp):
    from pd.engine.llm import LLM

    llm = LLM(tiny_model_dir, num_blocks=256, num_speculative_tokens=mtp, device=DEVICE,
              dtype="float32")
    prompts = [[3 + (11 * i + j) % 300 for i in range(9)] for j in range(len(SPECS))]
    params = [SP(max_tokens=24, temperature=0.0, structured_output=s) for s in SPECS]
    outs = llm.generate(prompts, params)
    for out, prompt, spec in zip(outs, prompts, SPECS):
        want = masked_greedy_reference(tiny_model_dir, grammars, prompt, spec, 24,
                                       set(llm.engine.eos_token_ids))
        assert out.token_ids == want, spec
    choice = outs[3].text
    assert choice in ("red", "green", "blue") and outs[3].finish_reason == "stop"


def test_seeded_sampling_under_a_grammar_is_valid_and_equal_with_overlap(tiny_model_dir, grammars):
    """Overlap on: a step's forward is launched before the previous step's tokens reach the
    matchers, its sampler after (a deferred sampling)."""
    from pd.engine.llm import LLM

    params = [SP(max_tokens=20, temperature=1.0, seed=s, structured_output=spec)
              for s, spec in enumerate(SPECS)]
    prompts = [[5, 6, 7, 8 + j] for j in range(len(SPECS))]
    llms = [LLM(tiny_model_dir, num_blocks=256, overlap=o, device=DEVICE) for o in (False, True)]
    runs = [llm.generate(prompts, params) for llm in llms]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    # with overlap each step's forward went ahead, its sampler after the previous step's tokens
    assert llms[1].engine.loop.num_deferred > 0
    for out, spec in zip(runs[0], SPECS):
        state = grammars.matcher(spec)
        assert all(state.accept(t) for t in out.token_ids), spec


def test_embedded_model_writes_json_of_the_schema_with_and_without_mtp():
    """The embedded model's MTP layer is trained: its drafts are accepted under the grammar."""
    from pd.engine.llm import LLM

    texts = {}
    for k in (0, 2):
        llm = LLM(num_speculative_tokens=k)
        texts[k] = []
        for prompt in ("# a JSON object:\n", "def fibonacci(n):"):
            out = llm.generate(prompt, SP(max_tokens=80, temperature=0.0,
                                          structured_output=("json", json.dumps(SCHEMA))))[0]
            value = json.loads(out.text)
            assert out.finish_reason == "stop" and set(value) == {"name", "n"}
            assert isinstance(value["name"], str) and len(value["name"]) <= 6
            assert isinstance(value["n"], int)
            texts[k].append(out.token_ids)
        out = llm.generate("x = ", SP(max_tokens=20, temperature=0.0,
                                      structured_output=("json_object", "")))[0]
        assert out.text.startswith("{")  # an object (this small model does not close it)
    assert texts[0] == texts[2]
    assert llm.engine.spec.stats.num_accepted_tokens > 0
    with pytest.raises(GrammarError):
        llm.generate("x", SP(structured_output=("regex", "(")))
    assert not llm.engine.has_unfinished()


def test_grammars_survive_preemption_and_aborts_with_overlap(tiny_model_dir):
    """A KV cache too small for the batch preempts requests (their tokens, and so their
    grammars' states, are kept; their KV is recomputed) and one request is aborted mid-way:
    with the overlap loop the others' tokens equal each request run alone."""
    from pd.engine.llm import LLM

    specs = [s for s in SPECS if s[0] != "choice"]
    prompts = [[3 + (5 * i + j) % 400 for i in range(40)] for j in range(6)]
    params = [SP(max_tokens=40, temperature=0.0, structured_output=specs[j % len(specs)])
              for j in range(6)]
    # NOTE: on the CPU whatever PD_TEST_DEVICE says: a GPU's products may round differently
    # at another batch size, and this is about the loop
    alone = [LLM(tiny_model_dir, num_blocks=64).generate([p], [sp])[0].token_ids
             for p, sp in zip(prompts, params)]
    llm = LLM(tiny_model_dir, num_blocks=16, overlap=True)
    engine = llm.engine
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    steps, aborted = 0, None
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 12:
            aborted = next(i for i, r in enumerate(reqs) if not r.is_finished)
            engine.abort(reqs[aborted].req_id)
    assert engine.scheduler.num_preemptions > 0
    assert reqs[aborted].finish_reason.value == "abort"
    for i, req in enumerate(reqs):
        if i != aborted:
            assert req.output_token_ids == alone[i], i


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
