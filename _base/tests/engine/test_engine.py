"""Engine behaviour on a tiny model: batch invariance, chunked prefill, preemption by
recompute, seeded sampling, stop conditions, and clear errors for bad input."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pd.engine.llm import LLM
from pd.engine.request import Req
from pd.wire.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, num_blocks=256)


def test_batch_invariance(llm):
    batch = prompts(16, seed=1)
    together = llm.generate(batch, GREEDY)
    for i in (0, 7, 15):
        alone = llm.generate([batch[i]], GREEDY)[0]
        assert alone.token_ids == together[i].token_ids
    assert len({tuple(o.token_ids) for o in together}) > 1


def test_chunked_prefill_matches_whole(tiny_model_dir, llm):
    long_prompts = prompts(4, seed=2) + [list(range(1, 200))]
    ref = llm.generate(long_prompts, GREEDY)
    chunked = LLM(tiny_model_dir, num_blocks=256, max_num_batched_tokens=32)
    out = chunked.generate(long_prompts, GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]


def test_preemption_gives_same_tokens(tiny_model_dir, llm):
    batch = prompts(12, seed=3)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    ref = llm.generate(batch, params)
    # 12 requests of up to 80 tokens need up to 60 blocks of 16; give them 12.
    small = LLM(tiny_model_dir, num_blocks=12)
    out = small.generate(batch, params)
    assert small.engine.scheduler.num_preemptions > 0
    for o, r in zip(out, ref):
        assert o.token_ids == r.token_ids
        assert o.logprobs == pytest.approx(r.logprobs, abs=1e-5)
    small.engine.allocator.check_integrity()
    assert small.engine.allocator.num_free == 12


def test_long_prompt_chunks_and_recomputes_match_whole(tiny_model_dir, llm):
    """Chunks of over 64 prompt tokens are sliced from the request's prompt array; a recompute
    after a preemption spans prompt and output (the token list): the tokens stay the same."""
    rng = random.Random(9)
    batch = [[rng.randrange(512) for _ in range(rng.randint(150, 300))] for _ in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = [llm.generate([p], params)[0].token_ids for p in batch]
    small = LLM(tiny_model_dir, num_blocks=40, max_num_batched_tokens=96)
    out = small.generate(batch, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in out] == ref


def test_validation_hands_its_array_to_the_request(llm):
    engine = llm.engine
    ids = engine.validate_prompt([5, 6, 7])
    assert ids.dtype == np.int64 and ids.tolist() == [5, 6, 7]
    req = engine.add_request([5, 6, 7], GREEDY, validated=ids)
    assert req.prompt_array() is ids
    engine.abort(req.req_id)
    assert Req("r", [8, 9], GREEDY).prompt_array().tolist() == [8, 9]


def test_seeded_sampling_is_batch_independent(llm):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    batch = prompts(6, seed=4)
    together = llm.generate(batch, params)
    alone = llm.generate([batch[3]], params)[0]
    assert alone.token_ids == together[3].token_ids
    other_seed = llm.generate([batch[3]], SamplingParams(max_tokens=16, temperature=0.9, seed=99))[0]
    assert other_seed.token_ids != alone.token_ids


def test_stop_conditions(llm):
    prompt = prompts(1, seed=5)[0]
    free = llm.generate([prompt], GREEDY)[0].token_ids
    stop_id = free[5]
    first = free.index(stop_id)
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                stop_token_ids=[stop_id]))[0]
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == free[:3] and out.finish_reason == "length"


def test_eos_stops_unless_ignored(tiny_model_dir, llm):
    prompt = prompts(1, seed=6)[0]
    free = llm.generate([prompt], GREEDY)[0].token_ids
    eos = free[4]
    first = free.index(eos)
    eos_llm = LLM(tiny_model_dir, num_blocks=64)
    eos_llm.engine.eos_token_ids = (eos,)
    out = eos_llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"
    out = eos_llm.generate([prompt], GREEDY)[0]
    assert out.token_ids == free


@pytest.mark.parametrize(
    "prompt, kwargs, message",
    [
        ([], {}, "empty prompt"),
        ([1] * 600, {}, "does not fit the context"),
        ([1, 2, 512], {}, "outside the vocabulary"),
        ([1, -3], {}, "outside the vocabulary"),
        ([1, 2], {"logprobs": 21}, "logprobs"),
        ([1, 2], {"temperature": -1.0}, "temperature"),
        ([1, 2], {"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_input_is_a_clear_error(llm, prompt, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], SamplingParams(**kwargs))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("k", [0, 2])
def test_logit_bias_forces_a_token_with_and_without_mtp(tiny_model_dir, llm, k):
    """A +100 bias makes a token the greedy choice everywhere; a -100 bias on the unbiased run's
    first token moves it off, in plain and MTP decoding alike (MTP's graphed greedy path
    leaves biased rows to the sampler)."""
    engine = llm if k == 0 else LLM(tiny_model_dir, num_blocks=256, num_speculative_tokens=k)
    prompt = prompts(1, seed=9)[0]
    forced = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                                      ignore_eos=True, logit_bias=[(77, 100.0)]))[0]
    assert forced.token_ids == [77] * 8
    free = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    banned = engine.generate([prompt], SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True,
        logit_bias=[(free.token_ids[0], -100.0)]))[0]
    assert banned.token_ids[0] != free.token_ids[0]
