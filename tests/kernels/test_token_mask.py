"""`pd_kernels.token_mask`: the twin masks exactly the tokens a bitmask refuses (a partial last
word, a mask narrower than the vocabulary, rows out of order, no row), the wrapper refuses
what does not fit; the Triton kernel equals the twin in triton's interpreter (CPU, CI) and on
a CUDA machine."""

from __future__ import annotations

import pytest
import torch

from pd_kernels.token_mask import apply_token_mask
from tests.kernels.interpreter import run_interpreted

CUDA = torch.cuda.is_available()


def case(rows: int, vocab: int, width: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    masked = torch.randperm(rows, generator=g)[: max(1, rows // 2)]
    bits = torch.randint(-2**31, 2**31 - 1, (masked.numel(), width), generator=g,
                         dtype=torch.int64).to(torch.int32)
    return x, bits, masked


def expected(x, bits, rows):
    out = x.clone()
    for m, r in enumerate(rows.tolist()):
        for t in range(x.shape[1]):
            w = t >> 5
            if w >= bits.shape[1] or not (int(bits[m, w]) >> (t & 31)) & 1:
                out[r, t] = -torch.inf
    return out


@pytest.mark.parametrize("vocab,width", [(70, 3), (70, 2), (64, 2), (5, 1)])
def test_twin_masks_exactly_the_refused_tokens(vocab, width):
    x, bits, rows = case(5, vocab, width, vocab + width)
    want = expected(x, bits, rows)
    apply_token_mask(x, bits, rows)
    assert torch.equal(x, want)
    y = x.clone()
    apply_token_mask(y, bits[:0], rows[:0])  # no row: nothing
    assert torch.equal(x, y)


def test_wrapper_refuses_what_does_not_fit():
    x, bits, rows = case(4, 70, 3, 0)
    with pytest.raises(ValueError, match="do not fit"):
        apply_token_mask(x, bits, rows[:1])
    with pytest.raises(ValueError, match="int32"):
        apply_token_mask(x, bits.long(), rows)
    with pytest.raises(ValueError, match="float32"):
        apply_token_mask(x.half(), bits, rows)


def test_kernel_equals_twin_in_the_interpreter():
    run_interpreted("""
import torch
from pd_kernels.token_mask import apply_token_mask
from tests.kernels.test_token_mask import case
for rows, vocab, width in ((3, 70, 3), (4, 4100, 120), (2, 9000, 300)):
    x, bits, idx = case(rows, vocab, width, vocab)
    a, b = x.clone(), x.clone()
    apply_token_mask(a, bits, idx, use_kernel=True)
    apply_token_mask(b, bits, idx, use_kernel=False)
    assert torch.equal(a, b), (rows, vocab, width)
print("ok")
""")


@pytest.mark.skipif(not CUDA, reason="the Triton kernel needs a CUDA device")
@pytest.mark.parametrize("rows,vocab,width", [(32, 128256, 4008), (3, 151936, 4748),
                                              (7, 4097, 100), (1, 70, 3)])
def test_kernel_equals_twin(rows, vocab, width):
    x, bits, idx = case(rows, vocab, width, rows + vocab)
    x, bits, idx = x.cuda(), bits.cuda(), idx.cuda()
    a, b = x.clone(), x.clone()
    apply_token_mask(a, bits, idx, use_kernel=True)
    apply_token_mask(b, bits, idx, use_kernel=False)
    assert torch.equal(a, b)
