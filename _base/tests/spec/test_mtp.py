"""MTP speculative decoding in the single-process engine: greedy output equal to plain decoding
token for token (random tiny model: low acceptance; a perfect drafter: long accepted runs and
stops inside them), the shipped model's drafts equal to its training code's golden drafts,
logprobs of accepted tokens, and the counters."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pd.engine.llm import LLM
from pd.wire.sampling_params import SamplingParams


def prompts(n: int, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def mixed_params(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=20 + i % 5, temperature=0.0, ignore_eos=i % 3 == 0,
                           logprobs=[None, 0, 3][i % 3]) for i in range(n)]


def assert_same(out, ref):
    for o, r in zip(out, ref):
        assert o.token_ids == r.token_ids
        assert o.finish_reason == r.finish_reason
        if r.logprobs is None:
            assert o.logprobs is None and o.top_logprobs is None
            continue
        assert o.ranks == r.ranks
        assert torch.allclose(torch.tensor(o.logprobs), torch.tensor(r.logprobs), atol=1e-4)
        for a, b in zip(o.top_logprobs, r.top_logprobs):
            assert [t for t, _ in a] == [t for t, _ in b]  # exactly the asked count, same ids
            assert torch.allclose(torch.tensor([v for _, v in a]), torch.tensor([v for _, v in b]), atol=1e-4)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_blocks=256)
    batch = prompts(10, seed=5) + [list(range(3, 110))]
    params = mixed_params(len(batch))
    return batch, params, llm.generate(batch, params)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_equals_plain_decoding(tiny_model_dir, reference, k):
    batch, params, ref = reference
    # small step budget: prompts are chunked, and chunks share steps with verify slots
    llm = LLM(tiny_model_dir, num_blocks=256, num_speculative_tokens=k, max_num_batched_tokens=48)
    assert_same(llm.generate(batch, params), ref)
    stats = llm.engine.spec.stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens <= k * stats.num_drafts
    assert len(stats.accepted_per_pos) == k
    llm.engine.allocator.check_integrity()
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks


def test_greedy_equal_under_preemption(tiny_model_dir, reference):
    batch, params, ref = reference
    llm = LLM(tiny_model_dir, num_blocks=20, block_size=8, num_speculative_tokens=2)
    assert_same(llm.generate(batch, params), ref)
    assert llm.engine.scheduler.num_preemptions > 0


class OracleDrafter:
    """Proposes the target's own greedy continuation (from a plain run), so every draft is
    accepted: long accepted runs through the real verify path."""

    def __init__(self, k: int, continuations: dict[tuple, list[int]]) -> None:
        self.k, self.continuations = k, continuations

    def propose(self, step, hidden, accepted, num_accepted):
        accepted, num_accepted = accepted.tolist(), num_accepted.tolist()
        drafts = []
        for b, req in enumerate(step.reqs):
            done = req.num_output_tokens + num_accepted[b]
            d = self.continuations[tuple(req.prompt_token_ids)][done:done + self.k]
            drafts.append(d + [0] * (self.k - len(d)))
        return torch.tensor(drafts, dtype=torch.int64).view(len(step.reqs), self.k)


@pytest.mark.parametrize("k", [2, 4])
def test_perfect_drafts_long_runs_and_stops_inside_them(tiny_model_dir, k):
    plain = LLM(tiny_model_dir, num_blocks=256)
    batch = prompts(6, seed=9)
    free = plain.generate(batch, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    # stop ids taken from the middle of each continuation, max_tokens that cut a run, min_tokens
    params = []
    for i, o in enumerate(free):
        if i % 3 == 0:
            params.append(SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                         stop_token_ids=[o.token_ids[7]], logprobs=2))
        elif i % 3 == 1:
            params.append(SamplingParams(max_tokens=9 + i, temperature=0.0, ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                         stop_token_ids=[o.token_ids[2]], min_tokens=5))
    ref = plain.generate(batch, params)
    assert any(r.finish_reason == "stop" for r in ref) and any(r.finish_reason == "length" for r in ref)
    llm = LLM(tiny_model_dir, num_blocks=256, num_speculative_tokens=k)
    llm.engine.spec.drafter = OracleDrafter(k, {tuple(p): r.token_ids for p, r in zip(batch, ref)})
    assert_same(llm.generate(batch, params), ref)
    stats = llm.engine.spec.stats
    # every draft inside a continuation is accepted; only the padding past a request's stop
    # token (at most k - 1 per request, in its last step) is not
    assert stats.accepted_per_pos[0] == stats.num_drafts
    assert stats.num_draft_tokens - (k - 1) * len(batch) <= stats.num_accepted_tokens
    assert stats.mean_acceptance_length > 1 + 0.8 * (k - 1)


def test_shipped_model_drafts_match_training_golden():
    """tools/train_tiny's draft-then-verify reference gives [283, 441, 2544] for this prompt at
    k = 3 (tests/tools/test_shipped_model.py); the engine's MTP layer, cache and chaining give
    the same after prefilling the prompt but its last token, which the target then predicts."""
    llm = LLM(num_speculative_tokens=3)
    ids = llm.tokenizer.encode("import os\nimport sys\n\n\ndef main(argv):")
    req = llm.engine.add_request(ids[:-1], SamplingParams(max_tokens=8, temperature=0.0))
    llm.engine.step()
    assert req.output_token_ids == ids[-1:]
    assert req.spec_token_ids == [283, 441, 2544]


def test_requires_an_mtp_layer(make_tiny_model):
    with pytest.raises(ValueError, match="MTP layer"):
        LLM(make_tiny_model("llama", mtp=False), num_blocks=32, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(make_tiny_model("llama", mtp=True), num_blocks=32, num_speculative_tokens=5)


def test_generate_cli_flag(tiny_model_dir, capsys):
    from pd.cli.main import main

    argv = ["generate", "--model", str(tiny_model_dir), "--num-blocks", "64", "--json",
            "--prompt-ids", "5,6,7,8", "--prompt-ids", "9,10", "--max-tokens", "12", "--top-logprobs", "2"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main(argv + ["--num-speculative-tokens", "3"]) == 0
    spec = capsys.readouterr().out
    for a, b in zip(map(json.loads, spec.splitlines()), map(json.loads, plain.splitlines()), strict=True):
        assert {k: a[k] for k in ("token_ids", "text", "finish_reason")} == \
            {k: b[k] for k in ("token_ids", "text", "finish_reason")}
        assert torch.allclose(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), atol=1e-4)
    with pytest.raises(SystemExit):
        main(argv + ["--num-speculative-tokens", "5"])


def test_penalties_and_min_tokens_per_verified_position(tiny_model_dir):
    """Each verified position is processed as the plain sampler would at that step: penalties
    over the output including the drafts before it, min_tokens banning EOS/stop ids by step."""
    plain = LLM(tiny_model_dir, num_blocks=256)
    batch = prompts(6, seed=13)
    free = plain.generate(batch, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    params = [SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3,
                             frequency_penalty=0.5, presence_penalty=0.3),
              SamplingParams(max_tokens=24, temperature=0.0, min_tokens=10,
                             stop_token_ids=[free[1].token_ids[3]])] * 3
    ref = plain.generate(batch, params)
    llm = LLM(tiny_model_dir, num_blocks=256, num_speculative_tokens=3)
    continuations = {tuple(p): r.token_ids for p, r in zip(batch, ref)}
    assert_same(llm.generate(batch, params), ref)  # MTP drafts (mostly rejected)
    llm.engine.spec.drafter = OracleDrafter(3, continuations)
    assert_same(llm.generate(batch, params), ref)  # perfect drafts: all accepted
