"""Prefix caching: the allocator's cache (parking, matching, eviction), the block hashes, the
scheduler starting a request after its cached prefix, and the engine giving the same tokens with
caching on and off (shared prefixes, chunked prefill, preemption, MTP, aborts mid-prefill)."""

from __future__ import annotations

import random

import pytest

from pd.engine.allocator import BlockAllocator
from pd.engine.llm import LLM
from pd.engine.prefix import PrefixCache, chain_hashes
from pd.engine.request import Req
from pd.engine.scheduler import Scheduler
from pd.wire.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_allocator_parks_matches_and_evicts_oldest_first():
    a = BlockAllocator(6, caching=True)
    x = a.allocate(3)
    for b, h in zip(x, (11, 12, 13)):
        a.register(b, h)
    a.free(x)
    a.check_integrity()
    assert a.num_free == 6 and a.num_cached == 3  # parked blocks count as free
    assert a.match([11, 12, 13, 14]) == x and a.match([12]) == [x[1]] and a.match([99]) == []
    assert a.share_cost(x[:2]) == 2
    a.share(x[:2])  # a new request takes the first two back
    assert a.num_free == 4 and a.share_cost(x[:2]) == 0
    a.check_integrity()
    # 4 asked, 3 never-cached blocks are free: the one parked block (x[2]) is evicted
    y = a.allocate(4)
    assert x[2] in y and a.num_evictions == 1 and a.match([11, 12, 13]) == x[:2]
    a.free(x[:2])
    a.free(y)
    a.check_integrity()
    assert a.num_free == 6 and a.num_cached == 2


def test_allocator_counts_check_cheaply_and_catch_a_lost_block():
    """The check an engine runs on going idle (counts kept as blocks move) holds through
    allocation, sharing, parking and eviction, and fails, like the full walk, on a block that
    fell out of every list."""
    rng = random.Random(3)
    a = BlockAllocator(16, caching=True)
    held: list[list[int]] = []
    for i in range(200):
        if held and rng.random() < 0.45:
            a.free(held.pop(rng.randrange(len(held))))
        elif a.num_free >= 3:
            blocks = a.allocate(rng.randrange(1, 4))
            for b in blocks:
                a.register(b, rng.randrange(40))
            held.append(blocks)
            hit = a.match([rng.randrange(40)])
            if hit:
                a.share(hit)
                held.append(hit)
        a.check_integrity(full=False)
        a.check_integrity()
    lost = a.allocate(1)[0]
    a._ref[lost] = 0  # the block is in no list and held by nobody: the counts no longer add up
    a._num_held -= 1
    with pytest.raises(AssertionError, match="total"):
        a.check_integrity(full=False)
    with pytest.raises(AssertionError, match="total"):
        a.check_integrity()


def test_allocator_register_rules():
    a = BlockAllocator(4, caching=True)
    x, y = a.allocate(1), a.allocate(1)
    a.register(x[0], 5)
    a.register(y[0], 5)  # the same content computed twice: the first block keeps it
    assert a.match([5]) == x
    a.free(y)
    assert a.num_cached == 1
    with pytest.raises(ValueError, match="not held"):
        a.register(y[0], 6)
    off = BlockAllocator(2)  # caching off: register does nothing
    z = off.allocate(1)
    off.register(z[0], 7)
    assert off.match([7]) == [] and off.num_cached == 0


def test_freeing_parks_the_tail_first():
    a = BlockAllocator(3, caching=True)
    x = a.allocate(3)
    for i, b in enumerate(x):
        a.register(b, 100 + i)
    a.free(x)
    assert a.allocate(1) == [x[2]]  # the sequence's last block goes first


def test_chain_hashes_are_prefix_hashes():
    toks = list(range(40))
    h = chain_hashes(toks, 8, root=1)
    assert len(h) == 5 and len(set(h)) == 5
    assert chain_hashes(toks[:17], 8, root=1) == h[:2]
    assert chain_hashes(toks, 8, root=1, prev=h[:2]) == h  # extending gives the same
    assert chain_hashes(toks, 8, root=2)[0] != h[0]  # another model
    changed = toks[:3] + [999] + toks[4:]
    assert chain_hashes(changed, 8, root=1)[0] != h[0]
    # with a lookahead of one token a block needs the token after it, which it hashes too
    la = chain_hashes(toks[:16], 8, root=1, lookahead=1)
    assert len(la) == 1 and la[0] != h[0]
    assert chain_hashes(toks[:8] + [5] + toks[9:17], 8, root=1, lookahead=1)[0] != la[0]


def make_sched(num_blocks: int, bs: int = 4, budget: int = 64) -> Scheduler:
    a = BlockAllocator(num_blocks, caching=True)
    return Scheduler(a, block_size=bs, max_num_seqs=8, max_num_batched_tokens=budget,
                     max_model_len=256, prefix=PrefixCache(a, bs, "test"))


def req(rid: str, prompt: list[int]) -> Req:
    return Req(rid, prompt, SamplingParams(max_tokens=2, temperature=0))


def finish_step(s: Scheduler):
    batch = s.schedule()
    sampled = {i: (7, None, None, None) for i in range(len(batch.reqs)) if batch.samples(i)}
    return batch, s.update(batch, sampled)


def test_scheduler_starts_after_the_cached_prefix():
    s = make_sched(32)
    shared = list(range(1, 13))  # 3 full blocks of 4
    first = req("a", shared + [50, 51])
    s.add(first)
    finish_step(s)
    finish_step(s)  # a finishes (max_tokens 2); its blocks are parked
    assert first.is_finished and s.allocator.num_used == 0
    second = req("b", shared + [60])
    s.add(second)
    batch, _ = finish_step(s)
    assert batch.num_new_tokens == [1] and second.num_computed_tokens == 13
    assert second.block_ids[:3] == s.allocator.match(first.block_hashes[:3])
    assert s.prefix.stats.queries == 14 + 13 and s.prefix.stats.hits == 12
    # a prompt that is entirely cached still computes its last token
    again = req("c", list(shared))
    s.add(again)
    batch, _ = finish_step(s)
    assert batch.reqs[-1] is again and batch.num_new_tokens[-1] == 4
    s.allocator.check_integrity()


def test_decoded_blocks_are_registered_when_the_request_leaves():
    """A running request's prompt blocks are registered as they fill (a request sharing the
    prompt finds them at once), the blocks its decoding fills when it finishes or is
    preempted; a follow-up whose prompt is the first's prompt and answer finds them all."""
    s = make_sched(32)
    first = Req("a", list(range(1, 7)), SamplingParams(max_tokens=8, temperature=0))
    s.add(first)
    finish_step(s)  # the prompt (6 tokens): its one full block registered
    assert first.num_registered_blocks == 1
    for _ in range(6):  # decoding: computed 12, block 1 (4..7, prompt in it) registered, block 2 not
        finish_step(s)
    assert first.num_computed_tokens == 12 and first.num_registered_blocks == 2
    while not first.is_finished:
        finish_step(s)
    assert first.num_registered_blocks == 3  # computed 13 (the last token's KV is not)
    follow = req("b", first.token_ids + [99])
    s.add(follow)
    batch, _ = finish_step(s)
    assert batch.num_new_tokens == [3]  # 12 of its 15 tokens cached
    # preempted: the blocks its decoding filled are registered before they are freed
    s2 = make_sched(32)
    r = Req("c", list(range(1, 5)), SamplingParams(max_tokens=20, temperature=0))
    s2.add(r)
    for _ in range(9):
        finish_step(s2)
    assert r.num_computed_tokens == 12 and r.num_registered_blocks == 1
    hashes = s2.prefix.hashes(r)[:3]
    s2._preempt(r)
    assert len(s2.allocator.match(hashes)) == 3
    s.allocator.check_integrity()
    s2.allocator.check_integrity()


def test_scheduler_waits_when_shared_blocks_would_not_fit():
    s = make_sched(5)
    shared = list(range(1, 9))  # 2 full blocks
    a = req("a", shared + [1])
    s.add(a)
    finish_step(s)
    finish_step(s)  # 2 blocks parked
    x = Req("x", [20, 21, 22, 23, 24], SamplingParams(max_tokens=3, temperature=0))
    s.add(x)
    finish_step(s)  # x holds 2 blocks: 1 never-cached block is free, 2 are parked
    # b shares the 2 parked blocks and needs 2 more (13 tokens + 1): 4 > 3 available
    b = req("b", shared + [2, 3, 4, 5, 6])
    s.add(b)
    batch, _ = finish_step(s)
    assert batch.reqs == [x] and b.num_computed_tokens == 0
    finish_step(s)  # x finishes
    batch, _ = finish_step(s)
    assert batch.reqs == [b] and b.num_computed_tokens == 13 and batch.num_new_tokens == [5]
    s.allocator.check_integrity()


@pytest.fixture(scope="module")
def workload():
    rng = random.Random(5)
    systems = [[rng.randrange(1, 512) for _ in range(rng.randint(20, 70))] for _ in range(3)]
    prompts = [systems[i % 3] + [rng.randrange(1, 512) for _ in range(rng.randint(1, 20))]
               for i in range(12)]
    return prompts + [list(p) for p in prompts[:3]]  # and a few exact repeats


def run(model_dir, prompts, caching: bool, **kwargs):
    llm = LLM(model_dir, enable_prefix_caching=caching, **kwargs)
    out = []
    for chunk in (prompts[:6], prompts[6:]):  # the second wave finds the first's blocks
        out += [o.token_ids for o in llm.generate(chunk, GREEDY)]
    llm.engine.allocator.check_integrity()
    return out, llm


@pytest.mark.parametrize("kwargs", [
    dict(num_blocks=256),
    dict(num_blocks=256, max_num_batched_tokens=24),  # chunked prefill
    dict(num_blocks=14),  # preemption and eviction
    dict(num_blocks=256, num_speculative_tokens=2),  # MTP: its layer's KV is cached too
], ids=["plain", "chunked", "small-cache", "mtp"])
def test_caching_on_and_off_give_the_same_tokens(tiny_model_dir, workload, kwargs):
    off, _ = run(tiny_model_dir, workload, False, **kwargs)
    on, llm = run(tiny_model_dir, workload, True, **kwargs)
    assert on == off
    stats = llm.engine.prefix.stats
    assert stats.hits > 0.3 * stats.queries, stats
    if kwargs["num_blocks"] == 14:  # memory pressure: cached blocks evicted, requests preempted
        assert llm.engine.allocator.num_evictions > 0 and llm.engine.scheduler.num_preemptions > 0


def test_abort_mid_prefill_leaves_the_cache_whole(tiny_model_dir, workload):
    llm = LLM(tiny_model_dir, num_blocks=64, max_num_batched_tokens=16)
    engine = llm.engine
    long = workload[0] * 3
    r = engine.add_request(long, GREEDY)
    engine.step()  # one chunk
    assert 0 < r.num_computed_tokens < len(long)
    engine.abort(r.req_id)
    while engine.has_unfinished():
        engine.step()
    engine.allocator.check_integrity()
    assert engine.allocator.num_used == 0 and engine.allocator.num_cached >= 1
    ref = LLM(tiny_model_dir, num_blocks=64, enable_prefix_caching=False)
    assert llm.generate([long], GREEDY)[0].token_ids == ref.generate([long], GREEDY)[0].token_ids
    assert engine.prefix.stats.hits >= 16


def test_bounded_registration_spreads_hashing_over_steps(monkeypatch):
    """A decode step hashes at most HASHES_PER_STEP prompt blocks for its requests (`bounded`);
    the rest follow in the steps after; unbounded registration takes every computed block."""
    monkeypatch.setattr("pd.engine.prefix.HASHES_PER_STEP", 6)
    a = BlockAllocator(64, caching=True)
    cache = PrefixCache(a, 4, "test")
    reqs = []
    for i in range(2):
        r = req(str(i), [100 * i + t for t in range(41)])  # 10 full blocks
        r.block_ids = a.allocate(11)
        r.num_computed_tokens = 41
        reqs.append(r)
    cache.new_step()
    for r in reqs:
        cache.register(r, True)
    assert [r.num_registered_blocks for r in reqs] == [6, 0]
    assert [len(r.block_hashes) for r in reqs] == [6, 0]  # hashed no further than registered
    cache.new_step()
    for r in reqs:
        cache.register(r, True)
    assert [r.num_registered_blocks for r in reqs] == [10, 2]
    cache.register(reqs[1])  # unbounded (a request leaving): the rest at once
    assert reqs[1].num_registered_blocks == 10
    for r in reqs:
        assert a.match(chain_hashes(r.token_ids, 4, cache.root)) == r.block_ids[:10]
    a.check_integrity()
