"""`accept_step`: a graphed MTP step's bookkeeping between the verify forward and the MTP layer,
in one kernel: what `verify_accept`, `update_status` and `draft_preprocess` do for a step of
decode slots, with their own device functions, written where the draft chain reads it.

The step's layout is `pd.spec.graphs`': slot b owns rows b * (k + 1) .. b * (k + 1) + k. Per
slot, the accepted run (`verify_accept`, every target probability 1: the graphs' sampled rows
carry their draft probabilities and uniforms so), its stops on copies of the lengths
(`update_status`: the inputs are not changed), the MTP layer's ids over the step's rows and
the drafting row (`draft_preprocess`, decode kind). Written:
- result [S, 2k + 4] columns 0 .. k + 3: the accepted ids, the kept count, the verified count
  and the stop flag (the drafts' k columns are the draft chain's to write);
- mtp_ids [S (k + 1)], draft_rows [S];
- chain_positions [k, S]: row m holds each slot's m-th chained position (its drafting row's
  position + 1 + m), so the chained pass m reads row m as positions and row m + 1 as KV
  lengths without a kernel of its own;
- chain_slots [k - 1, S]: the cache slots of chained pass m, by pass, the spare slot where
  `draft_preprocess` has none.
A padding slot (negative `slot_index`) gets what the three kernels leave in freshly made
outputs: accepted -1, counts and flag 0, ids and drafting row 0, chained positions 0 + m,
the spare slot. One thread per slot; a CuPy RawKernel on torch's current stream, capturable in
a CUDA graph, with its torch twin (the three kernels' twins).
"""

from __future__ import annotations

import torch

from pd_kernels.draft_preprocess import DEVICE as PREPROCESS, draft_preprocess
from pd_kernels.launch import check, launch, use_kernels
from pd_kernels.update_status import DEVICE as STATUS, update_status
from pd_kernels.verify_accept import DEVICE as ACCEPT, verify_accept

SOURCE = ACCEPT + STATUS + PREPROCESS + r"""
extern "C" __global__ void accept_step(
    const long long* slot_index, const long long* num_drafts, const long long* draft_ids,
    const long long* target_ids, const float* target_probs, const float* uniforms,
    const long long* greedy, const long long* seq_lens, const long long* num_outputs,
    const long long* max_seq_lens, const long long* min_tokens, const long long* stop_ids,
    const long long* positions, const long long* block_tables, long long* result,
    long long* mtp_ids, long long* draft_rows, long long* chain_positions,
    long long* chain_slots, int num_slots, int k, int num_stop, int width, int block_size,
    long long spare_slot)
{
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= num_slots) return;
    int k1 = k + 1;
    long long* r = result + (long long)b * (2 * k + 4);
    long long s = (long long)b * k1;
    if (slot_index[b] < 0) {
        for (int j = 0; j < k1; ++j) { r[j] = -1; mtp_ids[s + j] = 0; }
        r[k1] = 0; r[k1 + 1] = 0; r[k1 + 2] = 0;
        draft_rows[b] = 0;
        for (int m = 0; m < k; ++m) chain_positions[(long long)m * num_slots + b] = m;
        for (int m = 0; m + 1 < k; ++m) chain_slots[(long long)m * num_slots + b] = spare_slot;
        return;
    }
    long long o = (long long)b * k;
    int verified = accept_run((int)num_drafts[b], draft_ids + o, target_ids + s, nullptr,
                              target_probs + o, uniforms + o, greedy[b] != 0, r, k);
    int kept = verified;
    long long len = seq_lens[b], outs = num_outputs[b];
    int flag = stop_in_run(r, &kept, &len, &outs, max_seq_lens[b], min_tokens[b],
                           stop_ids + (long long)b * num_stop, num_stop);
    r[k1] = kept; r[k1 + 1] = verified; r[k1 + 2] = flag;
    long long row = mtp_rows(0, s, k1, r, verified, nullptr, mtp_ids);
    draft_rows[b] = row;
    long long pos = positions[row] + 1;
    for (int m = 0; m < k; ++m) chain_positions[(long long)m * num_slots + b] = pos + m;
    for (int m = 0; m + 1 < k; ++m) {
        long long slot = chain_slot(0, pos + m, block_tables + (long long)b * width, width,
                                    block_size);
        chain_slots[(long long)m * num_slots + b] = slot < 0 ? spare_slot : slot;
    }
}
"""

def accept_step_ref(slot_index, num_drafts, draft_ids, target_ids, target_probs, uniforms, greedy,
                    seq_lens, num_outputs, max_seq_lens, min_tokens, stop_ids, positions,
                    block_tables, result, mtp_ids, draft_rows, chain_positions, chain_slots,
                    block_size: int, spare_slot: int) -> None:
    """The torch twin: the three kernels' twins, their outputs laid out as the kernel's."""
    num_slots, k = draft_ids.shape
    k1, dev = k + 1, draft_ids.device
    accepted, kept = verify_accept(
        slot_index, num_drafts.to(torch.int32), draft_ids, target_ids, torch.ones_like(target_probs),
        target_probs, uniforms, greedy.to(torch.int32), use_kernel=False)
    verified = kept.clone()
    flags = torch.zeros(num_slots, dtype=torch.int32, device=dev)
    update_status(slot_index, accepted, kept, seq_lens.clone(), num_outputs.clone(), max_seq_lens,
                  min_tokens, stop_ids, flags, use_kernel=False)
    flat = positions.reshape(-1)
    ids, rows, pos, slots = draft_preprocess(
        slot_index, torch.arange(num_slots + 1, device=dev) * k1, flat, flat, accepted, verified,
        torch.zeros(num_slots, dtype=torch.int32, device=dev), block_tables, block_size, k - 1,
        use_kernel=False)
    result[:, :k1] = accepted
    result[:, k1:k1 + 3] = torch.stack([kept, verified, flags], dim=1)
    mtp_ids.copy_(ids)
    draft_rows.copy_(rows)
    chain_positions.copy_(pos[None, :] + torch.arange(k, device=dev)[:, None])
    chain_slots.copy_(torch.where(slots < 0, spare_slot, slots).t())


def accept_step(slot_index: torch.Tensor, num_drafts: torch.Tensor, draft_ids: torch.Tensor,
                target_ids: torch.Tensor, target_probs: torch.Tensor, uniforms: torch.Tensor,
                greedy: torch.Tensor, seq_lens: torch.Tensor, num_outputs: torch.Tensor,
                max_seq_lens: torch.Tensor, min_tokens: torch.Tensor, stop_ids: torch.Tensor,
                positions: torch.Tensor, block_tables: torch.Tensor, *, block_size: int,
                spare_slot: int, result: torch.Tensor | None = None,
                use_kernel: bool | None = None):
    """Returns (result [S, 2k + 4], mtp_ids [S (k + 1)], draft_rows [S], chain_positions
    [k, S], chain_slots [k - 1, S]), all int64; `result` (written but for its drafts' columns)
    may be given. Shapes: draft_ids, target_probs, uniforms [S, k] (probabilities float32),
    target_ids and positions [S, k + 1], stop_ids [S, N], block_tables [S, W], the rest [S];
    integers int64, every input contiguous."""
    num_slots, k = draft_ids.shape
    dev = draft_ids.device
    for t, name, dtype, shape in (
        (slot_index, "slot_index", torch.int64, (num_slots,)),
        (num_drafts, "num_drafts", torch.int64, (num_slots,)),
        (draft_ids, "draft_ids", torch.int64, (num_slots, k)),
        (target_ids, "target_ids", torch.int64, (num_slots, k + 1)),
        (target_probs, "target_probs", torch.float32, (num_slots, k)),
        (uniforms, "uniforms", torch.float32, (num_slots, k)),
        (greedy, "greedy", torch.int64, (num_slots,)),
        (seq_lens, "seq_lens", torch.int64, (num_slots,)),
        (num_outputs, "num_outputs", torch.int64, (num_slots,)),
        (max_seq_lens, "max_seq_lens", torch.int64, (num_slots,)),
        (min_tokens, "min_tokens", torch.int64, (num_slots,)),
        (stop_ids, "stop_ids", torch.int64, (num_slots, None)),
        (positions, "positions", torch.int64, (num_slots, k + 1)),
        (block_tables, "block_tables", torch.int64, (num_slots, None)),
    ):
        check(t, name, dtype, shape, dev)
    if result is None:
        result = torch.empty(num_slots, 2 * k + 4, dtype=torch.int64, device=dev)
    elif result.shape != (num_slots, 2 * k + 4) or result.dtype != torch.int64 or not result.is_contiguous():
        raise ValueError(f"result {tuple(result.shape)} {result.dtype} does not fit "
                         f"[{num_slots}, {2 * k + 4}] int64")
    mtp_ids = torch.empty(num_slots * (k + 1), dtype=torch.int64, device=dev)
    draft_rows = torch.empty(num_slots, dtype=torch.int64, device=dev)
    chain_positions = torch.empty(k, num_slots, dtype=torch.int64, device=dev)
    chain_slots = torch.empty(k - 1, num_slots, dtype=torch.int64, device=dev)
    outputs = (result, mtp_ids, draft_rows, chain_positions, chain_slots)
    if use_kernel if use_kernel is not None else use_kernels(draft_ids):
        import numpy as np  # noqa: PLC0415

        launch("accept_step", SOURCE, num_slots,
               [slot_index, num_drafts, draft_ids, target_ids, target_probs, uniforms, greedy,
                seq_lens, num_outputs, max_seq_lens, min_tokens, stop_ids, positions,
                block_tables, *outputs, np.int32(num_slots), np.int32(k),
                np.int32(stop_ids.shape[1]), np.int32(block_tables.shape[1]),
                np.int32(block_size), np.int64(spare_slot)])
    else:
        accept_step_ref(slot_index, num_drafts, draft_ids, target_ids, target_probs, uniforms,
                        greedy, seq_lens, num_outputs, max_seq_lens, min_tokens, stop_ids,
                        positions, block_tables, *outputs, block_size=block_size,
                        spare_slot=spare_slot)
    return outputs
