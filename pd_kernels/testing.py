"""Fresh random inputs for comparing each kernel with its twin (tests on CPU, the GPU check in
`benchmarks/gpu/check_kernels.py`): never zeros, always with invalid (negative) slots, stopped
slots, prefill slots and slots with fewer drafts than k. Nothing here runs in serving."""

from __future__ import annotations

import torch


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _ints(g, low, high, shape):
    return torch.randint(low, high, shape, generator=g, dtype=torch.int64)


def verify_inputs(num_slots: int, k: int, vocab: int, seed: int, device="cpu") -> dict:
    g = _gen(seed)
    draft = _ints(g, 0, vocab, (num_slots, k))
    target = _ints(g, 0, vocab, (num_slots, k + 1))
    # make long exact-match runs common, so every accept count shows up
    agree = torch.rand(num_slots, k, generator=g) < 0.7
    target[:, :k] = torch.where(agree, draft, target[:, :k])
    out = dict(
        slot_index=torch.where(torch.rand(num_slots, generator=g) < 0.15, -1 - _ints(g, 0, 3, (num_slots,)),
                               torch.arange(num_slots)),
        num_drafts=_ints(g, 0, k + 1, (num_slots,)).to(torch.int32),
        draft_ids=draft, target_ids=target,
        draft_probs=torch.rand(num_slots, k, generator=g) * 0.9 + 0.1,
        target_probs=torch.rand(num_slots, k, generator=g),
        uniforms=torch.rand(num_slots, k, generator=g),
        greedy=(torch.rand(num_slots, generator=g) < 0.5).to(torch.int32),
    )
    return {n: t.to(device) for n, t in out.items()}


def status_inputs(num_slots: int, k: int, vocab: int, seed: int, device="cpu") -> dict:
    g = _gen(seed)
    k1 = k + 1
    num_stop = 3
    seq_lens = _ints(g, 5, 60, (num_slots,))
    out = dict(
        slot_index=torch.where(torch.rand(num_slots, generator=g) < 0.15, -1 - _ints(g, 0, 3, (num_slots,)),
                               torch.arange(num_slots)),
        accepted_ids=_ints(g, 0, vocab, (num_slots, k1)),
        num_accepted=_ints(g, 1, k1 + 1, (num_slots,)).to(torch.int32),
        seq_lens=seq_lens,
        num_outputs=_ints(g, 1, 5, (num_slots,)),
        max_seq_lens=seq_lens + _ints(g, 1, k1 + 3, (num_slots,)),
        min_tokens=_ints(g, 0, 8, (num_slots,)),
        stop_ids=torch.where(torch.rand(num_slots, num_stop, generator=g) < 0.2, -1,
                             _ints(g, 0, vocab, (num_slots, num_stop))),
        stop_flags=torch.where(torch.rand(num_slots, generator=g) < 0.15, 1, 0).to(torch.int32),
    )
    return {n: t.to(device) for n, t in out.items()}


def preprocess_inputs(num_slots: int, k: int, vocab: int, seed: int, block_size: int = 4,
                      device="cpu") -> dict:
    g = _gen(seed)
    kinds = _ints(g, 0, 3, (num_slots,)).to(torch.int32)
    q = torch.where(kinds == 0, k + 1, _ints(g, 1, 3 * block_size, (num_slots,)))
    cu = torch.zeros(num_slots + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(q, 0)
    num_tokens = int(cu[-1])
    starts = _ints(g, 0, 40, (num_slots,))
    positions = torch.cat([torch.arange(int(s), int(s) + int(n)) for s, n in zip(starts, q)])
    max_blocks = (int((starts + q).max()) + k) // block_size + 1
    out = dict(
        slot_index=torch.where(torch.rand(num_slots, generator=g) < 0.15, -1 - _ints(g, 0, 3, (num_slots,)),
                               torch.arange(num_slots)),
        cu_seqlens=cu,
        input_ids=_ints(g, 0, vocab, (num_tokens,)),
        positions=positions,
        accepted_ids=_ints(g, 0, vocab, (num_slots, k + 1)),
        num_accepted=_ints(g, 1, k + 2, (num_slots,)).to(torch.int32),
        slot_kind=kinds,
        # some tables one block short, so the beyond-the-table case shows up
        block_tables=_ints(g, 1, 10_000, (num_slots, max_blocks - int(torch.rand(1, generator=g) < 0.3))),
    )
    return {n: t.to(device) for n, t in out.items()}


def advance_inputs_inputs(num_slots: int, k: int, vocab: int, seed: int, block_size: int = 4,
                          device="cpu") -> dict:
    """A step's inputs in the graphs' layout and its packed result (`pd_kernels.advance_inputs`):
    invalid and stopped slots, kept counts 0 .. k + 1, length budgets that cut the drafts, and
    positions that reach past a short block table."""
    g = _gen(seed)
    k1 = k + 1
    width = 4
    start = _ints(g, 0, width * block_size - 1, (num_slots,))
    kept = _ints(g, 0, k1 + 1, (num_slots,))
    seq_lens = start + 1
    result = torch.cat([_ints(g, 0, vocab, (num_slots, k1)), kept[:, None],
                        _ints(g, 1, k1 + 1, (num_slots, 1)),
                        torch.where(torch.rand(num_slots, 1, generator=g) < 0.2, 1, 0),
                        _ints(g, 0, vocab, (num_slots, k))], dim=1)
    out = dict(
        result=result,
        input_ids=_ints(g, 0, vocab, (num_slots, k1)),
        positions=start[:, None] + torch.arange(k1)[None, :],
        slot_mapping=_ints(g, 0, 1000, (num_slots, k1)),
        context_lens=_ints(g, 1, 100, (num_slots, k1)),
        draft_ids=_ints(g, 0, vocab, (num_slots, k)),
        num_drafts=_ints(g, 0, k1, (num_slots,)),
        seq_lens=seq_lens,
        num_outputs=_ints(g, 1, 50, (num_slots,)),
        block_tables=_ints(g, 1, 10_000, (num_slots, width)),
        max_seq_lens=seq_lens + _ints(g, 0, 2 * k1 + 2, (num_slots,)),
        slot_index=torch.where(torch.rand(num_slots, generator=g) < 0.15, -1 - _ints(g, 0, 3, (num_slots,)),
                               torch.arange(num_slots)),
    )
    return {n: t.to(device) for n, t in out.items()}


def accept_step_inputs(num_slots: int, k: int, vocab: int, seed: int, block_size: int = 4,
                       device="cpu") -> dict:
    """A graphed MTP step's inputs (`pd_kernels.accept_step`): the verify inputs' runs and the
    status inputs' lengths and stops, int64 counts and flags, positions in the graphs' layout
    (rows past a slot's drafts at position 0) and tables too short for some chained positions."""
    x, st = verify_inputs(num_slots, k, vocab, seed), status_inputs(num_slots, k, vocab, seed + 1)
    g = _gen(seed + 2)
    k1, width = k + 1, 3
    start = _ints(g, 0, width * block_size, (num_slots,))
    rows = torch.arange(k1)[None, :]
    positions = torch.where(rows <= x["num_drafts"][:, None].long(), start[:, None] + rows, 0)
    out = dict(
        slot_index=x["slot_index"], num_drafts=x["num_drafts"].long(), draft_ids=x["draft_ids"],
        target_ids=x["target_ids"], target_probs=x["target_probs"], uniforms=x["uniforms"],
        greedy=x["greedy"].long(), seq_lens=st["seq_lens"], num_outputs=st["num_outputs"],
        max_seq_lens=st["max_seq_lens"], min_tokens=st["min_tokens"], stop_ids=st["stop_ids"],
        positions=positions, block_tables=_ints(g, 1, 10_000, (num_slots, width)),
    )
    return {n: t.to(device) for n, t in out.items()}
