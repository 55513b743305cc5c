"""The torch twins of the MTP kernels against slot-by-slot Python references, on fresh random
inputs with invalid, stopped and prefill slots, k = 1..4. (Kernel vs twin on a GPU is
`benchmarks/gpu/check_kernels.py`; on CPU the wrappers run the twins, which are tested here.)"""

from __future__ import annotations

import pytest
import torch

from pd_kernels import draft_preprocess, update_status, verify_accept
from pd_kernels.accept_step import accept_step
from pd_kernels.advance_inputs import advance_inputs
from pd_kernels.testing import (accept_step_inputs, advance_inputs_inputs, preprocess_inputs,
                             status_inputs, verify_inputs)

CASES = [(k, b, seed) for k in (1, 2, 3, 4) for b, seed in ((1, 0), (7, 1), (64, 2))]


def _accepted(x: dict, b: int, draft_probs: torch.Tensor | None = None) -> int:
    """Slot b's accepted drafts, draft by draft: a greedy slot's while they equal the target's,
    a sampled slot's while u * q < p (q 1 without `draft_probs`)."""
    d, t = x["draft_ids"][b].tolist(), x["target_ids"][b].tolist()
    a = 0
    while a < int(x["num_drafts"][b]):
        q = 1.0 if draft_probs is None else draft_probs[b, a]
        if not (d[a] == t[a] if x["greedy"][b]
                else float(x["uniforms"][b, a] * q) < float(x["target_probs"][b, a])):
            break
        a += 1
    return a


@pytest.mark.parametrize("k,num_slots,seed", CASES)
def test_verify_accept(k, num_slots, seed):
    x = verify_inputs(num_slots, k, vocab=7, seed=seed)
    acc, num = verify_accept(**x)
    for b in range(num_slots):
        if x["slot_index"][b] < 0:
            assert num[b] == 0 and (acc[b] == -1).all()
            continue
        d, t = x["draft_ids"][b].tolist(), x["target_ids"][b].tolist()
        a = _accepted(x, b, x["draft_probs"])
        want = d[:a] + [t[a]] + [-1] * (k - a)
        assert acc[b].tolist() == want and int(num[b]) == a + 1


def _status_reference(x, b):
    n = int(x["num_accepted"][b])
    length, outs = int(x["seq_lens"][b]), int(x["num_outputs"][b])
    stops = [s for s in x["stop_ids"][b].tolist() if s >= 0]
    for j in range(n):
        tok = int(x["accepted_ids"][b, j])
        length, outs = length + 1, outs + 1
        if outs >= int(x["min_tokens"][b]) and tok in stops:
            return j + 1, length, outs, 1
        if length >= int(x["max_seq_lens"][b]):
            return j + 1, length, outs, 2
    return n, length, outs, 0


@pytest.mark.parametrize("k,num_slots,seed", CASES)
def test_update_status(k, num_slots, seed):
    x = status_inputs(num_slots, k, vocab=5, seed=seed)
    before = {n: t.clone() for n, t in x.items()}
    flag = update_status(**x)
    flags, running = [], False
    for b in range(num_slots):
        skip = before["slot_index"][b] < 0 or before["stop_flags"][b] != 0
        got = (int(x["num_accepted"][b]), int(x["seq_lens"][b]), int(x["num_outputs"][b]),
               int(x["stop_flags"][b]))
        if skip:
            want = tuple(int(before[n][b]) for n in ("num_accepted", "seq_lens", "num_outputs", "stop_flags"))
        else:
            want = _status_reference(before, b)
            running |= want[3] == 0
        assert got == want, b
        flags.append(got[3])
    assert int(flag[0]) == int(running)
    assert {1, 2} & set(flags) or num_slots < 8  # stops do happen in the larger cases


@pytest.mark.parametrize("k,num_slots,seed", CASES)
def test_draft_preprocess(k, num_slots, seed):
    bs = 4
    x = preprocess_inputs(num_slots, k, vocab=50, seed=seed, block_size=bs)
    ids, rows, pos, slots = draft_preprocess(**x, block_size=bs, num_chain=k - 1)
    cu, inp = x["cu_seqlens"].tolist(), x["input_ids"].tolist()
    for b in range(num_slots):
        s, e = cu[b], cu[b + 1]
        if x["slot_index"][b] < 0:
            assert (ids[s:e] == 0).all() and rows[b] == 0 and pos[b] == 0 and (slots[b] == -1).all()
            continue
        acc, kind = x["accepted_ids"][b].tolist(), int(x["slot_kind"][b])
        if kind == 0:
            n = min(max(int(x["num_accepted"][b]), 1), e - s)
            want = [acc[min(j, n - 1)] for j in range(e - s)]
            row = s + n - 1
        else:
            want = inp[s + 1:e] + [acc[0]]
            row = e - 1
        assert ids[s:e].tolist() == want and int(rows[b]) == row
        p0 = int(x["positions"][row]) + 1
        assert int(pos[b]) == p0
        table = x["block_tables"][b].tolist()
        for m in range(k - 1):
            p = p0 + m
            want_slot = -1 if kind == 2 or p // bs >= len(table) else table[p // bs] * bs + p % bs
            assert int(slots[b, m]) == want_slot


@pytest.mark.parametrize("k,num_slots,seed", CASES)
def test_advance_inputs(k, num_slots, seed):
    bs, spare = 4, 7 * 4
    x = advance_inputs_inputs(num_slots, k, vocab=50, seed=seed, block_size=bs)
    before = {n: t.tolist() for n, t in x.items()}
    advance_inputs(**x, block_size=bs, spare_slot=spare)
    k1, live_seen = k + 1, 0
    for b in range(num_slots):
        r = before["result"][b]
        acc, kept, flag, drafts = r[:k1], r[k1], r[k1 + 2], r[k1 + 3:]
        seq = before["seq_lens"][b] + kept
        live = before["slot_index"][b] >= 0 and flag == 0
        live_seen += live
        nd = min(k, max(0, before["max_seq_lens"][b] - seq - 1)) if live else 0
        start = before["positions"][b][0] + kept
        table = before["block_tables"][b]
        rows = [(acc[max(kept - 1, 0)] if j == 0 else drafts[j - 1], start + j,
                 table[min((start + j) // bs, len(table) - 1)] * bs + (start + j) % bs, start + j + 1)
                if live and j <= nd else (0, 0, spare, 1) for j in range(k1)]
        got = list(zip(*(x[n][b].tolist() for n in ("input_ids", "positions", "slot_mapping",
                                                    "context_lens"))))
        assert got == rows, b
        assert x["draft_ids"][b].tolist() == [drafts[j] if j < nd else 0 for j in range(k)]
        assert int(x["num_drafts"][b]) == nd and int(x["seq_lens"][b]) == seq
        assert int(x["num_outputs"][b]) == before["num_outputs"][b] + kept
        assert int(x["slot_index"][b]) == (before["slot_index"][b] if live else -1)
    assert live_seen or num_slots < 7


@pytest.mark.parametrize("k,num_slots,seed", CASES)
def test_accept_step(k, num_slots, seed):
    bs, spare = 4, 9 * 4
    x = accept_step_inputs(num_slots, k, vocab=6, seed=seed, block_size=bs)
    before = {n: t.clone() for n, t in x.items()}
    result, ids, rows, pos, slots = accept_step(**x, block_size=bs, spare_slot=spare)
    assert all(torch.equal(x[n], before[n]) for n in x)  # the inputs are left as they were
    k1, flags = k + 1, set()
    for b in range(num_slots):
        s = b * k1
        got_slots = slots[:, b].tolist()
        if x["slot_index"][b] < 0:
            assert result[b, :k1 + 3].tolist() == [-1] * k1 + [0, 0, 0]
            assert ids[s:s + k1].tolist() == [0] * k1 and int(rows[b]) == 0
            assert pos[:, b].tolist() == list(range(k)) and got_slots == [spare] * (k - 1)
            continue
        d, t = x["draft_ids"][b].tolist(), x["target_ids"][b].tolist()
        a = _accepted(x, b)  # every draft probability 1
        run = d[:a] + [t[a]]
        stops = [v for v in x["stop_ids"][b].tolist() if v >= 0]
        length, outs, kept, flag = int(x["seq_lens"][b]), int(x["num_outputs"][b]), len(run), 0
        for j, tok in enumerate(run):
            length, outs = length + 1, outs + 1
            flag = 1 if outs >= int(x["min_tokens"][b]) and tok in stops else (
                2 if length >= int(x["max_seq_lens"][b]) else 0)
            if flag:
                kept = j + 1
                break
        flags.add(flag)
        assert result[b, :k1 + 3].tolist() == run + [-1] * (k - a) + [kept, a + 1, flag], b
        assert ids[s:s + k1].tolist() == [run[min(j, a)] for j in range(k1)]
        assert int(rows[b]) == s + a
        p0 = int(x["positions"][b, a]) + 1
        assert pos[:, b].tolist() == [p0 + m for m in range(k)]
        table = x["block_tables"][b].tolist()
        assert got_slots == [table[(p0 + m) // bs] * bs + (p0 + m) % bs
                             if (p0 + m) // bs < len(table) else spare for m in range(k - 1)]
    assert {1, 2} <= flags or num_slots < 64  # both kinds of stop in the large cases


def test_wrappers_refuse_bad_inputs():
    x = verify_inputs(4, 2, vocab=7, seed=3)
    with pytest.raises(TypeError, match="num_drafts"):
        verify_accept(**{**x, "num_drafts": x["num_drafts"].long()})
    with pytest.raises(ValueError, match="target_ids"):
        verify_accept(**{**x, "target_ids": x["target_ids"][:, :2].contiguous()})
    with pytest.raises(ValueError, match="contiguous"):
        verify_accept(**{**x, "draft_ids": x["draft_ids"].t().contiguous().t()})
    y = status_inputs(4, 2, vocab=5, seed=3)
    with pytest.raises(TypeError, match="stop_flags"):
        update_status(**{**y, "stop_flags": y["stop_flags"].long()})
    z = advance_inputs_inputs(4, 2, vocab=5, seed=3)
    with pytest.raises(ValueError, match="seq_lens"):
        advance_inputs(**{**z, "seq_lens": z["seq_lens"][:2]}, block_size=4, spare_slot=0)


def test_no_cupy_import_on_cpu():
    import sys

    import pd_kernels  # noqa: F401
    x = verify_inputs(3, 2, vocab=7, seed=4)
    verify_accept(**x)
    assert "cupy" not in sys.modules or torch.cuda.is_available()
