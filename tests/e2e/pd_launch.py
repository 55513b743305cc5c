"""`pd launch` as a subprocess for end-to-end API tests: start, wait for the URL, read the node
lines, stop with SIGINT (what Ctrl-C sends)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launch:
    def __init__(self, model_dir: str, *extra: str, timeout: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.lines: list[str] = []
        self.nodes: dict[str, dict] = {}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pd", "launch", "--model", str(model_dir), "--port",
             str(self.port), "--log-level", "warning", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                m = re.match(r"node (\S+) pid (\d+) control (\S+)", line)
                if m:
                    self.nodes[m.group(1)] = {"pid": int(m.group(2)), "control": m.group(3)}
                if line.startswith("pd is serving"):
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("pd launch did not come up:\n" + "".join(self.lines[-40:]))

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def output(self) -> str:
        return "".join(self.lines)
