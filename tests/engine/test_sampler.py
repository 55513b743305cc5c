"""Tests of pd.engine.sampler against hand-written references of the HF/vLLM formulas, on random logits."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pd.engine.sampler import Sampler, SamplingRow, probs_after_processing, process_logits
from pd.wire.sampling_params import SamplingParams as SP

EOS = 3


def row(step: int = 0, out=(), prompt=(), eos=(EOS,), **kw) -> SamplingRow:
    return SamplingRow(SP(**kw), list(out), list(prompt), step, tuple(eos))


def rand_logits(b: int, v: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * scale


# ---- greedy ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_lowest_id_on_ties(dtype):
    logits = rand_logits(16, 300, 1).to(dtype)
    logits[3, 7] = logits[3, 250] = logits[3].max() + 1  # a tie: id 7 wins
    before = logits.clone()
    out = Sampler(0)(logits, [row(temperature=0.0) for _ in range(16)])
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))
    assert out.token_ids[3] == 7
    assert out.logprobs is None and out.ranks is None and out.topk_ids is None
    assert torch.equal(logits, before)


# ---- penalties and min_tokens -----------------------------------------------------------------

def ref_penalized(x: list[float], r: SamplingRow) -> list[float]:
    p, out = r.params, r.output_token_ids
    seen = set(out) | set(r.prompt_token_ids)
    y = []
    for t, v in enumerate(x):
        if t in seen:
            v = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        n = out.count(t)
        v -= p.frequency_penalty * n + (p.presence_penalty if n > 0 else 0.0)
        y.append(v)
    return y


def test_penalties_match_reference():
    rows = [
        row(out=[5, 5, 9, 1], prompt=[9, 11, 12], repetition_penalty=1.3),
        row(out=[5, 5, 5, 2, 40], prompt=[2], frequency_penalty=0.7, presence_penalty=-0.4),
        row(out=[5, 9], prompt=[3, 3, 17], temperature=0.0),  # no penalty: untouched
        row(out=[0, 0, 49, 7], prompt=[7, 8], repetition_penalty=0.6, frequency_penalty=-1.5,
            presence_penalty=2.0),
        row(out=[], prompt=[1, 2, 3], repetition_penalty=2.0),  # prompt-only repetition
    ]
    logits = rand_logits(len(rows), 50, 2)
    before = logits.clone()
    got = process_logits(logits, rows)
    assert torch.equal(logits, before)
    assert torch.equal(got[2], logits[2])
    for i, r in enumerate(rows):
        want = torch.tensor(ref_penalized(logits[i].tolist(), r))
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-6)
    # sign matters for repetition: a positive seen logit shrinks, a negative one grows in size
    assert not torch.allclose(got[0], logits[0]) and not torch.allclose(got[4], logits[4])
    greedy = [SamplingRow(SP(**{**r.params.to_dict(), "temperature": 0.0}),
                          r.output_token_ids, r.prompt_token_ids, 0, ()) for r in rows]
    out = Sampler(0)(logits, greedy)
    assert torch.equal(out.token_ids, got.argmax(dim=-1))


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = rand_logits(1, 40, 3)
    logits[0, [EOS, 10, 20]] = torch.tensor([50.0, 49.0, 48.0])  # EOS, extra EOS, stop id on top

    def pick(step, **kw):
        r = row(step=step, out=[1] * step, temperature=0.0, max_tokens=8, **kw)
        return Sampler(0)(logits, [r]).token_ids.item()

    kw = dict(min_tokens=3, stop_token_ids=(20,), extra_eos_token_ids=(10,))
    runner_up = logits[0, :].clone()
    runner_up[[EOS, 10, 20]] = -math.inf
    assert pick(0, **kw) == pick(2, **kw) == runner_up.argmax().item()
    assert pick(3, **kw) == EOS  # min_tokens reached: nothing masked
    assert pick(1, ignore_eos=True, **kw) == EOS  # EOS is no stop: not masked
    assert pick(1, ignore_eos=True, min_tokens=3, stop_token_ids=(EOS,)) == 10


def test_min_tokens_bans_follow_their_rows_step_after_step():
    """The bans' device indices are kept for a run of steps with the same bans: rows whose bans
    trade places, or end, are masked by their own."""
    logits = rand_logits(2, 40, 4)
    logits[:, [EOS, 20]] = torch.tensor([50.0, 49.0])
    under = dict(min_tokens=3, stop_token_ids=(20,), temperature=0.0, max_tokens=8)
    plain = dict(temperature=0.0, max_tokens=8)
    top = logits[0].clone()
    top[[EOS, 20]] = -math.inf
    rest = logits[1].clone()
    rest[[EOS, 20]] = -math.inf
    for _ in range(2):
        got = Sampler(0)(logits, [row(step=0, **under), row(step=0, **plain)]).token_ids
        assert got.tolist() == [top.argmax().item(), EOS]
        got = Sampler(0)(logits, [row(step=0, **plain), row(step=0, **under)]).token_ids
        assert got.tolist() == [EOS, rest.argmax().item()]
        got = Sampler(0)(logits, [row(step=3, **under), row(step=3, **under)]).token_ids
        assert got.tolist() == [EOS, EOS]


# ---- truncation -------------------------------------------------------------------------------

def ref_allowed(x: list[float], p: SP) -> dict[int, float]:
    """Kept tokens and their probabilities, in float64, straight from the definitions."""
    x = [v / p.temperature for v in x]
    keep = set(range(len(x)))

    def probs(ids):
        m = max(x[t] for t in ids)
        z = sum(math.exp(x[t] - m) for t in ids)
        return {t: math.exp(x[t] - m) / z for t in ids}

    if 0 < p.top_k < len(x):
        kth = sorted(x, reverse=True)[p.top_k - 1]
        keep = {t for t in keep if x[t] >= kth}
    if p.top_p < 1.0:
        pr, mass, last = probs(keep), 0.0, None
        for t in sorted(keep, key=lambda t: -x[t]):
            if mass >= p.top_p:
                break
            mass, last = mass + pr[t], x[t]
        keep = {t for t in keep if x[t] >= last}
    if p.min_p > 0.0:
        pr = probs(keep)
        top = max(pr.values())
        keep = {t for t in keep if pr[t] >= p.min_p * top}
    return probs(keep)


TRUNCATIONS = [
    dict(temperature=0.8, top_k=5),
    dict(temperature=1.3, top_p=0.6),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=0.7, top_k=12, top_p=0.8, min_p=0.05),
    dict(temperature=1.0, top_k=1),
    dict(temperature=2.0, top_k=-1, top_p=0.3),
    dict(temperature=1.0),
]


def test_probs_after_processing_matches_reference():
    logits = rand_logits(len(TRUNCATIONS) + 1, 64, 4)
    rows = [row(**kw) for kw in TRUNCATIONS] + [row(temperature=0.0)]
    probs = probs_after_processing(logits, rows)
    for i, kw in enumerate(TRUNCATIONS):
        want = torch.zeros(64, dtype=torch.float64)
        for t, pr in ref_allowed(logits[i].tolist(), SP(**kw)).items():
            want[t] = pr
        assert torch.equal(probs[i] > 0, want > 0), kw
        torch.testing.assert_close(probs[i].double(), want, rtol=1e-5, atol=1e-6)
    assert probs[-1].sum() == 1 and probs[-1, logits[-1].argmax()] == 1


def test_top_p_cut_beyond_the_candidates_matches_reference():
    logits = rand_logits(3, 2000, 8, scale=0.3)  # flat: top-p 0.9 needs most of the vocabulary
    kws = [dict(top_p=0.9), dict(top_p=0.05), dict(top_k=900, top_p=0.8, temperature=0.5)]
    probs = probs_after_processing(logits, [row(**kw) for kw in kws])
    for i, kw in enumerate(kws):
        allowed = ref_allowed(logits[i].tolist(), SP(**kw))
        assert set((probs[i] > 0).nonzero().view(-1).tolist()) == set(allowed), kw
    assert (probs[0] > 0).sum() > 1000 and (probs[1] > 0).sum() < 256


def test_truncation_never_samples_a_masked_token():
    reps, vocab = 2000, 64
    base = rand_logits(len(TRUNCATIONS), vocab, 5)
    logits = base.repeat_interleave(reps, dim=0)
    rows = [row(**kw) for kw in TRUNCATIONS for _ in range(reps)]
    tokens = Sampler(1)(logits, rows).token_ids.view(len(TRUNCATIONS), reps)
    for i, kw in enumerate(TRUNCATIONS):
        allowed = ref_allowed(base[i].tolist(), SP(**kw))
        drawn = set(tokens[i].tolist())
        assert drawn <= set(allowed), (kw, drawn - set(allowed))
        likely = {t for t, pr in allowed.items() if pr > 0.01}
        assert likely <= drawn, kw  # the mask is not wider than the definition


def test_row_distribution_does_not_depend_on_the_batch():
    logits = rand_logits(5, 500, 6)
    logits[4] = rand_logits(1, 500, 0, scale=4.0)[0]  # float32 cumsum reaches 1.0 before its tail
    rows = [row(temperature=0.9), row(top_p=0.5), row(top_k=7, min_p=0.1), row(temperature=0.0),
            row()]
    together = probs_after_processing(logits, rows)
    assert (together[4] > 0).all()  # top_p = 1 keeps every token even beside a top_p row
    for i, r in enumerate(rows):
        assert torch.equal(probs_after_processing(logits[i : i + 1], [r])[0], together[i])


# ---- seeded draws -----------------------------------------------------------------------------

def seeded_run(logits: torch.Tensor, seed: int, companions, position: int) -> list[int]:
    """Tokens of one seeded request over len(logits) steps, sharing each step's batch."""
    sampler, tokens = Sampler(position), []
    for step in range(logits.shape[0]):
        mine = row(step=step, seed=seed, temperature=0.9, top_p=0.95)
        others = [row(step=step, **kw) for kw in companions]
        rows = others[:position] + [mine] + others[position:]
        batch = rand_logits(len(rows), logits.shape[1], 100 + step)
        batch[position] = logits[step]
        tokens.append(sampler(batch, rows).token_ids[position].item())
    return tokens


def test_seeded_draws_ignore_batch_composition_and_position():
    logits = rand_logits(30, 1000, 7, scale=0.5)  # flat-ish: many tokens are likely
    alone = seeded_run(logits, 1234, [], 0)
    mixes = [
        ([dict(temperature=0.0), dict(seed=1, top_k=3)], 1),
        ([dict(temperature=1.0)] * 5, 5),
        ([dict(seed=1234, min_p=0.2), dict(repetition_penalty=1.5), dict(top_p=0.3)], 2),
    ]
    for companions, position in mixes:
        assert seeded_run(logits, 1234, companions, position) == alone
    assert len(set(alone)) > 20  # the draw changes with the step
    assert seeded_run(logits, 1235, [], 0) != alone


CHILD = """
import json, sys, torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1])
from pd.engine.sampler import Sampler, SamplingRow
from pd.wire.sampling_params import SamplingParams
logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(42)) * 0.5
rows = [SamplingRow(SamplingParams(seed=99, temperature=0.9), [], [], s, ()) for s in range(8)]
print(json.dumps(Sampler(7)(logits, rows).token_ids.tolist()))
"""


def test_seeded_draws_are_the_same_in_another_process():
    """Token 0 sampled on a prefill node, the rest on a decode node: same as one process."""
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, "-c", CHILD, repo], capture_output=True, text=True,
                           env=env, timeout=120, check=True)
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(42)) * 0.5
    here = [Sampler(s)(logits[s : s + 1], [row(step=s, seed=99, temperature=0.9, eos=())])
            .token_ids.item() for s in range(8)]
    assert json.loads(child.stdout) == here


# ---- distribution -----------------------------------------------------------------------------

CHI2_DF7_P001 = 24.32  # chi-square critical value, 7 degrees of freedom, p = 0.001


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_sampling_matches_softmax(seeded):
    n, temp = 20000 if not seeded else 4000, 0.7
    logits = torch.tensor([[1.0, 0.5, -0.3, 2.0, 0.0, -1.0, 1.2, 0.8]])
    rows = [row(step=3, temperature=temp, seed=(i if seeded else None)) for i in range(n)]
    tokens = Sampler(11)(logits.expand(n, -1), rows).token_ids
    assert chi_square(tokens, torch.softmax(logits[0] / temp, -1)) < CHI2_DF7_P001
    # the same draws are far from the untempered distribution: the test can tell them apart
    assert chi_square(tokens, torch.softmax(logits[0], -1)) > 10 * CHI2_DF7_P001


# ---- parameters -------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [
    dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(top_k=1.5),
    dict(min_p=-0.1), dict(min_p=1.1), dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
    dict(repetition_penalty=0.0), dict(logprobs=21), dict(logprobs=-1), dict(max_tokens=0),
    dict(seed=1.5), dict(min_tokens=20, max_tokens=10), dict(stop_token_ids=(-1,)),
])
def test_bad_parameters_raise(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SP(**bad)


def test_logits_rows_mismatch_raises():
    with pytest.raises(ValueError):
        Sampler(0)(rand_logits(2, 10, 0), [row()])


def test_logit_bias_moves_the_argmax_and_is_validated():
    import torch

    from pd.engine.sampler import Sampler, SamplingRow
    from pd.wire.sampling_params import SamplingParams

    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0], [3.0, 1.0, 0.0, -1.0]])
    rows = [SamplingRow(SamplingParams(temperature=0, logit_bias={2: 5.0}.items()), [], [], 0),
            SamplingRow(SamplingParams(temperature=0, logit_bias=[(0, -100.0)]), [], [], 0)]
    out = Sampler()(logits, rows)
    assert out.token_ids.tolist() == [2, 1]
    assert logits[0, 2] == 0.0  # the caller's logits are never written
    for bad in ([(1, 101.0)], [(-1, 1.0)], [(1, 1.0), (1, 2.0)], [(True, 1.0)], [(1,)]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    p = SamplingParams(logit_bias=[[3, 2]])
    assert p.logit_bias == ((3, 2.0),) and SamplingParams.from_dict(p.to_dict()) == p
