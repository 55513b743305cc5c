"""Fixtures for shm_ipc tests, and the check that the suite leaves no segment in /dev/shm."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

from shm_ipc import cleanup
from shm_ipc.receiver import KVReceiver
from shm_ipc.segment import LINK, MAGIC, PREFIX, SEGMENT_HEADER, SHM_DIR, is_alive

_counter = itertools.count()


def _ours_left() -> set[str]:
    """Segments with the project prefix whose creator is this process or is dead (whose link
    dangles: its creator is gone)."""
    left = set()
    for name in os.listdir(SHM_DIR):
        if not name.startswith(PREFIX):
            continue
        where = os.path.join(SHM_DIR, name)
        path = os.path.join(where, LINK) if os.path.isdir(where) else where
        if os.path.islink(path) and not os.path.exists(path):
            left.add(name)
            continue
        try:
            with open(path, "rb") as f:
                h = np.frombuffer(f.read(SEGMENT_HEADER.itemsize), SEGMENT_HEADER)[0]
        except (OSError, ValueError):
            continue
        pid = int(h["creator_pid"])
        if int(h["magic"]) != MAGIC or pid == os.getpid() or not is_alive(pid, int(h["creator_start"])):
            left.add(name)
    return left


@pytest.fixture(scope="session", autouse=True)
def no_segment_left_behind():
    before = _ours_left()
    yield
    leaked = _ours_left() - before
    for name in leaked:
        cleanup.remove(os.path.join(SHM_DIR, name))
    assert not leaked, f"segments left in {SHM_DIR}: {sorted(leaked)}"


@pytest.fixture
def seg_name() -> str:
    return f"{PREFIX}test_{os.getpid()}_{next(_counter)}"


@pytest.fixture
def rx():
    """A KV receiver on a loopback TCP port (the transport tests' decode side)."""
    r = KVReceiver("tcp://127.0.0.1:*", max_topk=20)
    yield r
    r.close()
