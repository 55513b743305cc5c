"""What every node service shares: the control socket, the token-event sockets to routers, the
/metrics and /health probe, the poll loop and its ending.

A node is one thread running `NodeService.run()`: it sleeps in `zmq.Poller.poll` while idle
(no spinning), and while it has work it polls without waiting, runs one engine step, and checks
timeouts. Subclasses (`prefill_node`, `decode_node`) register their sockets and handlers and say
what a step is. Refused messages are counted and logged; the loop never dies of one.

Ending: SIGINT stops at once (what is in flight ends with an error). SIGTERM drains: the node
refuses new work (the subclass says how), reports `draining` in its Pong and a 503 on /health so
routers stop picking it, runs until nothing is in flight (`busy()`) or `drain_timeout` passes,
then ends what is left with an error and exits. A router whose event endpoint stays disconnected
for `ROUTER_GONE_S` (killed) has its requests ended on the node (`on_router_gone`), so work
that nobody will read does not hold blocks.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

from pd.wire import messages

from pd.wire import security
from pd.wire.messages import MessageError, Ping, Pong, TokenStream, TokenStreams
from pd.wire.refusals import RefusalLog

log = logging.getLogger(__name__)
_REFUSALS = RefusalLog(log)  # rate-limited: a flood of garbage must not flood the log

MESSAGES_REFUSED = Counter(
    "pd_messages_refused", "Control messages refused by a node (malformed, unknown, too large)",
    ["role", "node", "socket"])
TICK_S = 0.05  # how often timeouts are checked, and the longest idle sleep
ROUTER_GONE_S = 1.0  # a router's event endpoint disconnected this long: its requests end
# NOTE: the allocator's integrity check walks every block (tens of ms at 100k blocks): an idle
# node runs it at most this often, so a request arriving as the node goes idle does not wait
INTEGRITY_S = 10.0


def bind_socket(ctx: zmq.Context, kind: int, host: str, port: int) -> tuple[zmq.Socket, int]:
    """Bind to tcp://host:port (port 0: any free port); returns the socket and its port."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, messages.MAX_MESSAGE_BYTES + 4096)
    security.secure_server(sock)
    if port == 0:
        port = sock.bind_to_random_port(f"tcp://{host}")
    else:
        sock.bind(f"tcp://{host}:{port}")
    return sock, port


@dataclass(eq=False)
class _RouterLink:
    sock: zmq.Socket
    monitor: zmq.Socket
    connected: bool = False
    since: float = field(default_factory=time.monotonic)  # when `connected` last changed


class EventSender:
    """PUSH sockets to the routers' event endpoints, connected on first use and watched: `gone()`
    names the endpoints disconnected (or never connected) for longer than `gone_after`."""

    def __init__(self, ctx: zmq.Context, gone_after: float = ROUTER_GONE_S) -> None:
        self.ctx = ctx
        self.gone_after = gone_after
        self.links: dict[str, _RouterLink] = {}

    def send(self, addr: str, msg: TokenStream | TokenStreams) -> None:
        link = self.links.get(addr)
        if link is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            security.secure_client(sock)
            sock.connect(addr)
            link = self.links[addr] = _RouterLink(sock, monitor)
        try:
            link.sock.send(messages.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.error("router %s is not reading its events; dropped a message for %s", addr,
                      getattr(msg, "req_id", f"{len(getattr(msg, 'streams', ()))} requests"))

    def gone(self, now: float) -> list[str]:
        """Endpoints found gone since the last call; their sockets are closed."""
        out = []
        for addr, link in list(self.links.items()):
            while link.monitor.poll(0):
                event = recv_monitor_message(link.monitor)["event"]
                if event in (zmq.EVENT_CONNECTED, zmq.EVENT_DISCONNECTED):
                    link.connected, link.since = event == zmq.EVENT_CONNECTED, now
            if not link.connected and now - link.since > self.gone_after:
                log.warning("router event endpoint %s gone for %.1fs", addr, now - link.since)
                self._close(self.links.pop(addr), linger=0)
                out.append(addr)
        return out

    def _close(self, link: _RouterLink, linger: int | None = None) -> None:
        link.sock.disable_monitor()
        link.monitor.close()
        link.sock.close(linger)

    def close(self) -> None:
        for link in self.links.values():
            self._close(link)
        self.links.clear()


class ProbeServer:
    """/metrics (Prometheus text) and /health (JSON) over HTTP, in a daemon thread."""

    def __init__(self, host: str, port: int, health: Callable[[], tuple[bool, dict]]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                path = self.path.split("?")[0]
                if path == "/metrics":
                    body, ctype, code = generate_latest(), CONTENT_TYPE_LATEST, 200
                elif path in ("/health", "/healthz", "/ready"):
                    ok, info = health()
                    body, ctype, code = json.dumps(info).encode(), "application/json", 200 if ok else 503
                else:
                    body, ctype, code = b"not found\n", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, name="probe", daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class NodeService:
    role = "node"

    def __init__(self, node_id: str, host: str, port: int, metrics_port: int | None,
                 drain_timeout: float = 30.0) -> None:
        self.node_id = node_id
        self.drain_timeout = drain_timeout
        self.drain_deadline: float | None = None  # set by SIGTERM (`drain()`)
        self.ctx = zmq.Context.instance()
        self.control, self.port = bind_socket(self.ctx, zmq.ROUTER, host, port)
        self.events = EventSender(self.ctx)
        self.poller = zmq.Poller()
        self.handlers: dict[zmq.Socket, Callable[[], None]] = {}
        self.register(self.control, self._on_control_socket)
        self.probe = ProbeServer(host, metrics_port, self.health) if metrics_port is not None else None
        self.stopping = threading.Event()
        self.started = time.monotonic()
        self.next_integrity_check = 0.0
        if threading.current_thread() is threading.main_thread():
            # NOTE: set before the node announces itself, so an early SIGTERM drains (an idle
            # node: exits 0) instead of killing the process.
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)

    # -- subclass hooks ------------------------------------------------------------------------
    def integrity_due(self) -> bool:
        """Whether an idle node checks its allocator now (at most every `INTEGRITY_S`)."""
        now = time.monotonic()
        if now < self.next_integrity_check:
            return False
        self.next_integrity_check = now + INTEGRITY_S
        return True

    def has_work(self) -> bool:
        return False

    def step(self) -> None:
        pass

    def tick(self, now: float) -> None:
        """Called every TICK_S: timeouts."""

    def busy(self) -> bool:
        """Requests in flight that a drain waits for."""
        return False

    def on_router_gone(self, reply_to: str) -> None:
        """End every request whose events go to `reply_to`, without sending it anything."""

    def stats(self) -> dict:
        return {}

    def on_control(self, identity: bytes, msg) -> None:
        raise MessageError(f"{type(msg).__name__} is not accepted by a {self.role} node")

    def shutdown(self) -> None:
        pass

    # -- machinery -----------------------------------------------------------------------------
    def register(self, sock: zmq.Socket | int, handler: Callable[[], None]) -> None:
        """Call `handler` when `sock` (a ZMQ socket or a file descriptor) is readable."""
        self.poller.register(sock, zmq.POLLIN)
        self.handlers[sock] = handler

    def unregister(self, sock: zmq.Socket | int) -> None:
        self.poller.unregister(sock)
        self.handlers.pop(sock, None)

    def refuse(self, socket_name: str, error: Exception) -> None:
        MESSAGES_REFUSED.labels(self.role, self.node_id, socket_name).inc()
        _REFUSALS("%s node %s refused a message on its %s socket: %s",
                  self.role, self.node_id, socket_name, error)

    @property
    def draining(self) -> bool:
        return self.drain_deadline is not None

    def drain(self) -> None:
        """Stop taking new work; `run()` ends once nothing is in flight or the drain times out."""
        if self.draining:
            return
        self.drain_deadline = time.monotonic() + self.drain_timeout
        log.info("%s node %s draining: up to %.0fs for the requests in flight",
                 self.role, self.node_id, self.drain_timeout)

    def health(self) -> tuple[bool, dict]:
        status = "draining" if self.draining else "ok"
        return not self.draining, {"status": status, "role": self.role, "node_id": self.node_id,
                                   **self.stats()}

    def reply(self, identity: bytes, msg) -> None:
        self.control.send_multipart([identity, messages.encode(msg)])

    def _on_control_socket(self) -> None:
        while True:
            try:
                frames = self.control.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.refuse("control", MessageError(f"{len(frames) - 1} frames, expected 1"))
                continue
            identity, data = frames
            try:
                msg = messages.decode(data)
                if isinstance(msg, Ping):
                    stats = {**self.stats(), "draining": self.draining}
                    self.reply(identity, Pong(msg.seq, self.role, self.node_id, stats,
                                              **self.pong_extra()))
                else:
                    self.on_control(identity, msg)
            except MessageError as e:
                self.refuse("control", e)

    def pong_extra(self) -> dict:
        return {}

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGTERM:
            self.drain()
        else:
            log.info("%s node %s: signal %d, stopping", self.role, self.node_id, signum)
            self.stopping.set()

    def run(self) -> None:
        last_tick = 0.0
        try:
            while not self.stopping.is_set():
                busy = self.has_work()
                for sock, _ in self.poller.poll(0 if busy else TICK_S * 1000):
                    self.handlers[sock]()
                if self.has_work():
                    self.step()
                now = time.monotonic()
                if now - last_tick >= TICK_S:
                    last_tick = now
                    self.tick(now)
                    for reply_to in self.events.gone(now):
                        self.on_router_gone(reply_to)
                if self.draining and not self.busy():
                    log.info("%s node %s drained", self.role, self.node_id)
                    break
                if self.draining and now > self.drain_deadline:
                    log.warning("%s node %s: drain timed out after %.0fs; ending what is left",
                                self.role, self.node_id, self.drain_timeout)
                    break
        finally:
            self.close()

    def close(self) -> None:
        self.shutdown()
        if self.probe is not None:
            self.probe.close()
        self.events.close()
        self.control.close()
