"""Rejection sampling with MTP keeps the target's distribution: many seeded draws of a
4-token continuation with the shipped model (trained MTP layer, so drafts are often but not
always accepted), truncated to top-4 at every position. Their first 3 tokens (64 possible
prefixes; the second and third come from verifying two drafts) are compared with the exact
distribution computed from the target's own logprobs without MTP.

Threshold: the chi-square statistic must stay under the critical value at p = 0.001 for its
degrees of freedom (Wilson-Hilferty approximation of the chi-square quantile); measured 34.3
on 27 degrees of freedom against 55.6. The same draws against the distribution at another
temperature must exceed it (the test has power); accepting every draft gave 2762."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from pd.engine.llm import LLM
from pd.wire.sampling_params import SamplingParams

PROMPT = "def fibonacci(n):"
TOP_K, TEMPERATURE, NUM_DRAWS = 4, 1.0, 900


def chi2_critical(df: int, z: float = 3.0902) -> float:
    """Upper quantile of chi-square(df) at the normal quantile z (3.0902: p = 0.001)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi_square(counts: Counter, expected: dict[tuple, float], n: int) -> tuple[float, int]:
    """Statistic and degrees of freedom; cells expecting fewer than 5 draws are pooled."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for key, p in expected.items():
        e = p * n
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(key, 0), pooled_exp + e
            continue
        stat += (counts.get(key, 0) - e) ** 2 / e
        cells += 1
    outside = n - sum(counts.get(key, 0) for key in expected)  # draws off the support
    assert outside == 0
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    return stat, cells - 1


def exact_distribution(llm: LLM, prompt: list[int], temperature: float) -> dict[tuple, float]:
    """P(t1, t2, t3) under top-k / temperature sampling, from the raw top-k logprobs."""
    def next_probs(prefixes):
        outs = llm.generate([prompt + list(p) for p in prefixes],
                            SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP_K, ignore_eos=True))
        result = []
        for o in outs:
            ids = [t for t, _ in o.top_logprobs[0]]
            lp = torch.tensor([v for _, v in o.top_logprobs[0]], dtype=torch.float64)
            result.append(dict(zip(ids, torch.softmax(lp / temperature, 0).tolist())))
        return result

    dist = {(): 1.0}
    for _ in range(3):
        prefixes = list(dist)
        dist = {p + (t,): dist[p] * q for p, probs in zip(prefixes, next_probs(prefixes))
                for t, q in probs.items()}
    return dist


@pytest.fixture(scope="module")
def draws():
    llm = LLM(num_speculative_tokens=2)
    prompt = llm.tokenizer.encode(PROMPT)
    params = [SamplingParams(max_tokens=4, temperature=TEMPERATURE, top_k=TOP_K, seed=s,
                             ignore_eos=True) for s in range(NUM_DRAWS)]
    outs = llm.generate([prompt] * NUM_DRAWS, params)
    return prompt, Counter(tuple(o.token_ids[:3]) for o in outs), llm.engine.spec.stats


def test_distribution_with_mtp_equals_target(draws):
    prompt, counts, stats = draws
    plain = LLM()
    stat, df = chi_square(counts, exact_distribution(plain, prompt, TEMPERATURE), NUM_DRAWS)
    assert df >= 5
    assert stat < chi2_critical(df), (stat, df)
    # both branches ran: some drafts accepted, some rejected (then resampled)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert len(stats.accepted_per_pos) == 2 and stats.accepted_per_pos[1] > 0
    # and the statistic does see a different distribution
    wrong, wdf = chi_square(counts, exact_distribution(plain, prompt, 0.6), NUM_DRAWS)
    assert wrong > chi2_critical(wdf), (wrong, wdf)
