"""Logprobs of the model's raw next-token distribution: the sampled token's logprob and rank,
and the top-k alternatives.

Everything here is computed from `log_softmax(logits)` in float32, BEFORE penalties,
temperature and top-k/top-p/min-p truncation (vLLM's "raw" logprobs): what a client sees is
what the model predicted, not the distribution the token was drawn from.

Ties are resolved so that P and D (and a brute-force reference) agree exactly:
- rank = 1 + the number of tokens with a strictly greater logprob (tied tokens share a rank);
- top-k lists tokens by descending logprob, the lowest token id first among equal logprobs
  (the order of `torch.argmax`).

On the device a step's logprobs travel packed, one float32 row per sampled token
(`pack_logprobs`: token logprob, rank, K top ids, K top logprobs), so that one copy brings
them to the host. Which rows asked, and packing the result on the wire (the header word's
top-k count), is left to the sampler and to the message code.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pd_kernels.token_logprob import token_logprob

MAX_PACKED_VOCAB = 1 << 24  # ids and ranks travel as float32 (`pack_logprobs`): exact below this


class Logprobs(NamedTuple):
    token_logprobs: torch.Tensor  # [B] float32
    ranks: torch.Tensor  # [B] int64, 1-based
    topk_ids: torch.Tensor  # [B, K] int64
    topk_logprobs: torch.Tensor  # [B, K] float32


def _order_key(x: torch.Tensor) -> torch.Tensor:
    """An int64 key per element, ordered like the float32 values of `x` and, among equal
    values, larger for a lower column index. All keys of a row are distinct."""
    bits = (x + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    # NOTE: flipping the magnitude bits of negative floats makes signed int order equal float
    # order (for every non-NaN value).
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    vocab = x.shape[-1]
    tiebreak = torch.arange(vocab - 1, -1, -1, device=x.device, dtype=torch.int64)
    return ordered * (1 << 32) + tiebreak


def _topk_by_key(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, pos = torch.topk(_order_key(x), k, dim=-1, sorted=True)
    return x.gather(-1, pos), pos


def topk_lowest_id(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`k` values and column ids of each row of float32 `x`, descending, ties broken by
    the lowest id. Returns ([B, k] float32, [B, k] int64); k = 0 gives empty columns."""
    batch, vocab = x.shape
    if k == 0:
        empty = x.new_empty((batch, 0))
        return empty, empty.to(torch.int64)
    if k >= vocab or x.is_cuda:  # on CUDA the exact path is cheap and needs no host wait
        return _topk_by_key(x, k)
    values, ids = torch.topk(x, k + 1, dim=-1, sorted=True)
    # NOTE: torch.topk orders ties arbitrarily. A row with no two equal values among its top
    # k + 1 has no tie inside its top k nor across its boundary: its result is exact. Only the
    # other rows (rare in float32, common with bf16 logits) take the exact, slower key path.
    tied = (values[:, 1:] == values[:, :-1]).any(dim=-1)
    values, ids = values[:, :k], ids[:, :k]
    if bool(tied.any()):
        rows = tied.nonzero().squeeze(1)
        values[rows], ids[rows] = _topk_by_key(x[rows], k)
    return values, ids


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> Logprobs:
    """Raw logprobs for each row of `logits` [B, V] (any float dtype) and its chosen token
    `token_ids` [B], with `num_top` (0..V) top-k columns."""
    if not 0 <= num_top <= logits.shape[-1]:
        raise ValueError(f"num_top={num_top} must be in [0, {logits.shape[-1]}]")
    lp = torch.log_softmax(logits.float(), dim=-1)
    tok = lp.gather(-1, token_ids.view(-1, 1))  # [B, 1]
    ranks = (lp > tok).sum(dim=-1) + 1
    top_lp, top_ids = topk_lowest_id(lp, num_top)
    return Logprobs(tok.view(-1), ranks, top_ids, top_lp)


def pack_logprobs(lp: Logprobs) -> torch.Tensor:
    """[B, 2 + 2K] float32: token logprob, rank, K top ids, K top logprobs, for one host copy.
    Ids and ranks are exact below `MAX_PACKED_VOCAB` (the runner refuses larger vocabularies)."""
    return torch.cat([lp.token_logprobs[:, None], lp.ranks[:, None].float(), lp.topk_ids.float(),
                      lp.topk_logprobs], dim=1)


def packed_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> torch.Tensor:
    """`compute_logprobs` packed (`pack_logprobs`); with no top columns `pd_kernels.token_logprob`,
    one kernel and no [B, V] temporaries."""
    if num_top == 0:
        return token_logprob(logits, token_ids)
    return pack_logprobs(compute_logprobs(logits, token_ids, num_top))


PROMPT_LOGITS_ROWS = 1024  # prompt positions whose logits are formed at once


def prompt_spans(reqs, num_new_tokens) -> list[tuple]:
    """The prompt positions of a step whose next-token logprobs are asked
    (`params.prompt_logprobs`) and not yet known: (request, its first row in the step's tokens,
    first position, count) per request. A position p scores prompt token p + 1; positions done
    before (a preempted request computed again) are skipped."""
    spans, offset = [], 0
    for req, n in zip(reqs, num_new_tokens):
        if req.params.prompt_logprobs is not None:
            start = req.num_computed_tokens
            first = max(start, len(req.prompt_logprobs))
            end = min(start + n, req.num_prompt_tokens - 1)
            if end > first:
                spans.append((req, offset + first - start, first, end - first))
        offset += n
    return spans


def record_prompt_logprobs(compute_logits, hidden: torch.Tensor, spans: list[tuple]) -> None:
    """Append each span's prompt logprobs to its request (`Req.prompt_logprobs`: logprob,
    rank, top list per position), from the step's hidden states [T, H]. Reads them back to the
    host: a step that asks for prompt logprobs waits for its forward."""
    for req, row, first, count in spans:
        k = req.params.prompt_logprobs
        for a in range(0, count, PROMPT_LOGITS_ROWS):
            b = min(count, a + PROMPT_LOGITS_ROWS)
            logits = compute_logits(hidden[row + a:row + b])
            ids = torch.tensor(req.prompt_token_ids[first + a + 1:first + b + 1],
                               dtype=torch.int64, device=hidden.device)
            lp = compute_logprobs(logits, ids, min(k, logits.shape[-1]))
            for v, rank, top_ids, top_lps in zip(lp.token_logprobs.tolist(), lp.ranks.tolist(),
                                                 lp.topk_ids.tolist(), lp.topk_logprobs.tolist()):
                req.prompt_logprobs.append((v, rank, list(zip(top_ids, top_lps))))

