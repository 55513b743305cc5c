"""The routing policies by name, as `--policy` gives them (`POLICIES`), and `make_policy`,
which builds one: the plain ones of `router.policy` and the cache-aware one of
`router.cache_aware`."""

from __future__ import annotations

from router.cache_aware import CacheAwarePolicy
from router.policy import LoadPolicy, Policy, RandomPolicy, RoundRobinPolicy

POLICIES = {"load": LoadPolicy, "round_robin": RoundRobinPolicy, "random": RandomPolicy,
            "cache_aware": CacheAwarePolicy}


def make_policy(name: str, seed: int | None = None, **options) -> Policy:
    """The policy `name`; `options` are the cache-aware policy's thresholds (ignored by the
    others)."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    if name == "cache_aware":
        return CacheAwarePolicy(seed, **options)
    return POLICIES[name](seed)
