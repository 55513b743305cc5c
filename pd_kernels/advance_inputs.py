"""`advance_inputs`: a chained MTP step's inputs from the previous step's packed result, in place.

The overlap loop launches MTP step N + 1 before the host has read step N, so N + 1's inputs are
computed on the device from N's result row per slot (`pd.spec.graphs`: accepted ids [k + 1],
kept count, verified count, stop flag, drafts [k]). Per slot b, with n = kept:
- the slot moves past its n kept tokens: seq_lens += n, num_outputs += n, and its newest token
  (accepted[n - 1]) sits at position positions[b, 0] + n;
- it stays live if its slot index is not negative and it did not stop (flag 0); a live slot
  drafts as many tokens as its length budget leaves, min(k, max_seq_lens - seq_lens - 1), the
  scheduler's cut; a slot that is not live gets slot index -1 and no drafts;
- rows j = 0 .. num_drafts (the newest token, then the drafts) get their token, position,
  cache slot (through the slot's block table) and KV length (position + 1); the other rows are
  padding: token 0 at position 0, KV length 1, written to the spare slot `spare_slot`.
One thread per slot (the padding slots included, which keep their padding); a CuPy RawKernel on
torch's current stream, capturable in a CUDA graph, with its torch twin.
"""

from __future__ import annotations

import torch

from pd_kernels.launch import check, launch, use_kernels

SOURCE = r"""
extern "C" __global__ void advance_inputs(
    const long long* result, long long* input_ids, long long* positions, long long* slot_mapping,
    long long* context_lens, long long* draft_ids, long long* num_drafts, long long* seq_lens,
    long long* num_outputs, const long long* block_tables, const long long* max_seq_lens,
    long long* slot_index, int num_slots, int k, int width, int block_size, long long spare_slot)
{
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= num_slots) return;
    int k1 = k + 1;
    const long long* r = result + (long long)b * (2 * k + 4);
    const long long* drafts = r + k1 + 3;
    long long kept = r[k1];
    long long seq = seq_lens[b] + kept;
    long long start = positions[(long long)b * k1] + kept;
    bool live = slot_index[b] >= 0 && r[k1 + 2] == 0;
    long long nd = 0;
    if (live) {
        nd = max_seq_lens[b] - seq - 1;
        nd = nd < 0 ? 0 : (nd > k ? k : nd);
    }
    long long newest = r[kept > 1 ? kept - 1 : 0];
    for (int j = 0; j < k1; ++j) {
        long long o = (long long)b * k1 + j;
        long long pos = start + j;
        if (live && j <= nd) {
            long long blk = pos / block_size;
            blk = blk < 0 ? 0 : (blk > width - 1 ? width - 1 : blk);
            input_ids[o] = j == 0 ? newest : drafts[j - 1];
            positions[o] = pos;
            slot_mapping[o] = block_tables[(long long)b * width + blk] * block_size + pos % block_size;
            context_lens[o] = pos + 1;
        } else {
            input_ids[o] = 0;
            positions[o] = 0;
            slot_mapping[o] = spare_slot;
            context_lens[o] = 1;
        }
        if (j < k) draft_ids[(long long)b * k + j] = j < nd ? drafts[j] : 0;
    }
    num_drafts[b] = nd;
    seq_lens[b] = seq;
    num_outputs[b] += kept;
    if (!live) slot_index[b] = -1;
}
"""

INPUTS = ("input_ids", "positions", "slot_mapping", "context_lens", "draft_ids", "num_drafts",
          "seq_lens", "num_outputs", "block_tables", "max_seq_lens", "slot_index")


def advance_inputs_ref(result, input_ids, positions, slot_mapping, context_lens, draft_ids,
                       num_drafts, seq_lens, num_outputs, block_tables, max_seq_lens, slot_index,
                       block_size: int, spare_slot: int) -> None:
    """The torch twin: same inputs, same in-place updates."""
    k = draft_ids.shape[1]
    k1, width = k + 1, block_tables.shape[1]
    accepted, kept, flags, drafts = result[:, :k1], result[:, k1], result[:, k1 + 2], result[:, k1 + 3:]
    seq = seq_lens + kept
    start = positions[:, 0] + kept  # the newest token's position
    live = (slot_index >= 0) & (flags == 0)
    nd = torch.where(live, (max_seq_lens - seq - 1).clamp(0, k), 0)
    newest = accepted.gather(1, (kept - 1).clamp(min=0)[:, None])
    j = torch.arange(k1, device=result.device)[None, :]
    valid = (j <= nd[:, None]) & live[:, None]
    pos = start[:, None] + j
    table_of = block_tables.gather(1, (pos // block_size).clamp(0, width - 1))
    input_ids.copy_(torch.where(valid, torch.cat([newest, drafts], dim=1), 0))
    positions.copy_(torch.where(valid, pos, 0))
    slot_mapping.copy_(torch.where(valid, table_of * block_size + pos % block_size, spare_slot))
    context_lens.copy_(torch.where(valid, pos + 1, 1))
    draft_ids.copy_(torch.where(j[:, :k] < nd[:, None], drafts, 0))
    num_drafts.copy_(nd)
    seq_lens.copy_(seq)
    num_outputs.add_(kept)
    slot_index.copy_(torch.where(live, slot_index, -1))


def advance_inputs(result: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                   slot_mapping: torch.Tensor, context_lens: torch.Tensor, draft_ids: torch.Tensor,
                   num_drafts: torch.Tensor, seq_lens: torch.Tensor, num_outputs: torch.Tensor,
                   block_tables: torch.Tensor, max_seq_lens: torch.Tensor, slot_index: torch.Tensor,
                   block_size: int, spare_slot: int, use_kernel: bool | None = None):
    """Updates every input but `result`, `block_tables` and `max_seq_lens` in place and returns
    them. All int64, contiguous: result [S, 2k + 4], input_ids / positions / slot_mapping /
    context_lens [S, k + 1], draft_ids [S, k], block_tables [S, W], the rest [S]."""
    num_slots, k = draft_ids.shape
    dev = result.device
    for t, name, shape in (
        (result, "result", (num_slots, 2 * k + 4)), (input_ids, "input_ids", (num_slots, k + 1)),
        (positions, "positions", (num_slots, k + 1)), (slot_mapping, "slot_mapping", (num_slots, k + 1)),
        (context_lens, "context_lens", (num_slots, k + 1)), (draft_ids, "draft_ids", (num_slots, k)),
        (num_drafts, "num_drafts", (num_slots,)), (seq_lens, "seq_lens", (num_slots,)),
        (num_outputs, "num_outputs", (num_slots,)), (block_tables, "block_tables", (num_slots, None)),
        (max_seq_lens, "max_seq_lens", (num_slots,)), (slot_index, "slot_index", (num_slots,)),
    ):
        check(t, name, torch.int64, shape, dev)
    args = (result, input_ids, positions, slot_mapping, context_lens, draft_ids, num_drafts,
            seq_lens, num_outputs, block_tables, max_seq_lens, slot_index)
    if use_kernel if use_kernel is not None else use_kernels(result):
        import numpy as np  # noqa: PLC0415

        launch("advance_inputs", SOURCE, num_slots,
               [*args, np.int32(num_slots), np.int32(k), np.int32(block_tables.shape[1]),
                np.int32(block_size), np.int64(spare_slot)])
    else:
        advance_inputs_ref(*args, block_size, spare_slot)
    return (input_ids, positions, slot_mapping, context_lens, draft_ids, num_drafts, seq_lens,
            num_outputs, slot_index)
