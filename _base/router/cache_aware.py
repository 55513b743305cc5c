"""The cache-aware routing policy (`--policy cache_aware`): send a request where its prompt's
prefix is most likely cached, unless that would unbalance the nodes.

The router keeps, per node, an approximate copy of the node's prefix cache: the chained hashes
of the block-sized chunks of every prompt it sent there (and, for a decode node, of each
finished conversation: prompt and output, which that node now holds), least recently used
first, bounded by the node's KV blocks from its heartbeat. The nodes' real caches evict on their
own; this copy forgets at the same size, so it errs by little. Per request and role:
- `balance`: the busiest and idlest nodes differ by more than `balance_abs` requests and by more
  than `balance_rel` times: the idlest node takes it, whatever is cached;
- `cache`: else, the node with the longest cached prefix takes it when that prefix covers at
  least `cache_threshold` of the prompt (ties: the less busy);
- `load`: else the least busy node (ties: the one whose copy holds the least, so new prefixes
  spread over the nodes).
Each decision is counted by role and reason (`pd_router_routing_decisions_total`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from router.policy import Policy
from router.registry import Node

DEFAULT_CAPACITY = 4096  # blocks, until a node's heartbeat says how many it has


def chunk_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full `block_size` chunks (router-local: Python's tuple hash)."""
    out, parent = [], 0
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, *token_ids[i:i + block_size]))
        out.append(parent)
    return out


class PrefixIndex:
    """One node's approximate cache: chunk hashes, least recently used first."""

    def __init__(self) -> None:
        self.chunks: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.chunks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int], capacity: int) -> None:
        for h in hashes:
            self.chunks[h] = None
            self.chunks.move_to_end(h)
        while len(self.chunks) > capacity:
            self.chunks.popitem(last=False)


class CacheAwarePolicy(Policy):
    learns_outputs = True

    def __init__(self, seed: int | None = None, *, block_size: int = 16,
                 cache_threshold: float = 0.5, balance_abs: int = 32,
                 balance_rel: float = 1.5, on_decision=None) -> None:
        super().__init__(seed)
        if not 0.0 <= cache_threshold <= 1.0 or balance_abs < 0 or balance_rel < 1.0:
            raise ValueError("cache_threshold must be in [0, 1], balance_abs >= 0, balance_rel >= 1")
        self.block_size = block_size
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self.indexes: dict[str, PrefixIndex] = {}
        self.on_decision = on_decision  # (role, reason) -> None
        self._hashes: tuple[Sequence[int], list[int]] = ((), [])

    def hashes(self, prompt_ids: Sequence[int]) -> list[int]:
        if self._hashes[0] is not prompt_ids:  # prefill and decode picks share one computation
            self._hashes = (prompt_ids, chunk_hashes(prompt_ids, self.block_size))
        return self._hashes[1]

    def _pick_prefill(self, nodes: list[Node], prompt_ids: Sequence[int] = ()) -> Node:
        return self._choose("prefill", nodes, prompt_ids)

    def _pick_decode(self, nodes: list[Node], prompt_ids: Sequence[int] = ()) -> Node:
        return self._choose("decode", nodes, prompt_ids)

    def _choose(self, role: str, nodes: list[Node], prompt_ids: Sequence[int]) -> Node:
        hashes = self.hashes(prompt_ids)
        index = {n.address: self.indexes.setdefault(n.address, PrefixIndex()) for n in nodes}
        busy = [n.busy for n in nodes]
        if max(busy) - min(busy) > self.balance_abs and max(busy) > self.balance_rel * min(busy):
            node, reason = min(nodes, key=lambda n: n.busy), "balance"
        else:
            matched = {n.address: index[n.address].match(hashes) for n in nodes}
            best = max(matched.values())
            if best and best * self.block_size >= self.cache_threshold * len(prompt_ids):
                node = min((n for n in nodes if matched[n.address] == best), key=lambda n: n.busy)
                reason = "cache"
            else:
                node = min(nodes, key=lambda n: (n.busy, len(index[n.address].chunks)))
                reason = "load"
        self.remember(node, hashes)
        if self.on_decision is not None:
            self.on_decision(role, reason)
        return node

    def remember(self, node: Node, hashes: Sequence[int]) -> None:
        capacity = node.load.total_kv_blocks or DEFAULT_CAPACITY
        self.indexes.setdefault(node.address, PrefixIndex()).insert(hashes, capacity)

    def finished(self, decode: Node, token_ids: Sequence[int]) -> None:
        """A request ended on `decode`: its prompt and output are now cached there."""
        self.remember(decode, chunk_hashes(token_ids, self.block_size))

    def forget(self, address: str) -> None:
        self.indexes.pop(address, None)
