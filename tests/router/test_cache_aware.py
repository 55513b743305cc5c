"""The cache-aware policy on registry nodes, no I/O: a prefix sticks to the node that has it,
new prefixes spread, busy nodes shed work, a decode node learns finished conversations, and the
per-node copy forgets at the node's size."""

from __future__ import annotations

import random

import pytest

from router.cache_aware import CacheAwarePolicy, PrefixIndex, chunk_hashes
from router.policies import make_policy
from router.registry import Node, NodeLoad, Role


def nodes(role: Role, n: int, blocks: int = 1000) -> list[Node]:
    return [Node(role, f"tcp://10.0.0.{i}:7000", healthy=True,
                 load=NodeLoad(total_kv_blocks=blocks, free_kv_blocks=blocks)) for i in range(n)]


def test_a_prefix_sticks_to_its_node_and_new_ones_spread():
    decisions = []
    policy = CacheAwarePolicy(0, on_decision=lambda role, reason: decisions.append(reason))
    ps = nodes(Role.PREFILL, 2)
    rng = random.Random(0)
    systems = [[rng.randrange(1000) for _ in range(256)] for _ in range(8)]
    home = {}
    for i in range(80):
        k = i % 8
        prompt = systems[k] + [rng.randrange(1000) for _ in range(16)]
        node = policy.pick_prefill(ps, prompt_ids=prompt)
        node.pending_requests += 1  # what the backend's dispatch does
        home.setdefault(k, node.address)
        assert node.address == home[k]
    assert sorted(list(home.values()).count(n.address) for n in ps) == [4, 4]
    assert decisions[:8] == ["load"] * 8 and set(decisions[8:]) == {"cache"}


def test_busy_nodes_shed_work_and_short_matches_go_by_load():
    policy = CacheAwarePolicy(0, balance_abs=4, balance_rel=1.5, cache_threshold=0.5)
    a, b = nodes(Role.PREFILL, 2)
    prompt = list(range(64))
    assert policy.pick_prefill([a, b], prompt_ids=prompt) is a
    a.pending_requests = 10  # a holds the prefix but is far busier than b
    assert policy.pick_prefill([a, b], prompt_ids=prompt) is b
    a.pending_requests, b.pending_requests = 3, 0
    # a prompt sharing only 16 of its 64 tokens with what a holds: below the threshold
    other = prompt[:16] + [999] * 48
    assert policy.pick_prefill([a, b], prompt_ids=other) is b


def test_decode_node_learns_finished_conversations():
    policy = make_policy("cache_aware", 0)
    ds = nodes(Role.DECODE, 3)
    turn1 = list(range(100))
    first = policy.pick_decode(ds, prompt_ids=turn1)
    policy.finished(first, turn1 + list(range(500, 540)))
    for n in ds:
        n.pending_requests = 1 if n is first else 0
    turn2 = turn1 + list(range(500, 540)) + [7, 8, 9]
    assert policy.pick_decode(ds, prompt_ids=turn2) is first


def test_index_forgets_least_recent_at_capacity():
    idx = PrefixIndex()
    a, b = chunk_hashes(list(range(64)), 16), chunk_hashes(list(range(100, 164)), 16)
    idx.insert(a, capacity=6)
    idx.insert(b, capacity=6)
    assert idx.match(b) == 4 and idx.match(a) == 0  # a's first two went first; the chain breaks
    assert chunk_hashes(list(range(40)), 16) == a[:2]


def test_bad_thresholds_are_refused():
    with pytest.raises(ValueError, match="cache_threshold"):
        make_policy("cache_aware", cache_threshold=1.5)
