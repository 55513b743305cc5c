"""The PD path end to end with real processes on loopback: prefill node + decode node output
equals single-process generation, over both KV transports, and the failure cases end cleanly."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest

from pd.engine.llm import LLM
from pd.wire.sampling_params import SamplingParams
from tests.e2e.conftest import DEVICE, DEVICE_KWARGS, wait_idle


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, 31, 33, 64, 100, 150]
    return [[rng.randrange(3, 512) for _ in range(lengths[i % len(lengths)] + rng.randrange(3))]
            for i in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return LLM(tiny_model_dir, num_blocks=512, **DEVICE_KWARGS)


@pytest.mark.parametrize("transport, budget", [("ipc", None), ("shm", None), ("zmq", None),
                                               ("ipc", 32), ("shm", 32)])
def test_pd_equals_single_process(cluster, client, reference, transport, budget):
    """`budget`: the prefill node's tokens per step; 32 prefills the longer prompts in chunks,
    whose blocks go to the decode node while the rest of the prompt is prefilled (ZMQ frames
    take parts in `test_mtp_pd.py`)."""
    if transport == "ipc" and DEVICE == "cpu":
        pytest.skip("CUDA IPC needs both nodes on a GPU (PD_TEST_DEVICE=cuda)")
    chunks = ("--max-num-batched-tokens", str(budget)) if budget else ()
    decode, prefill = cluster.ready(
        cluster.decode(wait=False),
        cluster.prefill("--transport", transport, *chunks, wait=False))
    prompts = mixed_prompts(32)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=k)
              for k in (0, 1, 5, None) * 8]
    if budget:
        # NOTE: a prompt of 13 chunks, so that the decode node's KVAccept, which a part waits
        # for, comes before its last chunk even on a loaded CPU (with 5 chunks it once did not)
        prompts.append([3 + (7 * i) % 500 for i in range(400)])
        params.append(params[0])
    ids = [client.submit(prefill.addr, decode.kv_addr, p, sp) for p, sp in zip(prompts, params)]
    results = client.wait(ids, timeout=90)
    expected = reference.generate(prompts, params)
    for res, ref, sp in zip(results, expected, params):
        assert res.error is None
        assert res.token_ids == ref.token_ids
        assert res.finish_reason == ref.finish_reason == "length"
        if sp.logprobs is None:
            assert res.logprobs == [] and res.top_logprobs == []
        else:
            assert res.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
            for got, want in zip(res.top_logprobs, ref.top_logprobs):
                assert len(got) == sp.logprobs
                assert [t for t, _ in got] == [t for t, _ in want]
                assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-5)
    prefill_stats, decode_stats = (wait_idle(client, node) for node in (prefill, decode))
    for stats in (prefill_stats, decode_stats):
        assert stats["free_blocks"] == stats["total_blocks"]
    if budget:
        assert prefill_stats["kv_parts_sent"] > 0
    # the KV went where asked: "shm" on a GPU is the ring, not CUDA IPC
    assert f"KV over {transport}" in Path(prefill.log_path).read_text()


def test_requests_ending_at_the_first_token(cluster, client, reference, tmp_path):
    # A copy of the model whose EOS is the greedy first token of `eos_prompt`, so that request
    # ends on EOS at the prefill node and never reaches the decode node.
    eos_prompt = [40, 41, 42, 43]
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    eos = reference.generate([eos_prompt], greedy)[0].token_ids[0]
    model = tmp_path / Path(cluster.model_dir).name
    shutil.copytree(cluster.model_dir, model)
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [eos]
    (model / "generation_config.json").write_text(json.dumps(gen))
    decode, prefill = cluster.ready(
        cluster.decode(model=str(model), wait=False),
        cluster.prefill(model=str(model), wait=False))
    prompts = [[5, 6, 7], eos_prompt, [9, 10, eos]]  # the last one ends on EOS itself
    params = [SamplingParams(max_tokens=1, temperature=0.0, logprobs=3),
              SamplingParams(max_tokens=8, temperature=0.0),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
    ids = [client.submit(prefill.addr, decode.kv_addr, p, sp) for p, sp in zip(prompts, params)]
    results = client.wait(ids, timeout=60)
    expected = reference.generate(prompts, params)
    assert results[0].token_ids == expected[0].token_ids
    assert results[0].logprobs == pytest.approx(expected[0].logprobs, abs=1e-5)
    assert results[1].token_ids == [eos] and results[1].finish_reason == "stop"
    assert results[2].token_ids == expected[2].token_ids, results[2]
    assert [r.finish_reason for r in results] == ["length", "stop", "length"]
    assert results[0].num_messages == results[1].num_messages == 1  # answered by the prefill node
    for node in (prefill, decode):
        assert wait_idle(client, node)["free_blocks"] == 256


def test_fan_out_and_fan_in(cluster, client, reference):
    d1, d2, p1, p2 = cluster.ready(cluster.decode(wait=False), cluster.decode(wait=False),
                                   cluster.prefill(wait=False), cluster.prefill(wait=False))
    prompts = mixed_prompts(16, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    # p1 feeds both decode nodes; d1 takes from both prefill nodes
    routes = [(p1, d1), (p1, d2), (p2, d1), (p1, d1)]
    ids = [client.submit(routes[i % 4][0].addr, routes[i % 4][1].kv_addr, p, params)
           for i, p in enumerate(prompts)]
    results = client.wait(ids, timeout=60)
    expected = reference.generate(prompts, params)
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    for node in (d1, d2, p1, p2):
        stats = wait_idle(client, node)
        assert stats["free_blocks"] == stats["total_blocks"]


def test_abort_mid_stream_frees_both_sides(cluster, client):
    decode, prefill = cluster.ready(cluster.decode(wait=False), cluster.prefill(wait=False))
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    rid = client.submit(prefill.addr, decode.kv_addr, list(range(3, 60)), long)
    deadline = time.monotonic() + 30
    while len(client.results[rid].token_ids) < 5 and time.monotonic() < deadline:
        client.poll(0.05)
    assert 5 <= len(client.results[rid].token_ids) < 400
    assert client.ping(decode.addr).stats["free_blocks"] < 256
    client.abort([prefill.addr, decode.addr], rid)
    for node in (decode, prefill):
        stats = wait_idle(client, node)
        assert stats["free_blocks"] == stats["total_blocks"] and stats["running"] == 0
    client.poll(0.3)  # drain what was sent before the abort took effect
    got = len(client.results[rid].token_ids)
    assert got < 400
    client.poll(0.5)
    assert len(client.results[rid].token_ids) == got  # nothing after the abort


def test_dead_decode_node_fails_waiting_requests(cluster, client):
    decode, prefill = cluster.ready(
        cluster.decode(wait=False),
        cluster.prefill("--handoff-timeout", "2", wait=False))
    decode.kill()
    params = SamplingParams(max_tokens=8, temperature=0.0)
    ids = [client.submit(prefill.addr, decode.kv_addr, [5, 6, 7, 8, 9], params) for _ in range(3)]
    start = time.monotonic()
    results = client.wait(ids, timeout=15)
    assert time.monotonic() - start < 10
    for r in results:
        assert r.error and decode.kv_addr in r.error
    stats = wait_idle(client, prefill)
    assert stats["free_blocks"] == stats["total_blocks"]


def test_geometry_mismatch_is_refused_naming_the_field(cluster, client):
    decode, prefill = cluster.ready(
        cluster.decode("--block-size", "32", wait=False),
        cluster.prefill(wait=False))
    rid = client.submit(prefill.addr, decode.kv_addr, [5, 6, 7], SamplingParams(max_tokens=4))
    (res,) = client.wait([rid], timeout=30)
    assert res.error and "block_size" in res.error and "refused to pair" in res.error
    assert wait_idle(client, prefill)["free_blocks"] == 256


def test_bad_request_is_refused_and_node_keeps_serving(cluster, client, reference):
    decode, prefill = cluster.ready(cluster.decode(wait=False), cluster.prefill(wait=False))
    bad = client.submit(prefill.addr, decode.kv_addr, [5, 99999], SamplingParams(max_tokens=4))
    good = client.submit(prefill.addr, decode.kv_addr, [5, 6], SamplingParams(max_tokens=4, temperature=0.0))
    bad_res, good_res = client.wait([bad, good], timeout=30)
    assert "outside the vocabulary" in bad_res.error
    assert good_res.token_ids == reference.generate([[5, 6]], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids
