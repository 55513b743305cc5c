"""The decode loop with overlap against the plain loop and the single-process engine: the same
tokens, stops found one step late never leak a token, aborts and late finishes free their
blocks only after the step that still holds them, the batch empties and fills again."""

from __future__ import annotations

import random

import pytest
import torch

from pd.config import EngineConfig
from pd.engine.engine import Engine
from pd.engine.llm import LLM
from pd.engine.decode_loop import DecodeLoop, overlap_disabled_by_env
from pd.engine.request import FinishReason, Req
from pd.wire.sampling_params import SamplingParams
from pd.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir)


@pytest.fixture(scope="module")
def eos(model):
    return tuple(Tokenizer.from_dir(model).eos_token_ids)


@pytest.fixture(scope="module")
def reference(model):
    return LLM(model, num_blocks=512)


def make_loop(model, eos, overlap, num_blocks=512):
    engine = Engine(EngineConfig(model=model, num_blocks=num_blocks), eos_token_ids=eos)
    return engine, DecodeLoop(engine.runner, engine.scheduler, overlap=overlap)


def drive(model, eos, overlap, prompts, params, arrivals, num_blocks=512):
    """Add request k at step arrivals[k]; step until all are done. Returns the requests, the
    tokens each step emitted per request (in order) and the loop."""
    engine, loop = make_loop(model, eos, overlap, num_blocks)
    reqs = [Req(str(i), p, sp, eos_token_ids=eos) for i, (p, sp) in enumerate(zip(prompts, params))]
    streamed = {r.req_id: [] for r in reqs}
    step = k = 0
    while k < len(reqs) or loop.has_work:
        while k < len(reqs) and arrivals[k] <= step:
            engine.scheduler.add(reqs[k])
            k += 1
        for req in loop.step():
            assert not streamed[req.req_id] or streamed[req.req_id][-1] is not None, \
                f"{req.req_id} emitted a token after it finished"
            streamed[req.req_id].append(req.token_ids[-1])
            if req.is_finished:
                streamed[req.req_id].append(None)
        step += 1
        assert step < 5000
    loop.close()
    engine.allocator.check_integrity()
    assert engine.allocator.num_free == engine.allocator.num_blocks
    return reqs, streamed, loop


def mixed(n, seed):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.choice([1, 2, 7, 16, 17, 40, 70]))]
               for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 24), temperature=0.0,
                             ignore_eos=rng.random() < 0.5, logprobs=rng.choice([None, None, 0, 3]))
              for _ in range(n)]
    arrivals = sorted(rng.randrange(0, 80) for _ in range(n))
    return prompts, params, arrivals


def test_overlap_equals_plain_and_engine_for_64_requests_arriving_at_random(model, eos, reference):
    prompts, params, arrivals = mixed(64, seed=1)
    plain, plain_stream, _ = drive(model, eos, False, prompts, params, arrivals)
    over, over_stream, loop = drive(model, eos, True, prompts, params, arrivals)
    expected = reference.generate(prompts, params)
    assert loop.num_syncs == 0 and loop.num_ahead > 50  # it did run one step ahead
    for a, b, ref in zip(plain, over, expected):
        assert a.output_token_ids == b.output_token_ids == ref.token_ids
        assert a.finish_reason == b.finish_reason and a.finish_reason.value == ref.finish_reason
        if ref.logprobs is not None:
            assert b.output_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
            assert [[t for t, _ in top] for top in b.output_top_logprobs] == \
                [[t for t, _ in top] for top in ref.top_logprobs]
    # every token is emitted once, in order, and nothing after the finish
    for req in over:
        assert over_stream[req.req_id] == req.output_token_ids + [None]
    assert over_stream == plain_stream


def test_stops_found_one_step_late_never_leak(model, eos, reference):
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))] for _ in range(24)]
    free_run = reference.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    params = []
    for i, out in enumerate(free_run):
        stop_at = i % 6 + 1  # stop on the token generated at this index
        if i % 3 == 0:
            params.append(SamplingParams(max_tokens=stop_at, temperature=0.0, ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                         stop_token_ids=[out.token_ids[stop_at - 1]]))
    reqs, streamed, loop = drive(model, eos, True, prompts, params, [0] * 12 + [3] * 12)
    for req, out, sp in zip(reqs, free_run, params):
        if sp.stop_token_ids:
            cut = out.token_ids.index(sp.stop_token_ids[0]) + 1
            assert req.finish_reason is FinishReason.STOP
        else:
            cut = sp.max_tokens
            assert req.finish_reason is FinishReason.LENGTH
        assert req.output_token_ids == out.token_ids[:cut]
        assert streamed[req.req_id] == out.token_ids[:cut] + [None]


def test_abort_mid_batch_discards_the_step_in_flight_and_frees_after_it(model, eos, reference):
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(8)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine, loop = make_loop(model, eos, True)
    reqs = [Req(str(i), p, params, eos_token_ids=eos) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.scheduler.add(r)
    for _ in range(5):
        loop.step()
    assert loop.in_flight
    victims = reqs[1:8:3]
    free_before = engine.allocator.num_free
    counts = {r.req_id: r.num_output_tokens for r in victims}
    for r in victims:
        loop.abort(r)
        assert r.finish_reason is FinishReason.ABORT
    # NOTE: the launched step still writes their KV: the blocks stay taken until it is done
    assert engine.allocator.num_free == free_before and all(r.block_ids for r in victims)
    emitted = loop.step()
    assert not set(emitted) & set(victims)
    assert all(not r.block_ids for r in victims)
    while loop.has_work:
        assert not set(loop.step()) & set(victims)
    assert {r.req_id: r.num_output_tokens for r in victims} == counts
    expected = reference.generate(prompts, params)
    for r, ref in zip(reqs, expected):
        if r not in victims:
            assert r.output_token_ids == ref.token_ids
    engine.allocator.check_integrity()
    assert engine.allocator.num_free == engine.allocator.num_blocks
    loop.close()


def test_finishing_while_others_join_and_batch_empties_and_refills(model, eos, reference):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(2, 20))] for _ in range(12)]
    # wave 1 finishes on the very steps wave 2 joins; then the batch runs dry; wave 3 refills it
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
              for m in [3, 4, 5, 6, 2, 3, 4, 5, 1, 2, 7, 8]]
    arrivals = [0, 0, 0, 0, 4, 5, 6, 7, 60, 60, 61, 61]
    reqs, streamed, loop = drive(model, eos, True, prompts, params, arrivals)
    expected = reference.generate(prompts, params)
    assert [r.output_token_ids for r in reqs] == [e.token_ids for e in expected]
    assert all(streamed[r.req_id] == r.output_token_ids + [None] for r in reqs)


def test_requests_with_penalties_sample_after_the_previous_step(model, eos):
    """Penalties need the tokens before on the host: the step's forward goes ahead, its sampler
    follows once the previous step is read (a deferred sampling), same tokens."""
    prompts, params, arrivals = mixed(16, seed=5)
    params = [SamplingParams(max_tokens=p.max_tokens, temperature=0.0, repetition_penalty=1.3,
                             frequency_penalty=0.2) if i % 4 == 0 else p for i, p in enumerate(params)]
    plain, _, _ = drive(model, eos, False, prompts, params, arrivals)
    over, _, loop = drive(model, eos, True, prompts, params, arrivals)
    assert loop.num_deferred > 0
    assert [r.output_token_ids for r in plain] == [r.output_token_ids for r in over]


def test_seeded_sampling_is_the_same_with_and_without_overlap(model, eos):
    prompts, _, arrivals = mixed(16, seed=9)
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=i, min_tokens=3)
              for i in range(16)]
    plain, _, _ = drive(model, eos, False, prompts, params, arrivals)
    over, _, _ = drive(model, eos, True, prompts, params, arrivals)
    assert [r.output_token_ids for r in plain] == [r.output_token_ids for r in over]


def test_a_cache_too_small_for_prediction_falls_back_to_waiting(model, eos, reference):
    # 20 blocks of 16 tokens for 6 requests of 80 tokens (5 blocks each): requests are
    # preempted, and never while a step is in flight (the loop raises if one is)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(40)] for _ in range(6)]
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True) for _ in prompts]
    over, _, loop = drive(model, eos, True, prompts, params, [0] * 6, num_blocks=20)
    assert loop.num_syncs > 0 and loop.scheduler.num_preemptions > 0
    expected = reference.generate(prompts, params)
    assert [r.output_token_ids for r in over] == [e.token_ids for e in expected]


@pytest.mark.parametrize("value,disabled", [("", False), ("0", False), ("off", False),
                                            ("1", True), ("true", True), ("YES", True)])
def test_env_var(value, disabled):
    assert overlap_disabled_by_env({"PD_DISABLE_OVERLAP": value}) is disabled


def test_env_var_refuses_garbage():
    with pytest.raises(ValueError, match="PD_DISABLE_OVERLAP"):
        overlap_disabled_by_env({"PD_DISABLE_OVERLAP": "maybe"})


def join(engine, prompts, max_tokens, seed):
    """Requests joining the running batch with their KV computed elsewhere (as a decode node's
    do: prompt KV in their blocks, the first token known, no block registered yet)."""
    gen = torch.Generator().manual_seed(seed)
    kv = engine.runner.kv_cache.kv
    reqs = []
    for i, prompt in enumerate(prompts):
        r = Req(f"j{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                ignore_eos=True))
        r.append_token(7 + i)
        r.block_ids = engine.allocator.allocate(engine.scheduler.blocks_needed(r, r.num_tokens))
        shape = (kv.shape[0], 2, len(r.block_ids)) + tuple(kv.shape[3:])
        kv[:, :, r.block_ids] = torch.randn(shape, generator=gen).to(kv.dtype)
        r.num_computed_tokens = len(prompt)
        engine.scheduler.add_running(r)
        reqs.append(r)
    return reqs


@pytest.mark.parametrize("overlap", [True, False])
def test_joined_prompts_register_a_bounded_number_of_blocks_a_step(model, eos, overlap,
                                                                    monkeypatch):
    """Six requests joining at once with 6 full prompt blocks each: their blocks join the prefix
    cache at most 8 a step (`HASHES_PER_STEP`, made small), all of them within 5 steps, and
    the tokens are those of a loop that registers them in one step."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(100)] for _ in range(6)]
    outputs = []
    for per_step in (8, 1000):
        monkeypatch.setattr("pd.engine.prefix.HASHES_PER_STEP", per_step)
        engine, loop = make_loop(model, eos, overlap)
        reqs = join(engine, prompts, 12, seed=5)
        blocks = [r.block_ids[:6] for r in reqs]
        registered = []
        while loop.has_work:
            loop.step()
            registered.append(sum(r.num_registered_blocks for r in reqs))
        loop.close()
        engine.allocator.check_integrity()
        if overlap:  # its first call launches the first step and processes none
            assert registered[0] == 0
            registered = registered[1:]
        assert registered[:5] == ([8, 16, 24, 32, 36] if per_step == 8 else [36] * 5), registered
        for r, held in zip(reqs, blocks):  # the prompt blocks stay cached after the requests left
            assert engine.allocator.match(engine.scheduler.prefix.hashes(r)[:6]) == held
        outputs.append([r.output_token_ids for r in reqs])
    assert outputs[0] == outputs[1]
