"""The decode overlap scheduler end to end: a decode node with overlap (the default) and one with
`--no-overlap` (and one with PD_DISABLE_OVERLAP=1) stream the same tokens as single-process
generation for 64 greedy requests of mixed lengths arriving at random times, stops included."""

from __future__ import annotations

import random
import time

import pytest

from pd.engine.llm import LLM
from pd.service.procs import start_node
from pd.wire.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return LLM(tiny_model_dir, num_blocks=512)


def workload(reference, n: int, seed: int):
    """Mixed prompt and output lengths; every other request stops on a token it would
    generate a few steps in (a stop found by the decode node, one step late with overlap)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.choice([1, 3, 16, 17, 40, 90]))]
               for _ in range(n)]
    free = reference.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    params = [SamplingParams(max_tokens=rng.randrange(1, 20), temperature=0.0, ignore_eos=rng.random() < 0.5,
                             stop_token_ids=[f.token_ids[rng.randrange(1, 8)]] if i % 2 else [])
              for i, f in enumerate(free)]
    gaps = [rng.expovariate(1 / 0.01) for _ in range(n)]  # ~10 ms apart on average
    return prompts, params, gaps


def run(client, prefill, decode, prompts, params, gaps):
    ids = []
    for p, sp, gap in zip(prompts, params, gaps):
        ids.append(client.submit(prefill.addr, decode.kv_addr, p, sp))
        client.poll(0)
        time.sleep(gap)
    return client.wait(ids, timeout=120)


def test_overlap_on_and_off_stream_the_same_tokens(cluster, client, reference):
    decodes = {"overlap": cluster.decode(), "no-overlap": cluster.decode("--no-overlap")}
    prefill = cluster.prefill("--transport", "zmq")
    assert "decode loop: overlap on (executor thread)" in decodes["overlap"].log_tail(200)
    assert "decode loop: overlap off (executor inline)" in decodes["no-overlap"].log_tail(200)
    prompts, params, gaps = workload(reference, 64, seed=4)
    expected = reference.generate(prompts, params)
    assert {e.finish_reason for e in expected} == {"stop", "length"}  # both kinds of ending
    for name, decode in decodes.items():
        results = run(client, prefill, decode, prompts, params, gaps)
        for res, ref in zip(results, expected):
            assert res.error is None, name
            assert (res.token_ids, res.finish_reason) == (ref.token_ids, ref.finish_reason), name
        stats = client.ping(decode.addr).stats
        deadline = time.monotonic() + 10
        while stats["free_blocks"] != stats["total_blocks"] and time.monotonic() < deadline:
            time.sleep(0.05)
            stats = client.ping(decode.addr).stats
        assert stats["free_blocks"] == stats["total_blocks"] and stats["running"] == 0


def test_env_var_disables_overlap(cluster, client, tmp_path):
    decode = start_node("decode", ["--model", cluster.model_dir, "--port", "0", "--kv-port", "0",
                                   "--num-blocks", "64", "--log-level", "info"],
                        env={"PD_DISABLE_OVERLAP": "1"}, log_dir=str(tmp_path))
    try:
        assert "decode loop: overlap off" in decode.log_tail(200)
    finally:
        decode.stop()
    bad = None
    try:
        bad = start_node("decode", ["--model", cluster.model_dir, "--port", "0", "--kv-port", "0",
                                    "--num-blocks", "64"], env={"PD_DISABLE_OVERLAP": "maybe"},
                         log_dir=str(tmp_path), timeout=30)
    except RuntimeError as e:
        assert "PD_DISABLE_OVERLAP" in str(e)
    else:
        bad.stop()
        pytest.fail("a decode node started with PD_DISABLE_OVERLAP=maybe")
