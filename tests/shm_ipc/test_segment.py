"""Segments: sealed memfds no process can truncate, owner-only, layout checked on attach, stale
ones replaced, removed on exit/signals. A segment's name is a 0700 directory in /dev/shm holding
a link to the creator's memfd (`LINK`), which dangles once the creator is gone, so these tests
look for the name itself (`lexists`)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys

import pytest

from shm_ipc.errors import SegmentError
from shm_ipc.ring import RING_KIND, RING_LAYOUT_VERSION, Ring
from shm_ipc.receiver import KVReceiver
from shm_ipc.segment import LINK, OWNER, SHM_DIR, Segment, remove_if_stale, segment_name

from shm_peer import spawn_peer


def test_created_owner_only_and_removed_on_close(seg_name):
    seg = Segment.create(seg_name, 8192, kind=9, layout_version=1)
    where = os.path.join(SHM_DIR, seg_name)
    assert stat.S_IMODE(os.stat(where).st_mode) == 0o700  # no other uid reads the link in it
    assert sorted(os.listdir(where)) == sorted([LINK, OWNER])
    assert seg.path == os.path.join(where, LINK)
    assert stat.S_IMODE(os.stat(seg.path).st_mode) == 0o600
    seg.close()
    assert not os.path.lexists(where)


def test_no_process_can_truncate_or_grow_a_segment(seg_name):
    """Truncating a ring under a mapping would kill its users with SIGBUS; the seals refuse
    it to anyone, this uid included, through the name or through any descriptor."""
    with Ring.create(seg_name, 1 << 12) as ring:
        path = ring.seg.path
        code = f"""if True:
            import os
            fd = os.open({path!r}, os.O_RDWR)
            for size in (0, 64, 1 << 20):
                try:
                    os.ftruncate(fd, size)
                    print("resized", size)
                except PermissionError:
                    print("refused", size)
        """
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=30)
        assert out.stdout.split("\n")[:3] == ["refused 0", "refused 64", "refused 1048576"], out
        with open(path, "r+b") as f:
            with pytest.raises(PermissionError):
                f.truncate(0)
        assert os.stat(path).st_size == 4096 + (1 << 12)
        ring.publish(1, b"still mapped")


def test_attach_refuses_a_plain_file_under_a_segment_name(seg_name):
    """A file someone put under a segment's name (not a sealed memfd) is not attached."""
    where = os.path.join(SHM_DIR, seg_name)
    os.mkdir(where, 0o700)
    fd = os.open(os.path.join(where, LINK), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 8192)
        with pytest.raises(SegmentError, match="not sealed"):
            Segment.attach(seg_name, RING_KIND, RING_LAYOUT_VERSION)
    finally:
        os.close(fd)
        os.unlink(os.path.join(where, LINK))
        os.rmdir(where)


def test_attach_checks_layout_version_and_kind(seg_name):
    with Ring.create(seg_name, 1 << 12):
        with pytest.raises(SegmentError, match="expects kind 1 version 99"):
            Segment.attach(seg_name, RING_KIND, 99)
        with pytest.raises(SegmentError, match="layout kind 1"):
            Segment.attach(seg_name, 2, RING_LAYOUT_VERSION)
        Ring.attach(seg_name).close()


def test_attach_refuses_group_readable_and_missing(seg_name):
    with Ring.create(seg_name, 1 << 12):
        os.chmod(os.path.join(SHM_DIR, seg_name, LINK), 0o640)  # the memfd behind the link
        with pytest.raises(SegmentError, match="owner-only"):
            Ring.attach(seg_name)
    with pytest.raises(SegmentError, match="does not exist"):
        Ring.attach(seg_name)


def test_live_segment_is_not_taken_over(seg_name):
    with Ring.create(seg_name, 1 << 12):
        with pytest.raises(SegmentError, match="in use by live pid"):
            Ring.create(seg_name, 1 << 12)


def test_stale_segment_from_dead_process_is_replaced(seg_name):
    proc = spawn_peer("hold", seg_name)
    assert proc.stdout.readline().strip() == "READY"
    proc.kill()
    proc.wait()
    assert os.path.lexists(os.path.join(SHM_DIR, seg_name))  # SIGKILL leaves it behind
    with pytest.raises(SegmentError, match="stale"):
        Ring.attach(seg_name)
    with Ring.create(seg_name, 1 << 12) as ring:
        assert int(ring.seg.header["creator_pid"]) == os.getpid()


def test_a_dead_creators_segment_is_stale_even_if_its_pid_was_reused(seg_name, tmp_path):
    # a new process with the dead creator's pid would make the /proc link resolve again (seen
    # in a long test session: pids wrap at 32768); the owner file still names the dead one
    proc = spawn_peer("hold", seg_name)
    assert proc.stdout.readline().strip() == "READY"
    link = os.path.join(SHM_DIR, seg_name, LINK)
    (tmp_path / "someone_elses").write_bytes(b"\0" * 4096)
    # NOTE: the link made to resolve while its creator lives (no sweep takes a live one's)
    os.unlink(link)
    os.symlink(tmp_path / "someone_elses", link)
    assert os.path.exists(link)
    proc.kill()
    proc.wait()
    # a receiver still alive elsewhere in the session (`sweep_stale`) may find it first: the
    # same check, which a segment taken for live would fail there too
    assert remove_if_stale(seg_name) or not os.path.lexists(os.path.join(SHM_DIR, seg_name))
    assert not os.path.lexists(os.path.join(SHM_DIR, seg_name))


def test_consumer_removes_only_a_dead_creators_segment(seg_name):
    proc = spawn_peer("hold", seg_name)
    assert proc.stdout.readline().strip() == "READY"
    assert not remove_if_stale(seg_name)  # its creator lives
    proc.kill()
    proc.wait()
    assert remove_if_stale(seg_name)
    assert not os.path.lexists(os.path.join(SHM_DIR, seg_name))
    assert not remove_if_stale(seg_name)
    assert not remove_if_stale("../../etc/passwd") and not remove_if_stale("not_ours")


def test_a_segment_being_made_is_not_swept(seg_name):
    """Between making its name and writing its header's magic a segment has no valid header:
    a consumer's sweep must leave it (it once removed it, and the producer's attach failed)."""
    where = os.path.join(SHM_DIR, seg_name)
    fd = os.memfd_create(seg_name)
    try:
        os.ftruncate(fd, 8192)
        os.mkdir(where, 0o700)
        os.symlink(f"/proc/{os.getpid()}/fd/{fd}", os.path.join(where, LINK))
        assert not remove_if_stale(seg_name)
        assert os.path.lexists(os.path.join(where, LINK))
    finally:
        os.close(fd)
    assert remove_if_stale(seg_name)  # its link dangles now: gone
    assert not os.path.lexists(where)


def test_receiver_sweeps_a_dead_producers_ring_it_never_attached(seg_name):
    """A producer killed before its attach message reached the consumer: the consumer's
    liveness check still removes the ring, and leaves a live producer's alone."""
    live, dead = spawn_peer("hold", seg_name + "_live"), spawn_peer("hold", seg_name)
    try:
        assert live.stdout.readline().strip() == "READY"
        assert dead.stdout.readline().strip() == "READY"
        dead.kill()
        dead.wait()
        rx = KVReceiver("tcp://127.0.0.1:*", liveness_interval=0.05)
        try:
            rx.recv(timeout=0.2)
        finally:
            rx.close()
        assert not os.path.lexists(os.path.join(SHM_DIR, seg_name))
        assert os.path.lexists(os.path.join(SHM_DIR, seg_name + "_live"))
    finally:
        live.kill()
        live.wait()
        remove_if_stale(seg_name + "_live")


def test_a_process_handling_sigterm_keeps_its_segments_until_it_exits(seg_name):
    code = f"""if True:
        import signal, os, threading
        from shm_ipc.ring import Ring
        done = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: done.set())
        Ring.create({seg_name!r}, 4096)
        print("READY", flush=True)
        done.wait(30)
        print(os.path.lexists({os.path.join(SHM_DIR, seg_name)!r}), flush=True)
    """
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "READY"
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline().strip() == "True"  # still there while it winds down
    assert proc.wait(timeout=10) == 0
    assert not os.path.lexists(os.path.join(SHM_DIR, seg_name))  # atexit removed it


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_removes_segments_and_chains(seg_name, signum):
    proc = spawn_peer("hold", seg_name)
    assert proc.stdout.readline().strip() == "READY"
    proc.send_signal(signum)
    rc = proc.wait(timeout=10)
    assert not os.path.lexists(os.path.join(SHM_DIR, seg_name))
    # the previous handler still ran: the default action for SIGTERM; for SIGINT Python's
    # KeyboardInterrupt, which an interpreter that does not catch it turns into death by SIGINT
    assert rc == -signum


def test_atexit_removes_segments(seg_name):
    code = f"from shm_ipc.ring import Ring; Ring.create({seg_name!r}, 4096)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
    assert not os.path.lexists(os.path.join(SHM_DIR, seg_name))


def test_segment_name_is_sanitized():
    assert segment_name("prefill-0", "tcp://10.0.0.1:5555") == "pd_shm_prefill-0_tcp---10.0.0.1-5555"
