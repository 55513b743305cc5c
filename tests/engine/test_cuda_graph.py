"""Decode CUDA graphs (`pd.engine.cuda_graph`) against eager decoding, float32, on a CUDA machine
(skipped without one; `benchmarks/gpu/run_all.sh` runs it on the GPU). On CPU: the runner never
builds graphs, and --enforce-eager reaches the engine config."""
from __future__ import annotations

import random

import pytest
import torch

from pd.config import EngineConfig
from pd.engine.decode_inputs import GRAPH_BANS, write_bans
from pd.engine.engine import Engine
from pd.service.flags import engine_config
from pd.wire.sampling_params import SamplingParams


def test_cpu_runner_builds_no_graphs_and_flag_reaches_config(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), num_blocks=64))
    assert engine.runner.graphs is None and engine.runner.kv_cache.dummy_block is None
    import argparse

    from pd.service.flags import add_engine_arguments

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert engine_config(p.parse_args(["--enforce-eager"])).enforce_eager
    assert not engine_config(p.parse_args([])).enforce_eager


def test_start_up_capture_keys_cover_every_batch_size_up_to_the_length():
    from pd.engine.cuda_graph import DecodeGraphs

    g = DecodeGraphs(None, dummy_block=0, block_size=16, max_num_seqs=24, max_model_len=8192,
                     device=torch.device("cpu"))
    keys = g.keys_up_to(300)  # 300 tokens: 19 blocks, so widths up to 32
    assert {w for _, w in keys} == {1, 2, 4, 8, 16, 32}
    assert {b for b, _ in keys} == set(g.batch_sizes) and g.batch_sizes[-1] == 24
    assert len(keys) == len(set(keys)) == 6 * len(g.batch_sizes)
    assert {w for _, w in g.keys_up_to(256)} == {1, 2, 4, 8, 16}  # 256 tokens fill 16 blocks


def test_graph_inputs_equal_the_eager_step_inputs(tiny_model_dir):
    """The host layout a decode graph reads (`fill_decode_inputs`) carries what the eager
    path's `prepare` builds for the same decode step: ids (placeholders as future rows),
    positions, KV slots, context lengths and block tables; padding rows sit in the spare block."""
    from pd.engine.cuda_graph import DecodeGraphs
    from pd.engine.decode_inputs import DecodeLayout, fill_decode_inputs
    from pd.engine.request import Req
    from pd.engine.scheduler import ScheduledBatch

    engine = Engine(EngineConfig(model=str(tiny_model_dir), num_blocks=256))
    rng = random.Random(5)
    reqs = []
    for i in range(13):
        req = Req(str(i), [rng.randrange(3, 200) for _ in range(rng.randrange(1, 60))],
                  SamplingParams(max_tokens=64))
        req.token_ids += [rng.randrange(3, 200) for _ in range(rng.randrange(0, 5))]
        if i % 3 == 0:
            req.token_ids.append(-(i // 3 + 1))  # the overlap loop's placeholder for row i // 3
        req.num_computed_tokens = req.num_tokens - 1
        req.block_ids = rng.sample(range(1, 256), -(-req.num_tokens // 16))
        reqs.append(req)
    inp = engine.runner.prepare(ScheduledBatch(reqs, [1] * len(reqs)))
    graphs = DecodeGraphs(None, dummy_block=0, block_size=16, max_num_seqs=64, max_model_len=4096,
                          device=torch.device("cpu"))
    key = graphs.key(len(reqs), max(len(r.block_ids) for r in reqs))
    assert key == (16, 4)
    layout = DecodeLayout(*key)
    flat = torch.full((layout.size,), 7, dtype=torch.int64)
    fill_decode_inputs(flat.numpy(), layout, reqs, 16, graphs.dummy_block)
    ids, pos, slots, lens, future, tables = layout.views(flat)
    n, ctx = len(reqs), inp.context
    eager_ids = inp.input_ids.clone()
    eager_future = torch.full((n,), -1, dtype=torch.int64)
    if inp.future_index is not None:
        eager_future[inp.future_index] = inp.future_slots
        eager_ids[inp.future_index] = 0
    assert torch.equal(ids[:n], eager_ids) and torch.equal(future[:n], eager_future)
    assert (future[:n] >= 0).sum() == 5
    assert torch.equal(pos[:n], inp.positions) and torch.equal(slots[:n], ctx.slot_mapping)
    assert torch.equal(lens[:n], ctx.context_lens)
    for i, req in enumerate(reqs):
        assert tables[i, :len(req.block_ids)].tolist() == req.block_ids
        assert (tables[i, len(req.block_ids):] == 0).all()
    assert (ids[n:] == 0).all() and (pos[n:] == 0).all() and (lens[n:] == 1).all()
    assert (slots[n:] == 0).all() and (future[n:] == -1).all() and (tables[n:] == 0).all()
    assert graphs.key(65, 1) is None and graphs.key(1, 257) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_start_up_capture_then_serving_captures_nothing_new(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="float32",
                                 num_blocks=512, max_num_seqs=24))
    graphs = engine.runner.graphs
    graphs.capture_all(graphs.keys_up_to(128))
    before = set(graphs.graphs)
    prompts = [[5 + i] * (3 + 7 * i) for i in range(12)]
    engine.generate(prompts, [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 12)
    assert set(graphs.graphs) == before  # every step's key was captured at start


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graphs_equal_eager_float32(tiny_model_dir):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.choice([1, 7, 16, 33, 90]))] for _ in range(40)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0.0, ignore_eos=True)
              for _ in prompts]
    outs = {}
    for eager in (True, False):
        engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="float32",
                                     num_blocks=512, max_num_seqs=24, enforce_eager=eager))
        outs[eager] = [r.output_token_ids for r in engine.generate(prompts, params)]
        engine.allocator.check_integrity()
        if not eager:
            assert engine.runner.graphs.graphs, "no decode step ran as a graph"
            dummy = engine.runner.kv_cache.dummy_block
            assert dummy == engine.allocator.num_blocks  # outside what the allocator hands out
    assert outs[False] == outs[True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_min_tokens_bans_through_the_graphs_equal_eager_float32(tiny_model_dir, monkeypatch):
    """Greedy rows under min_tokens take the decode graph's argmax past their banned ids (their
    stop ids, chosen as tokens greedy decoding would take there), with the tokens of eager
    decoding; beside them a row with more banned ids than the graph takes and a row asking for
    logprobs (both sampled eagerly over the graph's logits), and rows with none."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.choice([1, 7, 33]))] for _ in range(10)]
    free = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="float32",
                                 num_blocks=512))
    greedy = [r.output_token_ids for r in engine.generate(prompts, [free] * len(prompts))]
    params = []
    for i, out in enumerate(greedy):
        stops = list(dict.fromkeys(out[:6]))[:2]  # tokens it would take early on
        if i == 8:
            stops = list(dict.fromkeys(out))[:2] + list(range(3, 3 + GRAPH_BANS))
        # NOTE: rows 7 and 8 make the whole step eager while under min_tokens: 3 steps
        params.append(free if i == 9 else SamplingParams(
            max_tokens=16, temperature=0.0, min_tokens=3 if i in (7, 8) else 10,
            stop_token_ids=stops, logprobs=2 if i == 7 else None))
    import pd.engine.step_inputs as step_inputs

    written = []
    monkeypatch.setattr(step_inputs, "write_bans", lambda *a: written.append(a[2]) or
                        write_bans(*a))
    outs = {}
    for eager in (True, False):
        engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="float32",
                                     num_blocks=512, enforce_eager=eager))
        outs[eager] = [r.output_token_ids for r in engine.generate(prompts, params)]
    assert outs[False] == outs[True]
    assert written, "no graphed step passed over banned ids"
    for p, out, alone in zip(params, outs[True], greedy):
        assert not set(out[:p.min_tokens]) & set(p.stop_token_ids)
    assert sum(out != alone for out, alone in zip(outs[True], greedy)) >= 5  # the bans moved them


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_greedy_logprobs_through_the_graphs_equal_eager_float32(tiny_model_dir):
    """Greedy rows asking for logprobs (none, 0, 1, 5 top columns, mixed in one batch) decode
    through the graphs' logprobs graph (`DecodeGraphs.logprobs`) with the tokens, logprobs,
    ranks and top columns of eager decoding; a row with a penalty beside them runs the eager
    sampler over the graph's logits."""
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.choice([1, 7, 33]))] for _ in range(12)]
    asks = [None, 0, 1, 5]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                             logprobs=asks[i % 4], repetition_penalty=1.3 if i == 11 else 1.0)
              for i in range(len(prompts))]
    outs = {}
    for eager in (True, False):
        engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="float32",
                                     num_blocks=512, enforce_eager=eager))
        for split in (prompts[:11], prompts):  # greedy rows alone, then with the penalty
            got = engine.generate(split, params[:len(split)])
            outs[eager, len(split)] = [(r.output_token_ids, r.output_logprobs, r.output_ranks,
                                        r.output_top_logprobs) for r in got]
        if not eager:
            assert engine.runner.graphs.logprob_graphs, "no logprobs graph ran"
    for n in (11, 12):
        for (ids_e, lps_e, ranks_e, tops_e), (ids_g, lps_g, ranks_g, tops_g) in zip(
                outs[True, n], outs[False, n]):
            assert ids_g == ids_e and ranks_g == ranks_e
            assert lps_g == pytest.approx(lps_e, abs=1e-5)
            assert [[t for t, _ in top] for top in tops_g] == [[t for t, _ in top] for top in tops_e]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_prefill_graphs_equal_eager_float32(tiny_model_dir):
    """Prompts prefilled alone (the prefill graphs: padded to a size, causal over their own
    keys), then decoded: the same tokens and logprobs as eager steps."""
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (2, 37, 255, 256, 300, 450)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    with_prompt = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                 prompt_logprobs=2)
    outs = {}
    for eager in (True, False):
        engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="float32",
                                     num_blocks=512, max_num_batched_tokens=1024,
                                     enforce_eager=eager))
        outs[eager] = [engine.generate([p], [params])[0] for p in prompts]
        outs[eager] += [engine.generate([prompts[2]], [with_prompt])[0]]
        if not eager:
            assert set(engine.runner.prefill_graphs.graphs) == {256, 384, 512}
    for a, b in zip(outs[False], outs[True]):
        assert a.output_token_ids == b.output_token_ids
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-4)
    got, want = outs[False][-1].prompt_logprobs, outs[True][-1].prompt_logprobs
    assert len(got) == len(prompts[2]) - 1 and [r for _, r, _ in got] == [r for _, r, _ in want]
    assert [lp for lp, _, _ in got] == pytest.approx([lp for lp, _, _ in want], abs=1e-4)


def test_prefill_graph_inputs_layout():
    """`PrefillGraphs.host_inputs`: ids, positions and slots of the padded size, padding rows
    after the prompt (id 0, position n, the spare block's slot), then the last row's index."""
    from types import SimpleNamespace

    import numpy as np

    from pd.engine.prefill_graphs import PrefillGraphs

    decode = SimpleNamespace(dummy_block=9, block_size=16)
    graphs = PrefillGraphs(torch.nn.Linear(1, 1), decode, 1024, torch.device("cpu"))
    assert graphs.fits(1024) and graphs.fits(2) and not graphs.fits(1) and not graphs.fits(1025)
    ids, slots = np.arange(100, 400), np.arange(1000, 1300)
    flat = graphs.host_inputs(ids, slots).numpy()
    size = 384
    assert flat.shape == (3 * size + 1,)
    assert flat[:300].tolist() == ids.tolist() and not flat[300:size].any()
    assert flat[size:size + 300].tolist() == list(range(300))
    assert (flat[size + 300:2 * size] == 300).all()
    assert flat[2 * size:2 * size + 300].tolist() == slots.tolist()
    assert (flat[2 * size + 300:3 * size] == 9 * 16).all() and flat[3 * size] == 299


def test_varlen_start_up_capture_skips_32_bit_steps():
    """A float32 node runs its prompt-chunk steps eagerly (`VarlenPrefillGraphs.enabled`), so the
    prefill node's start-up capture has nothing to capture (it once captured them anyway, and
    the float32 prefill node on CUDA died before serving)."""
    from types import SimpleNamespace

    from pd.engine.prefill_graphs import VarlenPrefillGraphs

    decode = SimpleNamespace(block_tables=torch.zeros(1, 1, dtype=torch.int64))  # no spare block
    graphs = {dtype: VarlenPrefillGraphs(torch.nn.Linear(1, 1), decode, 256, 8, 4096, dtype,
                                         torch.device("cpu"))
              for dtype in (torch.float32, torch.bfloat16)}
    assert graphs[torch.bfloat16].enabled and not graphs[torch.float32].enabled
    assert graphs[torch.float32].capture_up_to(256) == 0 and not graphs[torch.float32].graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_prefill_start_up_capture_then_short_prompts_capture_nothing_new(tiny_model_dir):
    """The prefill node's start-up capture (`capture_up_to`): short prompts, alone or several
    per step, then replay graphs captured at start."""
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="bfloat16",
                                 num_blocks=512, max_num_seqs=24))
    lone, varlen = engine.runner.prefill_graphs, engine.runner.varlen_graphs
    assert lone.capture_up_to(128) == 1 and varlen.capture_up_to(128) > 4
    assert lone.capture_up_to(128) == 0 and varlen.capture_up_to(128) == 0  # all there
    before = set(lone.graphs), set(varlen.graphs)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(2, 20))] for _ in range(7)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:1], [params])
    engine.generate(prompts[1:], [params] * (len(prompts) - 1))
    assert varlen.graphs and (set(lone.graphs), set(varlen.graphs)) == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_varlen_prefill_graphs_match_eager_bfloat16(tiny_model_dir):
    """Steps of several prompts, prompts continuing a cached prefix and long prompts' later
    chunks replay the varlen prefill graphs (16 bits: flash attention): each prompt's first
    token and its logprobs match eager steps' to bfloat16 precision (a graph's matrix products
    run padded rows, so their rounding may differ in the last bits)."""
    rng = random.Random(3)
    system = [rng.randrange(3, 200) for _ in range(150)]
    prompts = [system + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 60))]
               for _ in range(12)] + [[rng.randrange(3, 200) for _ in range(400)]]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = {}
    for eager in (True, False):
        engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="bfloat16",
                                     num_blocks=512, max_num_batched_tokens=128,
                                     enforce_eager=eager))
        outs[eager] = engine.generate(prompts[:1], [params]) + engine.generate(
            prompts[1:], [params] * (len(prompts) - 1))
        engine.allocator.check_integrity()
        if not eager:
            assert engine.runner.varlen_graphs.graphs, "no prefill step ran as a varlen graph"
            assert engine.prefix.stats.hits > 0
    same = 0
    for a, b in zip(outs[False], outs[True]):
        same += a.output_token_ids == b.output_token_ids
        top_a, top_b = dict(a.output_top_logprobs[0]), dict(b.output_top_logprobs[0])
        for t in top_a.keys() & top_b.keys():
            assert top_a[t] == pytest.approx(top_b[t], abs=5e-2)
        assert len(top_a.keys() & top_b.keys()) >= 4
    assert same >= len(prompts) - 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("k", [0, 2])
def test_logit_bias_through_the_graphs(tiny_model_dir, k):
    """Biased rows on CUDA (decode graphs, MTP graphs with overlap): a +100 bias forces its
    token at every position, beside unbiased requests that keep their own greedy output."""
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="bfloat16",
                                 num_blocks=256), num_speculative_tokens=k)
    prompt = [5, 17, 42, 99, 3]
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = engine.generate([prompt], [free])[0].output_token_ids
    forced = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias=[(77, 100.0)])
    both = engine.generate([prompt, prompt], [forced, free])
    assert both[0].output_token_ids == [77] * 12
    assert both[1].output_token_ids == alone


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_step_inputs_travel_packed_in_one_copy():
    """`ModelRunner.to_device_all`: tensors of every dtype and shape a step has, packed into
    one page-locked buffer at 8-byte offsets, arrive whole on the device."""
    from types import SimpleNamespace

    from pd.engine.host_ring import HostRing
    from pd.engine.runner import ModelRunner

    runner = SimpleNamespace(device=torch.device("cuda"), host_buffers=HostRing(pin=True))
    host = {"ids": torch.arange(8193), "lens": torch.tensor([5, 7], dtype=torch.int32),
            "odd": torch.arange(3, dtype=torch.int32), "pos": torch.arange(12).view(3, 4),
            "ok": torch.tensor([True, False, True]), "none": torch.empty(0, dtype=torch.int64),
            "w": torch.rand(5)}
    for _ in range(4):  # the ring's buffers come round again
        dev = ModelRunner.to_device_all(runner, host)
        assert list(dev) == list(host)
        for k, t in host.items():
            assert dev[k].device.type == "cuda" and dev[k].dtype == t.dtype
            assert torch.equal(dev[k].cpu(), t), k
