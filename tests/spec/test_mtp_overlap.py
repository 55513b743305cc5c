"""MTP inside the overlap loop (`pd.engine.decode_loop`, `pd.spec.graphed.launch_chained`): step
N + 1 is launched from step N's result on the device before the host reads N. On CPU the graphs'
layout runs without capture (`spec_layout`). Overlap on == overlap off == plain greedy decoding,
token for token and logprobs, for requests arriving at random steps, stops inside accepted runs,
aborts of requests held by the launched step, a cache small enough to preempt, and seeded
sampling (which waits for each step)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pd.config import EngineConfig, default_model_dir
from pd.engine.decode_loop import DecodeLoop
from pd.engine.engine import Engine
from pd.engine.llm import LLM
from pd.engine.request import FinishReason, Req
from pd.text.tokenizer import Tokenizer
from pd.wire.sampling_params import SamplingParams
from tests.spec.test_mtp_graphs import spec_layout

MODEL = str(default_model_dir())  # trained MTP layer: long accepted runs


class Loop:
    def __init__(self, k: int, overlap: bool, num_blocks: int = 512) -> None:
        self.eos = tuple(Tokenizer.from_dir(MODEL).eos_token_ids)
        with spec_layout():
            self.engine = Engine(EngineConfig(model=MODEL, num_blocks=num_blocks),
                                 eos_token_ids=self.eos, num_speculative_tokens=k)
        self.loop = DecodeLoop(self.engine.runner, self.engine.scheduler, overlap=overlap,
                               spec=self.engine.spec)

    def close(self) -> None:
        self.loop.close()
        self.engine.allocator.check_integrity()
        assert self.engine.allocator.num_free == self.engine.allocator.num_blocks


def drive(k, overlap, prompts, params, arrivals, num_blocks=512, abort_at=None):
    """Add request i at step arrivals[i]; abort those in `abort_at` ({index: step}) then; step
    until all are done. Returns the requests, each one's streamed tokens, and the loop."""
    lp = Loop(k, overlap, num_blocks)
    reqs = [Req(str(i), p, sp, eos_token_ids=lp.eos) for i, (p, sp) in enumerate(zip(prompts, params))]
    streamed = {r.req_id: [] for r in reqs}
    step = i = 0
    while i < len(reqs) or lp.loop.has_work:
        while i < len(reqs) and arrivals[i] <= step:
            lp.engine.scheduler.add(reqs[i])
            i += 1
        for j, at in (abort_at or {}).items():
            if at == step and not reqs[j].is_finished and reqs[j] in lp.engine.scheduler.running:
                lp.loop.abort(reqs[j])
        counts = Counter(lp.loop.step())  # a request once per token it kept
        for req, c in counts.items():
            assert not streamed[req.req_id] or streamed[req.req_id][-1] is not None, \
                f"{req.req_id} emitted a token after it finished"
            streamed[req.req_id] += req.token_ids[-c:]
            if req.is_finished:
                streamed[req.req_id].append(None)
        step += 1
        assert step < 5000
    lp.close()
    return reqs, streamed, lp.loop


def workload(n: int, seed: int, reference: LLM, logprobs=(None, None, 0, 1, 5)):
    """Code prompts and random ones; greedy; logprobs off/0/1/5 (or `logprobs`' choices); some
    stop ids taken from the free-running continuation (so stops fall inside accepted runs);
    arrivals over 60 steps."""
    rng = random.Random(seed)
    tok = reference.tokenizer
    heads = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):",
             "for i in range(10):", "def is_prime(n):\n    if n < 2:"]
    prompts = [tok.encode(rng.choice(heads)) if rng.random() < 0.7 else
               [rng.randrange(3, 4000) for _ in range(rng.randrange(1, 30))] for _ in range(n)]
    free = reference.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    params = []
    for o in free:
        stop = [o.token_ids[rng.randrange(2, 30)]] if rng.random() < 0.3 else []
        params.append(SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0.0,
                                     ignore_eos=rng.random() < 0.6, stop_token_ids=stop,
                                     logprobs=rng.choice(logprobs)))
    arrivals = sorted(rng.randrange(0, 60) for _ in range(n))
    return prompts, params, arrivals


@pytest.fixture(scope="module")
def reference():
    return LLM(MODEL, num_blocks=512)


def assert_equal(reqs, expected):
    for r, ref in zip(reqs, expected):
        assert r.output_token_ids == ref.token_ids, r.req_id
        assert r.finish_reason.value == ref.finish_reason
        if ref.logprobs is not None:
            assert r.output_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
            assert r.output_ranks == ref.ranks
            assert len(r.output_top_logprobs) == len(ref.top_logprobs)
            for got, want in zip(r.output_top_logprobs, ref.top_logprobs):
                same_tops(got, want)


def same_tops(got, want, tol: float = 1e-4) -> None:
    """One token's top pairs equal, but for the order of entries whose logprobs tie within
    `tol` (the GPU's reductions may order near-equal logits either way)."""
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=tol)
    for t, lp in got:
        assert t in {u for u, v in want if abs(v - lp) <= tol}, (got, want)


@pytest.mark.parametrize("k, n", [(1, 16), (2, 16), (3, 32), (4, 16)])
def test_overlap_equals_no_overlap_equals_plain(reference, k, n):
    prompts, params, arrivals = workload(n, seed=k, reference=reference)
    expected = reference.generate(prompts, params)
    off, off_stream, _ = drive(k, False, prompts, params, arrivals)
    on, on_stream, loop = drive(k, True, prompts, params, arrivals)
    assert loop.num_ahead >= 5, "no step was chained on the device"
    assert_equal(off, expected)
    assert_equal(on, expected)
    assert on_stream == off_stream
    assert any(r.finish_reason is FinishReason.STOP and r.params.stop_token_ids for r in on)


def test_top_logprobs_0_folded_in_the_chained_step(reference, monkeypatch):
    """Requests asking top_logprobs 0 or no logprobs only: each chained step brings its
    tokens' logprobs and ranks in the result's own copy (`lp0_columns`), equal to plain decoding's."""
    import pd.spec.graphed as graphed

    calls = Counter()
    real = graphed.lp0_columns
    monkeypatch.setattr(graphed, "lp0_columns", lambda cols: calls.update(["pairs"]) or real(cols))
    prompts, params, arrivals = workload(16, seed=5, reference=reference, logprobs=(None, 0, 0))
    expected = reference.generate(prompts, params)
    on, _, loop = drive(3, True, prompts, params, arrivals)
    assert loop.num_ahead >= 5, "no step was chained on the device"
    assert calls["pairs"] >= 5, "the logprobs did not come folded in the result"
    assert_equal(on, expected)
    assert sum(p.logprobs == 0 for p in params) >= 8


def test_aborts_of_requests_held_by_the_launched_step(reference):
    prompts, params, arrivals = workload(24, seed=11, reference=reference)
    params = [SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True) for _ in prompts]
    abort_at = {i: 3 + i // 5 for i in range(0, 24, 5)}
    reqs, stream, loop = drive(3, True, prompts, params, [0] * 24, abort_at=abort_at)
    expected = reference.generate(prompts, params)
    for i, (r, ref) in enumerate(zip(reqs, expected)):
        if i in abort_at:
            assert r.finish_reason is FinishReason.ABORT and r.num_output_tokens < 80
            assert r.output_token_ids == ref.token_ids[:r.num_output_tokens]
            assert stream[r.req_id][:r.num_output_tokens] == r.output_token_ids  # nothing after
        else:
            assert r.output_token_ids == ref.token_ids
    assert loop.num_ahead > 0


def test_preemption_and_a_small_cache(reference):
    prompts, params, arrivals = workload(24, seed=5, reference=reference)
    expected = reference.generate(prompts, params)
    reqs, _, loop = drive(3, True, prompts, params, arrivals, num_blocks=24)
    assert_equal(reqs, expected)
    assert loop.scheduler.num_preemptions > 0 or loop.num_syncs > 0


def test_seeded_sampling_is_the_same_with_and_without_overlap(reference):
    prompts, _, arrivals = workload(8, seed=3, reference=reference)
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=100 + i) for i in range(8)]
    off, _, _ = drive(3, False, prompts, params, arrivals)
    on, _, _ = drive(3, True, prompts, params, arrivals)
    assert [r.output_token_ids for r in on] == [r.output_token_ids for r in off]


def test_spec_choice_follows_the_measurement():
    from pd.engine.loop_stats import SpecChoice

    c = SpecChoice(probe=2, explore=10, window=4)
    assert c.use_mtp(5) and c.bucket(5) == c.bucket(8) == 8 and c.bucket(1) == 1
    for _ in range(2):
        c.record(5, True, 0.004, 2)  # MTP: 2 ms per token
    assert not c.use_mtp(6)  # plain is not measured yet
    for _ in range(2):
        c.record(6, False, 0.001, 1)  # plain: 1 ms per token
    kinds = [c.use_mtp(7) for _ in range(20)]
    assert kinds.count(False) > kinds.count(True) > 0  # plain wins, MTP probed now and then
    assert c.num_plain_steps == kinds.count(False)
    assert c.use_mtp(1)  # another bucket starts with MTP
    for _ in range(4):
        c.record(8, True, 0.001, 4)  # MTP got faster: it wins again
    assert [c.use_mtp(8) for _ in range(5)].count(True) >= 4


def test_switching_between_mtp_and_plain_steps_keeps_the_tokens(reference):
    overlap = True  # the harder case: a switch drains the step in flight
    prompts, params, arrivals = workload(24, seed=8, reference=reference)
    expected = reference.generate(prompts, params)
    lp = Loop(3, overlap)
    from pd.engine.loop_stats import SpecChoice

    lp.loop.choice = SpecChoice(probe=2, explore=5, window=4)  # switch often
    reqs = [Req(str(i), p, sp, eos_token_ids=lp.eos) for i, (p, sp) in enumerate(zip(prompts, params))]
    step = i = 0
    while i < len(reqs) or lp.loop.has_work:
        while i < len(reqs) and arrivals[i] <= step:
            lp.engine.scheduler.add(reqs[i])
            i += 1
        lp.loop.step()
        step += 1
    lp.close()
    assert_equal(reqs, expected)
    measured = lp.loop.choice.buckets.values()
    assert any(st.steps[True] for st in measured) and any(st.steps[False] for st in measured)
