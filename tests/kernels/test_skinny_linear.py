"""`pd_kernels.skinny_linear`: the twin (with and without `out`, with a bias) against float64 on
CPU, where the kernel is never chosen; the kernel's logic (K split in slices, the last program
adding them, the counters left at zero) in triton's interpreter on a machine without a GPU; the
Triton kernel against float64 on fresh random inputs on a CUDA machine, row counts in every
bucket up to `MAX_ROWS`, ragged shapes, a bias, one slice and several, and batch invariance (a
row's result is the same in any batch of its row bucket). The norm prologue (`norm_linear`, with
or without a residual add, of x's rows or of gathered rows) against its two kernels, in the
interpreter and on the GPU. The gated product (`gated=True`: silu(gate) * up in the epilogue)
against the product then `silu_and_mul`, alone and after the norm prologue."""

from __future__ import annotations

import pytest
import torch

from pd_kernels.activation import silu_and_mul
from pd_kernels.norm_linear import norm_linear
from pd_kernels.rms_norm import rms_norm
from pd_kernels.skinny_linear import MAX_ROWS, gated_config, row_bucket, skinny_linear, use_skinny
from tests.kernels.interpreter import run_interpreted

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
@pytest.mark.parametrize("m", [1, 3, 16, 17, 40, MAX_ROWS])
@pytest.mark.parametrize("n,k,bias,config", [
    (2048, 2048, False, None), (3072, 2048, True, None), (2048, 8192, False, None),
    (1000, 1500, True, (16, 128, 1, 3, 4)), (1000, 1500, True, (32, 128, 4, 3, 4)),
    (128256, 2048, False, None), (40, 8192, False, (16, 256, 8, 3, 4))])
def test_kernel_against_float64(m, n, k, bias, config):
    x, w, b = inputs(m, n, k, torch.bfloat16, "cuda", m * 31 + n, bias)
    if config is None and row_bucket(m) == 64:
        config = (16, 256, 2, 3, 4)  # the table may keep cuBLAS for this bucket
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = skinny_linear(x, w, b, out=out, use_kernel=True, config=config)
    assert y is out and torch.isfinite(y).all()
    assert rel(y, x, w, b) < 1e-2
    # each row gives the same bits in a smaller batch of its bucket (alone, in the first one)
    fewer = 1 if row_bucket(m) == 16 else row_bucket(m) // 2 + 1
    for r in range(0, fewer, max(1, fewer // 3)):
        part = skinny_linear(x[:fewer], w, b, use_kernel=True, config=config)
        assert torch.equal(part[r], y[r])


INTERPRETED = """
import torch
from pd_kernels import skinny_linear as sk
torch.manual_seed(0)
for m, n, k, config, bias in [(1, 96, 200, (16, 64, 1, 2, 4), True), (5, 100, 300, (32, 64, 3, 2, 4), False),
                              (20, 64, 512, (16, 32, 4, 1, 4), True), (40, 48, 130, (16, 32, 2, 1, 4), False)]:
    x, w = torch.randn(m, k), torch.randn(n, k) / k ** 0.5
    b = torch.randn(n) if bias else None
    y = sk.skinny_linear(x, w, b, use_kernel=True, config=config)
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert (y.double() - ref).norm() / ref.norm() < 1e-5, (m, n, k, config)
    if sk.row_bucket(m) == 16:
        alone = sk.skinny_linear(x[m - 1:], w, b, use_kernel=True, config=config)
        assert torch.equal(alone[0], y[m - 1]), (m, config)
assert all(int(c.abs().sum()) == 0 for c in sk._COUNTS.values())
print("ok")
"""


@pytest.mark.skipif(CUDA, reason="on a CUDA machine the compiled kernel's tests above run instead")
def test_kernel_logic_in_the_triton_interpreter():
    """On a machine with triton and no GPU (CI): the kernel run by triton's interpreter (float32,
    CPU tensors) against float64, with K in one slice and in several (the last program adds
    them), a row alone equal to it in a batch, and the slice counters left at zero."""
    run_interpreted(INTERPRETED)


@pytest.mark.skipif(not CUDA, reason="the Triton kernel needs a CUDA device")
def test_kernel_refuses_too_many_rows():
    x, w, _ = inputs(MAX_ROWS + 1, 64, 64, torch.bfloat16, "cuda", 0)
    assert not use_skinny(x, w)
    with pytest.raises(ValueError, match="at most"):
        skinny_linear(x, w, use_kernel=True)


PROLOGUES = """
import torch
from pd_kernels import norm_linear as nl
from pd_kernels.rms_norm import rms_norm_ref
torch.manual_seed(0)
for m, n, k in [(1, 96, 200), (5, 100, 300), (20, 64, 130)]:
    w, g = torch.randn(n, k) / k ** 0.5, torch.rand(k) + 0.5
    table, rows = torch.randn(50, k), torch.randint(0, 50, (m,))
    for x, residual, index in [(torch.randn(m, k), None, None), (torch.randn(m, k), torch.randn(m, k), None),
                               (table, None, rows), (table, torch.randn(50, k), rows)]:
        y, h = nl.norm_linear(x, g, 1e-6, w, None, residual, index, use_kernel=True)
        stream = x if index is None else x[index]
        if residual is not None:
            stream = stream + (residual if index is None else residual[index])
        assert torch.equal(h, stream), (m, k)
        ref = rms_norm_ref(stream, g, 1e-6).double() @ w.double().t()
        assert (y.double() - ref).norm() / ref.norm() < 1e-5, (m, n, k)
print("ok")
"""


@pytest.mark.skipif(CUDA, reason="on a CUDA machine the compiled kernel's tests below run instead")
def test_prologue_in_the_triton_interpreter():
    """The norm prologue (no residual, a residual, gathered rows, both) against float64 through
    the twin; the stream returned equal to the add's."""
    run_interpreted(PROLOGUES)


def test_prologue_twins_on_cpu():
    x, w, _ = inputs(4, 48, 80, torch.float32, "cpu", 3)
    g, residual = torch.rand(80) + 0.5, torch.randn(4, 80)
    y, h = norm_linear(x, g, 1e-6, w, None, residual)
    normed, stream = rms_norm(x, g, 1e-6, residual)
    assert torch.equal(h, stream) and torch.equal(y, normed @ w.t())
    rows = torch.tensor([3, 0, 3])
    y, h = norm_linear(x, g, 1e-6, w, rows=rows)
    assert torch.equal(h, x[rows]) and torch.equal(y, rms_norm(x[rows], g, 1e-6) @ w.t())


@pytest.mark.skipif(not CUDA, reason="the Triton kernel needs a CUDA device")
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n,k", [(512, 256), (4096, 256), (256, 768), (1000, 300)])
def test_prologue_against_two_kernels(m, n, k):
    """bf16 on the GPU: the stream bit for bit, the product within the norm statistics'
    summation order."""
    x, w, _ = inputs(m, n, k, torch.bfloat16, "cuda", m + n + k)
    g = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)
    residual = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    table = torch.randn(64, k, device="cuda").to(torch.bfloat16)
    rows = torch.randint(0, 64, (m,), device="cuda")
    for src, res, index in [(x, None, None), (x, residual, None), (table, None, rows)]:
        y, h = norm_linear(src, g, 1e-6, w, None, res, index, use_kernel=True)
        ys, hs = norm_linear(src, g, 1e-6, w, None, res, index, use_kernel=False)
        assert torch.equal(h, hs)
        assert (y.float() - ys.float()).abs().max() <= 0.02 * ys.float().abs().max()


GATED = """
import torch
from pd_kernels import skinny_linear as sk
from pd_kernels.norm_linear import norm_linear
from pd_kernels.rms_norm import rms_norm_ref
torch.manual_seed(0)
for m, n, k, config, bias in [(1, 48, 200, (16, 64, 1, 2, 4), True), (5, 50, 300, (32, 64, 1, 2, 4), False),
                              (20, 64, 130, (16, 32, 1, 1, 4), True)]:
    x, w = torch.randn(m, k), torch.randn(2 * n, k) / k ** 0.5
    b = torch.randn(2 * n) if bias else None
    prod = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    ref = torch.nn.functional.silu(prod[:, :n]) * prod[:, n:]
    y = sk.skinny_linear(x, w, b, use_kernel=True, config=config, gated=True)
    assert y.shape == (m, n) and (y.double() - ref).norm() / ref.norm() < 1e-5, (m, n, k)
    if sk.row_bucket(m) == 16:
        alone = sk.skinny_linear(x[m - 1:], w, b, use_kernel=True, config=config, gated=True)
        assert torch.equal(alone[0], y[m - 1]), (m, config)
    g, residual = torch.rand(k) + 0.5, torch.randn(m, k)
    y, h = norm_linear(x, g, 1e-6, w, b, residual, use_kernel=True, config=(2 * config[0], *config[1:]),
                       gated=True)
    assert torch.equal(h, x + residual)
    prod = torch.nn.functional.linear(rms_norm_ref(h, g, 1e-6).double(), w.double(),
                                      None if b is None else b.double())
    ref = torch.nn.functional.silu(prod[:, :n]) * prod[:, n:]
    assert y.shape == (m, n) and (y.double() - ref).norm() / ref.norm() < 1e-5, (m, n, k)
print("ok")
"""


@pytest.mark.skipif(CUDA, reason="on a CUDA machine the compiled kernel's tests below run instead")
def test_gated_epilogue_in_the_triton_interpreter():
    """silu(gate) * up in the epilogue, alone and after the norm prologue, against float64; a
    row alone equal to it in a batch."""
    run_interpreted(GATED)


def test_gated_twin_on_cpu():
    x, w, b = inputs(3, 64, 40, torch.float32, "cpu", 5, bias=True)
    y = skinny_linear(x, w, b, gated=True)
    assert torch.equal(y, silu_and_mul(x @ w.t() + b))
    out = torch.full((3, 32), float("nan"))
    assert skinny_linear(x, w, b, out=out, gated=True) is out and torch.equal(out, y)
    g = torch.rand(40) + 0.5
    y, h = norm_linear(x, g, 1e-6, w, b, gated=True)
    assert torch.equal(y, silu_and_mul(norm_linear(x, g, 1e-6, w, b)[0])) and h is x


def test_gated_config():
    assert gated_config((64, 256, 1, 4, 4)) == (32, 256, 1, 4, 4)
    assert gated_config((128, 128, 2, 4, 4)) is None  # K in slices: two kernels
    assert gated_config((16, 512, 1, 4, 4)) is None  # 8 columns of each half: two kernels
    assert gated_config(None) is None


@pytest.mark.skipif(not CUDA, reason="the Triton kernel needs a CUDA device")
@pytest.mark.parametrize("m", [1, 7, 16, 40, MAX_ROWS])
@pytest.mark.parametrize("n,k,bias", [(16384, 2048, False), (1000, 1500, True)])
def test_gated_against_two_kernels(m, n, k, bias):
    """bf16 on the GPU: the epilogue's result against the product then `silu_and_mul` (within
    a bf16 unit of the product's rounding) and against float64; batch-invariant in its bucket."""
    x, w, b = inputs(m, n, k, torch.bfloat16, "cuda", m + n, bias)
    config = (64, 256, 1, 4, 4) if row_bucket(m) == 16 else (128, 128, 1, 4, 4)
    y = skinny_linear(x, w, b, use_kernel=True, config=gated_config(config), gated=True)
    two = silu_and_mul(skinny_linear(x, w, b, use_kernel=True, config=config))
    assert y.shape == (m, n // 2) and torch.isfinite(y).all()
    assert (y.float() - two.float()).abs().max() <= 0.02 * two.float().abs().max()
    prod = x.double() @ w.double().t() + (0 if b is None else b.double())
    ref = torch.nn.functional.silu(prod[:, :n // 2]) * prod[:, n // 2:]
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2
    fewer = 1 if row_bucket(m) == 16 else row_bucket(m) // 2 + 1
    part = skinny_linear(x[:fewer], w, b, use_kernel=True, config=gated_config(config), gated=True)
    assert torch.equal(part, y[:fewer])
    g = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16)
    residual = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    y, h = norm_linear(x, g, 1e-6, w, b, residual, gated=True)
    ys, hs = norm_linear(x, g, 1e-6, w, b, residual, use_kernel=False)
    assert torch.equal(h, hs)
    two = silu_and_mul(ys)
    assert (y.float() - two.float()).abs().max() <= 0.02 * two.float().abs().max()
