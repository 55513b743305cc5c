"""The router's view of the nodes: who exists, who is healthy, how loaded each one is.

Plain Python, no I/O: the backend feeds it (nodes from the command line with `add`, each
heartbeat with `heartbeat`, transport failures with `mark_down`, a periodic `sweep`) and the
policy reads it. A node given on the command line starts down and comes up with its first
heartbeat; a node that registers itself comes up on its first heartbeat too. A node whose
last heartbeat is older than `heartbeat_timeout` is marked down and comes back with the next
one; a self-registered node down for longer than `forget_after` is dropped. A node whose
heartbeat says it is draining (shutting down) stays up, so its requests run to their end, but
is not routable: the policy gets `routable()` nodes only.

Load is what the node last reported (queue length, running requests, free KV blocks,
outstanding prefill tokens) plus what this router sent it since (`dispatch`), so that a burst
between two heartbeats does not all land on one node. Sending heartbeats and reading them off
the wire is left to the node services and the ZMQ backend.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Callable

log = logging.getLogger(__name__)


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class NodeLoad:
    """A node's load as its heartbeat reports it."""

    queue_len: int = 0
    num_running: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    outstanding_prefill_tokens: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"heartbeat load {f.name}={v!r} must be a non-negative integer")

    @classmethod
    def from_dict(cls, d: dict) -> "NodeLoad":
        """From a heartbeat payload; keys this router does not know are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(eq=False)
class Node:
    role: Role
    address: str
    static: bool = False  # given on the command line: never forgotten
    healthy: bool = False
    draining: bool = False  # up, finishing its requests, taking no new ones
    last_heartbeat: float | None = None
    down_since: float | None = None
    load: NodeLoad = field(default_factory=NodeLoad)
    # what this router dispatched and the node has not yet finished with
    pending_prefill_tokens: int = 0
    pending_kv_blocks: int = 0
    pending_requests: int = 0

    @property
    def prefill_load(self) -> int:
        """Prompt tokens queued on this prefill node, as far as the router knows."""
        return self.load.outstanding_prefill_tokens + self.pending_prefill_tokens

    @property
    def free_kv(self) -> int:
        """KV blocks this decode node can still give out, as far as the router knows."""
        return self.load.free_kv_blocks - self.pending_kv_blocks

    @property
    def busy(self) -> int:
        """Requests queued or running on the node: the tie-breaker between equal nodes."""
        return self.load.queue_len + self.load.num_running + self.pending_requests


class NodeRegistry:
    def __init__(self, heartbeat_timeout: float = 3.0, forget_after: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if heartbeat_timeout <= 0 or forget_after < heartbeat_timeout:
            raise ValueError(f"heartbeat_timeout={heartbeat_timeout} must be > 0 and "
                             f"forget_after={forget_after} >= heartbeat_timeout")
        self.heartbeat_timeout = heartbeat_timeout
        self.forget_after = forget_after
        self._clock = clock
        self._nodes: dict[str, Node] = {}

    def add(self, role: Role | str, address: str) -> Node:
        """A node known from the command line; down until its first heartbeat."""
        node = self._get_or_create(Role(role), address)
        node.static = True
        return node

    def heartbeat(self, role: Role | str, address: str, load: NodeLoad | dict,
                  draining: bool = False) -> Node:
        """Record a heartbeat; registers an unknown node and brings a down one back."""
        node = self._get_or_create(Role(role), address)
        node.load = load if isinstance(load, NodeLoad) else NodeLoad.from_dict(load)
        node.last_heartbeat = self._clock()
        if draining != node.draining:
            log.info("%s node %s %s", node.role.value, address,
                     "is draining" if draining else "takes requests again")
            node.draining = draining
        if not node.healthy:
            log.info("%s node %s is up", node.role.value, address)
            node.healthy, node.down_since = True, None
        return node

    def mark_down(self, address: str, reason: str) -> None:
        """Take a node out now (a send failed, a request on it broke); a heartbeat brings it back."""
        node = self._nodes.get(address)
        if node is not None and node.healthy:
            log.warning("%s node %s is down: %s", node.role.value, address, reason)
            node.healthy, node.down_since = False, self._clock()

    def sweep(self) -> list[Node]:
        """Mark down nodes with late heartbeats, forget long-gone ones; returns those changed."""
        now = self._clock()
        changed = []
        for node in list(self._nodes.values()):
            if node.healthy and now - node.last_heartbeat > self.heartbeat_timeout:
                self.mark_down(node.address, f"no heartbeat for {now - node.last_heartbeat:.1f}s")
                changed.append(node)
            elif (not node.healthy and not node.static and node.down_since is not None
                  and now - node.down_since > self.forget_after):
                log.info("forgetting %s node %s", node.role.value, node.address)
                del self._nodes[node.address]
                changed.append(node)
        return changed

    def get(self, address: str) -> Node | None:
        return self._nodes.get(address)

    def nodes(self, role: Role | str | None = None) -> list[Node]:
        return [n for n in self._nodes.values() if role is None or n.role == Role(role)]

    def healthy(self, role: Role | str) -> list[Node]:
        return [n for n in self.nodes(role) if n.healthy]

    def routable(self, role: Role | str) -> list[Node]:
        """Healthy nodes that take new requests (not draining)."""
        return [n for n in self.healthy(role) if not n.draining]

    def counts(self) -> dict:
        """Routable nodes per role, in `Backend.health()`'s shape."""
        return {r.value: len(self.routable(r)) for r in Role}

    # router-side load accounting between heartbeats

    def dispatch(self, prefill: Node, decode: Node, prompt_len: int, kv_blocks: int) -> None:
        prefill.pending_prefill_tokens += prompt_len
        prefill.pending_requests += 1
        decode.pending_kv_blocks += kv_blocks
        decode.pending_requests += 1

    def prefill_done(self, prefill: Node, prompt_len: int) -> None:
        prefill.pending_prefill_tokens = max(0, prefill.pending_prefill_tokens - prompt_len)
        prefill.pending_requests = max(0, prefill.pending_requests - 1)

    def decode_done(self, decode: Node, kv_blocks: int) -> None:
        decode.pending_kv_blocks = max(0, decode.pending_kv_blocks - kv_blocks)
        decode.pending_requests = max(0, decode.pending_requests - 1)

    def _get_or_create(self, role: Role, address: str) -> Node:
        node = self._nodes.get(address)
        if node is None:
            node = self._nodes[address] = Node(role, address, down_since=self._clock())
        elif node.role != role:
            raise ValueError(f"node {address} is registered as {node.role.value}, "
                             f"not {role.value}")
        return node
