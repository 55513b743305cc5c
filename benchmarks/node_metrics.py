"""A serving run's figures from its processes' Prometheus endpoints and logs (`bench_serving.py`,
`gpu/bench_mixed.py`): each node's and the router's histogram sums and counts, the decode node's
host time by phase and the tail buckets (`node_sums`, `snapshot`), and what the nodes' log files
got during a run (`node_log_lines`)."""

from __future__ import annotations

import urllib.request


def node_log_lines(since: dict[str, int]) -> list[str]:
    """The lines the nodes' log files got past the given sizes: {path: bytes}."""
    out = []
    for path, size in since.items():
        with open(path, errors="replace") as f:
            f.seek(size)
            out += f.readlines()
    return out


def snapshot(lau) -> dict[tuple[str, str], float]:
    """The nodes' and the router's histogram sums and counts and the decode node's host time by
    phase, summed over the nodes of each role: {(role, name): value}; a phase is keyed
    'phase="NAME"'."""
    out: dict[tuple[str, str], float] = {}
    for node_name, n in lau.nodes.items():
        role = node_name.split("-")[0]
        for key, value in node_sums(n["metrics"]).items():
            out[(role, key)] = out.get((role, key), 0.0) + value
    for key, value in node_sums(lau.url.split("//", 1)[1]).items():
        out[("router", key)] = value
    return out


TAIL_BUCKETS = ("pd_time_to_first_token_seconds_bucket", "pd_inter_token_latency_seconds_bucket",
                "pd_request_queue_time_seconds_bucket", "pd_router_first_token_nodes_seconds_bucket",
                "pd_first_token_send_seconds_bucket", "pd_first_token_receive_seconds_bucket",
                "pd_request_join_seconds_bucket", "pd_token_send_interval_seconds_bucket",
                "pd_decode_step_gap_seconds_bucket")


def node_sums(address: str) -> dict[str, float]:
    """One node's (or the router's) histogram sums and counts, host time by phase and
    step-duration buckets, from its /metrics at `address` (host:port): {name: value}, a phase
    keyed 'phase="NAME"', a bucket 'step_le="BOUND"' (steps that took at most BOUND seconds),
    and the `TAIL_BUCKETS`' buckets as 'NAME_le="BOUND"' (NAME without `_bucket`)."""
    out: dict[str, float] = {}
    for line in urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode().splitlines():
        name, _, rest = line.partition("{")
        if line.startswith("pd_decode_host_seconds_total{"):
            key = 'phase="' + line.split('phase="', 1)[1].split('"', 1)[0] + '"'
        elif name == "pd_step_duration_seconds_bucket":
            key = 'step_le="' + line.split('le="', 1)[1].split('"', 1)[0] + '"'
        elif name in TAIL_BUCKETS:
            key = name[:-len("_bucket")] + '_le="' + line.split('le="', 1)[1].split('"', 1)[0] + '"'
        elif name.endswith(("_sum", "_count")) and rest:
            key = name
        else:
            continue
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out
