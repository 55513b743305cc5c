"""`pd_kernels.masked_argmax`: the twin gives each row of work's argmax over the tokens its bitmask
allows but its banned ids (ties to the lowest id, a partial last word, a mask narrower than the
vocabulary, a mask that allows nothing: token 0), from its own logits' row or another's, of
these logits or another step's (`prev`), its mask from any row of the bitmask, leaves the other
rows' tokens alone and refuses what does not fit; the Triton kernel equals the twin in triton's
interpreter (CPU, CI) and on a CUDA machine, on bfloat16 and float32 logits."""

from __future__ import annotations

import pytest
import torch

from pd_kernels.masked_argmax import BANS, items, masked_argmax
from tests.kernels.interpreter import run_interpreted

CUDA = torch.cuda.is_available()


def case(rows: int, vocab: int, width: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # few distinct values: ties are common
    x = torch.randint(-4, 4, (rows, vocab), generator=g).to(dtype)
    bits = torch.randint(-2**31, 2**31 - 1, (rows, width), generator=g,
                         dtype=torch.int64).to(torch.int32)
    bits[0] = 0  # allows nothing
    idx = torch.randperm(rows, generator=g)[: max(1, rows - 1)]
    return x, bits, idx


def expected(x, bits, idx, out, bans=None):
    out = out.clone()
    for m, r in enumerate(idx.tolist()):
        best, at = None, 0
        for t in range(x.shape[1]):
            w = t >> 5
            if (w < bits.shape[1] and (int(bits[r, w]) >> (t & 31)) & 1
                    and t not in (bans[m] if bans else ())):
                if best is None or float(x[r, t]) > best:
                    best, at = float(x[r, t]), t
        out[r] = at
    return out


def nan_case(x, bits) -> None:
    """Poison x with NaN in place: a whole row; in another, some allowed and some refused
    columns (near the end: the last chunk's padding follows), the mask allowing a NaN column."""
    x[-1] = float("nan")
    if x.shape[0] > 1:
        cols = [2, x.shape[1] // 2, x.shape[1] - 2]
        x[-2, cols] = float("nan")
        bit = 1 << (cols[1] & 31)  # as an int32 word holds it
        bits[-2, cols[1] >> 5] |= bit - (1 << 32) if bit >= 1 << 31 else bit


def bans_for(x, idx, seed):
    """Up to BANS ids a row, among them often the row's own argmax."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for m, r in enumerate(idx.tolist()):
        n = int(torch.randint(0, BANS + 1, (1,), generator=g))
        ids = torch.randint(0, x.shape[1], (n,), generator=g).tolist()
        if m % 2 and n:
            ids[0] = int(x[r].argmax())
        out.append(ids)
    return out


@pytest.mark.parametrize("vocab,width", [(70, 3), (70, 2), (64, 2), (5, 1)])
def test_twin_takes_the_argmax_of_the_allowed_tokens(vocab, width):
    x, bits, idx = case(5, vocab, width, vocab + width)
    out = torch.full((5,), -7, dtype=torch.int64)
    want = expected(x, bits, idx, out)
    masked_argmax(x, bits, items(idx.tolist(), mask_rows=idx.tolist()), out)
    assert torch.equal(out, want)
    assert (out == -7).sum() == 5 - idx.numel()  # rows not listed: untouched
    masked_argmax(x, bits, items([]), out)  # no row: nothing
    assert torch.equal(out, want)
    # other rows: of these logits, or of another step's (`prev`, another batch size)
    y = torch.cat([x.flip(0), x[:1]])
    out2 = torch.full((5,), -7, dtype=torch.int64)
    masked_argmax(y, bits, items(idx.tolist(), (4 - idx).tolist(), idx.tolist()), out2)
    assert torch.equal(out2, want)
    src = torch.where(idx % 2 == 0, idx, -(4 - idx) - 1)  # odd rows from prev's flipped rows
    out2.fill_(-7)
    masked_argmax(x, bits, items(idx.tolist(), src.tolist(), idx.tolist()), out2, y)
    assert torch.equal(out2, want)
    # masks in the order of the work (row m of a packed bitmask), and banned ids
    bans = bans_for(x, idx, vocab)
    out2.fill_(-7)
    masked_argmax(x, bits[idx], items(idx.tolist(), bans=bans), out2)
    assert torch.equal(out2, expected(x, bits, idx, out, bans))


def test_wrapper_refuses_what_does_not_fit():
    x, bits, idx = case(4, 70, 3, 0)
    out = torch.zeros(4, dtype=torch.int64)
    work = items(idx.tolist())
    with pytest.raises(ValueError, match="do not fit"):
        masked_argmax(x, bits, work[:, :3], out)
    with pytest.raises(ValueError, match="int32"):
        masked_argmax(x, bits.long(), work, out)
    with pytest.raises(ValueError, match="int32"):
        masked_argmax(x, bits, work.long(), out)
    with pytest.raises(ValueError, match="int64"):
        masked_argmax(x, bits, work, out.int())
    with pytest.raises(ValueError, match="do not fit"):
        masked_argmax(x, bits, work, out, x.double())


def test_kernel_equals_twin_in_the_interpreter():
    run_interpreted("""
import torch
from pd_kernels.masked_argmax import items, masked_argmax
from tests.kernels.test_masked_argmax import bans_for, case, nan_case
for rows, vocab, width in ((3, 70, 3), (4, 4100, 120), (2, 9000, 300)):
    x, bits, idx = case(rows, vocab, width, vocab)
    a, b = torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64)
    work = items(idx.tolist(), mask_rows=idx.tolist())
    masked_argmax(x, bits, work, a, use_kernel=True)
    masked_argmax(x, bits, work, b, use_kernel=False)
    assert torch.equal(a, b), (rows, vocab, width, a, b)
    src = torch.where(idx % 2 == 0, idx.flip(0), -idx - 1)
    work = items(idx.tolist(), src.tolist(), list(range(len(idx)))[::-1], bans_for(x, idx, rows))
    prev = x.flip(0) + 1
    masked_argmax(x, bits, work, a, prev, use_kernel=True)
    masked_argmax(x, bits, work, b, prev, use_kernel=False)
    assert torch.equal(a, b), (rows, vocab, width, a, b)
    nan_case(x, bits)  # a NaN is the largest allowed value, as in the twin
    work = items(idx.tolist(), mask_rows=idx.tolist())
    masked_argmax(x, bits, work, a, use_kernel=True)
    masked_argmax(x, bits, work, b, use_kernel=False)
    assert torch.equal(a, b), ("nan", rows, vocab, width, a, b)
print("ok")
""")


@pytest.mark.skipif(not CUDA, reason="the Triton kernel needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,vocab,width", [(32, 128256, 4008), (3, 151936, 4748),
                                              (7, 4097, 100), (1, 70, 3)])
def test_kernel_equals_twin(rows, vocab, width, dtype):
    x, bits, idx = case(rows, vocab, width, rows + vocab, dtype)
    x, bits = x.cuda(), bits.cuda()
    a = torch.zeros(rows, dtype=torch.int64, device="cuda")
    b = a.clone()
    work = items(idx.tolist(), mask_rows=idx.tolist()).cuda()
    masked_argmax(x, bits, work, a, use_kernel=True)
    masked_argmax(x, bits, work, b, use_kernel=False)
    assert torch.equal(a, b)
    src = torch.where(idx % 2 == 0, idx.flip(0), -idx - 1)
    work = items(idx.tolist(), src.tolist(), list(range(len(idx)))[::-1],
                 bans_for(x.cpu(), idx, rows)).cuda()
    prev = x.flip(0) + 1
    masked_argmax(x, bits, work, a, prev, use_kernel=True)
    masked_argmax(x, bits, work, b, prev, use_kernel=False)
    assert torch.equal(a, b)
    nan_case(x, bits)
    work = items(idx.tolist(), mask_rows=idx.tolist()).cuda()
    masked_argmax(x, bits, work, a, use_kernel=True)
    masked_argmax(x, bits, work, b, use_kernel=False)
    assert torch.equal(a, b)
