"""Starting pd processes and waiting for them: used by `pd launch`, the end-to-end tests and
the benchmarks.

A node prints one `PD_READY {json}` line on stdout when it serves; `start_node` waits for it
(with a timeout, and an error carrying the node's last log lines if it dies first). `Launch`
runs a whole `pd launch` and waits for its URL line. A long-running process that is ready to
serve takes its start-up objects out of the garbage collector's walks (`freeze_heap`).
"""

from __future__ import annotations

import gc
import json
import os
import re
import socket
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

_PR_SET_PDEATHSIG = 1


def freeze_heap() -> None:
    """Collect once, then keep every object alive now (modules, model, tokenizer, graphs) out of
    every later collection (`gc.freeze`): a full collection of a node's start-up heap (~330k
    objects) took 144 ms on a 2-core CPU, and Python may start one at any allocation while
    serving, holding every stream of the process that long. Later collections walk only what
    serving made."""
    gc.collect()
    gc.freeze()


def _die_with_parent():
    """A preexec_fn (Linux): the child gets SIGTERM when the process that started it dies, so a
    launcher killed with SIGKILL leaves no node behind. Elsewhere, None (no such guarantee).

    NOTE: the kernel sends it when the starting *thread* ends, so only a process's main thread
    may ask for it (`pd launch` does; the tests that start nodes from worker threads do not)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # NOTE: resolved here, not in the child

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return preexec


@dataclass
class NodeProcess:
    role: str
    proc: subprocess.Popen
    info: dict
    log_path: str
    _lines: list = field(default_factory=list, repr=False)
    _ready: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def wait_ready(self, timeout: float = 60.0) -> "NodeProcess":
        """Wait for the node's PD_READY line; kills it and raises if it exits or times out."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                why = f"exited with {self.proc.returncode}" if self.proc.returncode is not None \
                    else "timed out"
                raise RuntimeError(f"pd {self.role} {why} before it was ready:\n{self.log_tail()}")
        return self


def start_node(role: str, args: list[str], timeout: float = 60.0, env: dict | None = None,
               log_dir: str | None = None, prefix: list[str] | None = None,
               die_with_parent: bool = False) -> NodeProcess:
    """Run `python -m pd ROLE ARGS...` and wait for its PD_READY line (`spawn_node`, then
    `NodeProcess.wait_ready`)."""
    return spawn_node(role, args, env, log_dir, prefix, die_with_parent).wait_ready(timeout)


def spawn_node(role: str, args: list[str], env: dict | None = None, log_dir: str | None = None,
               prefix: list[str] | None = None, die_with_parent: bool = False) -> NodeProcess:
    """Run `python -m pd ROLE ARGS...` without waiting for it: several nodes start at once,
    then each is waited for (`wait_ready`). `prefix` runs it under a command that execs it
    (`ip netns exec NAME`), so the pid stays the node's. `die_with_parent` (from a main thread
    only): the node gets SIGTERM when this process dies."""
    log_dir = log_dir or tempfile.gettempdir()
    fd, log_path = tempfile.mkstemp(prefix=f"pd-{role}-", suffix=".log", dir=log_dir)
    log_file = os.fdopen(fd, "w")
    proc = subprocess.Popen(
        [*(prefix or []), sys.executable, "-m", "pd", role, *args], stdout=subprocess.PIPE,
        stderr=log_file, env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}, text=True,
        preexec_fn=_die_with_parent() if die_with_parent else None)
    log_file.close()
    node = NodeProcess(role, proc, {}, log_path)

    def read_stdout():
        for line in proc.stdout:
            if line.startswith("PD_READY ") and not node._ready.is_set():
                node.info = json.loads(line[len("PD_READY "):])
                node._ready.set()
            node._lines.append(line)

    threading.Thread(target=read_stdout, daemon=True).start()
    return node


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launch:
    def __init__(self, model_dir: str, *extra: str, timeout: float = 120.0,
                 serve: bool = False) -> None:
        """`pd launch --model DIR ...`, or `pd serve DIR ...` (vLLM's spelling) with `serve`."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.lines: list[str] = []
        self.nodes: dict[str, dict] = {}
        self.router_pids: list[int] = []  # with --router-workers N > 1, the workers'
        self.served_model_name = ""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pd", *(("serve", str(model_dir)) if serve else
                                           ("launch", "--model", str(model_dir))),
             "--port", str(self.port), "--log-level", "warning", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                m = re.match(r"node (\S+) pid (\d+) control (\S+)(?: kv (\S+))?(?: metrics (\S+))?"
                             r"(?: log (\S+))?", line)
                if m:
                    self.nodes[m.group(1)] = {"pid": int(m.group(2)), "control": m.group(3),
                                              "kv": m.group(4), "metrics": m.group(5),
                                              "log": m.group(6)}
                m = re.match(r"router workers: \d+, pids ([\d ]+)", line)
                if m:
                    self.router_pids = [int(p) for p in m.group(1).split()]
                m = re.match(r"pd is serving (\S+) at", line)
                if m:
                    self.served_model_name = m.group(1)
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("pd launch did not come up:\n" + "".join(self.lines[-40:]))

    def stop(self, timeout: float = 60.0) -> int:
        """Ctrl-C, as a user stops it (the nodes drain); past `timeout`, SIGKILL for it and for
        every node it started."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                for pid in [n["pid"] for n in self.nodes.values()] + self.router_pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
        return self.proc.returncode

    def output(self) -> str:
        return "".join(self.lines)
