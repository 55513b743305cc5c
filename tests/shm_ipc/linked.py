"""Helpers of the transport tests: a receiver's items read until n came (KV installed as each
arrives), and a shm transport whose ring a receiver has attached."""

from __future__ import annotations

import time

from shm_ipc.kv import install_kv
from shm_ipc.receiver import KVReceiver
from shm_ipc.records import KVRecord
from shm_ipc.tiers import make_transport


def collect(rx: KVReceiver, n: int, kv_dst=None, dst_ids=None, timeout: float = 20) -> list:
    items, deadline = [], time.monotonic() + timeout
    while len(items) < n:
        assert time.monotonic() < deadline, f"only {len(items)} of {n} items arrived: {items}"
        for inc in rx.recv(timeout=1.0):
            if isinstance(inc.item, KVRecord):
                install_kv(inc.item, kv_dst, dst_ids)  # before the next recv() reuses the ring
                items.append(("kv", inc.item.layer_start, inc.item.block_start))
            else:
                items.append(inc.item)
    return items


def attached_ring(rx: KVReceiver, name: str):
    """A shm transport whose ring `rx` has attached."""
    tx = make_transport(rx.endpoint, name, mode="shm", ring_bytes=64 << 10)
    deadline = time.monotonic() + 10
    while name.encode() not in rx.rings:
        assert time.monotonic() < deadline, "the receiver never attached the ring"
        rx.recv(timeout=0.1)
    return tx
