"""The MTP drafter: the checkpoint's MTP layer proposes k draft tokens per sampled request, and
its KV cache layer is kept in step with the target's.

After each target step (`pd.spec.verify`), one MTP pass runs over the step's own token layout
(same positions, same cache slots, same attention context): the entry at position p reads the
target's pre-norm hidden state at p and the token at p + 1 (`pd_kernels.draft_preprocess` builds
those ids from the accepted tokens). The output at each sampled slot's last accepted position
gives draft 1 (argmax); drafts 2..k chain: the entry at the next position reads the previous
draft's embedding and the previous MTP output, one token per slot per pass, attending over the
slot's MTP KV. Entries past the accepted run are written but never read before being rewritten
(a later pass writes a position before any query reads it). Blocks for the chained positions
are the scheduler's lookahead slots. Acceptance is the verifier's.
"""

from __future__ import annotations

import torch

from pd_kernels import draft_preprocess
from pd.model.context import ForwardContext, forward_context


class MTPDrafter:
    def __init__(self, runner, num_speculative_tokens: int) -> None:
        if not runner.model_config.has_mtp:
            raise ValueError("MTP speculative decoding needs a checkpoint with an MTP layer "
                             "(config.json num_nextn_predict_layers: 1)")
        self.runner, self.k = runner, num_speculative_tokens
        self.model = runner.model

    def chain_context(self, block_tables: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor, max_kv_len: int) -> ForwardContext:
        """One query per slot at `positions` (device tensors; nothing here waits on the host)."""
        num_slots = positions.shape[0]
        keys = torch.arange(max_kv_len, device=positions.device)
        return ForwardContext(
            slot_mapping=slots,
            block_tables=block_tables,
            context_lens=positions + 1,
            padded_index=torch.arange(num_slots, device=positions.device),
            attn_mask=(keys[None, :] <= positions[:, None])[:, None, None, :],
            max_q_len=1,
            max_kv_len=max_kv_len,
        )

    @torch.inference_mode()
    def propose(self, step, hidden: torch.Tensor, accepted: torch.Tensor,
                num_accepted: torch.Tensor) -> torch.Tensor:
        """Drafts [S, k] for the step's sampled slots. `accepted` [S, k+1] / `num_accepted` [S]
        are the verifier's (the untruncated run: the target's KV holds all of it)."""
        k, model, dev = self.k, self.model, hidden.device
        num_slots = step.cu_seqlens.shape[0] - 1
        # Every slot of the batch: chunks carry their next prompt token, sampled slots the run.
        acc_all = torch.zeros(num_slots, k + 1, dtype=torch.int64, device=dev)
        acc_all[:, 0] = step.next_ids
        num_all = torch.ones(num_slots, dtype=torch.int32, device=dev)
        if accepted.shape[0]:
            acc_all.index_copy_(0, step.sample_slots, accepted)
            num_all.index_copy_(0, step.sample_slots, num_accepted)
        ctx = step.context
        mtp_ids, draft_rows, chain_pos, chain_slots = draft_preprocess(
            torch.arange(num_slots, device=dev), step.cu_seqlens, step.input_ids, step.positions,
            acc_all, num_all, step.slot_kind, ctx.block_tables, self.runner.block_size, k - 1)
        with forward_context(ctx):
            out = model.mtp_forward(mtp_ids, step.positions, hidden)
        if not accepted.shape[0]:
            return torch.zeros(0, k, dtype=torch.int64, device=dev)
        sel = step.sample_slots
        prev = out[draft_rows[sel]]  # [S, H]
        drafts = [model.compute_logits(prev).argmax(dim=-1)]
        tables, pos, slots = ctx.block_tables[sel], chain_pos[sel], chain_slots[sel]
        max_kv = min(step.max_position + k, tables.shape[1] * self.runner.block_size)
        for m in range(k - 1):
            with forward_context(self.chain_context(tables, pos + m, slots[:, m].contiguous(), max_kv)):
                prev = model.mtp_forward(drafts[-1], pos + m, prev)
            drafts.append(model.compute_logits(prev).argmax(dim=-1))
        return torch.stack(drafts, dim=1)
