"""The decode layer's fused kernels (`pd_kernels.rms_norm`, `pd_kernels.rope_cache`,
`pd_kernels.activation`): each torch twin against an independent float64 reference (on CPU, in CI),
and each Triton kernel against its twin on fresh random inputs, never zeros, with poisoned
outputs and negative (invalid) cache slots (on CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pd_kernels.activation import silu_and_mul, silu_and_mul_ref
from pd_kernels.rms_norm import rms_norm, rms_norm_ref
from pd_kernels.rope_cache import rope_and_cache, rope_and_cache_ref

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="the Triton kernels need a CUDA device")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def norm_inputs(rows, cols, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g).to(device, dtype)
    r = torch.randn(rows, cols, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(cols, generator=g)).to(device, dtype)
    return x, r, w


def rope_inputs(tokens, hq, hkv, d, dtype, device, seed, num_blocks=8, block=16):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g).to(device, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(tokens, hq, d), k.view(tokens, hkv, d), v.view(tokens, hkv, d)
    pos = torch.randint(0, 4000, (tokens,), generator=g).double()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).double() / d))
    freqs = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    cos, sin = freqs.cos().to(device, dtype), freqs.sin().to(device, dtype)
    slots = torch.randperm(num_blocks * block, generator=g)[:tokens]
    slots[::3] = -1  # invalid slots: never written
    return q, k, v, cos, sin, slots.to(device), num_blocks, block


def poisoned_caches(num_blocks, block, hkv, d, dtype, device):
    k_cache = torch.full((num_blocks, block, hkv, d), float("nan"), dtype=dtype, device=device)
    return k_cache, k_cache.clone()


# --- twins on CPU -------------------------------------------------------------------------------

@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_twin_matches_float64(residual):
    x, r, w = norm_inputs(7, 96, torch.float32, "cpu", 0)
    h = x.double() + r.double() if residual else x.double()
    ref = w.double() * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    out = rms_norm_ref(x, w, 1e-6, r if residual else None)
    if residual:
        out, new_residual = out
        assert rel(new_residual, h) < 1e-6
    assert rel(out, ref) < 1e-6


def test_rms_norm_twin_rows_and_out():
    """Given rows (a column of a wider index, repeats allowed) and a given output (a half of
    wider rows): the rows' norms, as if gathered first, written there."""
    x, r, w = norm_inputs(9, 32, torch.float32, "cpu", 4)
    index = torch.tensor([[5, 0], [2, 0], [5, 0], [8, 0]])
    rows = index[:, 0]
    wide = torch.full((4, 64), -3.0)
    assert rms_norm_ref(x, w, 1e-6, rows=rows, out=wide[:, 32:]) is not None
    assert torch.equal(wide[:, 32:], rms_norm_ref(x[rows], w, 1e-6)) and (wide[:, :32] == -3).all()
    out, h = rms_norm(x, w, 1e-6, r, rows=rows)
    want, want_h = rms_norm_ref(x[rows], w, 1e-6, r[rows])
    assert torch.equal(out, want) and torch.equal(h, want_h)


def test_rope_and_cache_twin_matches_float64_and_skips_invalid_slots():
    q, k, v, cos, sin, slots, nb, bs = rope_inputs(12, 4, 2, 32, torch.float32, "cpu", 1)
    k_cache, v_cache = poisoned_caches(nb, bs, 2, 32, torch.float32, "cpu")
    valid = torch.nonzero(slots >= 0).flatten()
    out = rope_and_cache_ref(q, k, v, cos, sin, k_cache, v_cache, slots, valid)

    def rope64(x):
        x = x.double()
        x1, x2 = x.chunk(2, -1)
        c, s = cos.double()[:, None], sin.double()[:, None]
        return torch.cat([x1 * c[..., :16] - x2 * s[..., :16], x2 * c[..., 16:] + x1 * s[..., 16:]], -1)

    assert rel(out, rope64(q)) < 1e-6
    flat_k, flat_v = k_cache.view(-1, 2, 32), v_cache.view(-1, 2, 32)
    assert rel(flat_k[slots[valid]], rope64(k)[valid]) < 1e-6
    assert torch.equal(flat_v[slots[valid]], v[valid])
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool)
    written[slots[valid]] = True
    assert flat_k[~written].isnan().all() and flat_v[~written].isnan().all()


def test_silu_and_mul_twin_matches_float64():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 2 * 48, generator=g)
    gate, up = x.double().chunk(2, -1)
    assert rel(silu_and_mul_ref(x), gate * torch.sigmoid(gate) * up) < 1e-6


def test_cpu_dispatch_runs_the_twins():
    x, r, w = norm_inputs(3, 32, torch.float32, "cpu", 3)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    assert torch.equal(silu_and_mul(torch.cat([x, r], -1)), F.silu(x) * r)


# --- kernels vs twins on CUDA -----------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 2048), (64, 2048), (5, 96), (3, 5120)])
def test_rms_norm_kernel_matches_twin(dtype, rows, cols):
    for seed, residual in ((rows, False), (rows + 1, True)):
        x, r, w = norm_inputs(rows, cols, dtype, "cuda", seed)
        res = r if residual else None
        out = rms_norm(x, w, 1e-5, res, use_kernel=True)
        ref = rms_norm_ref(x, w, 1e-5, res)
        if residual:
            (out, h), (ref, h_ref) = out, ref
            assert torch.equal(h, h_ref)
        assert not out.isnan().any()
        assert rel(out, ref) < TOL[dtype] / 10


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel_rows_and_out(dtype):
    """Rows gathered by the kernel (an embedding lookup's table among them) give the same bits
    as the kernel on the gathered rows; a given output gets them, its other columns untouched."""
    x, r, w = norm_inputs(300, 256, dtype, "cuda", 5)
    index = torch.randint(0, 300, (17, 3), device="cuda")
    rows = index[:, 1]  # strided
    wide = torch.full((17, 512), -3.0, dtype=dtype, device="cuda")
    rms_norm(x, w, 1e-5, rows=rows, out=wide[:, :256], use_kernel=True)
    assert torch.equal(wide[:, :256], rms_norm(x[rows], w, 1e-5, use_kernel=True))
    assert (wide[:, 256:] == -3).all()
    out, h = rms_norm(x, w, 1e-5, r, rows=rows, use_kernel=True)
    want, want_h = rms_norm(x[rows].contiguous(), w, 1e-5, r[rows].contiguous(), use_kernel=True)
    assert torch.equal(out, want) and torch.equal(h, want_h)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hq,hkv,d", [(1, 32, 8, 64), (64, 32, 8, 64), (9, 16, 16, 128),
                                             (33, 8, 1, 32)])
def test_rope_and_cache_kernel_matches_twin(dtype, tokens, hq, hkv, d):
    q, k, v, cos, sin, slots, nb, bs = rope_inputs(tokens, hq, hkv, d, dtype, "cuda", tokens + d,
                                                   num_blocks=64)
    kc, vc = poisoned_caches(nb, bs, hkv, d, dtype, "cuda")
    kc_ref, vc_ref = poisoned_caches(nb, bs, hkv, d, dtype, "cuda")
    out = rope_and_cache(q, k, v, cos, sin, kc, vc, slots, use_kernel=True)
    valid = torch.nonzero(slots >= 0).flatten()
    ref = rope_and_cache_ref(q, k, v, cos, sin, kc_ref, vc_ref, slots, valid)
    assert torch.equal(out, ref)  # the kernel rounds as the twin does, step by step
    assert torch.equal(kc.isnan(), kc_ref.isnan()) and torch.equal(vc.isnan(), vc_ref.isnan())
    written = ~kc_ref.isnan()
    assert torch.equal(kc[written], kc_ref[written]) and torch.equal(vc[written], vc_ref[written])


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 8192), (64, 8192), (7, 100)])
def test_silu_and_mul_kernel_matches_twin(dtype, rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    x = (2 * torch.randn(rows, 2 * inter, generator=g)).to("cuda", dtype)
    out = silu_and_mul(x, use_kernel=True)
    assert not out.isnan().any()
    assert rel(out, silu_and_mul_ref(x)) < TOL[dtype] / 10
