"""Removal of this process's shared-memory segments at exit.

Segments register themselves here when created; they are unlinked at interpreter exit (atexit)
and on SIGTERM/SIGINT when the process has no handler of its own for the signal (the default
action then runs, so the process still dies of it). A process with its own handler (a node that
drains on SIGTERM) ends through it, and atexit removes what its shutdown did not. SIGKILL cannot
be caught: a segment left by a killed process is removed by the consumer that sees its creator
die (`receiver.py`), or found stale by its recorded pid and replaced by the next creator
(see `segment.py`).
"""

from __future__ import annotations

import atexit
import os
import signal
import threading

_lock = threading.Lock()
_paths: set[str] = set()
_installed = False
_previous: dict[int, object] = {}


def register(path: str) -> None:
    with _lock:
        _paths.add(path)
    _may_install()


def unregister(path: str) -> None:
    with _lock:
        _paths.discard(path)


def remove(path: str) -> None:
    """Remove a segment's name: a file, or a directory with the entries in it (not followed)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            for entry in os.listdir(path):
                os.unlink(os.path.join(path, entry))
            os.rmdir(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def unlink_all() -> None:
    with _lock:
        paths = list(_paths)
        _paths.clear()
    for path in paths:
        remove(path)


def _on_signal(signum, frame) -> None:
    prev = _previous.get(signum, signal.SIG_DFL)
    if callable(prev):
        # NOTE: the process handles this signal itself (a node drains on SIGTERM and still uses
        # its rings); it removes its segments on its way out, and atexit catches what it misses.
        prev(signum, frame)
        return
    unlink_all()
    if prev == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    # SIG_IGN: the process had chosen to ignore it; the segments are gone, it carries on.


def _may_install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(unlink_all)
    # NOTE: signal handlers can only be set from the main thread; elsewhere atexit alone stands.
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        prev = signal.getsignal(signum)
        if prev is _on_signal:
            continue
        _previous[signum] = prev if prev is not None else signal.SIG_DFL
        signal.signal(signum, _on_signal)
