"""Prometheus metrics of the node services, defined once for both roles.

Every metric carries `role` and `node` labels; a node binds its children once with
`for_node(role, node_id)`. Names follow vLLM's vocabulary with a `pd_` prefix. The router's own
metrics are in `router/metrics.py`; the transport's refusal counter is in `shm_ipc/metrics.py`.
Derived figures are left to PromQL: prefill tokens/s is `rate(pd_prompt_tokens_computed_total)`,
the mean MTP acceptance length is `1 + rate(accepted_tokens) / rate(drafts)` (vLLM's meaning).
The speculative-decoding and step-gap metrics are set by the decode loop that runs MTP and the
overlap scheduler; a node without them leaves them at zero.
"""

from __future__ import annotations

import gc
import time
from types import SimpleNamespace

from prometheus_client import Counter, Gauge, Histogram

LABELS = ("role", "node")
# Sub-millisecond to minutes.
TIME_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

_WAITING = Gauge("pd_num_requests_waiting", "Requests waiting to be scheduled", LABELS)
_RUNNING = Gauge("pd_num_requests_running", "Requests in the running batch", LABELS)
_KV_USAGE = Gauge("pd_kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)", LABELS)
_TOKENS = Counter("pd_prompt_tokens_computed", "Prompt tokens prefilled", LABELS)
_GEN_TOKENS = Counter("pd_generation_tokens", "Tokens generated", LABELS)
_STEP = Histogram("pd_step_duration_seconds", "Wall time of one engine step", LABELS,
                  buckets=TIME_BUCKETS)
# NOTE: tier: how the KV crossed, "shm" (the shared-memory ring, one host) or "zmq" (frames)
_KV_SENT = Counter("pd_kv_sent_bytes", "KV bytes sent to decode nodes", LABELS + ("tier",))
_KV_PARTS = Counter("pd_kv_parts_sent", "Parts of a request's KV sent while its prefill still ran "
                   "(the blocks its earlier chunks filled)", LABELS + ("tier",))
_KV_RECV = Counter("pd_kv_received_bytes", "KV bytes received from prefill nodes", LABELS + ("tier",))
_KV_XFER = Histogram("pd_kv_transfer_seconds",
                     "One request's KV transfer: prefill node, from the start of its send to the "
                     "decode node's ack; decode node, from its KVAccept to the last record installed",
                     LABELS + ("tier",), buckets=TIME_BUCKETS)
_KV_XFER_BYTES = Histogram("pd_kv_transfer_bytes", "KV bytes of one request's transfer",
                           LABELS + ("tier",), buckets=tuple(float(1 << n) for n in range(16, 34, 2)))
_HANDOFF = Gauge("pd_transfers_waiting", "Requests handed to a decode node, not yet acknowledged",
                 LABELS)
_REFUSED = Counter("pd_requests_refused", "Requests refused or failed by a node", LABELS + ("reason",))
_PREEMPT = Counter("pd_num_preemptions", "Requests preempted (recompute) for lack of KV blocks",
                   LABELS)
_FIRST_SEND = Histogram("pd_first_token_send_seconds",
                        "From a request's arrival at the prefill node to its first token sent "
                        "(FIRST_TOKEN to the decode node, or the answer to the router)", LABELS,
                        buckets=TIME_BUCKETS)
_FIRST_RECV = Histogram("pd_first_token_receive_seconds",
                        "From a request's RequestMeta at the decode node (sent as its prefill "
                        "starts) to its FIRST_TOKEN there", LABELS, buckets=TIME_BUCKETS)
_JOIN = Histogram("pd_request_join_seconds",
                  "From a request's first token at the decode node to its joining the running "
                  "batch (blocks reserved, KV received and installed)", LABELS, buckets=TIME_BUCKETS)
_EXPOSED = Histogram("pd_kv_exposed_seconds",
                     "From a request's KV being complete at the decode node (KVDone) to its first "
                     "decoded token: the transfer's time in no step's shadow, plus that step",
                     LABELS, buckets=TIME_BUCKETS)
_BATCH = Histogram("pd_batch_size", "Requests in one engine step", LABELS,
                   buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
_STEP_DEVICE = Histogram("pd_decode_step_device_seconds",
                         "Device time of one decode step (CUDA events from its start to its "
                         "results copied to the host; on CPU the worker's wall time)", LABELS,
                         buckets=TIME_BUCKETS)
_STEP_GAP = Histogram("pd_decode_step_gap_seconds",
                      "Device idle time between two decode steps (the overlap scheduler's gap)",
                      LABELS, buckets=TIME_BUCKETS)
_SEND_INTERVAL = Histogram("pd_token_send_interval_seconds",
                          "Between a decode node's sends of two consecutive steps' tokens to the "
                          "routers (the pace every stream sees leave the node)", LABELS,
                          buckets=TIME_BUCKETS)
_DRAFTS = Counter("pd_spec_decode_num_drafts", "MTP draft proposals verified", LABELS)
_DRAFT_TOKENS = Counter("pd_spec_decode_num_draft_tokens", "MTP draft tokens proposed", LABELS)
_ACCEPTED = Counter("pd_spec_decode_num_accepted_tokens", "MTP draft tokens accepted", LABELS)
_AHEAD = Counter("pd_decode_steps_ahead",
                 "Decode steps launched before the host had read the previous step (overlap)",
                 LABELS)
_SPEC_PLAIN = Counter("pd_spec_decode_plain_steps",
                      "Decode steps run without MTP because plain steps measured faster for "
                      "that batch size (--spec-fallback)", LABELS)
_HOST = Counter("pd_decode_host_seconds",
                "Decode loop host time by phase: schedule, launch, wait (for the device), process, "
                "intake (requests and KV arriving), stream (tokens sent)", LABELS + ("phase",))
_PREFIX_QUERIES = Counter("pd_prefix_cache_queries",
                          "Prompt tokens looked up in the prefix cache (a decode node looks up "
                          "each handed-over prompt)", LABELS)
_PREFIX_HITS = Counter("pd_prefix_cache_hits",
                       "Prompt tokens found in the prefix cache (not computed, or not received)",
                       LABELS)
_PREFIX_EVICTED = Counter("pd_prefix_cache_evicted_blocks",
                          "Cached KV blocks evicted to make room", LABELS)
_ACCEPTED_POS = Counter("pd_spec_decode_num_accepted_tokens_per_pos",
                        "MTP draft tokens accepted, by draft position (0-based)",
                        LABELS + ("position",))


def _mirror(counter):
    """`mirror(total)` raises `counter` to a running total kept elsewhere (the scheduler's, the
    decode loop's)."""
    seen = 0

    def mirror(total: int) -> None:
        nonlocal seen
        counter.inc(total - seen)
        seen = total

    return mirror


def _mirror_phases(role: str, node_id: str):
    """`mirror(totals)` raises each phase's counter to `totals[phase]` (seconds kept elsewhere,
    growing): a `_mirror` per phase."""
    mirrors = {}

    def mirror(totals: dict[str, float]) -> None:
        for phase, total in totals.items():
            if phase not in mirrors:
                mirrors[phase] = _mirror(_HOST.labels(role=role, node=node_id, phase=phase))
            mirrors[phase](total)

    return mirror


def export_prefix_cache(metrics: SimpleNamespace, engine) -> None:
    """Mirror the engine's prefix-cache counters into the node's metrics."""
    if engine.prefix is not None:
        metrics.count_prefix_queries(engine.prefix.stats.queries)
        metrics.count_prefix_hits(engine.prefix.stats.hits)
        metrics.count_prefix_evictions(engine.allocator.num_evictions)


_GC_PAUSE = Histogram("pd_gc_pause_seconds",
                      "Pauses of the process's Python garbage collections of generations 1 and "
                      "2 (a node's decoding stops for them)", LABELS + ("generation",),
                      buckets=TIME_BUCKETS)
_gc_watched = False


def time_collections(on_pause):
    """Call `on_pause(generation, seconds)` after each of the process's garbage collections of
    generations 1 and 2 (the young generation's are not timed); returns the callback installed
    (`gc.callbacks.remove` it to stop)."""
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if info["generation"] == 0:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            on_pause(info["generation"], time.perf_counter() - started[0])

    gc.callbacks.append(on_gc)
    return on_gc


def watch_gc(role: str, node_id: str) -> None:
    """Time the process's collections of generations 1 and 2 into `pd_gc_pause_seconds`, under
    the first node that asks (once a process)."""
    global _gc_watched
    if _gc_watched:
        return
    _gc_watched = True
    pauses = {g: _GC_PAUSE.labels(role=role, node=node_id, generation=str(g)) for g in (1, 2)}
    time_collections(lambda generation, seconds: pauses[generation].observe(seconds))


def for_node(role: str, node_id: str) -> SimpleNamespace:
    """The node's children of every metric (and its process's collections timed: `watch_gc`)."""
    lab = {"role": role, "node": node_id}
    watch_gc(role, node_id)
    return SimpleNamespace(
        waiting=_WAITING.labels(**lab), running=_RUNNING.labels(**lab),
        kv_usage=_KV_USAGE.labels(**lab), prompt_tokens=_TOKENS.labels(**lab),
        generation_tokens=_GEN_TOKENS.labels(**lab), step_seconds=_STEP.labels(**lab),
        kv_sent_bytes=lambda tier: _KV_SENT.labels(**lab, tier=tier),
        kv_parts_sent=lambda tier: _KV_PARTS.labels(**lab, tier=tier),
        kv_received_bytes=lambda tier: _KV_RECV.labels(**lab, tier=tier),
        kv_transfer_seconds=lambda tier: _KV_XFER.labels(**lab, tier=tier),
        kv_transfer_bytes=lambda tier: _KV_XFER_BYTES.labels(**lab, tier=tier),
        transfers_waiting=_HANDOFF.labels(**lab),
        preemptions=_PREEMPT.labels(**lab), first_token_send_seconds=_FIRST_SEND.labels(**lab),
        count_preemptions=_mirror(_PREEMPT.labels(**lab)),
        count_steps_ahead=_mirror(_AHEAD.labels(**lab)),
        first_token_receive_seconds=_FIRST_RECV.labels(**lab), join_seconds=_JOIN.labels(**lab),
        kv_exposed_seconds=_EXPOSED.labels(**lab),
        batch_size=_BATCH.labels(**lab), step_gap_seconds=_STEP_GAP.labels(**lab),
        step_device_seconds=_STEP_DEVICE.labels(**lab),
        send_interval_seconds=_SEND_INTERVAL.labels(**lab),
        spec_drafts=_DRAFTS.labels(**lab), spec_draft_tokens=_DRAFT_TOKENS.labels(**lab),
        spec_accepted_tokens=_ACCEPTED.labels(**lab),
        count_spec_plain_steps=_mirror(_SPEC_PLAIN.labels(**lab)),
        count_host_seconds=_mirror_phases(role, node_id),
        count_prefix_queries=_mirror(_PREFIX_QUERIES.labels(**lab)),
        count_prefix_hits=_mirror(_PREFIX_HITS.labels(**lab)),
        count_prefix_evictions=_mirror(_PREFIX_EVICTED.labels(**lab)),
        spec_accepted_at=lambda pos: _ACCEPTED_POS.labels(role=role, node=node_id, position=str(pos)),
        refused=lambda reason: _REFUSED.labels(role=role, node=node_id, reason=reason),
    )
