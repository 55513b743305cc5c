"""Per-step batch metadata that travels beside the model.

The engine builds one `ForwardContext` per forward (all tensors in one place, see
`ModelRunner.prepare`) and sets it for the duration of the forward, so layer signatures stay
`forward(positions, hidden)`. Attention reads it; nothing else should.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, fields, replace

import numpy as np
import torch


@dataclass
class ForwardContext:
    """The flattened batch: B sequences, T query tokens laid out sequence after sequence."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each token
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0 (masked out)
    context_lens: torch.Tensor  # [B] int64: KV length of each sequence after this step
    padded_index: torch.Tensor  # [T] int64: b * max_q_len + i for token i of sequence b
    # [B, 1, max_q_len, max_kv_len] bool, True = may attend; None: `mask()` derives it on the
    # device from query_pos (or, for a decode step, from context_lens)
    attn_mask: torch.Tensor | None
    max_q_len: int
    max_kv_len: int
    # NOTE: tokens whose slot is negative (an invalid slot) are not written to the cache;
    # write_index lists the tokens that are, or is None when every token is.
    write_index: torch.Tensor | None = None
    query_pos: torch.Tensor | None = None  # [B, max_q_len] int64 positions, -1 on padding rows
    # per sequence (query length, KV length) on the host, where the batch was built there
    seq_lens_host: tuple[tuple[int, int], ...] | None = None
    # NOTE: one sequence whose keys are exactly this step's tokens, in order (a prompt from
    # position 0, possibly followed by padding rows): attention is causal over the step's own
    # keys, with no table and no mask (the prefill CUDA graphs, `pd.engine.cuda_graph`)
    causal_self: bool = False
    # NOTE: for a step with prompt chunks (max_q_len > 1): each sequence's KV slots, positions
    # 0..kv_len-1, sequence after sequence, and the cumulative query and KV lengths (int32):
    # what one variable-length flash attention call over the batch reads (`prefill_varlen`)
    kv_slots: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    # NOTE: a plain decode step: one query row per sequence and no row reading another row's
    # new key (an MTP verify step's rows do), so each row's rotary and cache write may run
    # inside the attention kernel (`pd.model.attention.rope_cache_attention`)
    plain_decode: bool = False
    # NOTE: each table of block_tables serves this many consecutive sequences (rows): an MTP
    # verify step's k + 1 rows of one request share its table, read in place by the decode
    # attention kernel (`row_tables` repeats it for the torch paths)
    table_rows: int = 1

    def row_tables(self) -> torch.Tensor:
        """[B, max_blocks]: each sequence's table (`table_rows`)."""
        if self.table_rows == 1:
            return self.block_tables
        return self.block_tables.repeat_interleave(self.table_rows, 0)

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.max_q_len == 1

    def mask(self) -> torch.Tensor:
        """The causal mask over the padded batch, built where the tensors live (a prefill of
        8k tokens would otherwise move a 64 MiB mask per step)."""
        if self.attn_mask is None:
            keys = torch.arange(self.max_kv_len, device=self.context_lens.device)
            if self.query_pos is None:  # decode: the one query sits at context_len - 1
                self.attn_mask = (keys[None, :] < self.context_lens[:, None])[:, None, None, :]
            else:
                pos = self.query_pos[:, :, None]  # [B, max_q, 1]
                # Padding query rows attend to key 0 only, so softmax stays finite.
                mask = (keys <= pos) | ((pos < 0) & (keys == 0))
                self.attn_mask = mask[:, None]
        return self.attn_mask


_CONTEXT: ForwardContext | None = None


def get_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("no forward context set: run the model through the engine's runner")
    return _CONTEXT


@contextmanager
def forward_context(ctx: ForwardContext):
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = prev


def build_context(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    slot_mapping: list[int],
    device: torch.device,
    block: int | None = None,
) -> ForwardContext:
    """Build the context for a batch. Sequence b has `query_lens[b]` new tokens, the last of which
    sits at position `context_lens[b] - 1`; its KV lives in the blocks `block_tables[b]`.
    Built on the host with numpy; every tensor is moved to `device` (`to_device`, see
    `host_context` for building it without the move)."""
    return to_device(host_context(query_lens, context_lens, block_tables, slot_mapping, block),
                     lambda t: t.to(device))


def run_slots(table, start: int, n: int, block: int) -> np.ndarray:
    """The cache slots of positions start .. start + n - 1 of a sequence whose blocks are
    `table` (int64): whole blocks' slots cut to the run, with no division per token."""
    b0, b1 = start // block, (start + n - 1) // block + 1
    blocks = np.asarray(table[b0:b1], dtype=np.int64)
    first = start - b0 * block
    return (blocks[:, None] * block + np.arange(block)).reshape(-1)[first:first + n]


def host_context(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                 slot_mapping: list[int], block: int | None = None) -> ForwardContext:
    """The context with every tensor on the host (CPU): what `build_context` moves. With the
    cache's `block` size, a step with prompt chunks also gets its KV slots (`kv_slots`)."""
    num_seqs = len(query_lens)
    q_lens = np.asarray(query_lens, dtype=np.int64)
    kv_lens = np.asarray(context_lens, dtype=np.int64)
    max_q, max_kv = int(q_lens.max()), int(kv_lens.max())
    bt = np.zeros((num_seqs, max(len(row) for row in block_tables)), dtype=np.int64)
    for i, row in enumerate(block_tables):
        bt[i, :len(row)] = row
    slots = np.asarray(slot_mapping, dtype=np.int64)
    query_pos = kv_slots = cu_q = cu_k = None
    if max_q == 1:
        padded_index = np.arange(num_seqs, dtype=np.int64)
    else:
        if block:
            kv_slots = torch.from_numpy(np.concatenate([
                run_slots(bt[i], 0, int(kv), block) for i, kv in enumerate(kv_lens)]))
            cu_q = torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
            cu_k = torch.from_numpy(np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32))
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
        starts = np.cumsum(q_lens) - q_lens
        padded_index = seq_of_token * max_q + np.arange(len(seq_of_token)) - starts[seq_of_token]
        # Query i of sequence b sits at position kv_len - q_len + i and sees keys at positions
        # <= it; padding rows (i >= q_len) are -1.
        q_pos = (kv_lens - q_lens)[:, None] + np.arange(max_q)[None, :]  # [B, max_q]
        q_pos[np.arange(max_q)[None, :] >= q_lens[:, None]] = -1
        query_pos = torch.from_numpy(q_pos.astype(np.int64))
    valid = slots >= 0
    write_index = None if bool(valid.all()) else torch.from_numpy(np.nonzero(valid)[0])
    return ForwardContext(
        slot_mapping=torch.from_numpy(slots),
        block_tables=torch.from_numpy(bt),
        context_lens=torch.from_numpy(kv_lens),
        padded_index=torch.from_numpy(padded_index.astype(np.int64)),
        attn_mask=None,
        max_q_len=max_q,
        max_kv_len=max_kv,
        write_index=write_index,
        query_pos=query_pos,
        seq_lens_host=tuple(zip(map(int, q_lens), map(int, kv_lens))),
        kv_slots=kv_slots, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, plain_decode=max_q == 1,
    )


def to_device(ctx: ForwardContext, move) -> ForwardContext:
    """`ctx` with `move(t)` applied to each of its tensors."""
    return replace(ctx, **{f.name: move(getattr(ctx, f.name)) for f in fields(ctx)
                           if isinstance(getattr(ctx, f.name), torch.Tensor)})
