"""Allocator and scheduler: plain Python, no model."""

from __future__ import annotations

import pytest

from pd.engine.allocator import BlockAllocator, NoFreeBlocks
from pd.engine.request import Req, ReqStatus
from pd.wire.sampling_params import SamplingParams
from pd.engine.scheduler import Scheduler


def test_allocator_integrity_and_errors():
    a = BlockAllocator(8)
    x = a.allocate(3)
    y = a.allocate(5)
    assert a.num_free == 0 and len(set(x + y)) == 8
    with pytest.raises(NoFreeBlocks):
        a.allocate(1)
    a.share(x)
    a.free(x)
    assert a.num_free == 0  # still referenced once
    a.free(x)
    a.free(y)
    a.check_integrity()
    assert a.num_free == 8
    with pytest.raises(ValueError, match="freed twice"):
        a.free([x[0]])


def make(n_prompt: int, max_tokens: int = 4, rid: str = "r") -> Req:
    return Req(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, temperature=0))


def run_step(s: Scheduler, token: int = 7):
    batch = s.schedule()
    sampled = {i: (token, None, None, None) for i in range(len(batch.reqs)) if batch.samples(i)}
    return batch, s.update(batch, sampled)


def test_chunked_prefill_and_budget():
    s = Scheduler(BlockAllocator(64), block_size=4, max_num_seqs=8, max_num_batched_tokens=10,
                  max_model_len=128)
    long, short = make(25, rid="long"), make(3, rid="short")
    s.add(long)
    s.add(short)
    batch, _ = run_step(s)
    assert [r.req_id for r in batch.reqs] == ["long"] and batch.num_new_tokens == [10]
    assert not batch.samples(0) and long.num_computed_tokens == 10
    batch, _ = run_step(s)
    assert batch.num_new_tokens == [10]
    batch, _ = run_step(s)  # the last 5 of long, then short fits in the remaining budget
    assert [r.req_id for r in batch.reqs] == ["long", "short"] and batch.num_new_tokens == [5, 3]
    assert long.output_token_ids == [7] and short.output_token_ids == [7]
    assert len(long.block_ids) == 7  # 26 slots / 4


def test_preemption_recomputes_and_frees():
    alloc = BlockAllocator(4)
    s = Scheduler(alloc, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    a, b = make(7, max_tokens=8, rid="a"), make(7, max_tokens=8, rid="b")
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled (7 tokens, 2 blocks each): the cache is full
    assert alloc.num_free == 0
    run_step(s)  # position 7 still fits in the second block
    assert b.num_preemptions == 0
    batch, _ = run_step(s)  # position 8 needs a 3rd block for a: b (the newest) is preempted
    assert b.status is ReqStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert [r.req_id for r in batch.reqs] == ["a"]
    while s.has_work:
        run_step(s)
    assert a.finish_reason.value == "length" and b.finish_reason.value == "length"
    assert len(b.output_token_ids) == 8
    alloc.check_integrity()
    assert alloc.num_free == 4


def test_add_refuses_what_can_never_fit():
    s = Scheduler(BlockAllocator(2), block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                  max_model_len=64)
    with pytest.raises(ValueError, match="empty prompt"):
        s.add(make(0))
    with pytest.raises(ValueError, match="KV blocks"):
        s.add(make(20))
    with pytest.raises(ValueError, match="context"):
        Scheduler(BlockAllocator(99), 4, 8, 64, max_model_len=16).add(make(16))


def test_abort_frees_blocks():
    alloc = BlockAllocator(8)
    s = Scheduler(alloc, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    r = make(9, max_tokens=10)
    s.add(r)
    run_step(s)
    s.abort(r)
    assert r.finish_reason.value == "abort" and not s.has_work
    alloc.check_integrity()
    assert alloc.num_free == 8
