"""Named shared-memory segments, one per node instance and peer, found under /dev/shm (Linux).

A segment's memory is a sealed memfd (`memfd_create`, then F_SEAL_SHRINK | F_SEAL_GROW |
F_SEAL_SEAL): no process, not even one of the same uid, can truncate it under a mapping (which
would kill its users with SIGBUS) or grow it. Its name in /dev/shm is a 0700 directory holding
one symlink, `seg`, to the creator's descriptor of it (`/proc/<pid>/fd/<n>`): another uid can
neither read the link (the creator's pid) nor open it, and the link dangles once the creator is
gone; beside it `owner` names the creator (pid and process start time), since a new process
given the same pid could make the link resolve again. The creator keeps that descriptor open
until `close()`.

A segment opens with a 64-byte owner header (`SEGMENT_HEADER`, written once by the creator):
a magic word, the layout kind and version of what follows, the total size, and the creator's
pid and process start time. Creating refuses a name held by a live process and replaces one
left by a dead process (its owner file or header naming a dead process, or a dangling link);
attaching checks the seals, owner-only permissions, the owner uid, the magic, the layout kind
and version, the size and that the creator still lives. The creator unlinks the name on `close()`, at exit and on
SIGTERM/SIGINT (`cleanup.py`); a consumer that finds the creator dead may remove it
(`remove_if_stale`). What lives after the header is the caller's (see `ring.py`).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import stat

import numpy as np

from . import cleanup
from .errors import SegmentError

log = logging.getLogger("shm_ipc")

SHM_DIR = "/dev/shm"
PREFIX = "pd_shm_"
LINK = "seg"  # the link to the creator's memfd, inside the segment's 0700 directory
OWNER = "owner"  # beside it: "<creator pid> <its start time>", written before the link
MAGIC = 0x31304D4853445000  # b"\0PDSHM01" read as little-endian

# Written by the creator only, once, before the magic (which is written last).
SEGMENT_HEADER = np.dtype({
    "names": ["magic", "layout_version", "kind", "size", "creator_pid", "creator_start"],
    "formats": ["<u8", "<u4", "<u4", "<u8", "<u8", "<u8"],
    "offsets": [0, 8, 12, 16, 24, 32],
    "itemsize": 64,
})

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


def segment_name(*parts: str) -> str:
    """A segment name with the project prefix; characters other than [A-Za-z0-9_.-] become '-'."""
    return PREFIX + "_".join(re.sub(r"[^A-Za-z0-9_.-]", "-", str(p)) for p in parts)


def process_start(pid: int) -> int | None:
    """The start time (clock ticks since boot) of a live process, None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = data[data.rindex(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def is_alive(pid: int, start: int) -> bool:
    """True when `pid` runs and is the same process that recorded `start` (no pid reuse)."""
    now = process_start(pid)
    return now is not None and (start == 0 or now == start)


SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class Segment:
    """A mapped segment; `buf` is a writable memoryview over all of it, header included."""

    def __init__(self, name: str, fd: int, size: int, owner: bool):
        self.name = name
        self.dir = os.path.join(SHM_DIR, name)
        self.path = os.path.join(self.dir, LINK)
        self.size = size
        self.owner = owner
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        try:
            self._mmap = mmap.mmap(fd, size, flags=flags)
        except BaseException:
            os.close(fd)
            raise
        # NOTE: the creator's descriptor is what its /dev/shm link points at: kept until close()
        self._fd: int | None = fd if owner else None
        if not owner:
            os.close(fd)
        self.buf = memoryview(self._mmap)
        self._pinned: int | None = None  # the address registered with CUDA; 0: not pinnable
        self.header = np.frombuffer(self._mmap, dtype=SEGMENT_HEADER, count=1)[0]
        self.closed = False

    @classmethod
    def create(cls, name: str, size: int, kind: int, layout_version: int) -> "Segment":
        _check_name(name)
        where = os.path.join(SHM_DIR, name)
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        made = False
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            for _ in range(3):
                try:
                    os.mkdir(where, 0o700)
                    made = True
                    break
                except FileExistsError:
                    _may_remove_stale(where)
            else:
                raise SegmentError(f"segment {name!r} keeps reappearing; another creator races us")
            # NOTE: the link's /proc path alone names a pid, which a new process may reuse (the
            # link would then resolve to its file): the owner file says which process it was
            with open(os.path.join(where, OWNER), "x") as f:
                f.write(f"{os.getpid()} {process_start(os.getpid()) or 0}")
            os.symlink(f"/proc/{os.getpid()}/fd/{fd}", os.path.join(where, LINK))
        except BaseException:
            if made:
                cleanup.remove(where)
            os.close(fd)
            raise
        cleanup.register(where)
        seg = cls(name, fd, size, owner=True)
        h = seg.header
        h["layout_version"], h["kind"], h["size"] = layout_version, kind, size
        h["creator_pid"], h["creator_start"] = os.getpid(), process_start(os.getpid()) or 0
        h["magic"] = MAGIC
        return seg

    @classmethod
    def attach(cls, name: str, kind: int, layout_version: int) -> "Segment":
        _check_name(name)
        path = os.path.join(SHM_DIR, name, LINK)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            if os.path.islink(path):
                raise SegmentError(f"segment {name!r} is stale: its creator is gone") from None
            raise SegmentError(f"segment {name!r} does not exist (is the peer on this host?)")
        except OSError as e:  # a directory, no permission, ...
            raise SegmentError(f"segment {name!r} cannot be opened: {e.strerror}") from None
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if seals & SEALS != SEALS:
            os.close(fd)
            raise SegmentError(f"segment {name!r} is not sealed against truncation (seals "
                               f"{seals:#x}): not one this project made")
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            os.close(fd)
            raise SegmentError(f"segment {name!r} is not owner-only for uid {os.getuid()} "
                               f"(uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
        if st.st_size < SEGMENT_HEADER.itemsize:
            os.close(fd)
            raise SegmentError(f"segment {name!r} is too small ({st.st_size} bytes)")
        seg = cls(name, fd, st.st_size, owner=False)
        try:
            seg._check(kind, layout_version)
        except SegmentError:
            seg.close()
            raise
        return seg

    def _check(self, kind: int, layout_version: int) -> None:
        h = self.header
        if int(h["magic"]) != MAGIC:
            raise SegmentError(f"segment {self.name!r} has no valid header (magic)")
        if int(h["kind"]) != kind or int(h["layout_version"]) != layout_version:
            raise SegmentError(
                f"segment {self.name!r} holds layout kind {int(h['kind'])} version "
                f"{int(h['layout_version'])}; this reader expects kind {kind} version "
                f"{layout_version}")
        if int(h["size"]) != self.size:
            raise SegmentError(f"segment {self.name!r} records size {int(h['size'])} but is "
                               f"{self.size} bytes")
        if not self.creator_alive():
            raise SegmentError(f"segment {self.name!r} is stale: its creator pid "
                               f"{int(h['creator_pid'])} is gone")

    def creator_alive(self) -> bool:
        return is_alive(int(self.header["creator_pid"]), int(self.header["creator_start"]))

    def pin(self) -> bool:
        """Page-lock the mapping for CUDA copies (`shm_ipc.pinned`), once; True if pinned."""
        if self._pinned is None:
            from .pinned import register

            self._pinned = register(self._mmap) or 0
        return bool(self._pinned)

    def close(self) -> None:
        """Unmap; the creator also removes the name. Views still held keep the memory mapped."""
        if self.closed:
            return
        self.closed = True
        if self._pinned:
            from .pinned import unregister

            unregister(self._pinned)
        if self.owner:
            cleanup.unregister(self.dir)
            cleanup.remove(self.dir)
            os.close(self._fd)
            self._fd = None
        self.header = None
        self.buf.release()
        try:
            self._mmap.close()
        except BufferError:
            pass  # NOTE: numpy/torch views over it are alive; the mapping goes when they do.


def remove_if_stale(name: str) -> bool:
    """Remove segment `name` if it is one of ours (prefix, our uid, a dangling link or a dead
    creator in its header) and its creator is gone: a consumer cleaning up after a killed
    producer. True when it was removed."""
    if not _NAME_RE.match(name) or not name.startswith(PREFIX):
        return False
    where = os.path.join(SHM_DIR, name)
    try:
        st = os.lstat(where)
    except FileNotFoundError:
        return False
    # NOTE: only a segment known to be gone: one still being made has no magic yet
    if st.st_uid != os.getuid() or _creator(where)[0] != "gone":
        return False
    cleanup.remove(where)
    log.info("removed segment %s left by a dead process", name)
    return True


def sweep_stale() -> int:
    """`remove_if_stale` on every segment with our prefix: also those whose creator died before
    any consumer attached them, which no consumer would ever close. Returns how many went."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    return sum(remove_if_stale(name) for name in names if name.startswith(PREFIX))


def _check_name(name: str) -> None:
    if not _NAME_RE.match(name):
        raise SegmentError(f"bad segment name {name!r}: use 1-200 of [A-Za-z0-9_.-]")


def _creator(where: str) -> tuple[str, int]:
    """("alive", pid) for a segment whose creator lives, ("gone", pid or 0) for one whose link
    dangles or whose header names a dead process, ("unknown", 0) for one without a readable
    header yet (a creator between making the name and writing the magic) or not a segment."""
    in_dir = os.path.isdir(where) and not os.path.islink(where)
    if in_dir:
        try:
            with open(os.path.join(where, OWNER)) as f:
                pid, start = map(int, f.read().split())
        except (OSError, ValueError):
            pass  # not written yet: the link and header below decide
        else:
            if not is_alive(pid, start):
                return "gone", pid
    path = os.path.join(where, LINK) if in_dir else where
    if os.path.islink(path) and not os.path.exists(path):
        return "gone", 0
    try:
        with open(path, "rb") as f:
            raw = f.read(SEGMENT_HEADER.itemsize)
    except OSError:
        return "unknown", 0
    if len(raw) < SEGMENT_HEADER.itemsize:
        return "unknown", 0
    h = np.frombuffer(raw, dtype=SEGMENT_HEADER)[0]
    pid = int(h["creator_pid"])
    if int(h["magic"]) != MAGIC:
        return "unknown", 0
    return ("alive" if is_alive(pid, int(h["creator_start"])) else "gone"), pid


def _may_remove_stale(where: str) -> None:
    """Remove the segment at `where` unless a live process holds it (then raise): a creator
    taking its name back from a dead or unreadable one."""
    state, pid = _creator(where)
    if state == "alive":
        raise SegmentError(f"segment {os.path.basename(where)!r} is in use by live pid {pid}")
    log.warning("replacing %s segment %s", "stale" if state == "gone" else "unreadable", where)
    cleanup.remove(where)
