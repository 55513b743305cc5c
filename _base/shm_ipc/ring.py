"""Single-producer single-consumer ring of variable-length records in one shared segment.

Layout after the segment header (`segment.py`), defined once in `RING_CONTROL`; each line is
written by one process only, and the two positions sit on separate 128-byte lines:

    64   capacity, data_offset          creator (producer), once
    128  write_pos, producer_closed, controls_sent      producer
    256  read_pos, consumer_pid, consumer_start, consumer_closed   consumer
    4096 data region (capacity bytes, a multiple of ALIGN)

Positions are monotonic byte counts (offset = pos % capacity). A record is a uint32 header
word, a uint32 payload length and the payload, padded to ALIGN bytes; it never wraps: when it
does not fit before the end, a PAD record (word 0) fills the tail. The producer waits (bounded by
a timeout) for the consumer to release space and never overwrites unreleased bytes.

The ring moves bytes only: decoding a record (`records.py`) and waking the consumer
(`doorbell.py`, or the transport's ZMQ connection) are left to others. A consumer that reads only
up to a position it was told over a socket (or a pipe) inherits its memory ordering.
`controls_sent` counts the control messages the producer sent beside the ring (the transport
bumps it before each send), so a consumer woken by a pipe can tell whether every control message
sent before a record has reached it.
"""

from __future__ import annotations

import os
import time
from collections import deque

import numpy as np

from .errors import PeerGoneError, RingFullError
from .metrics import refuse
from .segment import Segment, is_alive, process_start

RING_KIND = 1
RING_LAYOUT_VERSION = 2
ALIGN = 64
RECORD_HEADER = 8  # uint32 word + uint32 payload length
DATA_OFFSET = 4096
MAX_PAYLOAD = 0xFFFFFFFF

RING_CONTROL = np.dtype({
    "names": ["capacity", "data_offset",  # producer, once at creation
              "write_pos", "producer_closed", "controls_sent",  # producer
              "read_pos", "consumer_pid", "consumer_start", "consumer_closed"],  # consumer
    "formats": ["<u8"] * 9,
    "offsets": [64, 72, 128, 136, 144, 256, 264, 272, 280],
    "itemsize": DATA_OFFSET,
})
_I = {name: off // 8 for name, (_, off) in RING_CONTROL.fields.items()}
CAPACITY, WRITE_POS, PRODUCER_CLOSED = _I["capacity"], _I["write_pos"], _I["producer_closed"]
READ_POS, CONSUMER_PID, CONSUMER_START = _I["read_pos"], _I["consumer_pid"], _I["consumer_start"]
CONSUMER_CLOSED, CONTROLS_SENT = _I["consumer_closed"], _I["controls_sent"]


def record_size(payload_len: int) -> int:
    """Bytes a record with this payload takes in the ring, header and padding included."""
    return (RECORD_HEADER + payload_len + ALIGN - 1) // ALIGN * ALIGN


class Ring:
    """One end of a ring: `create` for the producer, `attach` for the consumer."""

    def __init__(self, seg: Segment):
        self.seg = seg
        self.name = seg.name
        self._ctl = seg.buf[:DATA_OFFSET].cast("Q")
        self.capacity = self._ctl[CAPACITY]
        self._data = seg.buf[DATA_OFFSET:DATA_OFFSET + self.capacity]
        self._words = self._data.cast("I")
        self._cursor = 0  # producer: next write position; consumer: next read position
        self._pending: deque[int] = deque()  # producer: ends of reserved, unpublished records
        self._holds: deque[tuple[int, object]] = deque()  # consumer: (position, fence), `hold`
        self.num_waits = 0  # producer: times it found the ring full and waited

    # ---- producer -----------------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, capacity: int) -> "Ring":
        if capacity < ALIGN * 2 or capacity % ALIGN:
            raise ValueError(f"ring capacity {capacity} must be a multiple of {ALIGN}, >= {2 * ALIGN}")
        seg = Segment.create(name, DATA_OFFSET + capacity, RING_KIND, RING_LAYOUT_VERSION)
        ctl = seg.buf[:DATA_OFFSET].cast("Q")
        ctl[CAPACITY], ctl[_I["data_offset"]] = capacity, DATA_OFFSET
        ctl.release()
        return cls(seg)

    @property
    def max_payload(self) -> int:
        # NOTE: a record of at most half the ring always fits once the consumer catches up,
        # even when it must follow a PAD; a larger one could wait forever.
        return self.capacity // 2 // ALIGN * ALIGN - RECORD_HEADER

    def reserve(self, word: int, length: int, timeout: float = 30.0) -> memoryview:
        """Claim room for one record and return its writable payload; `commit()` publishes it.
        Several records may be reserved before the first is committed (a sender with copies
        in flight): each `commit()` publishes the oldest reserved one, so they appear in order."""
        total = record_size(length)
        if not 0 < word <= 0xFFFFFFFF:
            raise ValueError(f"header word {word!r}: 0 is PAD, records need a uint32 above 0")
        if length > self.max_payload or length > MAX_PAYLOAD:
            raise ValueError(f"record payload {length} bytes exceeds ring {self.name!r} "
                             f"({self.max_payload} bytes max); send it in chunks")
        pos = self._cursor
        off = pos % self.capacity
        tail = self.capacity - off
        end = self._end_of(total)
        if end - self._ctl[READ_POS] > self.capacity:
            self._wait_space(end, timeout)
        if total > tail:
            self._words[off // 4], self._words[off // 4 + 1] = 0, tail - RECORD_HEADER  # PAD
            pos += tail
            off = 0
        self._words[off // 4], self._words[off // 4 + 1] = word, length
        self._cursor = pos + total
        self._pending.append(self._cursor)
        start = off + RECORD_HEADER
        return self._data[start:start + length]

    def _end_of(self, total: int) -> int:
        """Where a record of `total` bytes reserved now would end (after a PAD when it does not
        fit before the end of the data region)."""
        tail = self.capacity - self._cursor % self.capacity
        return self._cursor + (total if total <= tail else tail + total)

    def fits(self, length: int) -> bool:
        """Whether a record of `length` payload bytes could be reserved now without waiting."""
        return self._end_of(record_size(length)) - self._ctl[READ_POS] <= self.capacity

    @property
    def num_pending(self) -> int:
        """Records reserved and not yet committed."""
        return len(self._pending)

    def commit(self) -> int:
        """Publish the oldest reserved record; returns the new write position (for the doorbell)."""
        if not self._pending:
            raise RuntimeError("commit() without a reserved record")
        # NOTE: payload bytes are stored before write_pos; the consumer reads no further than a
        # position it got after this store (from the doorbell or from write_pos itself).
        end = self._pending.popleft()
        self._ctl[WRITE_POS] = end
        return end

    def publish(self, word: int, *buffers, timeout: float = 30.0) -> int:
        """Copy `buffers` (contiguous bytes-like) into one record and publish it."""
        views = [memoryview(b).cast("B") for b in buffers]
        dst = self.reserve(word, sum(v.nbytes for v in views), timeout)
        at = 0
        for v in views:
            dst[at:at + v.nbytes] = v
            at += v.nbytes
        return self.commit()

    def note_control(self) -> None:
        """Count one control message about to be sent beside the ring (before sending it)."""
        self._ctl[CONTROLS_SENT] += 1

    def _wait_space(self, end: int, timeout: float) -> None:
        self.num_waits += 1
        deadline = time.monotonic() + timeout
        delay = 20e-6
        while end - self._ctl[READ_POS] > self.capacity:
            self._check_consumer()
            if time.monotonic() > deadline:
                raise RingFullError(
                    f"ring {self.name!r} full for {timeout:.1f}s: need {end - self._ctl[READ_POS]} "
                    f"bytes of {self.capacity}; consumer pid {self._ctl[CONSUMER_PID] or '-'} "
                    f"released nothing")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def _check_consumer(self) -> None:
        pid = self._ctl[CONSUMER_PID]
        if self._ctl[CONSUMER_CLOSED]:
            raise PeerGoneError(f"ring {self.name!r}: the consumer (pid {pid}) closed it")
        if pid and not is_alive(pid, self._ctl[CONSUMER_START]):
            raise PeerGoneError(f"ring {self.name!r}: the consumer (pid {pid}) is gone")

    # ---- consumer -----------------------------------------------------------------------------
    @classmethod
    def attach(cls, name: str) -> "Ring":
        seg = Segment.attach(name, RING_KIND, RING_LAYOUT_VERSION)
        ring = cls(seg)
        ring._cursor = ring._ctl[READ_POS]
        ring._ctl[CONSUMER_START] = process_start(os.getpid()) or 0
        ring._ctl[CONSUMER_PID] = os.getpid()
        return ring

    @property
    def write_pos(self) -> int:
        return self._ctl[WRITE_POS]

    @property
    def controls_sent(self) -> int:
        return self._ctl[CONTROLS_SENT]

    @property
    def read_pos(self) -> int:
        return self._ctl[READ_POS]

    def next_record(self, limit: int | None = None) -> tuple[int, memoryview] | None:
        """The next record before `limit` (default: the current write position), or None.

        Returns (raw header word, payload view); the view stays valid until `release()` gives
        it back.
        A length that would run past what was published or past the ring's end is refused
        (counted) and the reader skips to `limit`; it never reads outside the published bytes.
        """
        if limit is None:
            limit = self._ctl[WRITE_POS]
        while limit - self._cursor >= RECORD_HEADER:
            off = self._cursor % self.capacity
            word, length = self._words[off // 4], self._words[off // 4 + 1]
            tail = self.capacity - off
            if word == 0:  # PAD: the rest of the ring up to its end
                if length != tail - RECORD_HEADER or self._cursor + tail > limit:
                    return self._corrupt(limit, f"PAD of {length} bytes at offset {off}")
                self._cursor += tail
                continue
            total = record_size(length)
            if total > tail or self._cursor + total > limit:
                return self._corrupt(limit, f"length {length} at offset {off} runs past the "
                                            f"published bytes")
            self._cursor += total
            return word, self._data[off + RECORD_HEADER:off + RECORD_HEADER + length]
        if self._cursor < limit:
            return self._corrupt(limit, f"published position {limit} is not on a record boundary")
        return None

    def _corrupt(self, limit: int, why: str) -> None:
        refuse("ring_length", f"ring {self.name!r}: {why}; skipping to position {limit}")
        self._cursor = max(self._cursor, limit)
        return None

    @property
    def cursor(self) -> int:
        """Consumer: the position of the next record `next_record` would read."""
        return self._cursor

    def hold(self, start: int, fence) -> None:
        """Keep the records read from position `start` on (a `cursor` taken before reading
        them) past `release()` until `fence` has completed (`fence.query()`; a CUDA event of the
        copies that read their payloads): the consumer reads on while they are copied."""
        self._holds.append((start, fence))

    def release(self) -> None:
        """Give back to the producer everything read so far, except what a fence not yet
        completed holds (`hold`) and all after it (views of given-back records must no longer
        be used)."""
        while self._holds and self._holds[0][1].query():
            self._holds.popleft()
        self._ctl[READ_POS] = self._holds[0][0] if self._holds else self._cursor

    @property
    def num_held(self) -> int:
        """Fences holding records back (`hold`), completed or not, as of the last release."""
        return len(self._holds)

    def wait_held(self) -> None:
        """Wait for every fence holding records (before the mapping goes, or to release all)."""
        while self._holds:
            self._holds.popleft()[1].synchronize()

    def producer_alive(self) -> bool:
        return not self._ctl[PRODUCER_CLOSED] and self.seg.creator_alive()

    def check_producer(self) -> None:
        """Raise PeerGoneError when the producer closed the ring or its process is gone."""
        if self._ctl[PRODUCER_CLOSED]:
            raise PeerGoneError(f"ring {self.name!r}: the producer closed it")
        if not self.seg.creator_alive():
            raise PeerGoneError(f"ring {self.name!r}: the producer (pid "
                                f"{self.seg.header['creator_pid']}) is gone")

    # ---- both ---------------------------------------------------------------------------------
    def close(self) -> None:
        if self.seg.closed:
            return
        self.wait_held()  # no copy may still read the mapping
        self._ctl[PRODUCER_CLOSED if self.seg.owner else CONSUMER_CLOSED] = 1
        for v in (self._words, self._data, self._ctl):
            try:
                v.release()
            except BufferError:
                pass  # NOTE: a caller still holds an export; the mapping lives until it goes
        self.seg.close()

    def __enter__(self) -> "Ring":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
