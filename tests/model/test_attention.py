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
