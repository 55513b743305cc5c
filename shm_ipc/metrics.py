"""Prometheus metrics of the transport: refused records.

`RECORDS_REFUSED` is created here once, in the default registry, and importable by node code.
Exposing `/metrics` and adding per-node labels is left to the node services.
"""

from __future__ import annotations

import logging

from prometheus_client import REGISTRY, Counter

log = logging.getLogger("shm_ipc")

RECORDS_REFUSED = Counter(
    "pd_ring_records_refused",
    "Records (ring or ZMQ data messages) refused by a reader and dropped",
    ["reason"],
)


def refuse(reason: str, message: str) -> None:
    """Count one refused record under `reason` and log why; the reader then carries on."""
    RECORDS_REFUSED.labels(reason=reason).inc()
    log.error("refused record (%s): %s", reason, message)


def refused_count(reason: str) -> float:
    return REGISTRY.get_sample_value("pd_ring_records_refused_total", {"reason": reason}) or 0.0
