"""`pd_kernels.paged_decode`: the torch twin against the engine's reference attention (`pd.model.attention`,
masked SDPA over gathered blocks) on CPU, and the Triton kernel against the twin on fresh random
inputs on a CUDA machine (skipped without one; `benchmarks/gpu/run_all.sh` runs it there)."""
from __future__ import annotations

import random

import pytest
import torch

from pd_kernels.paged_decode import can_use_kernel, paged_decode, paged_decode_ref
from pd.model.attention import paged_attention
from pd.model.context import build_context, forward_context
from tests.kernels.interpreter import run_interpreted


def case(seed: int, num_seqs: int, kv_heads: int, group: int, head_dim: int, block: int,
         max_len: int, dtype: torch.dtype, device: str):
    """Random q, caches and per-sequence block tables of distinct shuffled blocks."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lens = [rng.randrange(1, max_len + 1) for _ in range(num_seqs)]
    need = [-(-n // block) for n in lens]
    num_blocks = sum(need) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for k in need:
        tables.append(ids[at:at + k])
        at += k
    shape = (num_blocks, block, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    q = torch.randn(num_seqs, kv_heads * group, head_dim, generator=gen).to(device, dtype)
    return q, k_cache, v_cache, tables, lens


def padded(tables: list[list[int]], device: str, width: int | None = None) -> torch.Tensor:
    width = width or max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)


@pytest.mark.parametrize("seed,group,head_dim", [(0, 1, 32), (1, 4, 64), (2, 8, 16)])
def test_twin_equals_engine_reference_on_cpu(seed, group, head_dim):
    q, k_cache, v_cache, tables, lens = case(seed, 6, 2, group, head_dim, 16, 90, torch.float32, "cpu")
    scale = head_dim ** -0.5
    slots = [tables[b][(n - 1) // 16] * 16 + (n - 1) % 16 for b, n in enumerate(lens)]
    ctx = build_context([1] * len(lens), lens, tables, slots, torch.device("cpu"))
    with forward_context(ctx):
        want = paged_attention(q, k_cache, v_cache, scale)
    got = paged_decode(q, k_cache, v_cache, padded(tables, "cpu", width=9), torch.tensor(lens), scale)
    assert not can_use_kernel(q, k_cache)  # CPU: the twin ran
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs a CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_seqs,kv_heads,group,head_dim,max_len", [
    (1, 8, 4, 64, 4000), (1, 8, 4, 64, 20000), (3, 2, 1, 32, 50), (64, 8, 4, 64, 700),
    (17, 4, 8, 128, 300), (200, 2, 2, 16, 40)])
@pytest.mark.parametrize("whole", [False, True])
def test_kernel_equals_twin(dtype, tol, num_seqs, kv_heads, group, head_dim, max_len, whole):
    q, k_cache, v_cache, tables, lens = case(num_seqs + head_dim, num_seqs, kv_heads, group, head_dim,
                                             16, max_len, dtype, "cuda")
    bt = padded(tables, "cuda", width=max(map(len, tables)) + 5)  # wider than needed, as in graphs
    lens_t = torch.tensor(lens, device="cuda")
    assert can_use_kernel(q, k_cache)
    got = paged_decode(q, k_cache, v_cache, bt, lens_t, head_dim ** -0.5, use_kernel=True,
                       whole=whole)
    want = paged_decode_ref(q, k_cache, v_cache, bt, lens_t, head_dim ** -0.5)
    assert torch.isfinite(got).all()
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < tol, f"relative error {err:.2e}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sub_tokens,stages", [(None, 1), (None, 2), (64, 2), (32, 3)])
def test_whole_programs_equal_split_programs_bit_for_bit(dtype, sub_tokens, stages):
    """One program per sequence and KV head folds the splits as the split programs' last one
    does: the same bits, for one split, a few and many, whichever the batch picks, and in
    either launch order."""
    q, k_cache, v_cache, tables, lens = case(11, 40, 8, 4, 64, 16, 2500, dtype, "cuda")
    lens[:3] = [1, 128, 129]  # one key, exactly one split, one key into the second
    lens_t = torch.tensor(lens, device="cuda")
    bt = padded(tables, "cuda", width=max(map(len, tables)) + 7)
    kw = dict(use_kernel=True, sub_tokens=sub_tokens, stages=stages)
    split = paged_decode(q, k_cache, v_cache, bt, lens_t, 64 ** -0.5, whole=False, **kw)
    for first in (False, True):  # either launch order, the same bits (whole or split)
        for way in (False, True):
            assert torch.equal(split, paged_decode(q, k_cache, v_cache, bt, lens_t, 64 ** -0.5,
                                                   whole=way, heads_first=first, **kw))


def rope_inputs(seed: int, num_seqs: int, kv_heads: int, head_dim: int, dtype, device: str):
    """Unrotated k, v rows, a cos/sin pair per row as the rotary tables give them."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_seqs, kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(num_seqs, kv_heads, head_dim, generator=gen).to(device, dtype)
    angle = torch.rand(num_seqs, head_dim // 2, generator=gen) * 6
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(device, dtype)
    sin = torch.cat([angle.sin(), angle.sin()], -1).to(device, dtype)
    return k, v, cos, sin


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("whole", [False, True])
def test_rotary_and_cache_write_inside_equal_the_rope_kernel_first(dtype, whole):
    """The kernel that rotates q and k and writes the step's keys and values itself leaves the
    cache bit-equal to `rope_and_cache` and gives the bits of attention after it (a row with a
    negative slot writes nothing)."""
    from pd_kernels.rope_cache import rope_and_cache

    q, k_cache, v_cache, tables, lens = case(5, 40, 8, 4, 64, 16, 900, dtype, "cuda")
    k, v, cos, sin = rope_inputs(5, 40, 8, 64, dtype, "cuda")
    slots = torch.tensor([t[(n - 1) // 16] * 16 + (n - 1) % 16 for t, n in zip(tables, lens)],
                         device="cuda")
    slots[3] = -1
    bt = padded(tables, "cuda", width=max(map(len, tables)) + 4)
    lens_t = torch.tensor(lens, device="cuda")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k0, v0 = k_cache.clone(), v_cache.clone()
    q_rot = rope_and_cache(q, k, v, cos, sin, k_ref, v_ref, slots,
                           torch.nonzero(slots >= 0).flatten(), use_kernel=True)
    want = paged_decode(q_rot, k_ref, v_ref, bt, lens_t, 64 ** -0.5, use_kernel=True, whole=whole)
    got = paged_decode(q, k_cache, v_cache, bt, lens_t, 64 ** -0.5, use_kernel=True, whole=whole,
                       rope=(k, v, cos, sin, slots))
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(got, want)
    # rows read through an index into tables (the position cache): the same bits
    perm = torch.randperm(50, device="cuda")[:40]
    cos_t = torch.randn(50, 64, device="cuda").to(dtype)
    sin_t = torch.randn(50, 64, device="cuda").to(dtype)
    cos_t[perm], sin_t[perm] = cos, sin
    k_cache.copy_(k0)
    v_cache.copy_(v0)
    got = paged_decode(q, k_cache, v_cache, bt, lens_t, 64 ** -0.5, use_kernel=True, whole=whole,
                       rope=(k, v, cos_t, sin_t, slots, perm))
    assert torch.equal(got, want) and torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    k_cache.copy_(k0)
    v_cache.copy_(v0)
    mine = rope_and_cache(q, k, v, cos_t, sin_t, k_cache, v_cache, slots,
                          torch.nonzero(slots >= 0).flatten(), use_kernel=True, cos_index=perm)
    assert torch.equal(mine, q_rot) and torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs a CUDA device")
def test_rows_sharing_a_table():
    """`table_rows`: consecutive rows reading their sequence's one table give the bits of each
    row with its own copy (an MTP verify step's rows)."""
    q, k_cache, v_cache, tables, lens = case(3, 8, 8, 4, 64, 16, 700, torch.bfloat16, "cuda")
    bt = padded(tables[:4], "cuda", width=max(map(len, tables)) + 2)
    lens_t = torch.tensor([min(n, lens[b // 2]) for b, n in enumerate(lens)], device="cuda")
    want = paged_decode(q, k_cache, v_cache, bt.repeat_interleave(2, 0), lens_t, 0.125, use_kernel=True)
    got = paged_decode(q, k_cache, v_cache, bt, lens_t, 0.125, use_kernel=True, table_rows=2)
    assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_is_batch_invariant(dtype):
    """A sequence's output is bit-equal alone, in a large batch, and with a wider block table:
    what makes an MTP verify step's rows equal to plain decode steps' rows in bfloat16."""
    q, k_cache, v_cache, tables, lens = case(7, 48, 8, 4, 64, 16, 3000, dtype, "cuda")
    scale = 64 ** -0.5
    lens_t = torch.tensor(lens, device="cuda")
    batch = paged_decode(q, k_cache, v_cache, padded(tables, "cuda"), lens_t, scale)
    assert torch.equal(batch, paged_decode(q, k_cache, v_cache, padded(tables, "cuda"), lens_t,
                                           scale, whole=True))
    for b in (0, 5, 47):
        for width in (len(tables[b]), 256):
            alone = paged_decode(q[b:b + 1], k_cache, v_cache, padded([tables[b]], "cuda", width),
                                 lens_t[b:b + 1], scale)
            assert torch.equal(alone[0], batch[b]), (b, width)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs a CUDA device")
@pytest.mark.parametrize("sub_tokens,stages,warps", [(16, 2, 4), (32, 2, 4), (64, 2, 4),
                                                     (64, 1, 8), (128, 1, 4), (128, 2, 2),
                                                     (64, 2, 2), (32, 3, 1)])
def test_sub_tiles_equal_twin_and_stay_batch_invariant(sub_tokens, stages, warps):
    """Each of the benchmark's kernel variants (keys loaded `sub_tokens` at a time) against
    the twin, and a sequence alone against it in the batch, bit for bit."""
    q, k_cache, v_cache, tables, lens = case(sub_tokens + stages, 24, 8, 4, 64, 16, 1500,
                                             torch.bfloat16, "cuda")
    bt = padded(tables, "cuda", width=max(map(len, tables)) + 3)
    lens_t = torch.tensor(lens, device="cuda")
    kw = dict(use_kernel=True, sub_tokens=sub_tokens, stages=stages, num_warps=warps)
    got = paged_decode(q, k_cache, v_cache, bt, lens_t, 64 ** -0.5, **kw)
    want = paged_decode_ref(q, k_cache, v_cache, bt, lens_t, 64 ** -0.5)
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert torch.isfinite(got).all() and err < 2e-2, f"relative error {err:.2e}"
    for b in (0, 7, 23):
        alone = paged_decode(q[b:b + 1], k_cache, v_cache, bt[b:b + 1], lens_t[b:b + 1],
                             64 ** -0.5, **kw)
        assert torch.equal(alone[0], got[b])


INTERPRETED = """
import torch
from tests.kernels.test_paged_decode import case, padded
from pd_kernels import paged_decode as pd_
for seed, (ns, kvh, g, d, ml) in enumerate([(5, 2, 4, 32, 400), (3, 2, 3, 32, 2600), (2, 1, 1, 16, 1500)]):
    q, kc, vc, tables, lens = case(seed, ns, kvh, g, d, 16, ml, torch.float32, "cpu")
    bt = padded(tables, "cpu", width=max(map(len, tables)) + 9)
    lt = torch.tensor(lens)
    want = pd_.paged_decode_ref(q, kc, vc, bt, lt, d ** -0.5)
    got = pd_.paged_decode(q, kc, vc, bt, lt, d ** -0.5, use_kernel=True, whole=False)
    assert (got - want).norm() / want.norm() < 1e-5, (seed, lens)
    for kw in ({"whole": True}, {"whole": True, "sub_tokens": 32, "stages": 2}):
        other = pd_.paged_decode(q, kc, vc, bt, lt, d ** -0.5, use_kernel=True, **kw)
        assert (other - want).norm() / want.norm() < 1e-5, (seed, lens, kw)
    for first in (False, True):  # the launch order does not change a bit
        assert torch.equal(got, pd_.paged_decode(q, kc, vc, bt, lt, d ** -0.5, use_kernel=True,
                                                 whole=True, heads_first=first)), (seed, first)
    assert torch.equal(got, pd_.paged_decode(q, kc, vc, bt, lt, d ** -0.5, use_kernel=True,
                                             whole=False, heads_first=True)), seed
    for b in range(ns):
        alone = pd_.paged_decode(q[b:b + 1], kc, vc, padded([tables[b]], "cpu", 200), lt[b:b + 1],
                                 d ** -0.5, use_kernel=True, whole=False)
        assert torch.equal(alone[0], got[b]), (seed, b)
assert all(int(c.abs().sum()) == 0 for c in pd_._COUNTS.values())
# rotary and the cache write inside: the cache and the output of the rope twin first
from tests.kernels.test_paged_decode import rope_inputs
from pd_kernels.rope_cache import rope_and_cache_ref
q, kc, vc, tables, lens = case(9, 5, 2, 4, 32, 16, 400, torch.float32, "cpu")
k, v, cos, sin = rope_inputs(9, 5, 2, 32, torch.float32, "cpu")
slots = torch.tensor([t[(n - 1) // 16] * 16 + (n - 1) % 16 for t, n in zip(tables, lens)])
slots[1] = -1
bt, lt = padded(tables, "cpu", width=max(map(len, tables)) + 9), torch.tensor(lens)
k_ref, v_ref = kc.clone(), vc.clone()
q_rot = rope_and_cache_ref(q, k, v, cos, sin, k_ref, v_ref, slots, torch.nonzero(slots >= 0).flatten())
want = pd_.paged_decode(q_rot, k_ref, v_ref, bt, lt, 32 ** -0.5, use_kernel=True, whole=False)
for whole in (False, True):
    k2, v2 = kc.clone(), vc.clone()
    got = pd_.paged_decode(q, k2, v2, bt, lt, 32 ** -0.5, use_kernel=True, whole=whole,
                           rope=(k, v, cos, sin, slots))
    assert torch.equal(k2, k_ref) and torch.equal(v2, v_ref) and torch.equal(got, want), whole
# the rotary rows read through an index into tables (the position cache), the bits of the rows
# gathered first
perm = torch.randperm(12)[:5]
cos_t, sin_t = torch.randn(12, 32), torch.randn(12, 32)
cos_t[perm], sin_t[perm] = cos, sin
k2, v2 = kc.clone(), vc.clone()
got = pd_.paged_decode(q, k2, v2, bt, lt, 32 ** -0.5, use_kernel=True, rope=(k, v, cos_t, sin_t, slots, perm))
assert torch.equal(k2, k_ref) and torch.equal(got, want)
# table_rows: rows sharing their sequence's table, equal to the tables repeated
grouped = pd_.paged_decode(q[:4], kc, vc, bt[:2], lt[:4], 32 ** -0.5, use_kernel=True, table_rows=2)
assert torch.equal(grouped, pd_.paged_decode(q[:4], kc, vc, bt[:2].repeat_interleave(2, 0), lt[:4],
                                             32 ** -0.5, use_kernel=True))
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the compiled kernel's "
                    "tests above run instead")
def test_kernel_logic_in_the_triton_interpreter():
    """On a machine with triton and no GPU (CI): the kernel run by triton's interpreter (float32, CPU
    tensors) equals the twin for sequences of one split and of many, with one program per split
    and one per sequence (the same bits), alone and in a batch bit for bit, and leaves its split
    counters at zero; with rotary and the cache write inside, the cache and output of the rope
    twin run first."""
    run_interpreted(INTERPRETED)
