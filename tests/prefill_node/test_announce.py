"""The prefill node announces a request to its decode node as the prefill starts: a real
prefill node and engine on the tiny model, a ZMQ ROUTER socket playing the decode node (frames
transport). The decode node's KVAccept, answered while a chunked prefill runs, lets the KV go
with the first token, with no round trip after the prefill; a request ended at the prefill node
after its announcement is aborted at the decode node and its named blocks released. A longer
prompt's KV goes in parts as its chunks fill blocks."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq

from pd.engine.llm import LLM
from pd.wire import messages as m
from pd.wire.sampling_params import SamplingParams
from prefill_node.job import JobState
from prefill_node.node import PrefillNode
from shm_ipc import control, header, records
from shm_ipc.kv import block_bytes


def prompt(req_id: str, length: int = 40) -> list[int]:
    """40 tokens (3 blocks of 16, prefilled in two chunks of 32 at most), the request's own (no
    prefix cached from another)."""
    return [3 + len(req_id)] + list(range(4, 3 + length))


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


def controls(sock, wait_ms: int = 150) -> list[tuple[bytes, dict]]:
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


def admit(node, req_id: str, addr: str, reply: str, max_tokens: int = 4, length: int = 40) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0).to_dict()
    node.admit(m.PrefillRequest(req_id, prompt(req_id, length), params, addr, reply))


def arrivals(sock, wait_ms: int = 150) -> list:
    """What arrives within `wait_ms`, in order: control messages, and KV records as
    (first block, blocks, layers)."""
    out = []
    while sock.poll(wait_ms):
        frames = sock.recv_multipart()
        if len(frames) == 4 and len(frames[1]) == 4:
            rec = records.decode(header.from_bytes(frames[1]), frames[2], frames[3])
            out.append((rec.block_start, rec.num_blocks, (rec.layer_start, rec.layer_end)))
        elif len(frames) in (2, 3) and len(frames[1]) > 4:
            msg = control.decode(frames[1])
            if msg["type"] not in control.INTERNAL:
                out.append(msg)
    return out


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

    def write(self, kv, src, dst, side: bool = True, after=None):
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
    node.step()  # the first chunk's blocks beside it; the last one behind its forward, on its
    # stream; then the first token, then KVDone
    part, last = cache.writes
    src = node.jobs["r"].req.block_ids
    assert part == (src[:2], [5, 6], True, JobState.ANNOUNCED)
    assert last == (src[2:3], [7], False, JobState.ANNOUNCED)  # inside the step
    (_, done), = controls(decode)
    assert done == m.to_dict(m.KVDone("r", 0)) and node.jobs["r"].state is JobState.KV_SENT
    link.peer_cache = None


def test_a_long_prompt_sends_its_kv_in_parts_as_its_chunks_fill_blocks(pair):
    node, decode, addr, reply = pair
    peer = pair_up(node, decode, addr, reply)
    admit(node, "r", addr, reply, length=72)  # 5 blocks, prefilled in chunks of 32, 32 and 8
    node.step()
    assert controls(decode)[0][1]["type"] == m.RequestMeta.TYPE
    decode.send_multipart([peer, control.encode(m.to_dict(m.KVAccept("r", 1)))])  # 1 cached there
    poll(node)
    node.step()  # before it runs, what the first chunk filled: block 1, named 0 in the records
    first = arrivals(decode)
    assert first and {(b0, nb) for b0, nb, _ in first} == {(0, 1)}
    job = node.jobs["r"]
    assert (job.kv_sent, job.kv_records, job.state) == (1, len(first), JobState.ANNOUNCED)
    node.step()  # blocks 2 and 3 before it; then the first token, block 4, and KVDone
    rest = arrivals(decode)
    parts = {(b0, nb) for b0, nb, _ in rest[:-1]}
    assert parts == {(1, 2), (3, 1)}
    assert rest[-1] == m.to_dict(m.KVDone("r", len(first) + len(rest) - 1))
    assert job.state is JobState.KV_SENT and job.kv_sent == 4
    assert job.kv_bytes == 4 * block_bytes(node.engine.runner.kv_cache.kv)
    assert node.kv_sends.parts_sent == 2


class PartsPeerCache(StreamPeerCache):
    """Records each copy: its blocks, its stream, and which earlier copy it waits for beyond
    its stream (by number)."""

    def __init__(self, node) -> None:
        super().__init__(node)
        self.names: dict = {}

    def write(self, kv, src, dst, side: bool = True, after=None):
        done = DoneCopy()
        self.writes.append((list(src), list(dst), side, after and self.names[after]))
        self.names[done] = len(self.names)
        return done


def direct_long_prompt(pair):
    """A direct link, a 72-token prompt's first chunk prefilled and announced, and the decode
    node's KVAccept naming blocks 9..5 read: (node, decode socket, link, its fake cache)."""
    node, decode, addr, reply = pair
    peer = pair_up(node, decode, addr, reply)
    link = node.links[addr]
    link.peer_cache = cache = PartsPeerCache(node)
    admit(node, "r", addr, reply, length=72)
    node.step()
    controls(decode)
    decode.send_multipart([peer, control.encode(m.to_dict(m.KVAccept("r", 0, [9, 8, 7, 6, 5])))])
    poll(node)
    return node, decode, link, cache


def test_a_direct_long_prompt_is_written_in_parts(pair):
    node, decode, link, cache = direct_long_prompt(pair)
    node.step()  # blocks 0 and 1 on the side stream, beside the step
    src = node.jobs["r"].req.block_ids
    assert cache.writes == [(src[:2], [9, 8], True, None)]
    assert not controls(decode)  # no KVDone for a part
    node.step()  # blocks 2 and 3 beside it; the last one on its own stream, after them; KVDone
    assert cache.writes[1:] == [(src[2:4], [7, 6], True, None), (src[4:5], [5], False, 1)]
    (_, done), = controls(decode)
    assert done == m.to_dict(m.KVDone("r", 0))
    link.peer_cache = None


def test_a_request_aborted_after_a_direct_part_is_answered_once_its_copy_is_done(pair):
    node, decode, link, cache = direct_long_prompt(pair)
    node.step()
    assert len(cache.writes) == 1
    node.abort("r", "client gone")
    # the decode node keeps the blocks until told the copy into them is done: KVDone, not
    # KVReleased (which says nothing was written)
    node.step()
    (_, done), = controls(decode)
    assert done == m.to_dict(m.KVDone("r", 0)) and not link.writes
    link.peer_cache = None


class StepRunning:
    """Stands in for the event of a step under way (`KVSends.await_accepts`): its first
    query sends the decode node's replies, and it completes once `until()` holds (or after
    a few seconds of queries)."""

    def __init__(self, decode, peer, replies, until) -> None:
        self.decode, self.peer, self.replies, self.until = decode, peer, replies, until
        self.deadline = None

    def query(self) -> bool:
        if self.deadline is None:
            self.deadline = time.monotonic() + 5
            for msg in self.replies:
                self.decode.send_multipart([self.peer, control.encode(m.to_dict(msg))])
        return self.until() or time.monotonic() > self.deadline


def test_accepts_that_come_while_a_step_runs_write_at_once(pair):
    """While a step runs, the prefill node reads its direct links: a KVAccept that comes then
    has the blocks earlier steps filled copied beside the step (a request the step goes on
    prefilling) or its last KV queued behind it (one the step ends); other replies wait."""
    node, decode, addr, reply = pair
    peer = pair_up(node, decode, addr, reply)
    link = node.links[addr]
    link.peer_cache = cache = PartsPeerCache(node)
    admit(node, "r", addr, reply, length=72)
    node.step()  # the first chunk, announced: 32 tokens in, no KVAccept yet
    controls(decode)
    job = node.jobs["r"]
    replies = [m.KVAck("other"), m.KVAccept("r", 0, [9, 8, 7, 6, 5])]
    node.kv_sends.await_accepts([(job, False)], StepRunning(decode, peer, replies, lambda: cache.writes))
    src = job.req.block_ids
    assert cache.writes == [(src[:2], [9, 8], True, None)] and job.kv_sent == 2
    assert [type(x) for x in link.deferred] == [m.KVAck]  # for after the step
    link.on_socket()
    assert not link.deferred
    node.step()  # blocks 2 and 3 beside the next chunk
    node.step()  # the last: block 4 behind it, then KVDone
    assert [w[:3] for w in cache.writes[1:]] == [(src[2:4], [7, 6], True), (src[4:5], [5], False)]
    (_, done), = controls(decode)
    assert done == m.to_dict(m.KVDone("r", 0))
    link.peer_cache = None


def test_an_accept_that_comes_during_the_last_step_queues_the_kv_behind_it(pair):
    node, decode, addr, reply = pair
    peer = pair_up(node, decode, addr, reply)
    link = node.links[addr]
    link.peer_cache = cache = PartsPeerCache(node)
    admit(node, "r", addr, reply)  # 40 tokens: chunks of 32 and 8
    node.step()
    controls(decode)
    job = node.jobs["r"]
    assert node.scheduler.schedule() is not None  # the last chunk's step (its block taken)
    node.kv_sends.await_accepts([(job, True)], StepRunning(decode, peer, [m.KVAccept("r", 0, [5, 6, 7])],
                                                  lambda: cache.writes))
    assert cache.writes == [(job.req.block_ids[:3], [5, 6, 7], False, None)]
    assert job.accept is None and job.kv_started  # KVDone once its first token has gone
    link.peer_cache = None


def test_slow_steps_are_logged_with_the_prefill_phases(pair, caplog):
    """PD_LOG_SLOW_STEPS_MS (here 0: every timed turn) names a prefill node's slow turn and its
    phases: a two-chunk prefill's second turn."""
    from pd.engine.loop_stats import SlowSteps

    node, decode, addr, reply = pair
    pair_up(node, decode, addr, reply)
    node.slow = SlowSteps(node.times, {"PD_LOG_SLOW_STEPS_MS": "0"})
    admit(node, "r", addr, reply)
    with caplog.at_level("WARNING", logger="prefill_node.node"):
        node.step()  # the first chunk: work is left, so the next turn is timed
        node.step()
    lines = [r.getMessage() for r in caplog.records if "slow step" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("prefill node prefill-announce: slow step")
    phases = dict(p.rsplit(" ", 1) for p in lines[0].split(": ", 2)[2].split(", "))
    assert float(phases["run"]) > 0 and set(phases) <= {"sends", "schedule", "run", "hand_off", "loop"}
