"""Paged attention's two prefill paths agree: the padded batch with its mask (the reference, and
the CPU path) and one SDPA per sequence, causal from the lower right (what CUDA runs for up to 8
sequences), over fresh prompts, chunks with earlier KV, and decode rows mixed in."""

from __future__ import annotations

import pytest
import torch

from pd.model.attention import paged_attention, prefill_per_sequence
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
