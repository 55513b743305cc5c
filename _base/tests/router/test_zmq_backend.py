"""The ZMQ backend's heartbeats against a fake node (a ROUTER answering pings in a thread): a
stall of the router's own loop longer than the heartbeat timeout does not mark a live node
down, a node that stops answering is still marked down, and a node whose process closes its
socket is down at once, long before the heartbeat timeout."""

from __future__ import annotations

import asyncio
import threading
import time

import zmq

from pd.wire import messages as m
from router.registry import Role
from router.zmq_backend import ZmqBackend

INTERVAL, TIMEOUT = 0.1, 0.5


class FakeNode:
    """Answers every Ping with a prefill node's Pong until `silence` is set."""

    def __init__(self, port: int = 0) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port:
            self.sock.bind(f"tcp://127.0.0.1:{port}")
            self.port = port
        else:
            self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.silence, self.stop = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            identity, data = self.sock.recv_multipart()
            msg = m.decode(data)
            if isinstance(msg, m.Ping) and not self.silence.is_set():
                self.sock.send_multipart([identity, m.encode(m.Pong(
                    msg.seq, "prefill", "fake", {"free_blocks": 8, "total_blocks": 8}))])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close()


async def wait_for(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def test_own_stall_is_not_a_dead_node_but_silence_is():
    node = FakeNode()
    addr = f"127.0.0.1:{node.port}"

    async def run() -> None:
        backend = ZmqBackend([addr], [], max_model_len=64, heartbeat_interval=INTERVAL,
                             heartbeat_timeout=TIMEOUT)
        downs: list[str] = []
        mark_down = backend.registry.mark_down
        backend.registry.mark_down = lambda a, why: (downs.append(why), mark_down(a, why))
        await backend.start()
        try:
            healthy = lambda: [n.address for n in backend.registry.healthy(Role.PREFILL)] == [addr]
            assert await wait_for(healthy, 5)
            time.sleep(3 * TIMEOUT)  # the router's loop stalls; the node stays up meanwhile
            await asyncio.sleep(3 * INTERVAL)
            assert healthy() and downs == [], "the router's own stall marked a live node down"
            node.silence.set()
            assert await wait_for(lambda: not healthy(), 3 * TIMEOUT + 1)
            assert downs and "no heartbeat" in downs[0]
        finally:
            await backend.close()

    try:
        asyncio.run(run())
    finally:
        node.close()


def test_dropped_connection_is_down_at_once_and_back_with_a_heartbeat():
    node = FakeNode()
    addr = f"127.0.0.1:{node.port}"

    async def run() -> None:
        backend = ZmqBackend([addr], [], max_model_len=64, heartbeat_interval=INTERVAL,
                             heartbeat_timeout=60.0)
        await backend.start()
        try:
            healthy = lambda: [n.address for n in backend.registry.healthy(Role.PREFILL)] == [addr]
            assert await wait_for(healthy, 5)
            node.close()  # the node's process is gone: its end of the connection closes
            assert await wait_for(lambda: not healthy(), 5)
            again = FakeNode(port=node.port)  # restarted on the same port
            try:
                assert await wait_for(healthy, 5)
            finally:
                again.close()
        finally:
            await backend.close()

    asyncio.run(run())
