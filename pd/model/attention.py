"""Paged attention in plain torch: correct on CPU and CUDA, for mixed batches of prefill chunks
and decode tokens.

The step's K/V are already in the paged cache (`pd_kernels.rope_cache`, called by
`rope_cache_attention` before it; in a plain decode step on CUDA both are one kernel); each
call gathers every sequence's keys through its block table into a padded batch and
runs one masked `scaled_dot_product_attention` over it. On CUDA, decode steps (one query per sequence) run
`pd_kernels.paged_decode` instead, a Triton kernel that reads the blocks in place (`PD_ATTENTION=torch`
keeps the torch path); prefill chunks on CUDA in 16 bits run one variable-length flash
attention call over the batch (`prefill_varlen`), in float32 (no flash) up to 8 sequences run
one SDPA per sequence, causal from the lower right (`prefill_per_sequence`); a
prompt prefilled from position 0 in a CUDA graph attends causally over its own keys
(`ForwardContext.causal_self`).
This module's padded path is the reference for both devices, and the only path for
sliding-window layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pd_kernels.paged_decode import can_use_kernel, paged_decode
from pd_kernels.rope_cache import rope_and_cache
from pd.model.context import get_context


def window_mask(mask: torch.Tensor, window: int) -> torch.Tensor:
    """A causal mask [B, 1, max_q, max_kv] narrowed to the last `window` keys of each query
    (key j is seen from position i when i - window < j <= i, as transformers has it). A
    query's position is its row's count of visible keys minus one (the mask is causal)."""
    q_pos = mask.sum(-1, keepdim=True) - 1  # [B, 1, max_q, 1]
    keys = torch.arange(mask.shape[-1], device=mask.device)
    return mask & (keys > q_pos - window)


MAX_SEQS_PER_SEQUENCE_PATH = 8  # past this many sequences, one padded SDPA beats a loop
VARLEN_DTYPES = (torch.float16, torch.bfloat16)  # what flash attention computes in


def prefill_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                   ctx) -> torch.Tensor:
    """Prefill chunks on CUDA in 16 bits: every sequence's keys gathered from their slots into
    one packed tensor (`ctx.kv_slots`), then one variable-length flash attention call over the
    whole batch, causal from the lower right (a chunk's queries are the last of its keys). Two
    gathers and one kernel per layer, whatever the number of sequences: a step of 8 prompts of
    128 tokens continuing 2,048 cached ones takes 23 ms eager, against about 40 ms with one SDPA per
    sequence (the 1B shape, `benchmarks/gpu/profile_prefix.py`)."""
    keys = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, ctx.kv_slots)
    values = v_cache.view(-1, *v_cache.shape[2:]).index_select(0, ctx.kv_slots)
    out = torch.ops.aten._flash_attention_forward(
        q, keys.to(q.dtype), values.to(q.dtype), ctx.cu_seqlens_q, ctx.cu_seqlens_k,
        ctx.max_q_len, ctx.max_kv_len, 0.0, True, False, scale=scale)[0]
    return out


def prefill_per_sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         scale: float, ctx) -> torch.Tensor:
    """Prefill chunks on CUDA: one SDPA per sequence over its own keys, causal from the lower
    right (a chunk's queries are the last of its keys), which SDPA runs as flash or
    memory-efficient attention: no padded batch and no mask tensor."""
    # NOTE: imported here: torch.nn.attention.bias imports torch._dynamo (2 s of start-up on a
    # small CPU), and only this CUDA path needs it
    from torch.nn.attention.bias import causal_lower_right

    out = torch.empty_like(q)
    block = k_cache.shape[1]
    start = 0
    for b, (q_len, kv_len) in enumerate(ctx.seq_lens_host):
        table = ctx.block_tables[b, :-(-kv_len // block)]
        keys = k_cache[table].flatten(0, 1)[:kv_len]  # [kv_len, H_kv, D]
        values = v_cache[table].flatten(0, 1)[:kv_len]
        mask = causal_lower_right(q_len, kv_len) if q_len > 1 else None
        o = F.scaled_dot_product_attention(
            q[start:start + q_len].transpose(0, 1)[None],  # [1, H_q, q_len, D]
            keys.transpose(0, 1)[None].to(q.dtype), values.transpose(0, 1)[None].to(q.dtype),
            attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:start + q_len] = o[0].transpose(0, 1)
        start += q_len
    return out


def rope_cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         scale: float, sliding_window: int | None = None,
                         cos_index: torch.Tensor | None = None) -> torch.Tensor:
    """A layer's attention from its projected q, k, v [T, H, D] and the step's cos/sin [T, D]
    (or tables [P, D] and each token's row, `cos_index`): rotary on q and k, the step's keys and
    values into the cache at their slots, then attention. One kernel in a plain decode step on
    CUDA (`ForwardContext.plain_decode`: no row reads another row's new key), else
    `rope_and_cache` then `paged_attention`."""
    ctx = get_context()
    if ctx.plain_decode and q.is_cuda and sliding_window is None and can_use_kernel(q, k_cache):
        rope = (k, v, cos, sin, ctx.slot_mapping) + (() if cos_index is None else (cos_index,))
        return paged_decode(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale,
                            use_kernel=True, rope=rope, table_rows=ctx.table_rows)
    q = rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, ctx.slot_mapping, ctx.write_index,
                       cos_index=cos_index)
    return paged_attention(q, k_cache, v_cache, scale, sliding_window)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q: [T, H_q, D] -> [T, H_q, D], attending over each sequence's cached keys (the last
    `sliding_window` of them, when given)."""
    ctx = get_context()
    num_seqs, max_q, max_kv = ctx.num_seqs, ctx.max_q_len, ctx.max_kv_len
    num_tokens, num_heads, head_dim = q.shape
    if ctx.causal_self and sliding_window is None:
        # the step's keys, read back from their slots (padding rows read the spare block; the
        # causal mask keeps every real row off them)
        keys = k_cache.view(-1, *k_cache.shape[2:])[ctx.slot_mapping]  # [T, H_kv, D]
        values = v_cache.view(-1, *v_cache.shape[2:])[ctx.slot_mapping]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None].to(q.dtype),
            values.transpose(0, 1)[None].to(q.dtype), is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    if (ctx.is_decode and q.is_cuda and sliding_window is None
            and can_use_kernel(q, k_cache)):
        return paged_decode(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale,
                            use_kernel=True, table_rows=ctx.table_rows)
    # NOTE: a fresh prompt alone keeps SDPA's causal kernel, as the prefill graphs run it, so
    # its first token does not depend on which path computed it (MTP prefills eagerly)
    alone = ctx.seq_lens_host is not None and len(ctx.seq_lens_host) == 1 and (
        ctx.seq_lens_host[0][0] == ctx.seq_lens_host[0][1])
    if (not ctx.is_decode and q.is_cuda and sliding_window is None and ctx.kv_slots is not None
            and q.dtype in VARLEN_DTYPES and not alone):
        return prefill_varlen(q, k_cache, v_cache, scale, ctx)
    if (not ctx.is_decode and q.is_cuda and sliding_window is None
            and ctx.seq_lens_host is not None and num_seqs <= MAX_SEQS_PER_SEQUENCE_PATH):
        return prefill_per_sequence(q, k_cache, v_cache, scale, ctx)
    mask = ctx.mask() if sliding_window is None else window_mask(ctx.mask(), sliding_window)
    if not q.is_cuda:
        # NOTE: a graph layout's step (MTP's, run uncaptured on the CPU) carries the graph's
        # width of blocks and keys; what lies past the longest context is masked, so the CPU
        # gathers no further (4.6x less at 24 requests of ~100 tokens in a 512-wide layout)
        max_kv = min(max_kv, int(ctx.context_lens.max()))
        mask = mask[..., :max_kv]
    # [B, max_blocks, block_size, H_kv, D] -> [B, max_blocks * block_size, H_kv, D] -> first max_kv
    tables = ctx.row_tables()[:, :-(-max_kv // k_cache.shape[1])]
    keys = k_cache[tables].flatten(1, 2)[:, :max_kv]
    values = v_cache[tables].flatten(1, 2)[:, :max_kv]
    if ctx.is_decode:
        q_pad = q.view(num_seqs, 1, num_heads, head_dim)
    else:
        q_pad = q.new_zeros(num_seqs * max_q, num_heads, head_dim)
        q_pad[ctx.padded_index] = q
        q_pad = q_pad.view(num_seqs, max_q, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),  # [B, H_q, max_q, D]
        keys.transpose(1, 2).to(q.dtype),  # [B, H_kv, max_kv, D]
        values.transpose(1, 2).to(q.dtype),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    out = out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)
    return out if ctx.is_decode else out[ctx.padded_index]
