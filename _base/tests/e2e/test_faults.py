"""Faults with real processes (router, two prefill and two decode nodes on loopback): kill -9 a
decode node mid-stream, a prefill node mid-prefill, the router mid-stream; SIGTERM (drain) a
decode node mid-stream and a prefill node mid-prefill; a drain that times out. Each killed part
is restarted on its ports and taken back by the router; the drained ones are not (the cluster
shrinks to one prefill and one decode node for the last case).

After each case: no request hung past its timeout, every affected client got an error after its
tokens or a retried success (none lost: an error before any token), the surviving nodes are back
to all blocks free, no shared-memory segment of a dead process and no stray process is left.
The cases share one cluster and run in file order; `pytest -s` prints the table of outcomes.
"""

from __future__ import annotations

import os
import random
import signal
import time

import httpx
import pytest

from fault_cluster import FaultCluster, Stream

TIMEOUT = 60.0  # no request may take longer
# d1's drain timeout, which the last case runs out: far shorter than its streams' rest (a fast
# host decoded one 400-token stream of the tiny model to its end within 1.0 s)
DRAIN_SHORT = 0.3


@pytest.fixture(scope="module")
def table():
    rows: list[dict] = []
    yield rows
    cols = ("case", "requests", "ok", "errored", "lost", "hung", "retried", "slowest s", "after")
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    lines += [" | ".join(str(r.get(c, "")) for c in cols) for r in rows]
    print("\n\nfault cases (errored: error after tokens; lost: error before any token)\n"
          + "\n".join(lines))


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory, table):
    c = FaultCluster(tiny_model_dir, tmp_path_factory.mktemp("faults"),
                     prefill_args=("--num-blocks", "512", "--max-num-batched-tokens", "64"),
                     decode_args=("--num-blocks", "512"))
    c.start(d1=("--drain-timeout", str(DRAIN_SHORT)))
    yield c
    codes = c.stop()
    assert codes == {name: 0 for name in codes}, codes
    assert not c.segments(), c.segments()
    assert not c.leftover_processes()
    table.append({"case": "stop all (SIGTERM nodes, SIGINT router)", "after":
                  f"exit codes {sorted(set(codes.values()))}, 0 segments, 0 processes left"})


def body(c: FaultCluster, prompt, max_tokens: int) -> dict:
    return {"model": os.path.basename(c.model_dir), "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "logprobs": 0, "ignore_eos": True}


def long_prompt(i: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(3, 250) for _ in range(300)]


def streams(c: FaultCluster, prompts, max_tokens: int) -> list[Stream]:
    return [Stream(c.url, body(c, p, max_tokens), TIMEOUT) for p in prompts]


def wait_tokens(ss: list[Stream], n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while any(s.tokens < n and s.error is None and not s.done for s in ss):
        assert time.monotonic() < deadline, [s.tokens for s in ss]
        time.sleep(0.02)


def wait_prefill_queued(c: FaultCluster, name: str, timeout: float = 20.0) -> int:
    """Until the prefill node has prompts waiting; returns the requests it holds then."""
    deadline = time.monotonic() + timeout
    while True:
        stats = c.health(name)[1]
        if stats["outstanding_prefill_tokens"]:
            return stats["queue_len"] + stats["running"] + stats["handing_off"]
        assert time.monotonic() < deadline, f"{name} never had a prompt waiting"
        time.sleep(0.005)


def finish(ss: list[Stream]) -> dict[str, int]:
    for s in ss:
        s.join(TIMEOUT + 5)
    out = {k: 0 for k in ("ok", "errored", "lost", "hung")}
    for s in ss:
        out[s.outcome] += 1
    return out


def slowest(ss: list[Stream]) -> str:
    return f"{max(s.seconds for s in ss):.1f}"


def survivors_idle(c: FaultCluster, names) -> str:
    stats = c.wait_idle(names)
    busy = {n: (s["free_blocks"], s["total_blocks"]) for n, s in stats.items()
            if s["free_blocks"] != s["total_blocks"] or s["running"]}
    assert not busy, f"blocks still held (free, total): {busy}"
    # A decode node checks its ring producers' lives every 0.5 s (its liveness interval) and
    # removes a dead one's ring then: the survivors may be idle before that check came.
    deadline = time.monotonic() + 5.0
    while c.stale_segments() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not c.stale_segments(), c.stale_segments()
    return f"{'/'.join(names)} idle, 0 stale segments"


def draining_or_gone(c: FaultCluster, name: str, timeout: float = 5.0) -> bool:
    """Until the node's /health says 503 draining (or it is gone, drained already)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status, health = c.health(name)
        except httpx.TransportError:
            return True
        if status == 503 and health["status"] == "draining":
            return True
        time.sleep(0.01)
    return False


def routed_again(c: FaultCluster, name: str, metric: str) -> int:
    """Send requests until the restarted node did work; returns how many it took."""
    c.wait_routable()
    for i in range(1, 21):
        prompt = long_prompt(1000 + i)[:40]
        s = streams(c, [prompt, prompt[::-1]], 4)
        assert finish(s)["ok"] == 2
        if c.metric(name, metric) > 0:
            return i
    raise AssertionError(f"the router sent nothing to the restarted {name}")


def row(case: str, ss: list[Stream], counts: dict, retried: float, after: str) -> dict:
    return {"case": case, "requests": sum(counts.values()), **counts, "retried": int(retried),
            "slowest s": slowest(ss), "after": after}


def test_kill9_decode_mid_stream(cluster, table):
    c = cluster
    retries = c.router_metric("pd_router_backend_retries_total")
    ss = streams(c, [f"x = {i}" for i in range(6)], 400)  # long enough to outlast the poll
    wait_tokens(ss, 2)
    c.nodes["d0"].kill()
    counts = finish(ss)
    assert counts["hung"] == 0 and counts["lost"] == 0, counts
    assert counts["errored"] and counts["ok"], counts
    assert all("decode" in s.error for s in ss if s.error), [s.error for s in ss]
    later = finish(streams(c, [f"z = {i}" for i in range(4)], 8))
    assert later["ok"] == 4, later  # new requests go to the surviving decode node
    after = survivors_idle(c, ["p0", "p1", "d1"])
    c.start_node("d0")
    took = routed_again(c, "d0", "pd_generation_tokens_total")
    table.append(row("kill -9 decode mid-stream", ss, counts,
                     c.router_metric("pd_router_backend_retries_total") - retries,
                     f"{after}; 4/4 new ok; restarted, routed to after {took} round(s)"))


def test_kill9_prefill_mid_prefill(cluster, table):
    c = cluster
    retries = c.router_metric("pd_router_backend_retries_total")
    ss = streams(c, [long_prompt(i) for i in range(8)], 4)
    held = wait_prefill_queued(c, "p0")
    c.nodes["p0"].kill()
    counts = finish(ss)
    retried = c.router_metric("pd_router_backend_retries_total") - retries
    assert counts["hung"] == 0 and counts["lost"] == 0, counts
    assert retried >= 1 and counts["ok"] >= retried, (counts, retried)
    after = survivors_idle(c, ["p1", "d0", "d1"])
    c.start_node("p0")
    took = routed_again(c, "p0", "pd_prompt_tokens_computed_total")
    table.append(row("kill -9 prefill mid-prefill", ss, counts, retried,
                     f"p0 held {held} when killed; {after}; restarted, routed to after {took} "
                     f"round(s)"))


def test_kill9_router_mid_stream(cluster, table):
    c = cluster
    decodes = ["d0", "d1"]
    generated = sum(c.metric(d, "pd_generation_tokens_total") for d in decodes)
    gone = sum(c.metric(d, "pd_requests_refused_total", reason="router_gone") for d in decodes)
    ss = streams(c, [f"y = {i}" for i in range(16)], 480)
    wait_tokens(ss, 2)
    c.router.kill()
    c.router.wait()
    killed = time.monotonic()
    counts = finish(ss)
    assert counts["hung"] == 0 and counts["errored"] == 16, counts
    after = survivors_idle(c, ["p0", "p1", *decodes])
    freed_s = time.monotonic() - killed
    generated = sum(c.metric(d, "pd_generation_tokens_total") for d in decodes) - generated
    gone = sum(c.metric(d, "pd_requests_refused_total", reason="router_gone")
               for d in decodes) - gone
    assert gone >= 1 and generated < 16 * 480, (gone, generated)  # ended, not decoded for nobody
    c.start_router()
    c.wait_routable()
    assert finish(streams(c, ["ok = 1"], 8))["ok"] == 1
    table.append(row("kill -9 router mid-stream", ss, counts, 0,
                     f"{after} {freed_s:.1f}s after the kill ({gone:.0f} ended by the nodes, "
                     f"{generated:.0f} of {16 * 480} tokens decoded); router restarted, 1/1 ok"))


def test_sigterm_decode_mid_stream_drains(cluster, table):
    c = cluster
    retries = c.router_metric("pd_router_backend_retries_total")
    ss = streams(c, [f"w = {i}" for i in range(6)], 60)
    wait_tokens(ss, 2)
    victim = c.nodes["d0"]
    victim.proc.send_signal(signal.SIGTERM)
    assert draining_or_gone(c, "d0")
    new = streams(c, [f"v = {i}" for i in range(4)], 16)
    ss += new
    counts = finish(ss)
    assert counts == {"ok": 10, "errored": 0, "lost": 0, "hung": 0}, counts
    assert victim.proc.wait(30) == 0
    assert not c.segments("d0")
    after = survivors_idle(c, ["p0", "p1", "d1"])
    table.append(row("SIGTERM decode mid-stream (6 running + 4 new)", ss, counts,
                     c.router_metric("pd_router_backend_retries_total") - retries,
                     f"exit 0, no segment left; {after}"))


def test_sigterm_prefill_mid_prefill_drains(cluster, table):
    c = cluster
    retries = c.router_metric("pd_router_backend_retries_total")
    ss = streams(c, [long_prompt(100 + i) for i in range(8)], 4)
    held = wait_prefill_queued(c, "p0")
    victim = c.nodes["p0"]
    victim.proc.send_signal(signal.SIGTERM)
    new = streams(c, [long_prompt(200 + i) for i in range(4)], 4)
    ss += new
    counts = finish(ss)
    assert counts == {"ok": 12, "errored": 0, "lost": 0, "hung": 0}, (
        counts, [(s.error, s.tokens) for s in ss if s.outcome != "ok"])  # what ended them
    assert victim.proc.wait(30) == 0
    assert "drained" in victim.log_tail()  # it ran what it held to the hand-off, failing none
    retried = c.router_metric("pd_router_backend_retries_total") - retries
    assert retried + held <= 12, (retried, held)
    assert not c.segments("p0")  # it removed its rings
    after = survivors_idle(c, ["p1", "d1"])
    table.append(row("SIGTERM prefill mid-prefill (8 sent + 4 new)", ss, counts, retried,
                     f"p0 held {held} at SIGTERM, finished them; exit 0, its rings removed; "
                     f"{after}"))


def test_drain_timeout_ends_the_rest_with_an_error(cluster, table):
    c = cluster
    ss = streams(c, [f"u = {i}" for i in range(4)], 480)
    wait_tokens(ss, 2)
    victim = c.nodes["d1"]
    victim.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    assert victim.proc.wait(DRAIN_SHORT + 15) == 0
    exited_s = time.monotonic() - sent
    counts = finish(ss)
    assert counts == {"ok": 0, "errored": 4, "lost": 0, "hung": 0}, counts
    assert all("shut down" in s.error for s in ss), [s.error for s in ss]
    after = survivors_idle(c, ["p1"])
    table.append(row(f"SIGTERM decode, drain timeout {DRAIN_SHORT:.1f}s, 480-token requests",
                     ss, counts, 0, f"exit 0 after {exited_s:.1f}s; {after}"))
