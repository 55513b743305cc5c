"""Per-step batch metadata that travels beside the model.

The engine builds one `ForwardContext` per forward (all tensors in one place, see
`ModelRunner.prepare`) and sets it for the duration of the forward, so layer signatures stay
`forward(positions, hidden)`. Attention reads it; nothing else should.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    """The flattened batch: B sequences, T query tokens laid out sequence after sequence."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each token
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0 (masked out)
    context_lens: torch.Tensor  # [B] int64: KV length of each sequence after this step
    padded_index: torch.Tensor  # [T] int64: b * max_q_len + i for token i of sequence b
    attn_mask: torch.Tensor  # [B, 1, max_q_len, max_kv_len] bool: True = may attend
    max_q_len: int
    max_kv_len: int
    # NOTE: tokens whose slot is negative (an invalid slot) are not written to the cache;
    # write_index lists the tokens that are, or is None when every token is.
    write_index: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.max_q_len == 1


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
) -> ForwardContext:
    """Build the context for a batch. Sequence b has `query_lens[b]` new tokens, the last of which
    sits at position `context_lens[b] - 1`; its KV lives in the blocks `block_tables[b]`."""
    num_seqs = len(query_lens)
    max_q = max(query_lens)
    max_kv = max(context_lens)
    max_blocks = max(len(bt) for bt in block_tables)
    bt = torch.zeros(num_seqs, max_blocks, dtype=torch.int64)
    for i, row in enumerate(block_tables):
        bt[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    kv_lens = torch.tensor(context_lens, dtype=torch.int64)
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_lens)
    starts = torch.cumsum(q_lens, 0) - q_lens
    offset_in_seq = torch.arange(int(q_lens.sum())) - starts[seq_of_token]
    padded_index = seq_of_token * max_q + offset_in_seq
    # Query i of sequence b sits at position kv_len - q_len + i and sees keys at positions <= it.
    q_pos = (kv_lens - q_lens)[:, None] + torch.arange(max_q)[None, :]  # [B, max_q]
    k_pos = torch.arange(max_kv)[None, None, :]  # [1, 1, max_kv]
    mask = k_pos <= q_pos[:, :, None]  # [B, max_q, max_kv]
    # Padding query rows (i >= q_len) attend to key 0 only, so softmax stays finite.
    pad_rows = torch.arange(max_q)[None, :] >= q_lens[:, None]
    mask[pad_rows] = False
    mask[..., 0] |= pad_rows
    slots = torch.tensor(slot_mapping, dtype=torch.int64)
    valid = slots >= 0
    write_index = None if bool(valid.all()) else torch.nonzero(valid).flatten().to(device)
    return ForwardContext(
        slot_mapping=slots.to(device),
        block_tables=bt.to(device),
        context_lens=kv_lens.to(device),
        padded_index=padded_index.to(device),
        attn_mask=mask[:, None].to(device),
        max_q_len=max_q,
        max_kv_len=max_kv,
        write_index=write_index,
    )
