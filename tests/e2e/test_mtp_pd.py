"""MTP through real prefill and decode processes: the prefill node proposes the first drafts
(DRAFT_TOKENS after FIRST_TOKEN, the MTP layer's KV with the target's), the decode node
verifies; greedy output equals single-process output without MTP, token for token, with
logprobs (exact top-k counts) and stop ids, overlap on and off. A node pair that disagrees on
MTP refuses to pair, naming the field."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from pd.engine.llm import LLM
from pd.engine.runner import SPEC_LAYOUT_ENV
from pd.wire.sampling_params import SamplingParams
from tests.e2e.conftest import DEVICE_KWARGS, wait_idle


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.choice([1, 5, 16, 17, 40, 90]))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return LLM(tiny_model_dir, num_blocks=512, **DEVICE_KWARGS)


def assert_equal(results, expected, params) -> None:
    """PD results equal the single process's: tokens, finish reasons (some a stop), logprobs of
    exactly the asked top-k width, none where not asked."""
    assert any(r.finish_reason == "stop" for r in expected)
    for res, ref, sp in zip(results, expected, params, strict=True):
        assert res.error is None
        assert res.token_ids == ref.token_ids
        assert res.finish_reason == ref.finish_reason
        if sp.logprobs is None:
            assert res.logprobs == [] and res.top_logprobs == []
        else:
            assert res.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
            for got, want in zip(res.top_logprobs, ref.top_logprobs):
                assert len(got) == sp.logprobs
                assert [t for t, _ in got] == [t for t, _ in want]


@pytest.mark.parametrize("k,overlap,budget", [(1, True, None), (2, False, 8), (4, True, None)])
def test_pd_with_mtp_equals_single_process(cluster, client, reference, k, overlap, budget):
    """`budget` 8: the longer prompts are prefilled in chunks, their blocks (the MTP layer's
    too) sent as the chunks fill them."""
    spec = ("--num-speculative-tokens", str(k))
    chunks = ("--max-num-batched-tokens", str(budget)) if budget else ()
    decode, prefill = cluster.ready(
        cluster.decode(*spec, "--metrics-port", "0", *(() if overlap else ("--no-overlap",)), wait=False),
        cluster.prefill(*spec, "--transport", "zmq", *chunks, wait=False))
    batch = prompts(16, seed=k)
    free = reference.generate(batch, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=[None, 0, 3][i % 3],
                             stop_token_ids=[free[i].token_ids[9]] if i % 4 == 0 else ())
              for i in range(len(batch))]
    ids = [client.submit(prefill.addr, decode.kv_addr, p, sp) for p, sp in zip(batch, params)]
    assert_equal(client.wait(ids, timeout=90), reference.generate(batch, params), params)
    # the drafts were verified on the decode node, the prefill node's records all accepted
    text = httpx.get(f"http://127.0.0.1:{decode.info['metrics_port']}/metrics", timeout=10).text
    draft_tokens = metric(text, "pd_spec_decode_num_draft_tokens_total")
    assert draft_tokens > 0 and 0 <= metric(text, "pd_spec_decode_num_accepted_tokens_total") <= draft_tokens
    assert metric(text, "pd_messages_refused_total") == 0
    if budget:
        assert wait_idle(client, prefill)["kv_parts_sent"] > 0


def test_chained_mtp_steps_through_pd_equal_single_process(cluster, client, reference):
    """The decode node runs MTP steps through the graphs' layout (PD_SPEC_LAYOUT=1: on CPU,
    without capture) with overlap, so steps are chained on the device while requests arrive at
    random times: greedy output, logprobs of width 0/1/5 and stops inside accepted runs equal
    the single process without MTP."""
    import time

    spec = ("--num-speculative-tokens", "3")
    decode, prefill = cluster.ready(
        cluster.decode(*spec, "--metrics-port", "0", env={SPEC_LAYOUT_ENV: "1"}, wait=False),
        cluster.prefill(*spec, "--transport", "zmq", wait=False))
    rng = random.Random(11)
    batch = prompts(32, seed=11)
    free = reference.generate(batch, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    params = [SamplingParams(max_tokens=rng.randrange(4, 16), temperature=0.0, ignore_eos=True,
                             logprobs=[None, 0, 1, 5][i % 4],
                             stop_token_ids=[free[i].token_ids[rng.randrange(2, 12)]] if i % 3 == 0 else ())
              for i in range(len(batch))]
    ids = []
    for p, sp in zip(batch, params):
        ids.append(client.submit(prefill.addr, decode.kv_addr, p, sp))
        time.sleep(rng.random() * 0.03)
    assert_equal(client.wait(ids, timeout=120), reference.generate(batch, params), params)
    text = httpx.get(f"http://127.0.0.1:{decode.info['metrics_port']}/metrics", timeout=10).text
    assert metric(text, "pd_decode_steps_ahead_total") > 0, "no MTP step was chained"


def test_structured_output_through_pd_with_mtp_equals_single_process(cluster, client, reference):
    """Grammars through P and D with MTP (k=2, overlap on): the prefill node samples the first
    token and proposes drafts unconstrained, the decode node verifies them under the masks
    along the drafts; greedy output equals the single process without MTP."""
    spec = ("--num-speculative-tokens", "2")
    decode, prefill = cluster.ready(cluster.decode(*spec, "--metrics-port", "0", wait=False),
                                    cluster.prefill(*spec, "--transport", "zmq", wait=False))
    specs = [("json", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})),
             ("regex", "[a-f]{2,6}[0-9]+"), ("choice", json.dumps(["left", "right"])),
             ("grammar", 'root ::= ("x" | "yz")+ "!"'), None]
    batch = prompts(15, seed=21)
    params = [SamplingParams(max_tokens=14, temperature=0.0, structured_output=specs[i % len(specs)],
                             logprobs=[None, 2][i % 2])
              for i in range(len(batch))]
    ids = [client.submit(prefill.addr, decode.kv_addr, p, sp) for p, sp in zip(batch, params)]
    results, expected = client.wait(ids, timeout=90), reference.generate(batch, params)
    for res, ref in zip(results, expected, strict=True):
        assert res.error is None and res.token_ids == ref.token_ids
        assert res.finish_reason == ref.finish_reason
    text = httpx.get(f"http://127.0.0.1:{decode.info['metrics_port']}/metrics", timeout=10).text
    assert metric(text, "pd_spec_decode_num_draft_tokens_total") > 0


def metric(text: str, name: str) -> float:
    """The sum of a metric's samples in a Prometheus text page."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_mtp_on_one_side_only_is_refused(cluster, client):
    decode, prefill = cluster.ready(
        cluster.decode(wait=False),
        cluster.prefill("--num-speculative-tokens", "2", "--transport", "zmq", wait=False))
    rid = client.submit(prefill.addr, decode.kv_addr, [5, 6, 7], SamplingParams(max_tokens=4))
    (res,) = client.wait([rid], timeout=30)
    assert res.error and "mtp" in res.error and "refused to pair" in res.error


def test_openai_api_through_pd_launch_with_mtp():
    """`pd launch --num-speculative-tokens 3` with the shipped model (trained MTP layer): the
    completions API returns the single-process greedy text, with exactly the asked top
    logprobs, streamed or not; an echoed prompt's logprobs (the prefill node's MTP prefill)
    equal single-process ones."""
    from pd.config import default_model_dir
    from pd.service.procs import Launch

    prompts = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main(argv):"]
    llm = LLM()
    want = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    ids = llm.encode(prompts[1])
    scored = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0,
                                                prompt_logprobs=1))[0].prompt_logprobs
    lg = Launch(str(default_model_dir()), "--num-speculative-tokens", "3", "--transport", "zmq",
                "--num-blocks", "256")
    try:
        for prompt, ref in zip(prompts, want):
            body = {"model": lg.served_model_name, "prompt": prompt, "max_tokens": 40,
                    "temperature": 0, "ignore_eos": True, "logprobs": 2}
            r = httpx.post(f"{lg.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["text"] == ref.text
            assert all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"])
            chunks = []
            with httpx.stream("POST", f"{lg.url}/v1/completions", json={**body, "stream": True},
                              timeout=60) as s:
                for line in s.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:])["choices"][0]["text"])
            assert "".join(chunks) == ref.text
        for max_tokens in (0, 6):  # the prompt alone (prefill node), and through the decode node
            r = httpx.post(f"{lg.url}/v1/completions", timeout=60, json={
                "model": lg.served_model_name, "prompt": prompts[1], "max_tokens": max_tokens,
                "echo": True, "logprobs": 1, "temperature": 0, "ignore_eos": True})
            lp = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            assert lp[0] is None and len(lp) == len(ids) + max_tokens
            assert lp[1:len(ids)] == pytest.approx([v for v, _, _ in scored], abs=1e-4)
    finally:
        lg.stop()


def test_seeded_sampling_through_pd_equals_single_process_mtp(cluster, client, tiny_model_dir):
    """Seeded rejection sampling is a function of (seed, step) on both nodes: the prefill
    node's first token and the decode node's verify steps give what one process gives."""
    spec = ("--num-speculative-tokens", "2")
    decode, prefill = cluster.ready(
        cluster.decode(*spec, wait=False),
        cluster.prefill(*spec, "--transport", "zmq", wait=False))
    batch = prompts(8, seed=11)
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=100 + i, ignore_eos=True)
              for i in range(len(batch))]
    ids = [client.submit(prefill.addr, decode.kv_addr, p, sp) for p, sp in zip(batch, params)]
    results = client.wait(ids, timeout=90)
    # NOTE: on the nodes' device: seeded draws are the same only on the same kind of device
    expected = LLM(tiny_model_dir, num_blocks=512, num_speculative_tokens=2,
                   **DEVICE_KWARGS).generate(batch, params)
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    assert len({tuple(e.token_ids) for e in expected}) > 1
