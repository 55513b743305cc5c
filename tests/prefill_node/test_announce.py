"""The prefill node announces a request to its decode node as the prefill starts: a real
prefill node and engine on the tiny model, a ZMQ ROUTER socket playing the decode node (frames
transport). The decode node's KVAccept, answered while a chunked prefill runs, lets the KV go
with the first token, with no round trip after the prefill; a request ended at the prefill node
after its announcement is aborted at the decode node and its named blocks released."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq

from pd.engine.llm import LLM
from pd.wire import messages as m
from pd.wire.sampling_params import SamplingParams
from prefill_node.node import JobState, PrefillNode
from shm_ipc import control


def prompt(req_id: str) -> list[int]:
    """40 tokens (3 blocks of 16, prefilled in two chunks of 32 at most), the request's own (no
    prefix cached from another)."""
    return [3 + len(req_id)] + list(range(4, 43))


@pytest.fixture
def pair(tiny_model_dir):
    engine = LLM(tiny_model_dir, num_blocks=32, max_num_batched_tokens=32).engine
    with ThreadPoolExecutor(1) as pool:  # off the main thread: no signal handlers taken
        node = pool.submit(PrefillNode, "prefill-announce", engine, host="127.0.0.1", port=0,
                           metrics_port=None, transport="zmq").result()
    decode = node.ctx.socket(zmq.ROUTER)
    addr = f"tcp://127.0.0.1:{decode.bind_to_random_port('tcp://127.0.0.1')}"
    router = node.ctx.socket(zmq.PULL)  # the router's event socket
    reply = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    yield node, decode, addr, reply
    for link in node.links.values():
        link.close()
    decode.close(linger=0)
    router.close(linger=0)


def controls(sock, wait_ms: int = 300) -> list[tuple[bytes, dict]]:
    """The control messages (not records or doorbells) that arrive within `wait_ms`."""
    out = []
    while sock.poll(wait_ms):
        frames = sock.recv_multipart()
        if len(frames) in (2, 3) and len(frames[1]) > 4:
            msg = control.decode(frames[1])
            if msg["type"] not in control.INTERNAL:
                out.append((frames[0], msg))
    return out


def poll(node) -> None:
    """What the node's loop does between steps: read its sockets."""
    for sock, _ in node.poller.poll(100):
        node.handlers[sock]()


def admit(node, req_id: str, addr: str, reply: str, max_tokens: int = 4) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0).to_dict()
    node.admit(m.PrefillRequest(req_id, prompt(req_id), params, addr, reply))


def pair_up(node, decode, addr, reply) -> bytes:
    """A first request opens the link; the decode node answers the handshake."""
    admit(node, "warm-up", addr, reply)
    node.step()
    (peer, hello), = controls(decode)
    assert hello["type"] == m.Hello.TYPE
    decode.send_multipart([peer, control.encode(m.to_dict(m.HelloOk("decode-test")))])
    poll(node)
    node.abort("warm-up", "test over")
    controls(decode)
    return peer


def test_an_accept_during_the_prefill_sends_the_kv_with_the_first_token(pair):
    node, decode, addr, reply = pair
    peer = pair_up(node, decode, addr, reply)
    admit(node, "r", addr, reply)
    node.step()  # the first chunk: announced before it runs
    (_, meta), = controls(decode)
    assert (meta["type"], meta["req_id"]) == (m.RequestMeta.TYPE, "r")
    assert node.jobs["r"].state is JobState.ANNOUNCED
    decode.send_multipart([peer, control.encode(m.to_dict(m.KVAccept("r")))])
    poll(node)  # kept until the prefill ends
    assert node.jobs["r"].state is JobState.ANNOUNCED and node.jobs["r"].accept is not None
    node.step()  # the last chunk: first token, then the KV at once
    assert node.jobs["r"].state is JobState.KV_SENT
    (_, done), = controls(decode)
    assert (done["type"], done["req_id"]) == (m.KVDone.TYPE, "r") and done["num_records"] >= 1
    decode.send_multipart([peer, control.encode(m.to_dict(m.KVAck("r")))])
    poll(node)
    assert "r" not in node.jobs


def test_an_announced_request_ended_here_is_aborted_there(pair):
    node, decode, addr, reply = pair
    peer = pair_up(node, decode, addr, reply)
    free = node.engine.allocator.num_free
    admit(node, "r", addr, reply)
    node.step()
    assert controls(decode)[0][1]["type"] == m.RequestMeta.TYPE
    decode.send_multipart([peer, control.encode(m.to_dict(m.KVAccept("r", 0, [5, 6, 7])))])
    poll(node)
    node.abort("r", "client gone")  # the router's abort while it prefills
    (_, released), = controls(decode)  # after the ABORT record: the blocks will not be written
    assert released == m.to_dict(m.KVReleased("r"))
    assert "r" not in node.jobs and node.engine.allocator.num_free == free
    assert not node.scheduler.has_work


def test_a_request_asking_for_one_token_is_not_announced(pair):
    node, decode, addr, reply = pair
    pair_up(node, decode, addr, reply)
    admit(node, "one", addr, reply, max_tokens=1)
    node.step()
    assert not controls(decode) and node.jobs["one"].state is JobState.QUEUED
    node.step()  # ends with its first token, answered here
    assert "one" not in node.jobs and not controls(decode)


class DoneCopy:
    """A direct copy's completion event; queued on the step's stream, it is done once the
    step's tokens are on the host."""

    def query(self) -> bool:
        return True


class StreamPeerCache:
    """Stands in for a decode node's cache opened by CUDA IPC (this machine has no GPU): it
    records each write and the stream it was queued on."""

    def __init__(self, node) -> None:
        self.node, self.writes = node, []

    def write(self, kv, src, dst, side: bool = True):
        # whether the step's tokens were already waited for (`ModelRunner.run` unpacks them)
        self.writes.append((list(src), list(dst), side, self.node.jobs["r"].state))
        return DoneCopy()

    def close(self) -> None:
        pass


def test_a_direct_accept_during_the_prefill_is_written_by_the_last_step(pair):
    node, decode, addr, reply = pair
    peer = pair_up(node, decode, addr, reply)
    link = node.links[addr]
    link.peer_cache = cache = StreamPeerCache(node)
    admit(node, "r", addr, reply)
    node.step()
    assert controls(decode)[0][1]["direct"] is True
    decode.send_multipart([peer, control.encode(m.to_dict(m.KVAccept("r", 0, [5, 6, 7])))])
    poll(node)
    node.step()  # queues the copy behind its forward, then the first token, then KVDone
    (src, dst, side, state), = cache.writes
    assert dst == [5, 6, 7] and src == node.jobs["r"].req.block_ids[:3]
    assert side is False and state is JobState.ANNOUNCED  # inside the step, on its stream
    (_, done), = controls(decode)
    assert done == m.to_dict(m.KVDone("r", 0)) and node.jobs["r"].state is JobState.KV_SENT
    link.peer_cache = None
