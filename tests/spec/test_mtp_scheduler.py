"""The scheduler's speculative bookkeeping, plain Python: draft tokens in the step's token
count, lookahead blocks for the chained drafts, drafts dropped to fit the budget or on
preemption, and `update_spec` (progress counter, stops, drafts trimmed to what is left); and
the acceptance counters (`SpecStats`) with what a node exports of them."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

from pd.engine.allocator import BlockAllocator
from pd.engine.request import FinishReason, Req, ReqStatus
from pd.wire.sampling_params import SamplingParams
from pd.engine.scheduler import Scheduler
from pd.spec.verify import SpecResult, SpecStats


def sched(num_blocks=64, budget=64, lookahead=3, max_model_len=256) -> Scheduler:
    return Scheduler(BlockAllocator(num_blocks), block_size=4, max_num_seqs=8,
                     max_num_batched_tokens=budget, max_model_len=max_model_len,
                     num_lookahead_slots=lookahead)


def req(n_prompt=6, max_tokens=20, rid="r") -> Req:
    return Req(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, temperature=0))


def result(tokens, reason=None, drafts=(), num_drafts=0, accepted=0) -> SpecResult:
    return SpecResult(list(tokens), None, reason, list(drafts), num_drafts, accepted)


def test_prefill_then_verify_steps():
    s, r = sched(), req()
    s.add(r)
    b = s.schedule()
    assert b.num_new_tokens == [6] and b.samples(0)
    # lookahead: blocks for 6 + 3 positions
    assert len(r.block_ids) == 3
    s.update_spec(b, {0: result([50], drafts=[51, 52, 53])})
    assert r.token_ids[-1] == 50 and r.num_computed_tokens == 6 and r.spec_token_ids == [51, 52, 53]
    b = s.schedule()
    assert b.num_new_tokens == [4] and b.samples(0)  # newest token + 3 drafts
    assert len(r.block_ids) == -(-(6 + 4 + 3) // 4)
    s.update_spec(b, {0: result([51, 52, 60], drafts=[61, 62, 63], num_drafts=3, accepted=2)})
    assert r.output_token_ids == [50, 51, 52, 60]
    assert r.num_computed_tokens == r.num_tokens - 1 == 9
    assert r.spec_token_ids == [61, 62, 63]


def test_drafts_trimmed_to_tokens_left_and_stop_inside_run():
    s, r = sched(), req(max_tokens=4)
    s.add(r)
    b = s.schedule()
    s.update_spec(b, {0: result([50], drafts=[51, 52, 53])})
    assert r.spec_token_ids == [51, 52]  # 3 tokens left: 2 drafts + the target's own
    b = s.schedule()
    finished = s.update_spec(b, {0: result([51, 52], FinishReason.STOP, drafts=[9, 9, 9])})
    assert finished == [r] and r.finish_reason is FinishReason.STOP and r.spec_token_ids == []
    assert s.allocator.num_free == s.allocator.num_blocks


def test_budget_drops_drafts_that_do_not_fit():
    s, r = sched(budget=8), req(n_prompt=3)
    s.add(r)
    s.update_spec(s.schedule(), {0: result([50], drafts=[51, 52, 53])})
    other = req(n_prompt=6, rid="o")
    s.add(other)
    b = s.schedule()
    assert b.reqs[0] is r and b.num_new_tokens == [4, 4] and not b.samples(1)  # a chunk
    s.max_num_batched_tokens = 2
    s.update_spec(b, {0: result([51], drafts=[51, 52, 53])})
    assert other.num_computed_tokens == 4 and other.num_output_tokens == 0
    b = s.schedule()
    assert b.num_new_tokens[0] == 2 and r.spec_token_ids == [51]  # one draft fits
    assert b.samples(0)


def test_preemption_drops_drafts():
    s = sched(num_blocks=6, lookahead=2)
    a, b_ = req(n_prompt=8, rid="a"), req(n_prompt=8, rid="b")
    s.add(a)
    s.add(b_)
    batch = s.schedule()
    s.update_spec(batch, {i: result([50 + i], drafts=[60, 61]) for i in range(len(batch.reqs))})
    assert a.spec_token_ids and b_.spec_token_ids
    s.schedule()  # 8 + 1 + 2 + 2 lookahead > 3 blocks each: the later one is preempted
    assert b_.status is ReqStatus.WAITING and b_.spec_token_ids == [] and b_.num_preemptions == 1


class _Count:
    def __init__(self) -> None:
        self.n = 0

    def inc(self, n: int = 1) -> None:
        self.n += n


def test_acceptance_counters_per_position_and_their_exported_increments():
    """A step's (drafts, accepted) per request counted at once: per draft position, the verify
    steps that accepted the draft there; a node exports only what was counted since its last
    snapshot."""
    stats = SpecStats()
    stats.count(3, [(3, 0), (3, 2), (2, 2), (3, 3)])
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 11, 7)
    assert stats.accepted_per_pos == [3, 3, 1]
    assert stats.mean_acceptance_length == 1 + 7 / 4
    at = defaultdict(_Count)
    metrics = SimpleNamespace(spec_drafts=_Count(), spec_draft_tokens=_Count(),
                              spec_accepted_tokens=_Count(), spec_accepted_at=lambda pos: at[pos])
    seen = stats.export(metrics, SpecStats())
    assert {pos: c.n for pos, c in at.items()} == {0: 3, 1: 3, 2: 1}
    stats.count(3, [(1, 1), (2, 0)])
    stats.count(3, [])
    seen = stats.export(metrics, seen)
    assert (metrics.spec_drafts.n, metrics.spec_draft_tokens.n, metrics.spec_accepted_tokens.n) \
        == (6, 14, 8)
    assert {pos: c.n for pos, c in at.items()} == {0: 4, 1: 3, 2: 1}
    assert seen.accepted_per_pos == stats.accepted_per_pos == [4, 3, 1]
    stats.runs[0] += 1  # the snapshot is a copy
    assert seen.runs == [2, 1, 2, 1]
