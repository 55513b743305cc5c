"""Request tracing for latency work: with `PD_TRACE_REQUESTS=DIR`, each process (router, prefill
node, decode node) appends one line per event of a request's way to its first token,
`EVENT REQ_ID SECONDS` (time.monotonic, one clock for every process of a host), to
DIR/PID.trace. The events, in their order: router_arrive (the HTTP request, as its sequence
was made), router_dispatch (PrefillRequest sent), prefill_admit (read by the prefill node),
decode_meta (RequestMeta read: sent as the prefill starts, or with the first token),
prefill_first_sent (FIRST_TOKEN to the decode node), decode_first_in (FIRST_TOKEN read; sent on
to the router at the end of that read), router_first_read (read off the router's event socket),
router_first_delta (its text ready for the client). Unset: nothing is done beyond one check
per event. `hops` reads a directory back (`benchmarks/bench_serving.py
--trace`)."""

from __future__ import annotations

import os
import time
from collections import defaultdict

ENV = "PD_TRACE_REQUESTS"
EVENTS = ("router_arrive", "router_dispatch", "prefill_admit", "decode_meta",
          "prefill_first_sent", "decode_first_in", "router_first_read", "router_first_delta")
_file = None
_dir = os.environ.get(ENV) or None


def trace(event: str, req_id: str, t: float | None = None) -> None:
    """Record `event` of request `req_id` at monotonic time `t` (now when None)."""
    global _file
    if _dir is None:
        return
    if _file is None:
        _file = open(os.path.join(_dir, f"{os.getpid()}.trace"), "a", buffering=1)
    _file.write(f"{event} {req_id} {time.monotonic() if t is None else t:.6f}\n")


def hops(directory: str, since: float = 0.0) -> dict[str, list[float]]:
    """Seconds between consecutive events of each request that arrived at the router at or
    after `since` (monotonic) and met every event: {"A -> B": [seconds, ...]}. A retried
    request ("ID-retry" at the nodes) counts under its first attempt's events only."""
    seen: dict[str, dict[str, float]] = defaultdict(dict)
    for name in os.listdir(directory):
        if name.endswith(".trace"):
            with open(os.path.join(directory, name)) as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 3:
                        seen[parts[1]].setdefault(parts[0], float(parts[2]))
    out: dict[str, list[float]] = {f"{a} -> {b}": [] for a, b in zip(EVENTS, EVENTS[1:])}
    for events in seen.values():
        if len(events) == len(EVENTS) and events["router_arrive"] >= since:
            for a, b in zip(EVENTS, EVENTS[1:]):
                out[f"{a} -> {b}"].append(events[b] - events[a])
    return out
