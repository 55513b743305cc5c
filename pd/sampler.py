"""The sampler: one batched pass from the logits of the rows that need a token to the token ids
(and raw logprobs when asked).

Order of work for each row (vLLM semantics):
1. logprobs/ranks/top-k of the RAW distribution, `log_softmax(logits)` in float32, before
   anything below (see `pd.logprobs`); only when some row asked;
2. penalties: repetition (prompt + output tokens), then frequency and presence (output tokens);
3. min_tokens: EOS ids (unless ignore_eos) and stop_token_ids get -inf while fewer than
   min_tokens tokens were generated;
4. greedy rows (temperature < 1e-5, as vLLM) take the argmax, lowest id on ties;
5. sampled rows: temperature, top-k, top-p, min-p, then one draw from the result.

Truncations are thresholds on values, so tokens tied with the last kept one are kept too and a
row's distribution depends on that row alone, never on the batch around it. Draws use the
exponential race `argmax(probs / E)`, E ~ Exp(1): a token with probability 0 is never drawn.
A seeded row draws E from a generator seeded by `step_seed(seed, step)`, so its i-th token is a
pure function of (seed, i, its logits) on a given device type: the prefill node sampling token
0 and the decode node sampling the rest give what one process would. Unseeded rows share one
generator per device.

`probs_after_processing` gives the final distribution of each row (steps 2-5) for rejection
sampling in speculative decoding; the sampler draws from exactly those probabilities.
Stop checks, detokenization and which rows need sampling are left to the engine/scheduler.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

import torch

from pd.logprobs import compute_logprobs
from pd.sampling_params import SamplingParams

GREEDY_EPS = 1e-5  # temperatures below this sample greedily (x / T would overflow)
_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SamplingRow:
    """One row of logits: one request's next position."""

    params: SamplingParams
    output_token_ids: list[int]  # generated so far (frequency/presence penalties)
    prompt_token_ids: list[int]  # repetition penalty covers prompt + output (HF/vLLM)
    step: int  # tokens this request generated before this one (min_tokens; seeded draws)
    eos_token_ids: tuple[int, ...] = field(default=())  # the model's EOS ids

    @property
    def is_greedy(self) -> bool:
        return self.params.temperature < GREEDY_EPS

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        """Ids masked at this position because fewer than min_tokens were generated."""
        p = self.params
        if self.step >= p.min_tokens:
            return ()
        if p.ignore_eos:
            return p.stop_token_ids
        return p.stop_token_ids + tuple(self.eos_token_ids) + p.extra_eos_token_ids


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    # The four below are None when no row asked for logprobs; rows that did not ask hold 0.
    logprobs: torch.Tensor | None  # [B] float32, raw logprob of the sampled token
    ranks: torch.Tensor | None  # [B] int64, 1 = argmax; tied tokens share a rank
    topk_ids: torch.Tensor | None  # [B, K] int64, K = max asked in the batch (may be 0)
    topk_logprobs: torch.Tensor | None  # [B, K] float32


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def step_seed(seed: int, step: int) -> int:
    """Generator seed (63 bits) for a seeded request's draw at `step`."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64)) >> 1


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64, device=device)


def apply_penalties(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition, frequency and presence penalties, in place on float32 logits [B, V]:
    seen = prompt ∪ output: x = x / rp if x > 0 else x * rp;
    then x -= frequency * count(output) + presence * [count(output) > 0]."""
    idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not idx:
        return
    dev, vocab = x.device, x.shape[1]
    whole = len(idx) == len(rows)
    idx_t = None if whole else _index(idx, dev)
    sub = x if whole else x[idx_t]  # [P, V]
    prows = [rows[i] for i in idx]
    coef = torch.tensor(
        [[r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty]
         for r in prows], dtype=torch.float32, device=dev,
    )  # [P, 3]
    rep, freq, pres = coef[:, 0:1], coef[:, 1:2], coef[:, 2:3]

    def scatter_rows(lists: list[list[int]], into: torch.Tensor, value: torch.Tensor) -> None:
        lens = torch.tensor([len(t) for t in lists], dtype=torch.int64, device=dev)
        ids = torch.tensor([t for ts in lists for t in ts], dtype=torch.int64, device=dev)
        row_of = torch.repeat_interleave(torch.arange(len(lists), device=dev), lens)
        into.index_put_((row_of, ids), value.expand(ids.shape[0]), accumulate=True)

    counts = torch.zeros_like(sub)
    scatter_rows([r.output_token_ids for r in prows], counts, torch.ones((), device=dev))
    if any(r.params.repetition_penalty != 1.0 for r in prows):
        seen = counts.clone()
        scatter_rows([r.prompt_token_ids for r in prows], seen, torch.ones((), device=dev))
        sub.copy_(torch.where(seen > 0, torch.where(sub > 0, sub / rep, sub * rep), sub))
    sub.sub_(freq * counts + pres * (counts > 0))
    if not whole:
        x[idx_t] = sub


def apply_min_tokens(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """-inf on EOS / stop ids of rows still under min_tokens, in place on logits [B, V]."""
    row_of, ids = [], []
    for i, r in enumerate(rows):
        banned = r.banned_token_ids
        row_of += [i] * len(banned)
        ids += banned
    if ids:
        x[_index(row_of, x.device), _index(ids, x.device)] = -math.inf


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Float32 logits after penalties and min_tokens. `logits` is never written: a copy is made
    when a row needs either; otherwise the result may share memory with `logits`."""
    if not any(r.params.has_penalties or r.step < r.params.min_tokens for r in rows):
        return logits.float()
    x = logits.to(torch.float32, copy=True)
    apply_penalties(x, rows)
    apply_min_tokens(x, rows)
    return x


def truncated_probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Sampling distribution [S, V] float32 of sampled rows (temperature >= GREEDY_EPS) from
    their processed logits `x` [S, V]: temperature, top-k, top-p, min-p, softmax.
    Each truncation keeps every token whose (tempered) logit is >= the row's threshold:
    top-k: the k-th largest; top-p: the smallest prefix of the sorted row whose mass reaches
    top_p (mass before a kept token < top_p); min-p: max + log(min_p), i.e. p >= min_p * p_max."""
    dev, vocab = x.device, x.shape[1]
    cols = torch.tensor(
        [[p.temperature, p.top_p, p.min_p, p.top_k if 0 < p.top_k < vocab else 0] for p in params],
        dtype=torch.float32, device=dev,
    )  # [S, 4]
    x = x / cols[:, 0:1]  # a new tensor: everything below is in place on it
    top_k = cols[:, 3].to(torch.int64)
    use_k = any(0 < p.top_k < vocab for p in params)
    use_p = any(p.top_p < 1.0 for p in params)
    if use_k or use_p:
        if use_p:
            ordered = x.sort(dim=-1, descending=True).values
        else:
            ordered = x.topk(int(top_k.max()), dim=-1).values
        if use_k:
            kth = ordered.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))
            kth = torch.where(top_k.unsqueeze(1) > 0, kth, -math.inf)
            x.masked_fill_(x < kth, -math.inf)
            ordered.masked_fill_(ordered < kth, -math.inf)
        if use_p:
            top_p = cols[:, 1]
            sorted_probs = ordered.softmax(dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            num_keep = (mass_before < top_p.unsqueeze(1)).sum(dim=-1)
            # NOTE: top_p == 1 keeps the whole row outright: a cumsum rounding to 1 early would
            # otherwise drop tail tokens depending on float error.
            num_keep = torch.where(top_p >= 1.0, vocab, num_keep.clamp(min=1))
            pth = ordered.gather(1, (num_keep - 1).unsqueeze(1))
            x.masked_fill_(x < pth, -math.inf)
    if any(p.min_p > 0.0 for p in params):
        min_p = cols[:, 2:3]
        floor = x.amax(dim=-1, keepdim=True) + torch.log(min_p)  # log(0) = -inf: off
        x.masked_fill_(x < floor, -math.inf)
    return x.softmax(dim=-1)


def probs_after_processing(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The final sampling distribution [B, V] float32 of each row: penalties, min_tokens, then
    temperature/top-k/top-p/min-p; a greedy row is one-hot on its argmax. The sampler draws
    from exactly these probabilities."""
    x = process_logits(logits, rows)
    greedy = [i for i, r in enumerate(rows) if r.is_greedy]
    sampled = [i for i, r in enumerate(rows) if not r.is_greedy]
    if not greedy:
        return truncated_probs(x, [r.params for r in rows])
    probs = torch.zeros_like(x, dtype=torch.float32)
    g = _index(greedy, x.device)
    probs[g, x[g].argmax(dim=-1)] = 1.0
    if sampled:
        s = _index(sampled, x.device)
        probs[s] = truncated_probs(x[s], [rows[i].params for i in sampled])
    return probs


class Sampler:
    """Called by the engine once per step on the logits [B, V] of the rows that need a token."""

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed if seed is not None else secrets.randbits(63)
        self._generators: dict[torch.device, torch.Generator] = {}
        self._seeded: dict[torch.device, torch.Generator] = {}

    def _generator(self, cache: dict, device: torch.device) -> torch.Generator:
        gen = cache.get(device)
        if gen is None:
            gen = cache[device] = torch.Generator(device=device)
            gen.manual_seed(self._seed)
        return gen

    def draw(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """One token per row of `probs` [S, V] (float32, rows sum to 1; written over) by the
        exponential race. Seeded rows use `step_seed(seed, row.step)`; the rest share one
        generator."""
        dev = probs.device
        noise = torch.empty_like(probs)
        seeded = [(j, r.params.seed, r.step) for j, r in enumerate(rows) if r.params.seed is not None]
        if len(seeded) < len(rows):
            noise.exponential_(generator=self._generator(self._generators, dev))
        if seeded:
            gen = self._generator(self._seeded, dev)
            for j, seed, step in seeded:
                gen.manual_seed(step_seed(seed, step))
                noise[j].exponential_(generator=gen)
        # NOTE: E = 0 would turn a zero probability into 0/0 = NaN, which argmax picks.
        noise.clamp_(min=torch.finfo(torch.float32).tiny)
        return probs.div_(noise).argmax(dim=-1)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        x = process_logits(logits, rows)
        greedy = [i for i, r in enumerate(rows) if r.is_greedy]
        if len(greedy) == len(rows):
            token_ids = x.argmax(dim=-1)
        elif not greedy:
            token_ids = self.draw(truncated_probs(x, [r.params for r in rows]), rows)
        else:
            sampled = [i for i, r in enumerate(rows) if not r.is_greedy]
            g, s = _index(greedy, x.device), _index(sampled, x.device)
            s_rows = [rows[i] for i in sampled]
            token_ids = torch.empty(len(rows), dtype=torch.int64, device=x.device)
            token_ids[g] = x[g].argmax(dim=-1)
            token_ids[s] = self.draw(truncated_probs(x[s], [r.params for r in s_rows]), s_rows)
        return self._with_logprobs(logits, rows, token_ids)

    @staticmethod
    def _with_logprobs(
        logits: torch.Tensor, rows: list[SamplingRow], token_ids: torch.Tensor
    ) -> SamplerOutput:
        asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not asked:
            return SamplerOutput(token_ids, None, None, None, None)
        num_top = min(max(rows[i].params.logprobs for i in asked), logits.shape[1])
        if len(asked) == len(rows):
            lp = compute_logprobs(logits, token_ids, num_top)
            return SamplerOutput(token_ids, *lp)
        a = _index(asked, logits.device)
        lp = compute_logprobs(logits[a], token_ids[a], num_top)
        batch = len(rows)
        out = SamplerOutput(
            token_ids,
            lp.token_logprobs.new_zeros(batch),
            lp.ranks.new_zeros(batch),
            lp.topk_ids.new_zeros((batch, num_top)),
            lp.topk_logprobs.new_zeros((batch, num_top)),
        )
        out.logprobs[a] = lp.token_logprobs
        out.ranks[a] = lp.ranks
        out.topk_ids[a] = lp.topk_ids
        out.topk_logprobs[a] = lp.topk_logprobs
        return out
