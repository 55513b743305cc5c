"""Tests of raw logprobs, ranks and top-k (pd.engine.logprobs, through the sampler) against brute force."""

from __future__ import annotations

import math
import os

import pytest
import torch

from pd.engine.logprobs import compute_logprobs, topk_lowest_id
from pd.engine.sampler import Sampler, SamplingRow
from pd.wire.sampling_params import SamplingParams as SP


def tied_logits(b: int, v: int, seed: int) -> torch.Tensor:
    """Random logits on a coarse grid: many exact ties, also among the top values."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-12, 12, (b, v), generator=g).float() / 3


def brute(lp_row: list[float], token: int, k: int):
    rank = 1 + sum(1 for x in lp_row if x > lp_row[token])
    top = sorted(range(len(lp_row)), key=lambda t: (-lp_row[t], t))[:k]
    return rank, top


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_ranks_topk_match_brute_force(dtype):
    asks = [0, None, 1, 5, None, 20, 5, 0]
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(top_p=0.7, seed=3),
             dict(temperature=0.0, repetition_penalty=1.8), dict(top_k=4)]
    rows = [SamplingRow(SP(logprobs=k, **kinds[i % len(kinds)]), [1, 2], [2, 5], 2, ())
            for i, k in enumerate(asks)]
    logits = tied_logits(len(rows), 64, 0).to(dtype)
    out = Sampler(0)(logits, rows)
    assert out.topk_ids.shape == out.topk_logprobs.shape == (len(rows), 20)
    exact = torch.log_softmax(logits.double(), dim=-1)
    for i, k in enumerate(asks):
        if k is None:
            assert out.logprobs[i] == 0 and out.ranks[i] == 0 and not out.topk_ids[i].any()
            continue
        lp = torch.log_softmax(logits[i].float(), dim=-1)
        tok = out.token_ids[i].item()
        rank, top = brute(lp.tolist(), tok, k)
        assert out.logprobs[i].item() == lp[tok].item()
        assert math.isclose(out.logprobs[i].item(), exact[i, tok].item(), abs_tol=1e-5)
        assert out.ranks[i].item() == rank
        assert out.topk_ids[i, :k].tolist() == top
        assert torch.equal(out.topk_logprobs[i, :k], lp[top])


def test_ties_share_a_rank_and_list_lowest_id_first():
    logits = torch.full((1, 10), -1.0)
    logits[0, [8, 2, 5]] = 4.0
    rows = [SamplingRow(SP(temperature=0.0, logprobs=4), [], [], 0, ())]
    out = Sampler(0)(logits, rows)
    assert out.token_ids.item() == 2 and out.ranks.item() == 1
    assert out.topk_ids[0].tolist() == [2, 5, 8, 0]
    forced = compute_logprobs(logits, torch.tensor([8]), 2)
    assert forced.ranks.item() == 1  # tied with the argmax: same rank
    assert compute_logprobs(logits, torch.tensor([9]), 0).ranks.item() == 4


def test_logprobs_are_of_the_raw_distribution():
    """Penalties, temperature and truncation change the token, never the reported logprobs."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1)) * 3
    best = logits.argmax().item()
    params = SP(temperature=0.3, top_k=2, repetition_penalty=2.0, frequency_penalty=2.0,
                logprobs=3)
    out = Sampler(0)(logits, [SamplingRow(params, [best] * 4, [], 4, ())])
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.token_ids.item() != best and out.ranks.item() > 1
    assert out.logprobs.item() == raw[out.token_ids.item()].item()
    assert torch.equal(out.topk_logprobs[0], raw.topk(3).values)


def test_no_row_asked_gives_none_and_k0_gives_empty_columns():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    none = Sampler(0)(logits, [SamplingRow(SP(), [], [], 0, ()) for _ in range(3)])
    assert none.logprobs is none.ranks is none.topk_ids is none.topk_logprobs is None
    rows = [SamplingRow(SP(logprobs=lp), [], [], 0, ()) for lp in (None, 0, None)]
    out = Sampler(0)(logits, rows)
    assert out.topk_ids.shape == (3, 0) and out.topk_logprobs.shape == (3, 0)
    tok = out.token_ids[1].item()
    assert out.logprobs[1].item() == torch.log_softmax(logits[1], -1)[tok].item()


def test_topk_lowest_id_orders_any_float_values():
    x = torch.tensor([[-0.0, 0.0, 3.5, -2.0, 3.5, math.inf, -math.inf, 1e-30, -1e-30, 3.5]])
    values, ids = topk_lowest_id(x, 10)
    want = sorted(range(10), key=lambda t: (-x[0, t].item(), t))
    assert ids[0].tolist() == want
    assert torch.equal(values[0], x[0, want])
    big = torch.randn(64, 3000, generator=torch.Generator().manual_seed(3))
    big[::2] = big[::2].round(decimals=1)  # even rows tied (exact path), odd rows not (fast path)
    vals, ids = topk_lowest_id(big, 20)
    for r in range(0, 64, 5):
        assert ids[r].tolist() == sorted(range(3000), key=lambda t: (-big[r, t].item(), t))[:20]


def test_num_top_out_of_range_raises():
    with pytest.raises(ValueError):
        compute_logprobs(torch.randn(1, 4), torch.tensor([0]), 5)


@pytest.mark.parametrize("mtp", [0, 2])
def test_prompt_logprobs_equal_transformers_over_chunks_and_the_prefix_cache(tiny_model_dir, mtp):
    """Prompt logprobs (each prompt token after the first, scored by the positions before it)
    equal transformers' log_softmax, prefilled in 16-token chunks, with MTP's prefill too, and
    a prompt whose blocks are cached is computed whole again. `PD_TEST_DEVICE=cuda` runs the
    engine on the GPU (float32, CUDA graphs)."""
    import transformers

    from pd.engine.llm import LLM

    prompt = [3 + (7 * i) % 400 for i in range(47)]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        exact = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), dim=-1)
    llm = LLM(tiny_model_dir, num_blocks=256, max_num_batched_tokens=16, num_speculative_tokens=mtp,
              device=os.environ.get("PD_TEST_DEVICE", "cpu"), dtype="float32")
    params = SP(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    for _ in range(2):  # the second prompt's full blocks are in the prefix cache
        out = llm.generate([prompt], params)[0]
        assert len(out.prompt_logprobs) == len(prompt) - 1
        for p, (v, rank, top) in enumerate(out.prompt_logprobs):
            row, token = exact[p], prompt[p + 1]
            assert v == pytest.approx(row[token].item(), abs=1e-4)
            assert rank == 1 + int((row > row[token] + 1e-6).sum())
            assert [t for t, _ in top] == row.topk(3).indices.tolist()
    assert llm.generate([prompt], SP(max_tokens=2, temperature=0.0))[0].prompt_logprobs is None
