"""Paged attention's prefill paths agree: the padded batch with its mask (the reference, and the
CPU path), one SDPA per sequence, causal from the lower right (what CUDA runs in float32 for up
to 8 sequences), and one variable-length flash call over the gathered keys (CUDA, 16 bits),
over fresh prompts, chunks with earlier KV, and decode rows mixed in."""

from __future__ import annotations

import pytest
import torch

from pd.model.attention import paged_attention, prefill_per_sequence, prefill_varlen
from pd.model.context import build_context, forward_context


@pytest.mark.parametrize("q_lens,kv_lens", [([5, 1, 40, 17], [5, 30, 100, 17]), ([64], [64]),
                                            ([3, 3], [200, 3])])
def test_per_sequence_prefill_equals_the_padded_batch(q_lens, kv_lens):
    g = torch.Generator().manual_seed(sum(kv_lens))
    block, kv_heads, q_heads, head_dim = 16, 2, 8, 32
    k_cache = torch.randn(64, block, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(64, block, kv_heads, head_dim, generator=g)
    tables = [list(range(i * 16, i * 16 + -(-kv // block))) for i, kv in enumerate(kv_lens)]
    ctx = build_context(q_lens, kv_lens, tables, [0] * sum(q_lens), torch.device("cpu"))
    q = torch.randn(sum(q_lens), q_heads, head_dim, generator=g)
    with forward_context(ctx):
        padded = paged_attention(q, k_cache, v_cache, head_dim ** -0.5)
        per_sequence = prefill_per_sequence(q, k_cache, v_cache, head_dim ** -0.5, ctx)
    assert (padded - per_sequence).abs().max() < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention needs a CUDA device")
@pytest.mark.parametrize("q_lens,kv_lens", [([5, 1, 40, 17], [5, 30, 100, 17]), ([64], [64]),
                                            ([3, 3], [200, 3]), ([128] * 8, [2176] * 8)])
def test_varlen_prefill_equals_the_padded_batch(q_lens, kv_lens):
    g = torch.Generator(device="cuda").manual_seed(sum(kv_lens))
    block, kv_heads, q_heads, head_dim = 16, 2, 8, 64
    num_blocks = sum(-(-kv // block) for kv in kv_lens) + 4
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g, device="cuda")
    v_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g, device="cuda")
    perm = torch.randperm(num_blocks, generator=g, device="cuda").tolist()
    tables, used = [], 0
    for kv in kv_lens:  # scattered blocks, as a real cache has them
        tables.append(perm[used:used + -(-kv // block)])
        used += len(tables[-1])
    ctx = build_context(q_lens, kv_lens, tables, [0] * sum(q_lens), torch.device("cuda"), block)
    q = torch.randn(sum(q_lens), q_heads, head_dim, generator=g, device="cuda")
    with forward_context(ctx):
        ref = paged_attention(q, k_cache, v_cache, head_dim ** -0.5)  # float32: per sequence
        out = prefill_varlen(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(),
                             head_dim ** -0.5, ctx)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert (out.float() - ref).abs().max() < 3e-2


def test_causal_self_over_a_padded_prompt_equals_the_padded_batch():
    """A prompt from position 0 followed by padding rows (the prefill CUDA graphs' layout):
    causal attention over the step's own keys, read back from their slots, gives the prompt's
    rows what the reference gives the prompt alone."""
    from dataclasses import replace

    g = torch.Generator().manual_seed(3)
    block, kv_heads, q_heads, head_dim, n, size = 16, 2, 8, 32, 37, 64
    k_cache = torch.randn(9, block, kv_heads, head_dim, generator=g)  # block 8: the spare one
    v_cache = torch.randn(9, block, kv_heads, head_dim, generator=g)
    table = [5, 2, 7]
    slots = [table[p // block] * block + p % block for p in range(n)]
    q = torch.randn(size, q_heads, head_dim, generator=g)
    ref_ctx = build_context([n], [n], [table], slots, torch.device("cpu"))
    with forward_context(ref_ctx):
        ref = paged_attention(q[:n], k_cache, v_cache, head_dim ** -0.5)
    padded = replace(ref_ctx, slot_mapping=torch.tensor(slots + [8 * block] * (size - n)),
                     max_q_len=size, max_kv_len=size, causal_self=True)
    with forward_context(padded):
        out = paged_attention(q, k_cache, v_cache, head_dim ** -0.5)
    assert out.shape == q.shape
    assert (out[:n] - ref).abs().max() < 1e-5


def test_run_slots_equal_the_per_token_formula():
    import random

    import numpy as np

    from pd.model.context import run_slots

    rng = random.Random(0)
    for _ in range(500):
        block = rng.choice([1, 2, 16, 32])
        table = rng.sample(range(1000), rng.randint(1, 40))
        start = rng.randrange(len(table) * block)
        n = rng.randint(1, len(table) * block - start)
        pos = np.arange(start, start + n)
        got = run_slots(table, start, n, block)
        assert got.dtype == np.int64
        assert got.tolist() == (np.asarray(table)[pos // block] * block + pos % block).tolist()
