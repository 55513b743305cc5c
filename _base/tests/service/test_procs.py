"""`pd.service.procs`: a node started with `die_with_parent` by a process that is then killed with
SIGKILL does not outlive it (the node gets SIGTERM from the kernel, drains and exits), so a
crashed `pd launch` leaves no node behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_node_exits_when_its_starter_is_killed(tiny_model_dir):
    starter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pd.service.procs import start_node
        node = start_node("decode", ["--model", {str(tiny_model_dir)!r}, "--port", "0",
                                     "--kv-port", "0", "--num-blocks", "64"], die_with_parent=True)
        print(node.pid, flush=True)
        time.sleep(120)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        node_pid = int(starter.stdout.readline())
        assert alive(node_pid)
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait()
        deadline = time.monotonic() + 20
        while alive(node_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(node_pid), "the node outlived the process that started it"
    finally:
        starter.kill()
