"""Prometheus metrics of the transport: refused records.

`RECORDS_REFUSED` is created here once, in the default registry, and importable by node code.
Exposing `/metrics` and adding per-node labels is left to the node services.
"""

from __future__ import annotations

import logging

from prometheus_client import REGISTRY, Counter

from pd.wire.refusals import RefusalLog

log = logging.getLogger("shm_ipc")
_REFUSALS = RefusalLog(log)  # rate-limited: a flood of garbage must not flood the log

RECORDS_REFUSED = Counter(
    "pd_ring_records_refused",
    "Records (ring or ZMQ data messages) refused by a reader and dropped",
    ["reason"],
)


def refuse(reason: str, message: str) -> None:
    """Count one refused record under `reason` and log why; the reader then carries on."""
    RECORDS_REFUSED.labels(reason=reason).inc()
    _REFUSALS("refused record (%s): %s", reason, message)


def refused_count(reason: str) -> float:
    return REGISTRY.get_sample_value("pd_ring_records_refused_total", {"reason": reason}) or 0.0
