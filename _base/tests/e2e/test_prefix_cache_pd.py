"""Prefix caching through real prefill and decode processes: a multi-turn conversation (each
turn's prompt is the previous prompt, its answer and a new message) gives the single process's
tokens; from the second turn on the decode node holds the previous turn's blocks and the prefill
node sends only the rest, block for block; the prefill node computes only what its own cache
lacks. With `--no-enable-prefix-caching` every turn ships its whole prompt."""

from __future__ import annotations

import random

import httpx
from pd.engine.llm import LLM
from pd.wire.sampling_params import SamplingParams

BS = 16
PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def metrics(node) -> str:
    return httpx.get(f"http://127.0.0.1:{node.info['metrics_port']}/metrics", timeout=10).text


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def conversation(client, prefill, decode, turns: int, seed: int):
    """Run the turns one after another; returns per turn (prompt, output ids, KV bytes D got)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 512) for _ in range(37)]
    out = []
    for t in range(turns):
        before = metric(metrics(decode), "pd_kv_received_bytes_total")
        rid = client.submit(prefill.addr, decode.kv_addr, prompt, PARAMS)
        (res,) = client.wait([rid], timeout=60)
        assert res.error is None
        got = metric(metrics(decode), "pd_kv_received_bytes_total") - before
        out.append((list(prompt), res.token_ids, got))
        prompt = prompt + res.token_ids + [rng.randrange(3, 512) for _ in range(rng.randint(5, 30))]
    return out


def test_multi_turn_sends_only_the_new_blocks(cluster, client, tiny_model_dir):
    decode, prefill = cluster.ready(
        cluster.decode("--metrics-port", "0", wait=False),
        cluster.prefill("--metrics-port", "0", "--transport", "shm", wait=False))
    turns = conversation(client, prefill, decode, 5, seed=1)
    ref = LLM(tiny_model_dir, num_blocks=256, enable_prefix_caching=False)
    for prompt, output, _ in turns:
        assert output == ref.generate([prompt], PARAMS)[0].token_ids
    first_prompt, _, first_bytes = turns[0]
    per_block = first_bytes / -(-len(first_prompt) // BS)
    for (prev, prev_out, _), (prompt, _, got) in zip(turns, turns[1:]):
        # D holds the previous turn's full blocks whose KV it has (all but the newest token's)
        held = min((len(prev) + len(prev_out) - 1) // BS, len(prompt) // BS)
        assert got == per_block * (-(-len(prompt) // BS) - held), (len(prompt), held)
        assert got < per_block * -(-len(prompt) // BS)
    d, p = metrics(decode), metrics(prefill)
    assert metric(d, "pd_prefix_cache_hits_total") > 0.5 * metric(d, "pd_prefix_cache_queries_total")
    # every transfer went through the ring, and each side counted it under that tier
    shm = 'tier="shm"'
    assert metric(d, "pd_kv_received_bytes_total") == sum(t[2] for t in turns) == sum(
        float(line.rsplit(" ", 1)[1]) for line in d.splitlines()
        if line.startswith("pd_kv_received_bytes_total{") and shm in line)
    for text in (d, p):
        assert sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pd_kv_transfer_seconds_count{") and shm in line) == len(turns)
    # each turn's first decoded token timed from its KV being in (every turn decodes past it)
    assert metric(d, "pd_kv_exposed_seconds_count") == len(turns)
    assert 0 < metric(d, "pd_kv_exposed_seconds_sum") < 10 * len(turns)
    # P caches each turn's prompt: the next turn computes from there
    assert metric(p, "pd_prefix_cache_hits_total") > 0
    assert metric(p, "pd_prompt_tokens_computed_total") < sum(len(t[0]) for t in turns)


def test_caching_off_ships_every_prompt_whole(cluster, client):
    off = ("--no-enable-prefix-caching",)
    decode, prefill = cluster.ready(
        cluster.decode("--metrics-port", "0", *off, wait=False),
        cluster.prefill("--metrics-port", "0", "--transport", "zmq", *off, wait=False))
    turns = conversation(client, prefill, decode, 2, seed=2)
    per_block = turns[0][2] / -(-len(turns[0][0]) // BS)
    for prompt, _, got in turns:
        assert got == per_block * -(-len(prompt) // BS)
    assert metric(metrics(decode), "pd_prefix_cache_queries_total") == 0
    assert metric(metrics(prefill), "pd_prompt_tokens_computed_total") == sum(len(t[0]) for t in turns)


def test_multi_turn_with_mtp_equals_single_process(cluster, client, tiny_model_dir):
    spec = ("--num-speculative-tokens", "2")
    decode, prefill = cluster.ready(
        cluster.decode("--metrics-port", "0", *spec, wait=False),
        cluster.prefill("--metrics-port", "0", "--transport", "zmq", *spec, wait=False))
    turns = conversation(client, prefill, decode, 4, seed=3)
    ref = LLM(tiny_model_dir, num_blocks=256, enable_prefix_caching=False)
    for prompt, output, _ in turns:
        assert output == ref.generate([prompt], PARAMS)[0].token_ids
    full = sum(-(-len(t[0]) // BS) for t in turns[1:])
    per_block = turns[0][2] / -(-len(turns[0][0]) // BS)
    assert sum(t[2] for t in turns[1:]) < 0.6 * per_block * full
