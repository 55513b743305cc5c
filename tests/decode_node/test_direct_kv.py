"""The decode node's intake of direct KV (the CUDA IPC tier), on the CPU: which peers are offered
the cache, what KVAccept names, and that a direct request dropped after its KVAccept keeps its
blocks until the prefill node answers (KVDone, KVReleased) or is gone, since the prefill node
may be writing them; and how first tokens read together go on to their router (one message,
before any error of theirs). A real decode node and engine on the tiny model; its messages are
driven through its intake's `dispatch` and the replies collected instead of sent (this machine
has no GPU to export a cache from, so the offer is a stand-in the test never opens)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq

from decode_node.node import DecodeNode
from pd.engine.llm import LLM
from pd.wire import messages as m
from pd.wire.sampling_params import SamplingParams
from shm_ipc.records import AbortRecord, FirstTokenRecord, KVRecord

RING_PEER, FRAME_PEER = b"ring-peer", b"frame-peer"
PROMPT = list(range(3, 43))  # 40 tokens: 3 blocks of 16


@pytest.fixture
def node(tiny_model_dir):
    engine = LLM(tiny_model_dir, num_blocks=32).engine
    with ThreadPoolExecutor(1) as pool:  # off the main thread: no signal handlers taken
        node = pool.submit(DecodeNode, "decode-direct", engine, host="127.0.0.1", port=0,
                           kv_port=0, metrics_port=None).result()
    sink = node.ctx.socket(zmq.PULL)  # the router's event socket
    node.reply = f"tcp://127.0.0.1:{sink.bind_to_random_port('tcp://127.0.0.1')}"
    node.sent = []
    intake = node.intake
    intake.receiver.send_control = lambda peer, msg: node.sent.append((peer, m.from_dict(msg)))
    intake.receiver.tier = lambda peer: "shm" if peer == RING_PEER else "zmq"
    intake.kv_ipc = {"cache": "stand-in"}  # what `cuda_ipc.export` gives on a GPU
    yield node
    intake.receiver.close()
    sink.close(linger=0)


def replies(node, peer, kind):
    return [msg for p, msg in node.sent if p == peer and isinstance(msg, kind)]


def hand_over(node, peer, req_id: str, direct: bool = True):
    """Hello (once per peer), RequestMeta and FIRST_TOKEN: the request's blocks are reserved
    (unless its RequestMeta was refused)."""
    if peer not in node.intake.peers:
        node.intake.dispatch(peer, m.to_dict(m.Hello("prefill-test", node.intake.geometry)))
    params = SamplingParams(max_tokens=4, temperature=0.0).to_dict()
    node.intake.dispatch(peer, m.to_dict(m.RequestMeta(req_id, PROMPT, params, node.reply,
                                                num_blocks=3, direct=direct)))
    if req_id in node.intake.incoming:  # not refused
        node.intake.dispatch(peer, FirstTokenRecord(req_id, 7, 0.0, 0, []))


def test_only_a_ring_peer_is_offered_the_cache(node):
    for peer in (RING_PEER, FRAME_PEER):
        node.intake.dispatch(peer, m.to_dict(m.Hello("prefill-test", node.intake.geometry)))
    assert replies(node, RING_PEER, m.HelloOk)[0].kv_ipc == node.intake.kv_ipc
    assert replies(node, FRAME_PEER, m.HelloOk)[0].kv_ipc is None
    hand_over(node, FRAME_PEER, "r")  # asks to write directly without the offer
    assert "not offered" in replies(node, FRAME_PEER, m.KVRefuse)[0].reason
    assert "r" not in node.intake.incoming


def test_kv_accept_names_the_blocks_and_kv_done_joins_without_records(node):
    free = node.allocator.num_free
    hand_over(node, RING_PEER, "r")
    accept = replies(node, RING_PEER, m.KVAccept)[0]
    req = node.intake.incoming["r"].req
    assert accept.block_ids == req.block_ids[:3] and accept.num_cached_blocks == 0
    with pytest.raises(m.MessageError, match="written directly"):
        node.intake.dispatch(RING_PEER, KVRecord("r", 0, 1, 1, memoryview(b"")))
    node.intake.dispatch(RING_PEER, m.to_dict(m.KVDone("r", 0)))
    assert replies(node, RING_PEER, m.KVAck) and req in node.scheduler.running
    assert node.allocator.num_free == free - len(req.block_ids)
    hand_over(node, RING_PEER, "s", direct=False)  # the ring as before: no blocks named
    assert replies(node, RING_PEER, m.KVAccept)[1].block_ids is None


@pytest.mark.parametrize("answer", ["kv_done", "kv_released", "peer_gone"])
def test_a_dropped_direct_request_keeps_its_blocks_until_the_peer_answers(node, answer):
    free = node.allocator.num_free
    hand_over(node, RING_PEER, "r")
    node.abort("r")  # the router's abort, while the prefill node may be writing the blocks
    assert "r" not in node.intake.incoming and node.allocator.num_free < free
    hand_over(node, RING_PEER, "r")  # its id is not free for reuse either
    assert "duplicate" in replies(node, RING_PEER, m.KVRefuse)[-1].reason
    if answer == "peer_gone":
        node.intake.on_peer_gone(RING_PEER, "ring closed")
    else:
        msg = m.KVDone("r", 0) if answer == "kv_done" else m.KVReleased("r")
        with pytest.raises(m.MessageError):  # not from another peer
            node.intake.dispatch(FRAME_PEER, m.to_dict(msg))
        node.intake.dispatch(RING_PEER, m.to_dict(msg))
        with pytest.raises(m.MessageError):  # and once
            node.intake.dispatch(RING_PEER, m.to_dict(msg))
    assert node.allocator.num_free == free and not node.intake.fenced
    assert not replies(node, RING_PEER, m.KVAck)


def test_a_timed_out_direct_request_is_fenced_and_a_ring_one_is_not(node):
    free = node.allocator.num_free
    hand_over(node, RING_PEER, "direct")
    hand_over(node, RING_PEER, "ring", direct=False)
    for inc in node.intake.incoming.values():
        inc.deadline = 0.0
    node.tick(1.0)
    assert {r.req_id for r in replies(node, RING_PEER, m.KVRefuse)} == {"direct", "ring"}
    assert set(node.intake.fenced) == {"direct"}
    node.intake.dispatch(RING_PEER, m.to_dict(m.KVReleased("direct")))
    assert node.allocator.num_free == free


def announce(node, peer, req_id: str, direct: bool = True):
    """Hello (once per peer) and RequestMeta alone: the prefill node announces a request whose
    prefill has just started."""
    if peer not in node.intake.peers:
        node.intake.dispatch(peer, m.to_dict(m.Hello("prefill-test", node.intake.geometry)))
    params = SamplingParams(max_tokens=4, temperature=0.0).to_dict()
    node.intake.dispatch(peer, m.to_dict(m.RequestMeta(req_id, PROMPT, params, node.reply,
                                                       num_blocks=3, direct=direct)))


def test_request_meta_alone_reserves_the_blocks_and_the_kv_waits_for_the_first_token(node):
    free = node.allocator.num_free
    announce(node, RING_PEER, "r")
    accept, = replies(node, RING_PEER, m.KVAccept)  # while its prefill runs
    req = node.intake.incoming["r"].req
    # the prompt's 40 tokens and the first token to come: 3 blocks of 16
    assert accept.block_ids == req.block_ids == req.block_ids[:3] and len(req.block_ids) == 3
    assert node.allocator.num_free == free - 3
    with pytest.raises(m.MessageError, match="before its FIRST_TOKEN"):
        node.intake.dispatch(RING_PEER, m.to_dict(m.KVDone("r", 0)))
    node.intake.dispatch(RING_PEER, FirstTokenRecord("r", 7, 0.0, 0, []))
    with pytest.raises(m.MessageError, match="second FIRST_TOKEN"):
        node.intake.dispatch(RING_PEER, FirstTokenRecord("r", 7, 0.0, 0, []))
    node.intake.dispatch(RING_PEER, m.to_dict(m.KVDone("r", 0)))
    assert req in node.scheduler.running and req.token_ids[-1] == 7


@pytest.mark.parametrize("direct", [True, False])
def test_an_announced_request_ended_at_the_prefill_node_frees_its_blocks(node, direct):
    """The prefill node's ABORT before the first token (the request ended there, or failed):
    a ring request's blocks are free at once, a direct one's once KVReleased says they will not
    be written."""
    free = node.allocator.num_free
    announce(node, RING_PEER, "r", direct=direct)
    assert replies(node, RING_PEER, m.KVAccept)
    node.intake.dispatch(RING_PEER, AbortRecord("r", "ended at the prefill node"))
    assert "r" not in node.intake.incoming
    if direct:
        assert "r" in node.intake.fenced and node.allocator.num_free == free - 3
        node.intake.dispatch(RING_PEER, m.to_dict(m.KVReleased("r")))
    assert node.allocator.num_free == free and not node.intake.fenced


def test_an_announced_request_times_out_waiting_for_its_first_token(node):
    announce(node, RING_PEER, "r", direct=False)
    node.intake.incoming["r"].deadline = 0.0
    node.tick(1.0)
    assert "waiting for the first token" in replies(node, RING_PEER, m.KVRefuse)[0].reason


def test_first_tokens_read_together_reach_their_router_in_one_message(node):
    """First tokens read in one pass over the socket go out as one TokenStreams per router at
    its end (`Intake.flush_first_tokens`), with the first token's logprobs where asked; one
    asking prompt logprobs goes in a TokenStream of its own, at once."""
    sink = zmq.Context.instance().socket(zmq.PULL)
    node.reply = f"tcp://127.0.0.1:{sink.bind_to_random_port('tcp://127.0.0.1')}"
    node.intake.dispatch(RING_PEER, m.to_dict(m.Hello("prefill-test", node.intake.geometry)))
    for req_id, extra in (("a", {}), ("b", {"logprobs": 1}), ("c", {}), ("p", {"prompt_logprobs": 0})):
        params = SamplingParams(max_tokens=4, temperature=0.0, **extra).to_dict()
        node.intake.dispatch(RING_PEER, m.to_dict(m.RequestMeta(
            req_id, PROMPT, params, node.reply, num_blocks=3, direct=False,
            prompt_logprobs=[None] + [[]] * (len(PROMPT) - 1) if req_id == "p" else None)))
        top = [[7, -0.5]] if req_id == "b" else []
        node.intake.dispatch(RING_PEER, FirstTokenRecord(req_id, 7, -0.5, 1, top))
    assert set(node.intake.first_tokens[node.reply]) == {node.intake.incoming[r].req for r in "abc"}
    node.intake.flush_first_tokens()
    assert not node.intake.first_tokens
    got = [m.unpack_streams(m.decode(sink.recv())) for _ in range(2)]
    sink.close(linger=0)
    alone, batch = sorted(got, key=len)
    assert [s.req_id for s in alone] == ["p"] and alone[0].prompt_logprobs is not None
    assert [(s.req_id, s.token_ids, s.num_output_tokens) for s in batch] == [
        ("a", [7], 1), ("b", [7], 1), ("c", [7], 1)]
    assert batch[1].logprobs == [-0.5] and batch[1].top_logprobs == [[[7, -0.5]]]
    assert batch[0].logprobs is None


def test_a_failure_goes_after_the_first_token_read_before_it(node):
    """A request that fails in the pass that read its first token (its KV incomplete at KVDone)
    reaches the router as its first token, then its error."""
    sink = zmq.Context.instance().socket(zmq.PULL)
    node.reply = f"tcp://127.0.0.1:{sink.bind_to_random_port('tcp://127.0.0.1')}"
    hand_over(node, RING_PEER, "r", direct=False)  # first token read, not yet sent on
    node.intake.dispatch(RING_PEER, m.to_dict(m.KVDone("r", 2)))  # two records, none came
    node.intake.flush_first_tokens()
    got = [s for _ in range(2) for s in m.unpack_streams(m.decode(sink.recv()))]
    sink.close(linger=0)
    assert [(s.req_id, s.token_ids, s.error is None) for s in got] == [
        ("r", [7], True), ("r", [], False)]
    assert "incomplete" in got[1].error


@pytest.mark.parametrize("token", [-1, 10**6])
def test_a_first_token_outside_the_vocabulary_fails_its_request_alone(node, token):
    """A FIRST_TOKEN whose id the model has no row for (a prefill node's logits gone wrong)
    fails its request, refused to the peer and reported to the router with its blocks freed,
    and never reaches a step, where it would index the embedding out of range on the device."""
    sink = zmq.Context.instance().socket(zmq.PULL)
    node.reply = f"tcp://127.0.0.1:{sink.bind_to_random_port('tcp://127.0.0.1')}"
    free = node.allocator.num_free
    announce(node, RING_PEER, "bad", direct=False)
    hand_over(node, RING_PEER, "good", direct=False)
    node.intake.dispatch(RING_PEER, FirstTokenRecord("bad", token, 0.0, 0, []))
    assert "outside the vocabulary" in replies(node, RING_PEER, m.KVRefuse)[0].reason
    assert "bad" not in node.intake.incoming and "good" in node.intake.incoming
    node.intake.flush_first_tokens()
    got = [s for _ in range(2) for s in m.unpack_streams(m.decode(sink.recv()))]
    sink.close(linger=0)
    assert {(s.req_id, s.error is None) for s in got} == {("bad", False), ("good", True)}
    assert node.allocator.num_free == free - len(node.intake.incoming["good"].req.block_ids)
