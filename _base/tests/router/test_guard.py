"""The router's connection guard (`router.guard`) on a live router over loopback: past
--max-connections a new connection gets an OpenAI-style 503 at once while those held keep being
served; a connection that trickles its request head is closed after --header-timeout; 1,100
slow connections do not stop /health."""

from __future__ import annotations

import json
import resource
import socket
import time
import urllib.error
import urllib.request

import pytest

from tests.router.conftest import ScriptedBackend, echo_script


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (ConnectionError, urllib.error.URLError):
        return 0


def read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(4096):
        out += chunk
    return out


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture
def backend(tokenizer):
    return ScriptedBackend(echo_script(tokenizer, "hello"), tokenizer.eos_token_ids[0])


def test_past_the_limit_a_connection_gets_503_and_held_ones_are_served(make_server, backend):
    srv = make_server(backend, max_connections=6)
    held = [connect(srv.port) for _ in range(6)]
    try:
        assert wait_for(lambda: srv_open(srv) == 6, 5)
        extra = connect(srv.port)
        reply = read_all(extra)  # answered and closed at once
        extra.close()
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), reply
        assert b"Retry-After: 1" in head
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        # a held connection is still served
        held[0].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert read_all(held[0]).startswith(b"HTTP/1.1 200")
    finally:
        for s in held:
            s.close()
    assert wait_for(lambda: health(srv.url) == 200, 5)  # room again
    assert metric(srv.url, "pd_http_connections_refused_total") >= 1


def srv_open(srv) -> int:
    """Connections the live server's guard holds open."""
    return sum(site._guard.num_open for site in srv.runner.sites)


def test_a_trickled_request_head_is_cut_at_the_header_timeout(make_server, backend):
    srv = make_server(backend, header_timeout=0.5)
    sock = connect(srv.port)
    sock.sendall(b"GET /health HTTP/1.1\r\nHo")
    start = time.monotonic()
    closed = False
    try:
        while time.monotonic() - start < 5:
            try:
                sock.sendall(b"s")  # a byte every 50 ms: never a whole head
            except OSError:
                closed = True
                break
            sock.settimeout(0.05)
            try:
                if sock.recv(1) == b"":
                    closed = True
                    break
            except socket.timeout:
                pass
            except OSError:
                closed = True
                break
    finally:
        sock.close()
    took = time.monotonic() - start
    assert closed and 0.4 < took < 2.0, took
    assert health(srv.url) == 200  # whole heads in time are served
    assert metric(srv.url, "pd_http_header_timeouts_total") >= 1


def test_1100_slow_connections_do_not_stop_health(make_server, backend):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 4096
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the open-file hard limit ({hard}) is under {need}: 1,100 client sockets and "
                    f"the router's share of them do not fit one process")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    try:
        srv = make_server(backend, max_connections=512, header_timeout=2.0)
        slow = []
        try:
            for _ in range(1100):
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", srv.port))
                slow.append(s)
            for s in slow:  # each sends the start of a head and no more
                try:
                    s.send(b"GET /health HTTP/1.1\r\n")
                except OSError:
                    pass  # refused (503) and closed already
            guard = next(iter(srv.runner.sites))._guard
            start = time.monotonic()
            # the cap is met: 512 held, the rest answered 503 and closed
            assert wait_for(lambda: guard.num_refused > 0, 5), guard.num_open
            assert wait_for(lambda: health(srv.url) == 200, 6), "health never answered 200"
            took = time.monotonic() - start
            assert took < 4.0, took  # within the header timeout, give or take
            assert metric(srv.url, "pd_http_connections_refused_total") > 0
            assert wait_for(lambda: metric(srv.url, "pd_http_header_timeouts_total") >= 100, 5)
        finally:
            for s in slow:
                s.close()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
