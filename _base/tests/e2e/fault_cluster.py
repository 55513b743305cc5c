"""A router and its prefill and decode nodes as real processes on fixed loopback ports, for the
fault tests: any of them can be killed, stopped and started again on the same ports.

Each node gets an id with the cluster's tag, so its processes can be told from those of other
tests; its shared-memory segments (named at random) are told by the creator pid in their header,
from the pids of every node the cluster started. `Stream` is one streaming OpenAI
completion in a thread, whose outcome is ok, errored (after tokens), lost (an error before any
token: a retry should have saved it) or hung (past its timeout).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from pd.service.procs import NodeProcess, free_port, start_node
from shm_ipc.segment import PREFIX, SEGMENT_HEADER, SHM_DIR, is_alive


class Stream:
    """POST /v1/completions with stream=true in a thread; `tokens` grows as chunks arrive."""

    def __init__(self, url: str, body: dict, timeout: float) -> None:
        self.tokens = 0
        self.error: str | None = None
        self.done = False
        self.hung = False
        self.seconds = 0.0  # from start to the end of the stream, however it ended
        self._thread = threading.Thread(target=self._run, args=(url, body, timeout), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict, timeout: float) -> None:
        start = time.monotonic()
        try:
            self._read(url, body, timeout, start + timeout)
        finally:
            self.seconds = time.monotonic() - start

    def _read(self, url: str, body: dict, timeout: float, deadline: float) -> None:
        try:
            with httpx.Client(timeout=httpx.Timeout(timeout, connect=5.0)) as client, \
                    client.stream("POST", url + "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    self.error = f"HTTP {resp.status_code}: {resp.read()[:200]!r}"
                    return
                for line in resp.iter_lines():
                    if time.monotonic() > deadline:
                        self.hung = True
                        return
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        return
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        self.error = chunk["error"]["message"]
                    for choice in chunk.get("choices", []):
                        self.tokens += len((choice.get("logprobs") or {}).get("tokens", []))
        except httpx.TimeoutException:
            self.hung = True
        except httpx.HTTPError as e:
            self.error = f"{type(e).__name__}: {e}"

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.hung = True

    @property
    def outcome(self) -> str:
        if self.hung:
            return "hung"
        if self.error is None and self.done:
            return "ok"
        return "errored" if self.tokens else "lost"


class FaultCluster:
    def __init__(self, model_dir: Path, log_dir: Path, num_prefill: int = 2, num_decode: int = 2,
                 prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = ()) -> None:
        self.model_dir = str(model_dir)
        self.log_dir = str(log_dir)
        self.role_args = {"prefill": list(prefill_args), "decode": list(decode_args)}
        self.tag = "ft" + uuid.uuid4().hex[:8]
        self.ports: dict[str, dict[str, int]] = {}
        for i in range(num_decode):
            self.ports[f"d{i}"] = {"port": free_port(), "kv": free_port(), "metrics": free_port()}
        for i in range(num_prefill):
            self.ports[f"p{i}"] = {"port": free_port(), "metrics": free_port()}
        self.router_port = free_port()
        self.url = f"http://127.0.0.1:{self.router_port}"
        self.nodes: dict[str, NodeProcess] = {}
        self.pids: dict[int, str] = {}  # every node process started -> its name
        self.router: subprocess.Popen | None = None
        self.num_routers = 0  # started so far

    # -- processes -------------------------------------------------------------------------------
    def node_id(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def start_node(self, name: str, *extra: str) -> NodeProcess:
        p = self.ports[name]
        role = "decode" if name.startswith("d") else "prefill"
        args = ["--model", self.model_dir, "--node-id", self.node_id(name),
                "--port", str(p["port"]), "--metrics-port", str(p["metrics"]),
                *self.role_args[role], *extra]
        if role == "decode":
            args += ["--kv-port", str(p["kv"])]
        node = start_node(role, args, log_dir=self.log_dir)
        self.nodes[name] = node
        self.pids[node.pid] = name
        return node

    def addresses(self, kind: str) -> list[str]:
        """Control addresses of the prefill ("p") or decode ("d") nodes."""
        return [f"127.0.0.1:{p['port']}" for n, p in self.ports.items() if n.startswith(kind)]

    def start_router(self, heartbeat_timeout: float = 3.0) -> None:
        self.num_routers += 1
        log = open(os.path.join(self.log_dir, f"router-{self.num_routers}.log"), "w")
        self.router = subprocess.Popen(
            [sys.executable, "-m", "pd", "router", "--model", self.model_dir,
             "--port", str(self.router_port), "--prefill", *self.addresses("p"),
             "--decode", *self.addresses("d"), "--heartbeat-interval", "0.2",
             "--heartbeat-timeout", str(heartbeat_timeout), "--log-level", "info"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()

    def start(self, **extra: tuple[str, ...]) -> None:
        """Every node (`extra`: more flags for some, by name) and the router, side by side."""
        self.start_router()
        with ThreadPoolExecutor(len(self.ports)) as pool:
            list(pool.map(lambda name: self.start_node(name, *extra.get(name, ())), self.ports))
        self.wait_routable()

    def wait_routable(self, timeout: float = 60.0, **want: int) -> dict:
        """Until the router routes to `want` nodes per role (default: all of them)."""
        want = want or {"prefill": sum(n.startswith("p") for n in self.ports),
                        "decode": sum(n.startswith("d") for n in self.ports)}
        deadline = time.monotonic() + timeout
        while True:
            try:
                h = httpx.get(self.url + "/health", timeout=2.0).json()
                if all(h.get(role) == n for role, n in want.items()):
                    return h
            except (httpx.HTTPError, ValueError):
                h = None
            if time.monotonic() > deadline:
                raise TimeoutError(f"router health {h}, wanted {want}")
            time.sleep(0.1)

    def stop(self) -> dict[str, int | None]:
        """SIGTERM everything at once (nodes drain), then wait; returns exit codes."""
        procs = {name: node.proc for name, node in self.nodes.items()}
        if self.router is not None:
            procs["router"] = self.router
        for p in procs.values():
            p.send_signal(15 if p is not self.router else 2)
        codes = {}
        for name, p in procs.items():
            try:
                codes[name] = p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[name] = p.wait()
        return codes

    # -- what the nodes say ----------------------------------------------------------------------
    def health(self, name: str) -> tuple[int, dict]:
        resp = httpx.get(f"http://127.0.0.1:{self.ports[name]['metrics']}/health", timeout=2.0)
        return resp.status_code, resp.json()

    def metric(self, name: str, metric: str, **labels: str) -> float:
        """The sum of a node's `metric` samples that carry `labels`."""
        url = f"http://127.0.0.1:{self.ports[name]['metrics']}/metrics"
        text = httpx.get(url, timeout=2.0).text
        want = [f'{k}="{v}"' for k, v in labels.items()]
        return sum(float(v) for lab, v in re.findall(rf"^{metric}{{([^}}]*)}} (\S+)$", text, re.M)
                   if all(w in lab.split(",") for w in want))

    def router_metric(self, metric: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=2.0).text
        return sum(float(v) for v in re.findall(rf"^{metric}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    def wait_idle(self, names, timeout: float = 15.0) -> dict[str, dict]:
        """Until every named node has all its blocks free and nothing running; their stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = {n: self.health(n)[1] for n in names}
            idle = all(s["free_blocks"] == s["total_blocks"] and s["running"] == 0
                       for s in stats.values())
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.1)

    # -- what is left behind ---------------------------------------------------------------------
    def _creators(self) -> dict[str, tuple[int, int]]:
        """This cluster's segments -> their creator's (pid, start time), from their headers."""
        out = {}
        for name in sorted(os.listdir(SHM_DIR)):
            if not name.startswith(PREFIX):
                continue
            try:
                with open(os.path.join(SHM_DIR, name), "rb") as f:
                    raw = f.read(SEGMENT_HEADER.itemsize)
            except OSError:
                continue
            if len(raw) == SEGMENT_HEADER.itemsize:
                h = np.frombuffer(raw, dtype=SEGMENT_HEADER)[0]
                if int(h["creator_pid"]) in self.pids:
                    out[name] = (int(h["creator_pid"]), int(h["creator_start"]))
        return out

    def segments(self, node: str | None = None) -> list[str]:
        """This cluster's segments (those made by any process of `node`, when given)."""
        return [name for name, (pid, _) in self._creators().items()
                if node is None or self.pids[pid] == node]

    def stale_segments(self) -> list[str]:
        """This cluster's segments whose creator process is gone."""
        return [name for name, (pid, start) in self._creators().items()
                if not is_alive(pid, start)]

    def leftover_processes(self) -> list[int]:
        """Processes this cluster started that still run, and any other carrying its tag."""
        live = {p.pid for p in [*(n.proc for n in self.nodes.values()), self.router]
                if p is not None and p.poll() is None}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    cmdline = Path("/proc", entry, "cmdline").read_bytes()
                except OSError:
                    continue
                if self.tag.encode() in cmdline:
                    live.add(int(entry))
        return sorted(live)
