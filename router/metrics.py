"""The router's Prometheus metrics, on a registry of its own (one per server instance).

Names follow vLLM's vocabulary with a `pd_` prefix: request counts by endpoint and status,
time to first token, inter-token latency and end-to-end latency (fed by one `RequestTimer`
per request), queue time, prompt and generation tokens, requests running and waiting,
finished requests by reason, aborts by reason, and the healthy nodes per role as the backend
reports them. Every sample is rendered with `role="router"` and `node` (env `PD_NODE_ID`, else
the host name) so one Prometheus query can tell the router's series from the nodes'. Retries of
the ZMQ backend (another prefill node before the first token) count in `BACKEND_RETRIES`, and
the ZMQ messages it refuses in `MESSAGES_REFUSED`, one per process; the nodes' part of each
first token in `FIRST_TOKEN_NODES`. Serving `/metrics` is the
server's job; the nodes export their own metrics. Several router workers on one port share
their samples through prometheus_client's multiprocess mode (`router.workers`).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the server)
from prometheus_client.metrics_core import Metric

MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # set for router workers (`router.workers`)
_PROCESS = CollectorRegistry()
BACKEND_RETRIES = Counter("pd_router_backend_retries",
                          "Requests the backend retried on another prefill node before the first "
                          "token", registry=_PROCESS)
MESSAGES_REFUSED = Counter("pd_router_messages_refused",
                           "ZMQ messages the router refused (malformed, unknown, too large, wrong "
                           "frames) by socket: 'events' (its event PULL), 'control' (node replies)",
                           ["socket"], registry=_PROCESS)
ROUTING_DECISIONS = Counter("pd_router_routing_decisions",
                            "Node choices of the cache-aware policy, by role and reason: 'cache' "
                            "(longest cached prefix), 'load' (no prefix cached enough: least "
                            "busy), 'balance' (nodes too unequal: least busy)",
                            ["role", "reason"], registry=_PROCESS)

# Sub-millisecond to minutes.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0)
FIRST_TOKEN_NODES = Histogram("pd_router_first_token_nodes_seconds",
                              "Time from a request's dispatch to its prefill node to its first "
                              "token read off the router's event socket: the nodes' part of TTFT "
                              "(the rest is the router's own: admission, tokenizing, writing)",
                              buckets=_LATENCY_BUCKETS, registry=_PROCESS)
_ITL_BUCKETS = (0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class RouterMetrics:
    def __init__(self, health: Callable[[], dict] | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.http_requests = Counter("pd_http_requests", "HTTP requests by endpoint and status",
                                     ["endpoint", "status"], registry=r)
        self.ttft = Histogram("pd_time_to_first_token_seconds",
                              "Time from arrival to the first token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("pd_inter_token_latency_seconds",
                             "Time between consecutive output tokens", buckets=_ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram("pd_e2e_request_latency_seconds",
                             "Time from arrival to the last token", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.queue_time = Histogram("pd_request_queue_time_seconds",
                                    "Time spent waiting in the router's admission queue",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pd_prompt_tokens", "Prefill tokens processed", registry=r)
        self.generation_tokens = Counter("pd_generation_tokens", "Generation tokens produced",
                                         registry=r)
        self.running = Gauge("pd_num_requests_running", "Requests in flight to the nodes",
                             registry=r, multiprocess_mode="livesum")
        self.waiting = Gauge("pd_num_requests_waiting", "Requests in the admission queue",
                             registry=r, multiprocess_mode="livesum")
        self.success = Counter("pd_request_success", "Finished choices by finish reason",
                               ["finished_reason"], registry=r)
        self.aborts = Counter("pd_request_aborts", "Aborted requests by reason", ["reason"],
                              registry=r)
        self.retries = Counter("pd_request_retries", "Requests retried before the first token",
                               registry=r)
        self.healthy_nodes = Gauge("pd_router_healthy_nodes", "Healthy nodes by role", ["role"],
                                   registry=r, multiprocess_mode="livemax")
        self.connections_refused = Counter(
            "pd_http_connections_refused", "Connections answered 503 at once: --max-connections "
            "were open", registry=r)
        self.header_timeouts = Counter(
            "pd_http_header_timeouts", "Connections closed for not sending a request head "
            "within --header-timeout", registry=r)
        self._health = health
        self.labels = {"role": "router", "node": os.environ.get("PD_NODE_ID") or socket.gethostname()}

    def render(self) -> bytes:
        if self._health is not None:
            h = self._health()
            for role in ("prefill", "decode"):
                self.healthy_nodes.labels(role).set(int(h.get(role, 0)))
        return generate_latest(self)

    def collect(self):
        """The registry's metrics with the router's labels added (a sample's own labels win:
        `pd_router_healthy_nodes` keeps the role of the nodes it counts). With several router
        workers (`router.workers`, prometheus_client's multiprocess mode) every worker's
        samples, summed (gauges: the live workers' sum, or max for the healthy nodes)."""
        registries = (self.registry, _PROCESS)
        if os.environ.get(MULTIPROCESS_ENV):
            from prometheus_client import multiprocess

            registries = (CollectorRegistry(),)
            multiprocess.MultiProcessCollector(registries[0])
        for registry in registries:
            for mf in registry.collect():
                out = Metric(mf.name, mf.documentation, mf.type, mf.unit)
                out.samples = [s._replace(labels={**self.labels, **s.labels}) for s in mf.samples]
                yield out


class RequestTimer:
    """Latency metrics of one request: TTFT, inter-token latency, end to end, finish reasons."""

    def __init__(self, metrics: RouterMetrics, t_arrival: float) -> None:
        self.m = metrics
        self.t_arrival = t_arrival
        self.last: dict[int, float] = {}

    def observe(self, d) -> None:
        """Account one `Delta` (see `choice.py`) of the request."""
        now = time.perf_counter()
        if d.num_tokens:
            self.m.generation_tokens.inc(d.num_tokens)
            if not self.last:
                self.m.ttft.observe(now - self.t_arrival)
            elif d.index in self.last:
                gap = (now - self.last[d.index]) / d.num_tokens
                for _ in range(d.num_tokens):
                    self.m.itl.observe(gap)
            self.last[d.index] = now
        if d.finish_reason:
            self.m.success.labels(d.finish_reason).inc()

    def done(self) -> None:
        self.m.e2e.observe(time.perf_counter() - self.t_arrival)
