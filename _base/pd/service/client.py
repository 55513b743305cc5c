"""A synchronous client of the node protocol: sends PrefillRequests to a prefill node and
collects the TokenStream messages that come back. The router's asynchronous backend speaks the
same protocol; this one serves tests, benchmarks and scripts.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import zmq

from pd.wire import messages as m
from pd.wire import security
from pd.wire.sampling_params import SamplingParams


@dataclass
class Result:
    req_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_messages: int = 0
    first_token_time: float | None = None
    sent_time: float = 0.0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class NodeClient:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.ctx = zmq.Context.instance()
        self.events = self.ctx.socket(zmq.PULL)
        self.events.setsockopt(zmq.LINGER, 0)
        security.secure_server(self.events)
        port = self.events.bind_to_random_port(f"tcp://{host}")
        self.reply_to = f"tcp://{host}:{port}"
        self.controls: dict[str, zmq.Socket] = {}
        self.results: dict[str, Result] = {}

    def control(self, addr: str) -> zmq.Socket:
        sock = self.controls.get(addr)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            security.secure_client(sock)
            sock.connect(addr)
            self.controls[addr] = sock
        return sock

    def submit(self, prefill_addr: str, decode_kv_addr: str, prompt_ids: list[int],
               params: SamplingParams, req_id: str | None = None) -> str:
        req_id = req_id or uuid.uuid4().hex
        self.results[req_id] = Result(req_id, sent_time=time.perf_counter())
        self.control(prefill_addr).send(m.encode(m.PrefillRequest(
            req_id, list(prompt_ids), params.to_dict(), decode_kv_addr, self.reply_to)))
        return req_id

    def abort(self, addrs: list[str], req_id: str) -> None:
        for addr in addrs:
            self.control(addr).send(m.encode(m.Abort(req_id, "client")))

    def ping(self, addr: str, timeout: float = 5.0) -> m.Pong:
        sock = self.control(addr)
        sock.send(m.encode(m.Ping(1)))
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no pong from {addr} within {timeout}s")
        return m.decode(sock.recv())

    def poll(self, timeout: float) -> list[m.TokenStream]:
        out = []
        if self.events.poll(int(timeout * 1000)):
            while True:
                try:
                    streams = m.unpack_streams(m.decode(self.events.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
                for msg in streams:
                    out.append(msg)
                    res = self.results.get(msg.req_id)
                    if res is None:
                        continue
                    if msg.token_ids and res.first_token_time is None:
                        res.first_token_time = time.perf_counter()
                    res.num_messages += 1
                    res.token_ids += msg.token_ids
                    res.logprobs += msg.logprobs or []
                    res.top_logprobs += msg.top_logprobs or []
                    res.finish_reason = res.finish_reason or msg.finish_reason
                    res.error = res.error or msg.error
        return out

    def wait(self, req_ids: list[str], timeout: float = 60.0) -> list[Result]:
        deadline = time.monotonic() + timeout
        while not all(self.results[r].done for r in req_ids):
            if time.monotonic() > deadline:
                pending = [r for r in req_ids if not self.results[r].done]
                raise TimeoutError(f"{len(pending)} request(s) unfinished after {timeout}s")
            self.poll(0.05)
        return [self.results[r] for r in req_ids]

    def close(self) -> None:
        for s in self.controls.values():
            s.close()
        self.events.close()

    def __enter__(self) -> "NodeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
