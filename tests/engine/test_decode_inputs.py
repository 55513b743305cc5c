"""A graphed decode step's inputs advanced from the step before's (`DecodeInputs`) equal the
same inputs filled whole, whatever happened between: tokens appended, blocks got, requests
joining, leaving or reordered, a request preempted and readmitted with new blocks, several
tokens kept at once (MTP), the layout changing."""

from __future__ import annotations

import random

import numpy as np

from pd.engine.decode_inputs import GRAPH_BANS, DecodeInputs, DecodeLayout, fill_decode_inputs
from pd.engine.request import Req
from pd.wire.sampling_params import SamplingParams

BLOCK = 16


def _grow(req: Req, rng: random.Random, free: list[int], tokens: int) -> None:
    """`tokens` more tokens (the last a placeholder now and then), blocks for them."""
    req.num_computed_tokens = req.num_tokens - 1 + tokens
    req.token_ids += [rng.randrange(3, 200) for _ in range(tokens)]
    if rng.random() < 0.3:
        req.token_ids[-1] = -rng.randrange(1, 9)
    while len(req.block_ids) * BLOCK < req.num_tokens:
        req.block_ids += [free.pop()]


def test_advanced_inputs_equal_inputs_filled_whole():
    rng = random.Random(7)
    free = list(range(1, 100000))
    rng.shuffle(free)
    reqs = []
    for i in range(20):
        req = Req(str(i), [rng.randrange(3, 200) for _ in range(rng.randrange(1, 40))],
                  SamplingParams(max_tokens=4096))
        _grow(req, rng, free, 1)
        reqs.append(req)
    inputs = DecodeInputs(BLOCK, dummy_block=0)
    batch = reqs[:12]
    for step in range(400):
        event = rng.random()
        if event < 0.03 and len(batch) > 1:  # one leaves
            batch = [r for r in batch if r is not rng.choice(batch)]
        elif event < 0.06:  # one joins
            batch = batch + [r for r in reqs if r not in batch][:1]
        elif event < 0.08:  # preempted and readmitted: a new block list, recomputed
            victim = rng.choice(batch)
            victim.block_ids = []
            _grow(victim, rng, free, 0)
        elif event < 0.09:
            rng.shuffle(batch)
        for req in batch:
            _grow(req, rng, free, 1 if rng.random() < 0.8 else rng.randrange(2, 5))
        width = 1 << (max(len(r.block_ids) for r in batch) - 1).bit_length()
        layout = DecodeLayout(1 << (len(batch) - 1).bit_length(), width)
        got = np.full(layout.size + 3, 9, np.int64)
        inputs.fill(got, layout, batch)
        want = np.full(layout.size + 3, 9, np.int64)
        fill_decode_inputs(want, layout, batch, BLOCK, 0)
        assert np.array_equal(got, want), step
    assert inputs.advanced > 250 and inputs.filled > 20  # both kinds were met


def test_graphed_steps_reuse_rows_only_of_the_same_argmax_requests(tiny_model_dir):
    """`ModelRunner.prepare_graphed` (the runner given CPU decode graphs to build inputs for):
    a step of the same requests, in the same order, that all took the argmax last step reuses
    its rows; a sampled row, a row still under min_tokens or another order builds them again;
    the inputs are whole either way. A greedy row under min_tokens takes the graph's argmax,
    its banned ids (its stop ids) written in the inputs' last section, until it is past
    min_tokens; one with more banned ids than the graph takes, or asking for logprobs, does
    not."""
    import torch

    from pd.config import EngineConfig
    from pd.engine.cuda_graph import DecodeGraphs
    from pd.engine.engine import Engine
    from pd.engine.scheduler import ScheduledBatch

    runner = Engine(EngineConfig(model=str(tiny_model_dir), num_blocks=256)).runner
    runner.graphs = DecodeGraphs(None, dummy_block=0, block_size=BLOCK, max_num_seqs=64,
                                 max_model_len=4096, device=torch.device("cpu"))
    rng = random.Random(3)
    free = list(range(1, 256))

    def req(name: str, **params) -> Req:
        r = Req(name, [rng.randrange(3, 200) for _ in range(9)],
                SamplingParams(max_tokens=64, **{"temperature": 0.0, **params}))
        _grow(r, rng, free, 1)
        return r

    def step(reqs: list[Req]):
        for r in reqs:
            _grow(r, rng, free, 1)
        inp = runner.prepare(ScheduledBatch(reqs, [1] * len(reqs)))
        key, host = inp.decode_graph
        want = np.zeros(host.numel(), np.int64)
        fill_decode_inputs(want, DecodeLayout(*key), reqs, BLOCK, 0)
        bans = DecodeLayout(*key).bans(want)
        for i, r in enumerate(reqs):
            n = len(r.token_ids) - len(r.prompt_token_ids)
            if inp.argmax_only and n < r.params.min_tokens:
                bans[i, :2] = r.params.stop_token_ids
        assert inp.bans == (bans >= 0).any()
        assert np.array_equal(host.numpy(), want)
        return inp

    greedy = [req(str(i)) for i in range(5)]
    first = step(greedy)
    assert first.argmax_only and not first.wants_logprobs
    assert step(greedy).rows is first.rows  # the same requests: the same rows
    assert step(greedy[::-1]).rows is not first.rows  # another order
    late = req("min", min_tokens=4, stop_token_ids=[5, 7])  # counts this request's outputs
    mixed = greedy + [late]
    steps = [step(mixed) for _ in range(5)]
    assert all(s.argmax_only for s in steps)
    assert [s.bans for s in steps] == [True, True, False, False, False]
    assert steps[1].rows is not steps[0].rows and steps[2].rows is not steps[1].rows
    assert steps[3].rows is steps[2].rows
    many = req("many", min_tokens=4, stop_token_ids=list(range(3, 3 + GRAPH_BANS + 1)))
    lp = req("lp-min", min_tokens=4, stop_token_ids=[5], logprobs=1)
    assert [step(greedy + [r]).argmax_only for r in (many, lp)] == [False, False]
    sampled = greedy + [req("hot", temperature=0.8)]
    a, b = step(sampled), step(sampled)
    assert not a.argmax_only and b.rows is not a.rows
    asks = greedy + [req("lp", logprobs=2)]
    c, d = step(asks), step(asks)
    assert c.argmax_only and c.wants_logprobs and c.num_top == 2 and d.rows is c.rows
