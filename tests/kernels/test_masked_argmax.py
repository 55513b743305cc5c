"""`kernels.masked_argmax`: the twin gives each listed row's argmax over the tokens its bitmask
allows (ties to the lowest id, a partial last word, a mask narrower than the vocabulary, a mask
that allows nothing: token 0), from its own logits' row or another's, of these logits or another step's (`src`, `prev`), leaves the other rows' tokens alone and refuses what does not
fit; the Triton kernel equals the twin in triton's interpreter (CPU, CI) and on a CUDA
machine, on bfloat16 and float32 logits."""

from __future__ import annotations

import pytest
import torch

from kernels.masked_argmax import masked_argmax
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


def expected(x, bits, idx, out):
    out = out.clone()
    for r in idx.tolist():
        best, at = None, 0
        for t in range(x.shape[1]):
            w = t >> 5
            if w < bits.shape[1] and (int(bits[r, w]) >> (t & 31)) & 1:
                if best is None or float(x[r, t]) > best:
                    best, at = float(x[r, t]), t
        out[r] = at
    return out


@pytest.mark.parametrize("vocab,width", [(70, 3), (70, 2), (64, 2), (5, 1)])
def test_twin_takes_the_argmax_of_the_allowed_tokens(vocab, width):
    x, bits, idx = case(5, vocab, width, vocab + width)
    out = torch.full((5,), -7, dtype=torch.int64)
    want = expected(x, bits, idx, out)
    masked_argmax(x, bits, idx, out)
    assert torch.equal(out, want)
    assert (out == -7).sum() == 5 - idx.numel()  # rows not listed: untouched
    masked_argmax(x, bits, idx[:0], out)  # no row: nothing
    assert torch.equal(out, want)
    # other rows (`src`): of these logits, or of another step's (`prev`, another batch size)
    y = torch.cat([x.flip(0), x[:1]])
    out2 = torch.full((5,), -7, dtype=torch.int64)
    masked_argmax(y, bits, idx, out2, 4 - idx)
    assert torch.equal(out2, want)
    src = torch.where(idx % 2 == 0, idx, -(4 - idx) - 1)  # odd rows from prev's flipped rows
    out2.fill_(-7)
    masked_argmax(x, bits, idx, out2, src, y)
    assert torch.equal(out2, want)


def test_wrapper_refuses_what_does_not_fit():
    x, bits, idx = case(4, 70, 3, 0)
    out = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="do not fit"):
        masked_argmax(x, bits[:2], idx, out)
    with pytest.raises(ValueError, match="int32"):
        masked_argmax(x, bits.long(), idx, out)
    with pytest.raises(ValueError, match="int64"):
        masked_argmax(x, bits, idx, out.int())
    with pytest.raises(ValueError, match="do not fit"):
        masked_argmax(x, bits, idx, out, idx[:1])
    with pytest.raises(ValueError, match="do not fit"):
        masked_argmax(x, bits, idx, out, idx, x.double())


def test_kernel_equals_twin_in_the_interpreter():
    run_interpreted("""
import torch
from kernels.masked_argmax import masked_argmax
from tests.kernels.test_masked_argmax import case
for rows, vocab, width in ((3, 70, 3), (4, 4100, 120), (2, 9000, 300)):
    x, bits, idx = case(rows, vocab, width, vocab)
    a, b = torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64)
    masked_argmax(x, bits, idx, a, use_kernel=True)
    masked_argmax(x, bits, idx, b, use_kernel=False)
    assert torch.equal(a, b), (rows, vocab, width, a, b)
    src = torch.where(idx % 2 == 0, idx.flip(0), -idx - 1)
    prev = x.flip(0) + 1
    masked_argmax(x, bits, idx, a, src, prev, use_kernel=True)
    masked_argmax(x, bits, idx, b, src, prev, use_kernel=False)
    assert torch.equal(a, b), (rows, vocab, width, a, b)
print("ok")
""")


@pytest.mark.skipif(not CUDA, reason="the Triton kernel needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,vocab,width", [(32, 128256, 4008), (3, 151936, 4748),
                                              (7, 4097, 100), (1, 70, 3)])
def test_kernel_equals_twin(rows, vocab, width, dtype):
    x, bits, idx = case(rows, vocab, width, rows + vocab, dtype)
    x, bits, idx = x.cuda(), bits.cuda(), idx.cuda()
    a = torch.zeros(rows, dtype=torch.int64, device="cuda")
    b = a.clone()
    masked_argmax(x, bits, idx, a, use_kernel=True)
    masked_argmax(x, bits, idx, b, use_kernel=False)
    assert torch.equal(a, b)
    src = torch.where(idx % 2 == 0, idx.flip(0), -idx - 1)
    prev = x.flip(0) + 1
    masked_argmax(x, bits, idx, a, src, prev, use_kernel=True)
    masked_argmax(x, bits, idx, b, src, prev, use_kernel=False)
    assert torch.equal(a, b)
