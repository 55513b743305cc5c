"""Routing policies over registry nodes: load (with two choices among equals), round robin, random."""

from __future__ import annotations

from collections import Counter

import pytest

from router.policies import make_policy
from router.registry import NodeLoad, NodeRegistry


def _nodes(role: str, loads: list[dict]):
    reg = NodeRegistry()
    return reg, [reg.heartbeat(role, f"{role[0]}{i}:1", NodeLoad(**ld))
                 for i, ld in enumerate(loads)]


def test_load_picks_least_prefill_tokens_and_most_free_kv():
    pol = make_policy("load", seed=0)
    _, ps = _nodes("prefill", [{"outstanding_prefill_tokens": t} for t in (300, 20, 90)])
    assert pol.pick_prefill(ps) is ps[1]
    _, ds = _nodes("decode", [{"free_kv_blocks": b} for b in (5, 50, 40)])
    assert pol.pick_decode(ds) is ds[1]


def test_load_counts_what_the_router_sent_since_the_heartbeat():
    pol = make_policy("load", seed=0)
    reg, ps = _nodes("prefill", [{}, {}])
    _, ds = _nodes("decode", [{"free_kv_blocks": 10}])
    picks = []
    for _ in range(6):
        p = pol.pick_prefill(ps)
        reg.dispatch(p, ds[0], prompt_len=100, kv_blocks=1)
        picks.append(p.address)
    assert Counter(picks) == {"p0:1": 3, "p1:1": 3}  # a burst alternates, never herds
    assert ds[0].free_kv == 4


def test_two_choices_among_equals_prefers_less_busy():
    pol = make_policy("load", seed=1)
    _, ps = _nodes("prefill", [{"num_running": 9}, {"num_running": 0}])
    assert all(pol.pick_prefill(ps) is ps[1] for _ in range(20))
    _, ps = _nodes("prefill", [{}, {}, {}, {}])  # fully equal: spread over all
    assert len(Counter(pol.pick_prefill(ps).address for _ in range(200))) == 4


def test_round_robin_cycles_in_address_order():
    pol = make_policy("round_robin")
    _, ds = _nodes("decode", [{"free_kv_blocks": 1}, {"free_kv_blocks": 99}, {}])
    assert [pol.pick_decode(ds).address for _ in range(6)] == ["d0:1", "d1:1", "d2:1"] * 2
    _, ps = _nodes("prefill", [{}, {}])
    assert [pol.pick_prefill(ps).address for _ in range(3)] == ["p0:1", "p1:1", "p0:1"]


def test_random_covers_all_and_is_seeded():
    _, ps = _nodes("prefill", [{}, {}, {}])
    pa, pb = make_policy("random", seed=5), make_policy("random", seed=5)
    assert [pa.pick_prefill(ps) for _ in range(20)] == [pb.pick_prefill(ps) for _ in range(20)]
    pol = make_policy("random", seed=3)
    assert len({pol.pick_prefill(ps).address for _ in range(100)}) == 3


@pytest.mark.parametrize("name", ["load", "round_robin", "random"])
def test_exclude_and_empty(name):
    pol = make_policy(name, seed=0)
    _, ps = _nodes("prefill", [{}, {"outstanding_prefill_tokens": 500}])
    assert all(pol.pick_prefill(ps, exclude={"p0:1"}) is ps[1] for _ in range(5))
    assert pol.pick_prefill(ps[:1], exclude={"p0:1"}) is ps[0]  # nothing else: same node
    assert pol.pick_prefill([]) is None and pol.pick_decode([]) is None


def test_unknown_policy():
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("fastest")
