"""Which prefill node and which decode node take a request.

Plain Python over the registry's `Node`s, no I/O. `load`: the prefill node with the fewest
outstanding prefill tokens and the decode node with the most free KV blocks; among nodes equal
on that, two are drawn at random and the less busy one wins (power of two choices), so equal
nodes share the work without herding. `round_robin` cycles through the nodes of each role in
address order; `random` draws uniformly; `cache_aware` (`cache_aware.py`) sends a request where
its prompt's prefix is cached, balanced against load. `exclude` names nodes to avoid (a retry
after a failed prefill); when it leaves none, every given node is a candidate again. Callers pass
healthy nodes only and handle an empty list, and tell the policy when a request ends
(`finished`): the cache-aware policy learns what each decode node holds from it. Each is built by
its name (`router.policies.make_policy`).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from typing import Collection, Sequence

from router.registry import Node


class Policy(ABC):
    learns_outputs = False  # wants `finished` with each request's tokens

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    def pick_prefill(self, nodes: Sequence[Node], exclude: Collection[str] = (),
                     prompt_ids: Sequence[int] = ()) -> Node | None:
        nodes = _candidates(nodes, exclude)
        return self._pick_prefill(nodes, prompt_ids) if nodes else None

    def pick_decode(self, nodes: Sequence[Node], exclude: Collection[str] = (),
                    prompt_ids: Sequence[int] = ()) -> Node | None:
        nodes = _candidates(nodes, exclude)
        return self._pick_decode(nodes, prompt_ids) if nodes else None

    def finished(self, decode: Node, token_ids: Sequence[int]) -> None:
        """A request ended well on `decode` with these prompt + output tokens."""

    @abstractmethod
    def _pick_prefill(self, nodes: list[Node], prompt_ids: Sequence[int] = ()) -> Node: ...

    @abstractmethod
    def _pick_decode(self, nodes: list[Node], prompt_ids: Sequence[int] = ()) -> Node: ...


def _candidates(nodes: Sequence[Node], exclude: Collection[str]) -> list[Node]:
    kept = [n for n in nodes if n.address not in exclude]
    return kept or list(nodes)


class LoadPolicy(Policy):
    def _pick_prefill(self, nodes: list[Node], prompt_ids: Sequence[int] = ()) -> Node:
        best = min(n.prefill_load for n in nodes)
        return self._two_choices([n for n in nodes if n.prefill_load == best])

    def _pick_decode(self, nodes: list[Node], prompt_ids: Sequence[int] = ()) -> Node:
        best = max(n.free_kv for n in nodes)
        return self._two_choices([n for n in nodes if n.free_kv == best])

    def _two_choices(self, equals: list[Node]) -> Node:
        if len(equals) == 1:
            return equals[0]
        a, b = self.rng.sample(equals, 2)
        return b if b.busy < a.busy else a


class RoundRobinPolicy(Policy):
    def __init__(self, seed: int | None = None) -> None:
        super().__init__(seed)
        self._next = {"prefill": 0, "decode": 0}

    def _cycle(self, key: str, nodes: list[Node]) -> Node:
        nodes = sorted(nodes, key=lambda n: n.address)
        node = nodes[self._next[key] % len(nodes)]
        self._next[key] += 1
        return node

    def _pick_prefill(self, nodes: list[Node], prompt_ids: Sequence[int] = ()) -> Node:
        return self._cycle("prefill", nodes)

    def _pick_decode(self, nodes: list[Node], prompt_ids: Sequence[int] = ()) -> Node:
        return self._cycle("decode", nodes)


class RandomPolicy(Policy):
    def _pick_prefill(self, nodes: list[Node], prompt_ids: Sequence[int] = ()) -> Node:
        return self.rng.choice(nodes)

    def _pick_decode(self, nodes: list[Node], prompt_ids: Sequence[int] = ()) -> Node:
        return self.rng.choice(nodes)
