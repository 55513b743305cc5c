"""`pd_kernels.argmax`: the wrapper's checks and `out=` on CPU (the twin), the twin's banned ids
against a brute-force reference, the kernels with banned ids in triton's interpreter (CPU, CI),
and the Triton kernels against the twin on a CUDA machine: fresh random rows with ties planted
across chunk borders, rows of -inf, poisoned outputs, banned ids, rows of NaN (those in the
interpreter too; skipped without CUDA; `benchmarks/gpu/run_all.sh` runs them)."""

from __future__ import annotations

import pytest
import torch

from pd_kernels.argmax import CHUNK, argmax
from tests.kernels.interpreter import run_interpreted

CUDA = torch.cuda.is_available()


def rows_with_ties(num_rows: int, vocab: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """Random rows; in every other row the max is planted at 2-3 columns, some on either side of
    a chunk border, so the lowest of them must win."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, vocab, generator=g)
    for r in range(0, num_rows, 2):
        top = x[r].max() + 1.0
        cols = torch.randint(0, vocab, (3,), generator=g).tolist()
        if vocab > CHUNK + 1:
            cols[0] = CHUNK - 1 + (r % 3)  # at, before or after the first border
        x[r, cols] = top
    return x.to(device, dtype)


def test_twin_writes_out_and_refuses_bad_shapes():
    x = rows_with_ties(5, 300, torch.float32, "cpu", 0)
    out = torch.full((5,), -7, dtype=torch.int64)
    assert argmax(x, out=out) is out
    assert torch.equal(out, x.argmax(dim=-1))
    wide = torch.full((5, 4), -7, dtype=torch.int64)
    argmax(x, out=wide[:, 2])  # a column of a wider result
    assert torch.equal(wide[:, 2], x.argmax(dim=-1)) and (wide[:, [0, 1, 3]] == -7).all()
    with pytest.raises(ValueError, match="rows, columns"):
        argmax(x[0])
    with pytest.raises(ValueError, match="does not fit"):
        argmax(x, out=torch.empty(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="does not fit"):
        argmax(x, out=torch.empty(5, dtype=torch.int32))


def bans_for(x: torch.Tensor, seed: int) -> torch.Tensor:
    """[B, 3] banned ids: each row's own argmax (so its token moves), a random id, -1 padding,
    in a changing order; a row with none."""
    g = torch.Generator().manual_seed(seed)
    top = x.float().argmax(dim=-1).cpu()
    other = torch.randint(0, x.shape[1], (x.shape[0],), generator=g)
    bans = torch.stack([top, other, torch.full_like(top, -1)], 1)
    bans = bans[:, torch.randperm(3, generator=g)]
    bans[0] = -1
    return bans.to(x.device)


def expected_with_bans(x: torch.Tensor, bans: torch.Tensor) -> torch.Tensor:
    want = []
    for r in range(x.shape[0]):
        row = x[r].float().clone()
        for t in bans[r].tolist():
            if t >= 0:
                row[t] = float("-inf")
        want.append(int(row.argmax()))
    return torch.tensor(want, device=x.device)


def test_twin_passes_over_banned_ids():
    x = rows_with_ties(6, 300, torch.float32, "cpu", 1)
    bans = bans_for(x, 1)
    bans[1, 0] = 0  # a ban of column 0
    want = expected_with_bans(x, bans)
    assert torch.equal(argmax(x, bans=bans), want)
    assert not torch.equal(want, x.argmax(dim=-1))  # the bans moved some tokens
    past = bans.clone()
    past[past < 0] = x.shape[1] + 5  # an id past the vocabulary bans nothing (as the kernel)
    assert torch.equal(argmax(x, bans=past), want)
    with pytest.raises(ValueError, match="bans"):
        argmax(x, bans=bans[:2])
    with pytest.raises(ValueError, match="bans"):
        argmax(x, bans=bans.int())


def test_kernels_pass_over_banned_ids_in_the_interpreter():
    run_interpreted("""
import torch
from pd_kernels.argmax import argmax
from tests.kernels.test_argmax import bans_for, expected_with_bans, rows_with_ties
for rows, vocab in ((3, 70), (4, 9000)):  # one chunk (the direct kernel), then three
    x = rows_with_ties(rows, vocab, torch.float32, "cpu", vocab)
    bans = bans_for(x, vocab)
    out = torch.full((rows,), -1, dtype=torch.int64)
    argmax(x, out=out, use_kernel=True, bans=bans)
    assert torch.equal(out, expected_with_bans(x, bans)), (out, expected_with_bans(x, bans))
    assert torch.equal(argmax(x, use_kernel=True), x.argmax(dim=-1))
print("ok")
""")


def rows_with_nan(vocab: int, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Rows of NaN: all of it, one among numbers (near the end: the last chunk's padding
    follows), half of it after numbers, one banned before another; and a row of numbers."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(5, vocab, generator=g)
    x[0] = float("nan")
    x[1, vocab - 3] = float("nan")
    x[2, vocab // 2:] = float("nan")
    x[3, [1, vocab - 2]] = float("nan")
    bans = torch.tensor([[-1], [-1], [-1], [1], [-1]])
    return x.to(device, dtype), bans.to(device)


def test_kernels_take_a_nan_as_torch_does_in_the_interpreter():
    """A NaN is the largest value (the first NaN's column, as torch's argmax): a row of NaN is
    column 0, never a padding column past the vocabulary."""
    run_interpreted("""
import torch
from pd_kernels.argmax import argmax
from tests.kernels.test_argmax import rows_with_nan
for vocab in (70, 4096, 9000):
    x, bans = rows_with_nan(vocab)
    assert torch.equal(argmax(x, use_kernel=True), x.argmax(dim=-1)), vocab
    want = argmax(x, use_kernel=False, bans=bans)
    assert torch.equal(argmax(x, use_kernel=True, bans=bans), want) and want[3] == vocab - 2
print("ok")
""")


@pytest.mark.skipif(not CUDA, reason="the Triton kernels need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [128256, 4096, 100])
def test_kernels_take_a_nan_as_torch_does(dtype, vocab):
    x, bans = rows_with_nan(vocab, "cuda", dtype)
    assert torch.equal(argmax(x, use_kernel=True), x.argmax(dim=-1))
    want = argmax(x, use_kernel=False, bans=bans)
    assert torch.equal(argmax(x, use_kernel=True, bans=bans), want)


@pytest.mark.skipif(not CUDA, reason="the Triton kernels need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows,vocab", [(32, 128256), (3, 4096), (2, 100)])
def test_kernel_passes_over_banned_ids(dtype, num_rows, vocab):
    x = rows_with_ties(num_rows, vocab, dtype, "cuda", num_rows + vocab)
    bans = bans_for(x, vocab)
    out = torch.full((num_rows,), -1, dtype=torch.int64, device="cuda")
    argmax(x, out=out, use_kernel=True, bans=bans)
    assert torch.equal(out, expected_with_bans(x, bans))
    assert torch.equal(argmax(x, use_kernel=False, bans=bans), out)


@pytest.mark.skipif(not CUDA, reason="the Triton kernels need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows,vocab", [(1, 128256), (3, 151936), (64, 32000), (300, 4097),
                                            (7, 4096), (5, 1), (2, 100)])
def test_kernel_equals_twin(dtype, num_rows, vocab):
    x = rows_with_ties(num_rows, vocab, dtype, "cuda", num_rows * 7 + vocab)
    if num_rows > 2:
        x[1] = float("-inf")  # every column equal: column 0
    out = torch.full((num_rows,), -1, dtype=torch.int64, device="cuda")
    argmax(x, out=out, use_kernel=True)
    assert torch.equal(out, x.argmax(dim=-1)), (out, x.argmax(dim=-1))
    sliced = x[:, : max(1, vocab - 3)]  # a row stride wider than the row
    assert torch.equal(argmax(sliced, use_kernel=True), sliced.argmax(dim=-1))
    wide = torch.full((num_rows, 3), -5, dtype=torch.int64, device="cuda")
    argmax(x, out=wide[:, 1], use_kernel=True)  # a column of a wider result
    assert torch.equal(wide[:, 1], x.argmax(dim=-1)) and (wide[:, [0, 2]] == -5).all()
