"""`kernels.skinny_linear`: the twin (with and without `out`, with a bias) against float64 on
CPU, where the kernel is never chosen; the Triton kernel against float64 on fresh random
inputs on a CUDA machine, every row count up to `MAX_ROWS`, ragged shapes, a bias, and
batch invariance (a row's result alone equals it in any batch)."""

from __future__ import annotations

import pytest
import torch

from kernels.skinny_linear import MAX_ROWS, skinny_linear, use_skinny

CUDA = torch.cuda.is_available()


def inputs(m, n, k, dtype, device, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    return x, w, b


def rel(y, x, w, b):
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    return ((y.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("bias", [False, True])
def test_twin_on_cpu_with_and_without_out(bias):
    x, w, b = inputs(5, 48, 80, torch.float32, "cpu", 1, bias)
    assert not use_skinny(x, w)
    y = skinny_linear(x, w, b)
    assert rel(y, x, w, b) < 1e-6
    out = torch.full((5, 48), float("nan"))
    assert skinny_linear(x, w, b, out=out) is out
    assert torch.equal(out, y)


@pytest.mark.skipif(not CUDA, reason="the Triton kernel needs a CUDA device")
@pytest.mark.parametrize("m", [1, 2, 3, 8, MAX_ROWS])
@pytest.mark.parametrize("n,k,bias", [(2048, 2048, False), (3072, 2048, True), (1000, 1500, True),
                                      (128256, 2048, False), (40, 8192, False)])
def test_kernel_against_float64(m, n, k, bias):
    x, w, b = inputs(m, n, k, torch.bfloat16, "cuda", m * 31 + n, bias)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = skinny_linear(x, w, b, out=out, use_kernel=True)
    assert y is out and torch.isfinite(y).all()
    assert rel(y, x, w, b) < 1e-2
    # each row alone gives its bits in the batch
    for r in range(0, m, max(1, m // 3)):
        alone = skinny_linear(x[r:r + 1], w, b, use_kernel=True)
        assert torch.equal(alone[0], y[r])


@pytest.mark.skipif(not CUDA, reason="the Triton kernel needs a CUDA device")
def test_kernel_refuses_too_many_rows():
    x, w, _ = inputs(MAX_ROWS + 1, 64, 64, torch.bfloat16, "cuda", 0)
    assert not use_skinny(x, w)
    with pytest.raises(ValueError, match="at most"):
        skinny_linear(x, w, use_kernel=True)
