"""The graphed MTP step (`pd.spec.graphs`): its fixed-stride layout (k + 1 rows per slot, rows
past a slot's drafts and slots past the batch as padding in a spare block) and the split of
the step into a verify and a draft part with sampling between them. On CPU the same layout runs
without capture (`PD_SPEC_LAYOUT=1`, torch twins of the kernels); on a CUDA machine the graphs
are captured and compared with the eager MTP step and with plain decoding."""

from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from pd.engine.llm import LLM
from pd.engine.runner import SPEC_LAYOUT_ENV
from pd.spec import graphed
from pd.spec.step_graphs import StepGraphs
from pd.wire.sampling_params import SamplingParams
from tests.spec.test_mtp import assert_same, mixed_params, prompts


@contextmanager
def spec_layout():
    """Engines made inside run their verify steps through the graphs' layout without capture
    (`PD_SPEC_LAYOUT=1`: the runner keeps a spare block for the padding)."""
    old = os.environ.get(SPEC_LAYOUT_ENV)
    os.environ[SPEC_LAYOUT_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ[SPEC_LAYOUT_ENV]
        else:
            os.environ[SPEC_LAYOUT_ENV] = old


def sampled_params(n: int) -> list[SamplingParams]:
    kinds = [dict(temperature=0.9, top_p=0.9, seed=11), dict(temperature=0.0, min_tokens=6),
             dict(temperature=0.7, top_k=20, repetition_penalty=1.2, seed=5, logprobs=2),
             dict(temperature=0.0, logprobs=0)]
    return [SamplingParams(max_tokens=14 + i % 4, ignore_eos=i % 2 == 0, **kinds[i % 4])
            for i in range(n)]


@pytest.mark.parametrize("k", [1, 3, 4])
def test_layout_greedy_equals_plain_decoding(tiny_model_dir, k):
    batch = prompts(11, seed=5)  # 11 slots: padded to 16
    params = mixed_params(len(batch))
    ref = LLM(tiny_model_dir, num_blocks=256).generate(batch, params)
    with spec_layout():
        llm = LLM(tiny_model_dir, num_blocks=256, num_speculative_tokens=k)
    assert_same(llm.generate(batch, params), ref)
    assert any(s == 16 for s, _ in llm.engine.spec.graphs.graphs), "the layout path did not run"
    llm.engine.allocator.check_integrity()
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks


def test_layout_top_logprobs_0_rides_with_the_result(tiny_model_dir, monkeypatch):
    """Steps whose requests ask at most top_logprobs 0 take the token logprobs from the draft
    step's packed output (one copy with the result); they equal plain decoding's."""
    batch = prompts(9, seed=8)
    params = [SamplingParams(max_tokens=18 + i % 3, temperature=0.0, ignore_eos=i % 2 == 0,
                             logprobs=[0, None][i % 2]) for i in range(len(batch))]
    ref = LLM(tiny_model_dir, num_blocks=256).generate(batch, params)
    with spec_layout():
        llm = LLM(tiny_model_dir, num_blocks=256, num_speculative_tokens=3)
    folded, draft = [], StepGraphs.draft

    def watched(self, lp0=False):
        folded.append(lp0)
        return draft(self, lp0)

    monkeypatch.setattr(StepGraphs, "draft", watched)
    assert_same(llm.generate(batch, params), ref)
    assert any(folded), "no step folded its logprobs into the draft step's output"


def test_chained_steps_patch_the_known_part(tiny_model_dir, monkeypatch):
    """A chained step writes the blocks its requests got into the known part's host copy
    (`KnownPart.patch`) instead of building it again: after every chained launch the copy
    equals a full build; patches with new blocks and full builds (a slot stopped) both occur,
    and the tokens equal plain decoding's."""
    seen = {"patched": 0, "rebuilt": 0}
    launch = graphed.GraphedSteps.launch_chained

    def checked(self, prev):
        was = prev.graphs.known
        lengths = None if was is None else was.lengths.copy()
        flight = launch(self, prev)
        g = prev.graphs
        kind = ("rebuilt" if g.known is not was else
                "unchanged" if np.array_equal(was.lengths, lengths) else "patched")
        seen[kind] = seen.get(kind, 0) + 1
        host, _ = self._host_inputs(prev.batch.reqs, prev.key, prev.rows)
        assert np.array_equal(g.known.flat[g.layout.tail:], host.numpy()[g.layout.tail:])
        return flight

    monkeypatch.setattr(graphed.GraphedSteps, "launch_chained", checked)
    batch = prompts(11, seed=5)
    params = [SamplingParams(max_tokens=40 + 3 * i, temperature=0.0, ignore_eos=i % 2 == 0)
              for i in range(len(batch))]
    ref = LLM(tiny_model_dir, num_blocks=256).generate(batch, params)
    with spec_layout():
        llm = LLM(tiny_model_dir, num_blocks=256, num_speculative_tokens=3, overlap=True)
    assert_same(llm.generate(batch, params), ref)
    assert seen["patched"] > 5 and seen["rebuilt"] > 0, seen


def test_layout_sampling_equals_eager_step(tiny_model_dir):
    """Seeded sampling, top-p/top-k, penalties and min_tokens go through the eager sampler
    between the two parts; the tokens equal the eager MTP step's."""
    batch = prompts(6, seed=21)
    params = sampled_params(len(batch))
    eager = LLM(tiny_model_dir, num_blocks=256, num_speculative_tokens=3).generate(batch, params)
    with spec_layout():
        llm = LLM(tiny_model_dir, num_blocks=256, num_speculative_tokens=3)
    out = llm.generate(batch, params)
    for o, e, p in zip(out, eager, params):
        assert o.token_ids == e.token_ids, p
    assert llm.engine.spec.graphs.graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("k", [1, 3])
def test_graphs_equal_plain_and_eager_float32(tiny_model_dir, k):
    batch = prompts(20, seed=3)
    params = mixed_params(len(batch))
    ref_llm = LLM(tiny_model_dir, device="cuda", dtype="float32", num_blocks=512)
    ref = ref_llm.generate(batch, params)
    llm = LLM(tiny_model_dir, device="cuda", dtype="float32", num_blocks=512, num_speculative_tokens=k,
              spec_fallback=False)
    assert_same(llm.generate(batch, params), ref)
    assert llm.engine.spec.graphs.graphs, "no verify step ran as a graph"
    sampled = sampled_params(12)
    eager = LLM(tiny_model_dir, device="cuda", dtype="float32", num_blocks=512,
                num_speculative_tokens=k, enforce_eager=True).generate(batch[:12], sampled)
    assert [o.token_ids for o in llm.generate(batch[:12], sampled)] == [o.token_ids for o in eager]
    alone = [SamplingParams(max_tokens=10 + i, temperature=0.0, ignore_eos=True,
                            logprobs=[None, 0, 3][i % 3]) for i in range(6)]
    longer = [prompt for prompt in batch if len(prompt) > 1]  # a 1-token prompt runs eagerly
    for prompt, p in zip(longer, alone):  # each prompt's first chunk alone: `pd.spec.prefill`
        assert_same(llm.generate([prompt], [p]), ref_llm.generate([prompt], [p]))
    assert {top for _, top in llm.engine.spec.prefill.steps} == {None, 0, 3}
    llm.engine.allocator.check_integrity()


def test_layout_prefill_step_equals_eager(tiny_model_dir):
    """A prompt prefilled alone runs its MTP step in the prefill layout (`pd.spec.prefill`):
    its first token, stop and drafts equal the eager step's, and the requests' tokens equal
    plain decoding's (one stopped by its first token, one by its length there)."""
    batch = prompts(6, seed=13)
    params = [SamplingParams(max_tokens=[12, 1, 20, 7, 16, 9][i], temperature=0.0,
                             ignore_eos=i != 2, logprobs=[None, 0, None, 3, None, 0][i])
              for i in range(len(batch))]
    first = ref_first = None
    ref = LLM(tiny_model_dir, num_blocks=256)
    eager = LLM(tiny_model_dir, num_blocks=256, num_speculative_tokens=3)
    with spec_layout():
        llm = LLM(tiny_model_dir, num_blocks=256, num_speculative_tokens=3)
    tops, run_prefill = [], llm.engine.spec.prefill.run

    def prefill(b, max_model_len, top):
        tops.append(top)
        return run_prefill(b, max_model_len, top)

    llm.engine.spec.prefill.run = prefill
    for prompt, p in zip(batch, params):  # one at a time: each prompt's first chunk alone
        seen = {}
        for engine, key in ((eager, "eager"), (llm, "layout")):
            run = engine.engine.spec.run

            def watched(b, run=run, key=key):
                out = run(b)
                seen.setdefault(key, out)
                return out

            engine.engine.spec.run = watched
            out = engine.generate([prompt], [p])[0]
            del engine.engine.spec.run
            seen[key + "_tokens"] = out.token_ids
        first, ref_first = seen["layout"][0], seen["eager"][0]
        assert first.drafts == ref_first.drafts and first.finish_reason == ref_first.finish_reason
        assert first.token_ids == ref_first.token_ids and len(first.token_ids) == 1
        assert (first.logprobs is None) == (ref_first.logprobs is None), p
        if first.logprobs is not None:
            (lp,), (rank,), (top,) = first.logprobs
            (ref_lp,), (ref_rank,), (ref_top,) = ref_first.logprobs
            assert rank == ref_rank
            assert lp == pytest.approx(ref_lp, abs=1e-5)
            assert [t for t, _ in top] == [t for t, _ in ref_top]
            assert [x for _, x in top] == pytest.approx([x for _, x in ref_top], abs=1e-5)
        assert seen["layout_tokens"] == ref.generate([prompt], [p])[0].token_ids
    assert tops == [p.logprobs for p in params], "not every prompt ran through the prefill layout"
    assert not eager.engine.spec.prefill
    llm.engine.allocator.check_integrity()
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graphed_prompt_chunks_equal_plain_bfloat16(tiny_model_dir):
    """A step of several prompts runs its MTP step as the varlen prefill graph and one graph of
    the rest (`SpecPrefill.run_chunks`): greedy tokens and logprob ranks equal plain decoding's
    in bfloat16 (batch-invariant kernels), with a stop at the first token among them."""
    batch = [p for p in prompts(24, seed=7) if len(p) > 1][:12]
    params = [SamplingParams(max_tokens=[1, 9, 16][i % 3], temperature=0.0, ignore_eos=True,
                             logprobs=0 if i % 4 == 1 else None) for i in range(len(batch))]
    ref = LLM(tiny_model_dir, device="cuda", num_blocks=512).generate(batch, params)
    llm = LLM(tiny_model_dir, device="cuda", num_blocks=512, num_speculative_tokens=3,
              spec_fallback=False)
    out = llm.generate(batch, params)
    for o, r in zip(out, ref):
        assert o.token_ids == r.token_ids and o.finish_reason == r.finish_reason
        assert (o.ranks is None) == (r.ranks is None)
    assert any(isinstance(shape, tuple) for (shape, _) in llm.engine.spec.prefill.steps), \
        "no step of prompt chunks ran in the graphs"
    llm.engine.allocator.check_integrity()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_chained_top_logprobs_0_equal_the_steps_launched_from_the_host(tiny_model_dir):
    """A chained step's top_logprobs 0 pairs come from its verify's argmax on a branch of its
    graph beside the draft chain (`StepGraphs._chain_lp0`); the steps the host launches one by
    one (overlap off) read them from the accepted ids after the chain: the same tokens, ranks
    and logprobs."""
    batch = prompts(6, seed=9)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = {}
    for overlap in (True, False):
        llm = LLM(tiny_model_dir, device="cuda", num_blocks=512, num_speculative_tokens=3,
                  spec_fallback=False, overlap=overlap)
        outs[overlap] = llm.generate(batch, params)
        chained = [g.chain_lp0 is not None for g in llm.engine.spec.graphs.graphs.values()]
        assert any(chained) == overlap, "chained steps with top_logprobs 0 ran only with overlap"
    for on, off in zip(outs[True], outs[False]):
        assert on.token_ids == off.token_ids and on.ranks == off.ranks
        assert np.allclose(on.logprobs, off.logprobs, atol=2e-2, rtol=0)
        assert all(r >= 1 for r in on.ranks)
