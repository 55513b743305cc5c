"""Evaluation of a `tools/tiny_lm.TinyLM` on held-out text: per-token loss, greedy completions,
and greedy MTP speculative decoding (draft k tokens with the chained MTP layer, verify them
with one target forward, keep the exact-match prefix plus the target's own next token).

Everything is full recompute without a KV cache: simple and exact, fast enough for a model this
small. The serving engine's paged, cached version of the same loop lives elsewhere.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


@torch.no_grad()
def heldout_loss(model, ids: torch.Tensor, seq_len: int, batch_size: int, max_tokens: int):
    """Mean next-token and MTP level-1 cross entropy over non-overlapping windows of `ids`."""
    n = min(len(ids) - 2, max_tokens) // seq_len
    if n == 0:
        raise ValueError(f"held-out text has {len(ids)} tokens, fewer than one window of {seq_len}")
    total_lm = total_mtp = 0.0
    for start in range(0, n, batch_size):
        rows = torch.stack([ids[j * seq_len:(j + 1) * seq_len + 2]
                            for j in range(start, min(n, start + batch_size))])
        h = model.hidden(rows[:, :seq_len])
        lm = F.cross_entropy(model.logits(h).flatten(0, 1).float(),
                             rows[:, 1:seq_len + 1].flatten(), reduction="sum")
        (o,) = model.mtp_levels(h, lambda m, _: rows[:, 1:seq_len + 1], 1)
        mtp = F.cross_entropy(model.logits(o).flatten(0, 1).float(),
                              rows[:, 2:seq_len + 2].flatten(), reduction="sum")
        total_lm, total_mtp = total_lm + lm.item(), total_mtp + mtp.item()
    tokens = n * seq_len
    return {"tokens": tokens, "loss": total_lm / tokens, "perplexity": math.exp(total_lm / tokens),
            "mtp_loss": total_mtp / tokens}


def _target_greedy(model, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids], device=model.model.embed_tokens.weight.device)
    return model.logits(model.hidden(x))[0].argmax(-1)


@torch.no_grad()
def greedy(model, prompt: list[int], max_new: int, eos_ids: set[int]) -> list[int]:
    ids = list(prompt)
    for _ in range(max_new):
        nxt = int(_target_greedy(model, ids)[-1])
        ids.append(nxt)
        if nxt in eos_ids:
            break
    return ids[len(prompt):]


def draft(model, ids: list[int], k: int) -> list[int]:
    """k chained MTP drafts after `ids`, whose last token is the newest verified one."""
    x = torch.tensor([ids], device=model.model.embed_tokens.weight.device)
    h = model.hidden(x[:, :-1])
    outs = model.mtp_levels(
        h, lambda m, prev: x[:, 1:] if m == 1 else model.logits(prev).argmax(-1), k)
    return [int(model.logits(o[:, -1]).argmax(-1)) for o in outs]


@torch.no_grad()
def speculative(model, prompt: list[int], k: int, max_new: int, eos_ids: set[int]):
    """Greedy draft-then-verify decoding. Returns (new ids, tokens gained per verify step)."""
    ids = list(prompt)
    ids.append(int(_target_greedy(model, ids)[-1]))  # the prefill step's token
    per_step = []
    while len(ids) - len(prompt) < max_new and ids[-1] not in eos_ids:
        d = draft(model, ids, k)
        g = _target_greedy(model, ids + d)[len(ids) - 1:].tolist()  # g[j] follows d[:j]
        a = 0
        while a < k and d[a] == g[a]:
            a += 1
        gained = d[:a] + [g[a]]
        per_step.append(len(gained))
        ids.extend(gained)
    new = ids[len(prompt):]
    for j, t in enumerate(new):
        if t in eos_ids:
            new = new[:j + 1]
            break
    return new[:max_new], per_step


def acceptance(model, prompts: list[list[int]], ks, max_new: int, eos_ids: set[int]) -> dict:
    """Per k: mean tokens per verify step (accepted drafts + 1), the accepted share of drafts,
    the share of steps whose j-th draft was accepted, and whether every speculative output
    equalled plain greedy decoding."""
    plain = [greedy(model, p, max_new, eos_ids) for p in prompts]
    result = {}
    for k in ks:
        steps, same = [], True
        for p, ref in zip(prompts, plain):
            out, per_step = speculative(model, p, k, max_new, eos_ids)
            steps += per_step
            same = same and out == ref
        mean = sum(steps) / max(1, len(steps))
        result[str(k)] = {
            "verify_steps": len(steps),
            "mean_tokens_per_step": round(mean, 4),
            "mean_accepted_drafts": round(mean - 1, 4),
            "accepted_fraction": round((mean - 1) / k, 4),
            "acceptance_by_position": [round(sum(s > j for s in steps) / max(1, len(steps)), 4)
                                       for j in range(1, k + 1)],
            "matches_greedy": same,
        }
    return result
