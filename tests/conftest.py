"""Shared pytest fixtures: tiny model directories written by `pd.testing.tiny`.

`tiny_model_dir` is the default (Llama + MTP) checkpoint; `make_tiny_model(**kwargs)` writes
any other variant with `write_tiny_checkpoint`'s keyword arguments, once per distinct set of
arguments per test session. Tests must treat these directories as read-only.
"""
from __future__ import annotations

import inspect
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from pd.testing.tiny import write_tiny_checkpoint

# every engine of the suite, in this process and in the nodes it starts, walks its whole block
# allocator each time it goes idle, not only its counts (`pd.engine.engine.Engine.step`)
os.environ.setdefault("PD_CHECK_INTEGRITY", "1")


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory) -> Callable[..., Path]:
    cache: dict[str, Path] = {}
    signature = inspect.signature(write_tiny_checkpoint)

    def make(arch: str = "llama", **kwargs) -> Path:
        # defaults filled in, so make() and make(mtp=True) share one directory
        bound = signature.bind(None, arch, **kwargs)
        bound.apply_defaults()
        args = {k: v for k, v in bound.arguments.items() if k != "path"}
        key = json.dumps(args, sort_keys=True, default=repr)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = write_tiny_checkpoint(out, arch, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(make_tiny_model) -> Path:
    return make_tiny_model("llama", mtp=True)


# -- the machine at the first failure ---------------------------------------------------------
# A run on a CI machine can fail where it never does on a developer's: the first failing test's
# report carries what the machine was like then, and the run's last lines repeat it.
_first_failure: list[str] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and not _first_failure:
        _first_failure.append(f"{report.nodeid} ({report.when})")
        _first_failure.extend(machine_state())
        report.sections.append(("the machine at the first failure", "\n".join(_first_failure[1:])))
    return report


def pytest_unconfigure(config):
    if _first_failure:
        print("\npd: the machine at the first failure, " + _first_failure[0] + ":\n  "
              + "\n  ".join(_first_failure[1:]), file=sys.stderr)


def _read(path: str) -> str:
    """A small file of /proc or /sys, stripped; "-" where it is not there."""
    try:
        with open(path, errors="replace") as f:
            return f.read().strip()
    except OSError:
        return "-"


def machine_state() -> list[str]:
    """Cores, memory, this process's files and threads, the processes left, /dev/shm, and
    whether a ZMQ round trip on loopback works in this process (its shared context and a new
    one); a line that cannot be read says why, and the others still come."""
    lines = []
    for what in (_cores, _memory, _this_process, _processes, _shm, _zmq):
        try:
            lines.append(what())
        except Exception as e:  # noqa: BLE001 (a report of the machine must not fail the run)
            lines.append(f"{what.__name__.strip('_')}: could not be read ({e!r})")
    return lines


def _cores() -> str:
    return (f"cores {len(os.sched_getaffinity(0))}, cgroup cpu.max {_read('/sys/fs/cgroup/cpu.max')}"
            f" (v1 quota {_read('/sys/fs/cgroup/cpu/cpu.cfs_quota_us')}), load {_read('/proc/loadavg')}")


def _memory() -> str:
    mem = dict(line.split(":", 1) for line in _read("/proc/meminfo").splitlines() if ":" in line)
    return (f"memory available {mem.get('MemAvailable', '-').strip()}, cgroup pids "
            f"{_read('/sys/fs/cgroup/pids.current')} of {_read('/sys/fs/cgroup/pids.max')}")


def _this_process() -> str:
    return (f"this process: {len(os.listdir('/proc/self/fd'))} files open of "
            f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]}, "
            f"{len(os.listdir('/proc/self/task'))} threads")


def _processes() -> str:
    mine = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{p}").st_uid == os.getuid():
                mine.append(p)
        except OSError:  # gone since the listing
            pass
    nodes = [p for p in mine if " pd " in _read(f"/proc/{p}/cmdline").replace("\0", " ")]
    return f"processes of this user {len(mine)}, pd commands among them {len(nodes)}"


def _shm() -> str:
    shm = shutil.disk_usage("/dev/shm")
    return (f"/dev/shm {shm.used >> 20} MiB used of {shm.total >> 20}, "
            f"{sum(n.startswith('pd_') for n in os.listdir('/dev/shm'))} pd entries")


def _zmq() -> str:
    from pd.wire import security  # noqa: PLC0415

    return (f"zmq round trip: shared context {_zmq_round_trip(True)}, new context "
            f"{_zmq_round_trip(False)}; CURVE keys configured in this process: "
            f"{'yes' if security.active() else 'no'}")


def _zmq_round_trip(shared: bool) -> str:
    import zmq  # noqa: PLC0415

    ctx = zmq.Context.instance() if shared else zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        port = a.bind_to_random_port("tcp://127.0.0.1")
        b.connect(f"tcp://127.0.0.1:{port}")
        t0 = time.monotonic()
        b.send(b"ping", zmq.NOBLOCK)  # NOTE: never blocks the report (zmq.Again: failed)
        if not a.poll(2000):
            return "no answer in 2 s"
        a.recv()
        return f"ok in {1e3 * (time.monotonic() - t0):.1f} ms"
    except zmq.ZMQError as e:
        return f"failed: {e}"
    finally:
        a.close(linger=0)
        b.close(linger=0)
        if not shared:
            ctx.term()
