"""Which KV transport a prefill node connects to a decode node's KV ingest endpoint with:
`make_transport` picks shm (`shm_transport.ShmTransport`) when the endpoint's host is this host
(mode "auto"), else ZMQ frames (`zmq_transport.ZmqTransport`), or what `mode`/PD_KV_TRANSPORT
says."""

from __future__ import annotations

import ipaddress
import os
import socket
from urllib.parse import urlsplit

from .transport import Transport

MODES = ("auto", "shm", "zmq")


def is_local(endpoint: str) -> bool:
    """True when `endpoint` (tcp://host:port, ipc://..., inproc://...) is on this host."""
    parts = urlsplit(endpoint)
    if parts.scheme in ("ipc", "inproc"):
        return True
    host = parts.hostname or ""
    if host in ("localhost", "*", "") or host == socket.gethostname():
        return True
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    local = {"0.0.0.0", "::"}
    try:
        local |= {ai[4][0] for ai in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        pass
    return any(ipaddress.ip_address(a.split("%")[0]).is_loopback or a in local for a in addrs)


def choose_mode(endpoint: str, mode: str | None = None) -> str:
    """'shm' or 'zmq' for `endpoint`: `mode`, else PD_KV_TRANSPORT, else auto."""
    mode = mode or os.environ.get("PD_KV_TRANSPORT", "auto")
    if mode not in MODES:
        raise ValueError(f"KV transport mode {mode!r}: choose one of {', '.join(MODES)}")
    if mode == "auto":
        return "shm" if is_local(endpoint) else "zmq"
    return mode


def make_transport(endpoint: str, instance_id: str, mode: str | None = None, **kw) -> Transport:
    """Connect P's transport to D's kv-ingest `endpoint`; `kw` go to the implementation."""
    chosen = choose_mode(endpoint, mode)
    if chosen == "shm":
        from .shm_transport import ShmTransport
        return ShmTransport(endpoint, instance_id, **kw)
    from .zmq_transport import ZmqTransport
    kw.pop("ring_bytes", None)
    kw.pop("timeout", None)
    return ZmqTransport(endpoint, instance_id, **kw)
