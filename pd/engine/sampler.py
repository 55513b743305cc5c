"""The sampler: one batched pass from the logits of the rows that need a token to the token ids
(and raw logprobs when asked).

Order of work for each row (vLLM semantics):
1. logprobs/ranks/top-k of the RAW distribution, `log_softmax(logits)` in float32, before
   anything below (see `pd.engine.logprobs`); only when some row asked;
2. penalties: repetition (prompt + output tokens), then frequency and presence (output tokens);
   logit_bias;
3. min_tokens: EOS ids (unless ignore_eos) and stop_token_ids get -inf while fewer than
   min_tokens tokens were generated; a grammar's mask (structured output) gives -inf to every
   token it does not allow;
4. greedy rows (temperature < 1e-5, as vLLM) take the argmax, lowest id on ties;
5. sampled rows: temperature, top-k, top-p, min-p, then one draw from the result.

Truncations are thresholds on values, so tokens tied with the last kept one are kept too and a
row's distribution depends on that row alone, never on the batch around it. Draws use the
exponential race `argmax(probs / E)`, E ~ Exp(1): a token with probability 0 is never drawn.
A seeded row draws E from a generator seeded by `step_seed(seed, step)`, so its i-th token is a
pure function of (seed, i, its logits) on a given device type: the prefill node sampling token
0 and the decode node sampling the rest give what one process would. Unseeded rows share one
generator per device.

On CUDA nothing here waits for the device (parameter tensors go through pinned memory, no
shape depends on data), so the overlap loop can queue the next step behind the sampler.

`probs_after_processing` gives the final distribution of each row (steps 2-5) for rejection
sampling in speculative decoding; the sampler draws from exactly those probabilities.
Stop checks, detokenization and which rows need sampling are left to the engine/scheduler.
"""

from __future__ import annotations

import math
import secrets
from collections import Counter
from dataclasses import dataclass, field

import torch

from pd_kernels.argmax import argmax
from pd.engine.decode_inputs import GRAPH_BANS
from pd.engine.grammar_masks import apply_grammar
from pd.engine.host_ring import list_to_device
from pd.engine.logprobs import packed_logprobs
from pd.wire.sampling_params import SamplingParams

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
    # structured output: the tokens its grammar allows here, int32 bitmask words on the host
    # (`pd.engine.grammar.GrammarState.mask`); None: no grammar
    allowed: torch.Tensor | None = None
    # a grammar checked after sampling (`pd.engine.checked_grammar.CheckedSampling`): no mask this
    # step, and the row takes the argmax of its logits as a row without a grammar does
    checked: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.params.temperature < GREEDY_EPS

    @property
    def takes_argmax(self) -> bool:
        """Greedy on the raw logits but for its banned ids: no penalty or bias, no more than a
        decode graph's argmax passes over (`GRAPH_BANS`), and no logprobs while it has any (the
        argmax a decode graph takes, its bans written in the graph's inputs, is this row's
        token)."""
        p = self.params
        return (self.is_greedy
                and (self.step >= p.min_tokens
                     or p.logprobs is None and len(self.banned_token_ids) <= GRAPH_BANS)
                and (not p.processes_logits or (self.checked and not p.has_penalties
                                                and not p.logit_bias)))

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        """Ids masked at this position because fewer than min_tokens were generated."""
        return banned_token_ids(self.params, self.step, self.eos_token_ids)


def banned_token_ids(p: SamplingParams, step: int, eos_token_ids) -> tuple[int, ...]:
    """Ids masked at position `step` of a request's output because fewer than min_tokens were
    generated (`SamplingRow.banned_token_ids`)."""
    if step >= p.min_tokens:
        return ()
    if p.ignore_eos:
        return p.stop_token_ids
    return p.stop_token_ids + tuple(eos_token_ids) + p.extra_eos_token_ids


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    # None when no row asked for logprobs; else [B, 2 + 2K] float32 packed
    # (`pd.engine.logprobs.pack_logprobs`), K the most top columns any row asked; rows that did
    # not ask hold 0. The properties below read its columns (None likewise).
    packed: torch.Tensor | None = None

    @property
    def logprobs(self) -> torch.Tensor | None:  # [B] float32, raw logprob of the sampled token
        return None if self.packed is None else self.packed[:, 0]

    @property
    def ranks(self) -> torch.Tensor | None:  # [B] int64, 1 = argmax; tied tokens share a rank
        return None if self.packed is None else self.packed[:, 1].long()

    @property
    def topk_ids(self) -> torch.Tensor | None:  # [B, K] int64
        k = self._width()
        return None if k is None else self.packed[:, 2:2 + k].long()

    @property
    def topk_logprobs(self) -> torch.Tensor | None:  # [B, K] float32
        k = self._width()
        return None if k is None else self.packed[:, 2 + k:]

    def _width(self) -> int | None:
        return None if self.packed is None else (self.packed.shape[1] - 2) // 2


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def step_seed(seed: int, step: int) -> int:
    """Generator seed (63 bits) for a seeded request's draw at `step`."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64)) >> 1


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return list_to_device(rows, torch.int64, device)


def apply_penalties(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition, frequency and presence penalties, in place on float32 logits [B, V]:
    seen = prompt ∪ output: x = x / rp if x > 0 else x * rp;
    then x -= frequency * count(output) + presence * [count(output) > 0].
    Token sets and counts are made on the host; only the touched entries of `x` are read and
    written (work grows with the tokens, not with B * V)."""
    dev, vocab = x.device, x.shape[1]
    flat = x.view(-1)
    rep_keys, rep_vals, out_keys, out_vals = [], [], [], []
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            seen = set(r.prompt_token_ids)
            seen.update(r.output_token_ids)
            rep_keys += [i * vocab + t for t in seen]
            rep_vals += [p.repetition_penalty] * len(seen)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            for t, n in Counter(r.output_token_ids).items():
                out_keys.append(i * vocab + t)
                out_vals.append(p.frequency_penalty * n + p.presence_penalty)
    if rep_keys:
        keys, rp = _index(rep_keys, dev), list_to_device(rep_vals, torch.float32, dev)
        vals = flat[keys]
        flat[keys] = torch.where(vals > 0, vals / rp, vals * rp)
    if out_keys:
        keys = _index(out_keys, dev)
        flat[keys] -= list_to_device(out_vals, torch.float32, dev)


# the flat indices of a step's min_tokens bans on the device, by the bans and the stream (a
# batch's bans stay the same for its first min_tokens steps)
_BANS: dict[tuple, torch.Tensor] = {}
_MAX_BANS = 64


def apply_min_tokens(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """-inf on EOS / stop ids of rows still under min_tokens, in place on logits [B, V]. The
    indices are copied to the device once for a run of steps with the same bans (a copy
    through the staging buffers cost ~100 us of host a step on the H100 machine)."""
    bans = tuple(r.banned_token_ids for r in rows)
    if not any(bans):
        return
    # NOTE: by stream too: another stream must not read the index before its copy has landed
    stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
    key = (x.device, stream, x.shape[1], bans)
    index = _BANS.get(key)
    if index is None:
        vocab = x.shape[1]
        index = _index([i * vocab + t for i, banned in enumerate(bans) for t in banned], x.device)
        if len(_BANS) >= _MAX_BANS:
            _BANS.clear()
        _BANS[key] = index
    x.view(-1).index_fill_(0, index, -math.inf)  # scalar fill: no host wait


def apply_logit_bias(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Each row's logit_bias added to its logits, in place on [B, V] (ids past the vocabulary
    are left out: the router refuses them; a padded vocabulary may hold fewer)."""
    keys, vals, vocab = [], [], x.shape[1]
    for i, r in enumerate(rows):
        for t, b in r.params.logit_bias:
            if t < vocab:
                keys.append(i * vocab + t)
                vals.append(b)
    if keys:
        x.view(-1).index_add_(0, _index(keys, x.device), list_to_device(vals, torch.float32, x.device))


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Float32 logits after penalties, logit_bias, min_tokens and grammars. `logits` is never
    written: a copy is made when a row needs any; otherwise the result may share memory with
    `logits`."""
    if not any(r.params.processes_logits or r.step < r.params.min_tokens for r in rows):
        return logits.float()
    x = logits.to(torch.float32, copy=True, memory_format=torch.contiguous_format)
    apply_penalties(x, rows)
    apply_logit_bias(x, rows)
    apply_min_tokens(x, rows)
    apply_grammar(x, rows)
    return x


TOP_P_CANDIDATES = 256  # top-p looks for its cut among this many largest logits first


def _top_p_threshold(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[S, 1]: the smallest logit top-p keeps in each row of `x` [S, V] (-inf where
    top_p == 1): the shortest prefix of the sorted row whose mass reaches top_p."""
    vocab = x.shape[1]
    lse = x.logsumexp(dim=-1, keepdim=True)
    p = top_p.unsqueeze(1)

    def cut(ordered: torch.Tensor, lse: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        probs = (ordered - lse).exp()
        num_keep = ((probs.cumsum(dim=-1) - probs) < p).sum(dim=-1, keepdim=True)
        return num_keep.clamp(min=1)

    # NOTE: the candidate count is fixed, so whether a row needs the full sort depends on that
    # row alone, and its cut never on the batch.
    # On CUDA every row is sorted: sorting is cheap there and needs no wait for a row count.
    num_candidates = vocab if x.is_cuda else min(vocab, TOP_P_CANDIDATES)
    if num_candidates == vocab:
        ordered = x.sort(dim=-1, descending=True).values
    else:
        ordered = x.topk(num_candidates, dim=-1).values
    num_keep = cut(ordered, lse, p)
    thr = ordered.gather(1, num_keep - 1)
    if num_candidates < vocab:
        short = ((num_keep.squeeze(1) == num_candidates) & (top_p < 1.0)).nonzero().squeeze(1)
        if short.numel():
            full = x[short].sort(dim=-1, descending=True).values
            thr[short] = full.gather(1, cut(full, lse[short], p[short]) - 1)
    # NOTE: top_p == 1 keeps the whole row outright: a cumsum rounding to 1 early would
    # otherwise drop tail tokens depending on float error.
    return torch.where(p >= 1.0, -math.inf, thr)


def truncated_logits(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Tempered logits [S, V] of sampled rows (temperature >= GREEDY_EPS), -inf on every token
    that top-k, top-p or min-p drops; `x` [S, V] holds their processed logits (not written).
    Each truncation keeps the tokens whose logit is >= the row's threshold (ties are kept):
    top-k: the k-th largest; top-p: the smallest prefix of the sorted row (after top-k) whose
    mass reaches top_p; min-p: max + log(min_p), i.e. p >= min_p * p_max."""
    dev, vocab = x.device, x.shape[1]
    cols = list_to_device(
        [[p.temperature, p.top_p, p.min_p, p.top_k if 0 < p.top_k < vocab else 0] for p in params],
        torch.float32, dev,
    )  # [S, 4]
    x = x / cols[:, 0:1]  # a new tensor: everything below is in place on it
    max_k = max((p.top_k for p in params if 0 < p.top_k < vocab), default=0)
    if max_k:
        top_k = cols[:, 3:4].to(torch.int64)
        kth = x.topk(max_k, dim=-1).values.gather(1, (top_k - 1).clamp(min=0))
        x.masked_fill_(x < torch.where(top_k > 0, kth, -math.inf), -math.inf)
    thr = None
    if any(p.top_p < 1.0 for p in params):
        thr = _top_p_threshold(x, cols[:, 1])
    if any(p.min_p > 0.0 for p in params):
        # min-p compares with the row's max, which top-k and top-p always keep
        floor = x.amax(dim=-1, keepdim=True) + torch.log(cols[:, 2:3])  # log(0) = -inf: off
        thr = floor if thr is None else torch.maximum(thr, floor)
    if thr is not None:
        x.masked_fill_(x < thr, -math.inf)
    return x


def truncated_probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Sampling distribution [S, V] float32 of sampled rows: softmax of `truncated_logits`."""
    return truncated_logits(x, params).softmax(dim=-1)


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
    probs[g] = torch.zeros_like(probs[g]).scatter_(1, x[g].argmax(dim=-1, keepdim=True), 1.0)
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
            noise.uniform_(generator=self._generator(self._generators, dev))
        if seeded:
            gen = self._generator(self._seeded, dev)
            for j, seed, step in seeded:
                gen.manual_seed(step_seed(seed, step))
                noise[j].uniform_(generator=gen)
        # NOTE: E = -log(U) ~ Exp(1) with U in [0, 1): E > 0, so 0 / E = 0 and no NaN appears.
        return probs.div_(noise.log_().neg_()).argmax(dim=-1)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        x = process_logits(logits, rows)
        greedy = [i for i, r in enumerate(rows) if r.is_greedy]
        if len(greedy) == len(rows):
            token_ids = argmax(x)
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
            return SamplerOutput(token_ids)
        num_top = min(max(rows[i].params.logprobs for i in asked), logits.shape[1])
        if len(asked) == len(rows):
            return SamplerOutput(token_ids, packed_logprobs(logits, token_ids, num_top))
        a = _index(asked, logits.device)
        packed = packed_logprobs(logits[a], token_ids[a], num_top)
        out = packed.new_zeros((len(rows), packed.shape[1]))
        out[a] = packed
        return SamplerOutput(token_ids, out)
