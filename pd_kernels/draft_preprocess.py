"""`draft_preprocess`: the MTP layer's inputs for a step, built from the step's accepted tokens.

The MTP layer's first pass reuses the target step's flat token layout (slot b owns rows
cu_seqlens[b] .. cu_seqlens[b+1]-1, same positions and cache slots): the entry at position p
reads the target's hidden state at p and the token at p + 1. So per slot with q rows from s:
- prefill slot (kind 1, or 2 for a chunk that drafts nothing): mtp_ids[s + j] =
  input_ids[s + j + 1] for j < q - 1, and mtp_ids[s + q - 1] = accepted_ids[b, 0] (the sampled
  token, or the next prompt token of a chunk); the drafting row is s + q - 1;
- decode (verify) slot (kind 0), n = num_accepted[b] tokens emitted: mtp_ids[s + j] =
  accepted_ids[b, min(j, n - 1)] (rows past n - 1 hold rejected drafts' positions; their
  entries are overwritten before they are ever read); the drafting row is s + n - 1.
For the chained drafts, chain_positions[b] = positions[row] + 1 and chain_slots[b, m] is the
cache slot of position chain_positions[b] + m through the slot's block table (m < k - 1), -1
for kind 2 slots and beyond the table. Invalid slots (negative `slot_index`) are skipped:
their outputs keep the initial 0 (mtp_ids, draft_rows, chain_positions) and -1 (chain_slots).
Stopped slots are built like the others; their drafts are simply not used.
"""

from __future__ import annotations

import torch

from pd_kernels.launch import check, launch, use_kernels

DECODE, PREFILL, CHUNK = 0, 1, 2

# NOTE: one slot's MTP ids (returning its drafting row) and a chained position's cache slot as
# device functions, which `pd_kernels.accept_step` calls too
DEVICE = r"""
__device__ long long mtp_rows(int kind, long long s, long long q, const long long* acc,
                              long long n, const long long* input_ids, long long* mtp_ids)
{
    if (kind == 0) {
        n = n < 1 ? 1 : (n > q ? q : n);
        for (long long j = 0; j < q; ++j) mtp_ids[s + j] = acc[j < n - 1 ? j : n - 1];
        return s + n - 1;
    }
    for (long long j = 0; j + 1 < q; ++j) mtp_ids[s + j] = input_ids[s + j + 1];
    mtp_ids[s + q - 1] = acc[0];
    return s + q - 1;
}

__device__ long long chain_slot(int kind, long long p, const long long* table, int max_blocks,
                                int block_size)
{
    long long blk = p / block_size;
    if (kind == 2 || blk >= max_blocks) return -1;
    return table[blk] * block_size + p % block_size;
}
"""

SOURCE = DEVICE + r"""
extern "C" __global__ void draft_preprocess(
    const long long* slot_index, const long long* cu_seqlens, const long long* input_ids,
    const long long* positions, const long long* accepted_ids, const int* num_accepted,
    const int* slot_kind, const long long* block_tables, long long* mtp_ids, long long* draft_rows,
    long long* chain_positions, long long* chain_slots, int num_slots, int k1,
    int max_blocks, int block_size, int num_chain)
{
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= num_slots || slot_index[b] < 0) return;
    long long s = cu_seqlens[b], q = cu_seqlens[b + 1] - s;
    int kind = slot_kind[b];
    long long row = mtp_rows(kind, s, q, accepted_ids + (long long)b * k1, num_accepted[b],
                             input_ids, mtp_ids);
    draft_rows[b] = row;
    long long pos = positions[row] + 1;
    chain_positions[b] = pos;
    for (int m = 0; m < num_chain; ++m)
        chain_slots[(long long)b * num_chain + m] = chain_slot(
            kind, pos + m, block_tables + (long long)b * max_blocks, max_blocks, block_size);
}
"""


def draft_preprocess_ref(slot_index, cu_seqlens, input_ids, positions, accepted_ids, num_accepted,
                         slot_kind, block_tables, block_size, mtp_ids, draft_rows, chain_positions,
                         chain_slots) -> None:
    """The torch twin: same inputs, same in-place outputs."""
    num_slots, num_chain = chain_slots.shape
    num_tokens, max_blocks = input_ids.shape[0], block_tables.shape[1]
    dev = input_ids.device
    starts, q = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]
    seg = torch.repeat_interleave(torch.arange(num_slots, device=dev), q)  # [T] slot of each row
    j = torch.arange(num_tokens, device=dev) - starts[seg]  # [T] offset in its slot
    n = num_accepted.long().clamp(min=1).minimum(q)  # [B]
    next_in = input_ids[(torch.arange(num_tokens, device=dev) + 1).clamp(max=num_tokens - 1)]
    prefill_ids = torch.where(j == q[seg] - 1, accepted_ids[seg, 0], next_in)
    decode_ids = accepted_ids[seg, j.minimum(n[seg] - 1)]
    ids = torch.where(slot_kind[seg] == DECODE, decode_ids, prefill_ids)
    valid = slot_index >= 0
    mtp_ids.copy_(torch.where(valid[seg], ids, mtp_ids))
    rows = torch.where(slot_kind == DECODE, starts + n - 1, starts + q - 1)
    pos = positions[rows] + 1
    p = pos[:, None] + torch.arange(num_chain, device=dev)[None, :]  # [B, num_chain]
    blk = p // block_size
    ok = (slot_kind != CHUNK)[:, None] & (blk < max_blocks) & valid[:, None]
    slots = block_tables.gather(1, blk.clamp(max=max_blocks - 1)) * block_size + p % block_size
    draft_rows.copy_(torch.where(valid, rows, draft_rows))
    chain_positions.copy_(torch.where(valid, pos, chain_positions))
    chain_slots.copy_(torch.where(ok, slots, chain_slots))


def draft_preprocess(slot_index: torch.Tensor, cu_seqlens: torch.Tensor, input_ids: torch.Tensor,
                     positions: torch.Tensor, accepted_ids: torch.Tensor, num_accepted: torch.Tensor,
                     slot_kind: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                     num_chain: int, use_kernel: bool | None = None):
    """Returns (mtp_ids [T], draft_rows [B], chain_positions [B], chain_slots [B, num_chain]),
    all int64. Shapes: slot_index [B] int64, cu_seqlens [B+1] int64, input_ids / positions [T]
    int64, accepted_ids [B, k+1] int64, num_accepted [B] int32, slot_kind [B] int32,
    block_tables [B, M] int64."""
    num_slots, k1 = accepted_ids.shape
    num_tokens = input_ids.shape[0]
    dev = input_ids.device
    for t, name, dtype, shape in (
        (slot_index, "slot_index", torch.int64, (num_slots,)),
        (cu_seqlens, "cu_seqlens", torch.int64, (num_slots + 1,)),
        (input_ids, "input_ids", torch.int64, (num_tokens,)),
        (positions, "positions", torch.int64, (num_tokens,)),
        (accepted_ids, "accepted_ids", torch.int64, (num_slots, k1)),
        (num_accepted, "num_accepted", torch.int32, (num_slots,)),
        (slot_kind, "slot_kind", torch.int32, (num_slots,)),
        (block_tables, "block_tables", torch.int64, (num_slots, None)),
    ):
        check(t, name, dtype, shape, dev)
    mtp_ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
    draft_rows = torch.zeros(num_slots, dtype=torch.int64, device=dev)
    chain_positions = torch.zeros(num_slots, dtype=torch.int64, device=dev)
    chain_slots = torch.full((num_slots, num_chain), -1, dtype=torch.int64, device=dev)
    if use_kernel if use_kernel is not None else use_kernels(input_ids):
        import numpy as np  # noqa: PLC0415

        launch("draft_preprocess", SOURCE, num_slots,
               [slot_index, cu_seqlens, input_ids, positions, accepted_ids, num_accepted,
                slot_kind, block_tables, mtp_ids, draft_rows, chain_positions, chain_slots,
                np.int32(num_slots), np.int32(k1), np.int32(block_tables.shape[1]),
                np.int32(block_size), np.int32(num_chain)])
    else:
        draft_preprocess_ref(slot_index, cu_seqlens, input_ids, positions, accepted_ids,
                             num_accepted, slot_kind, block_tables, block_size, mtp_ids,
                             draft_rows, chain_positions, chain_slots)
    return mtp_ids, draft_rows, chain_positions, chain_slots
