"""CUDA graphs of the MTP step: the verify forward and the whole draft chain, per padded batch.

A step whose slots are all decode (verify) slots is laid out at a fixed stride: slot b owns
query rows b * (k + 1) .. b * (k + 1) + k, its newest token then its n <= k drafts, and rows
past n are padding (token 0 at position 0, written to the cache's spare block). Every row is
run as its own one-query sequence over its slot's block table with KV length position + 1, so
the verify forward is a plain decode forward of S * (k + 1) rows: the same layers and the same
attention kernel as a plain decode step (`pd_kernels.paged_decode`), and no mask.

Graphs per (padded slot count, padded block-table width; no narrower than MIN_WIDTH_TOKENS),
sharing the decode graphs' memory pool:
- verify: target forward, logits of every row (in the model's dtype: the argmax and the token
  logprobs read them as they are, a sampler widens them), the greedy target (argmax) of every row;
- draft: acceptance, stops inside the accepted run and the MTP layer's inputs in one kernel
  (`pd_kernels.accept_step`), the layer's pass over the step's rows and the k - 1 chained
  single-token passes, each with the LM head at the slots' drafting rows and its argmax
  (`CausalLM.mtp_logits`), and one packed int64 result [S, 2k + 4] (accepted ids, kept count,
  verified count, stop flag, drafts; every part written in place) that the host copies back
  in one transfer;
- advance: the next step's inputs from that result, on the device, for a step launched before
  the host has read this one (`pd_kernels.advance_inputs`, one kernel; the overlap loop);
- chain: advance, verify and draft in one graph, for such a step when no logprobs are asked;
- logprobs: the raw logprobs of every row's accepted token, one graph per top-k width; with
  top_logprobs 0 a second draft graph instead, the draft chain followed by each row's token
  logprob and rank (`pd_kernels.token_logprob`) packed after the result, so one replay and one host
  copy carry both.
Greedy rows without logit processing need nothing between the two replays. Other rows
(sampling, penalties, min_tokens) overwrite the target ids, the target's draft probabilities
and the acceptance uniforms between the replays (`pd.spec.verify`); the kernels read them from
these static buffers. Padding slots have slot index -1: every kernel skips them.

Inputs travel in one int64 buffer per (S, W), filled by one host-to-device copy (`host_inputs`
builds it; a chained step copies only the part the host knows, `Layout.tail`). On CPU the same
layout runs without capture (`pool_owner` None), which is how the tests check it. `SpecGraphs`
here holds the layout and the passes; the graphs of each (S, W) and their static buffers are a
`pd.spec.step_graphs.StepGraphs`.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pd_kernels import update_status, verify_accept
from pd_kernels.accept_step import accept_step
from pd_kernels.advance_inputs import INPUTS as ADVANCED, advance_inputs
from pd_kernels.argmax import argmax
from pd_kernels.launch import use_kernels
from pd.engine.cuda_graph import BATCH_SIZES, round_up
from pd.model.context import ForwardContext, forward_context
from pd.spec.step_graphs import StepGraphs, Verified

log = logging.getLogger(__name__)

STOP_WIDTH = 8  # stop ids a graphed slot may carry (EOS ids + stop_token_ids); more: eager
MAX_ROWS = 1024  # S * (k + 1) rows at most per graph (the logits of every row are kept)
MIN_WIDTH_TOKENS = 512  # the narrowest block table of a graph holds this many tokens


class FlatLayout:
    """Named arrays laid out one after another in one flat buffer: `fields` (name, start, end,
    shape) in the order of `shapes`, `size` in all."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.fields, total = [], 0
        for name, shape in shapes.items():
            size = int(np.prod(shape))
            self.fields.append((name, total, total + size, shape))
            total += size
        self.size = total

    def views(self, flat):
        """name -> view of `flat` (a numpy array or a torch tensor) in its shape."""
        return {name: flat[start:end].reshape(shape) for name, start, end, shape in self.fields}


class Layout(FlatLayout):
    """Where each input lives in the flat int64 buffer of one (S, W) graph."""

    def __init__(self, num_slots: int, width: int, k: int) -> None:
        super().__init__({
            # what a chained step computes on the device from the previous step's result
            "input_ids": (num_slots, k + 1), "positions": (num_slots, k + 1),
            "slot_mapping": (num_slots, k + 1), "context_lens": (num_slots, k + 1),
            "draft_ids": (num_slots, k), "num_drafts": (num_slots,), "seq_lens": (num_slots,),
            "num_outputs": (num_slots,),
            # what the host knows before that result (from `tail` on)
            "block_tables": (num_slots, width), "greedy": (num_slots,),
            "max_seq_lens": (num_slots,), "min_tokens": (num_slots,),
            "stop_ids": (num_slots, STOP_WIDTH), "slot_index": (num_slots,),
        })
        self.tail = next(start for name, start, _, _ in self.fields if name == "block_tables")
        self.template: np.ndarray | None = None  # every slot padding (`SpecGraphs.host_inputs`)


class SpecGraphs:
    """`pool_owner`: the decode graphs (`pd.engine.cuda_graph.DecodeGraphs`), whose memory pool
    these graphs share; None runs the same layout without capture."""

    def __init__(self, model: torch.nn.Module, k: int, *, block_size: int, dummy_block: int,
                 batch_sizes: tuple[int, ...], block_widths: tuple[int, ...],
                 device: torch.device, pool_owner=None) -> None:
        self.model, self.k, self.device = model, k, device
        self.block_size, self.dummy_block = block_size, dummy_block
        self.pool_owner = pool_owner
        # NOTE: asked once, not per step (the environment's lookup is in `key`'s every call)
        self.graphed_bookkeeping = pool_owner is None or use_kernels(pool_owner.staging)
        self.slot_counts = tuple(s for s in batch_sizes if s == 1 or s * (k + 1) <= MAX_ROWS)
        self.block_widths = block_widths
        # NOTE: the narrowest table a step's graph gets: a request crossing into a wider graph
        # breaks the chain of steps computed on the device (the host waits for the step in
        # flight, then launches the next), 5 times in a 256-token request at batch 1 with
        # widths from 1 block; a wider table only adds attention splits that do nothing
        self.min_width = next((w for w in block_widths if w * block_size >= MIN_WIDTH_TOKENS),
                              block_widths[-1])
        self.graphs: dict[tuple[int, int], StepGraphs] = {}
        # NOTE: a benchmark hook (benchmarks/gpu/bench_mtp_mechanism.py): the greedy
        # continuation every slot shares [L], proposed as the drafts (after the MTP layer ran,
        # or instead of it with oracle_only), to time the machinery with every draft accepted.
        # Set before the first capture.
        self.oracle: torch.Tensor | None = None
        self.oracle_only = False
        self.layouts: dict[tuple[int, int], Layout] = {}

    @classmethod
    def for_decode_graphs(cls, model: torch.nn.Module, k: int, decode, device: torch.device):
        return cls(model, k, block_size=decode.block_size, dummy_block=decode.dummy_block,
                   batch_sizes=decode.batch_sizes, block_widths=decode.block_widths,
                   device=device, pool_owner=decode)

    @classmethod
    def uncaptured(cls, model: torch.nn.Module, k: int, runner) -> "SpecGraphs":
        """The layout without capture, for a runner with a spare block
        (`pd.engine.runner.SPEC_LAYOUT_ENV`)."""
        max_blocks = -(-runner.max_model_len // runner.block_size)
        sizes = tuple(s for s in BATCH_SIZES if s < runner.config.max_num_seqs) + (
            runner.config.max_num_seqs,)
        widths = tuple(1 << i for i in range((max_blocks - 1).bit_length() + 1))
        return cls(model, k, block_size=runner.block_size, dummy_block=runner.kv_cache.dummy_block,
                   batch_sizes=sizes, block_widths=widths, device=runner.device)

    def key(self, num_slots: int, num_blocks: int) -> tuple[int, int] | None:
        """(padded slots, padded width) of a step, or None when it is too large for a graph
        or the bookkeeping runs as torch twins (PD_KERNELS=torch: they wait on the host)."""
        if num_slots > self.slot_counts[-1] or num_blocks > self.block_widths[-1]:
            return None
        if not self.graphed_bookkeeping:
            return None
        return (round_up(num_slots, self.slot_counts),
                round_up(max(num_blocks, self.min_width), self.block_widths))

    # -- host: the inputs ----------------------------------------------------------------------
    def layout(self, key: tuple[int, int]) -> Layout:
        layout = self.layouts.get(key)
        if layout is None:
            layout = self.layouts[key] = Layout(*key, self.k)
            template = np.empty(layout.size, dtype=np.int64)
            views = layout.views(template)
            spare = self.dummy_block * self.block_size
            for name, value in (("input_ids", 0), ("positions", 0), ("slot_mapping", spare),
                                ("context_lens", 1), ("block_tables", self.dummy_block),
                                ("draft_ids", 0), ("num_drafts", 0), ("greedy", 1),
                                ("seq_lens", 0), ("num_outputs", 0), ("max_seq_lens", 1 << 40),
                                ("min_tokens", 0), ("stop_ids", -1), ("slot_index", -1)):
                views[name][...] = value
            layout.template = template
        return layout

    def host_inputs(self, key: tuple[int, int]) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """A host int64 buffer for `key` (pinned on CUDA) with every slot set to padding, and
        numpy views of it for the caller to fill its slots."""
        layout = self.layout(key)
        host = torch.empty(layout.size, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        flat = host.numpy()
        flat[:] = layout.template
        return host, layout.views(flat)

    def constants(self, num_slots: int) -> dict[str, torch.Tensor]:
        """Index tensors of an S-slot step that never change (made before a capture, so that no
        replay computes them): "slots" 0 .. S - 1, "rows" 0 .. S (k + 1) - 1."""
        return {"slots": torch.arange(num_slots, device=self.device),
                "rows": torch.arange(num_slots * (self.k + 1), device=self.device)}

    # -- device --------------------------------------------------------------------------------
    def _verify(self, v: dict[str, torch.Tensor], width: int) -> Verified:
        num_slots = v["slot_index"].shape[0]
        k1 = self.k + 1
        rows = num_slots * k1
        ctx = ForwardContext(
            slot_mapping=v["slot_mapping"].reshape(rows),
            block_tables=v["block_tables"], table_rows=k1,
            context_lens=v["context_lens"].reshape(rows),
            padded_index=v["rows"],
            attn_mask=None, max_q_len=1, max_kv_len=width * self.block_size)
        with forward_context(ctx):
            hidden, logits = self.model.forward_logits(v["input_ids"].reshape(rows),
                                                       v["positions"].reshape(rows))
        return Verified(hidden, logits, argmax(logits).view(num_slots, k1), ctx)

    def _draft(self, v: dict[str, torch.Tensor], ver: Verified, p_draft: torch.Tensor,
               uniforms: torch.Tensor, width: int) -> torch.Tensor:
        """The step's result [S, 2k + 4]: acceptance, stops and the MTP layer's inputs in one
        kernel (`pd_kernels.accept_step`), then the draft chain writing the drafts' columns."""
        k, dev = self.k, self.device
        result, mtp_ids, draft_rows, chain_pos, chain_slots = accept_step(
            v["slot_index"], v["num_drafts"], v["draft_ids"], ver.target, p_draft, uniforms,
            v["greedy"], v["seq_lens"], v["num_outputs"], v["max_seq_lens"], v["min_tokens"],
            v["stop_ids"], v["positions"], v["block_tables"], block_size=self.block_size,
            spare_slot=self.dummy_block * self.block_size)
        drafts = result[:, k + 4:]
        if self.oracle is None or not self.oracle_only:
            with forward_context(ver.context):
                prev, logits = self.model.mtp_logits(mtp_ids, v["positions"].reshape(-1),
                                                     ver.hidden, rows=draft_rows)
            self.chain_drafts(prev, logits, chain_pos, chain_slots, v["block_tables"], width,
                              drafts, v["slots"])
        if self.oracle is not None:  # the benchmark's perfect drafter
            done = v["num_outputs"] + result[:, k + 1]
            index = done[:, None] + torch.arange(k, device=dev)[None, :]
            drafts.copy_(self.oracle[index.clamp(max=self.oracle.shape[0] - 1)])
        return result

    def accept(self, v: dict[str, torch.Tensor], target: torch.Tensor, p_draft: torch.Tensor,
               uniforms: torch.Tensor):
        """Acceptance (`verify_accept`) and stops inside the accepted run (`update_status`) of
        the slots in `v`: (accepted [S, k + 1], kept [S], verified [S], stop flags [S])."""
        slot_index = v["slot_index"]
        accepted, num_kept = verify_accept(
            slot_index, v["num_drafts"].to(torch.int32), v["draft_ids"], target,
            torch.ones_like(p_draft), p_draft, uniforms, v["greedy"].to(torch.int32))
        num_verified = num_kept.clone()
        stop_flags = torch.zeros(slot_index.shape[0], dtype=torch.int32, device=self.device)
        update_status(slot_index, accepted, num_kept, v["seq_lens"].clone(), v["num_outputs"].clone(),
                      v["max_seq_lens"], v["min_tokens"], v["stop_ids"], stop_flags)
        return accepted, num_kept, num_verified, stop_flags

    def chain_drafts(self, prev: torch.Tensor, logits: torch.Tensor, chain_pos: torch.Tensor,
                     chain_slots: torch.Tensor, block_tables: torch.Tensor, width: int,
                     drafts: torch.Tensor, slots: torch.Tensor) -> None:
        """The drafts [S, k] into `drafts` (the result's columns) from the MTP layer's output
        at each slot's drafting row, `prev` [S, H] and its `logits`: their argmax, then k - 1
        chained single-token passes, pass m at positions `chain_pos[m]` [k, S] writing the MTP
        layer's KV at `chain_slots[m]` [k - 1, S] (`pd_kernels.accept_step`'s layout, or
        `by_pass`'); `slots`: 0 .. S - 1."""
        argmax(logits, out=drafts[:, 0])
        for m in range(self.k - 1):
            ctx = ForwardContext(
                slot_mapping=chain_slots[m], block_tables=block_tables,
                context_lens=chain_pos[m + 1], padded_index=slots,
                attn_mask=None, max_q_len=1, max_kv_len=width * self.block_size)
            with forward_context(ctx):
                prev, logits = self.model.mtp_logits(drafts[:, m], chain_pos[m], prev)
            argmax(logits, out=drafts[:, m + 1])

    def by_pass(self, chain_pos: torch.Tensor, chain_slots: torch.Tensor):
        """`pd_kernels.draft_preprocess`' chained positions [S] and cache slots [S, k - 1] (-1:
        none) laid out as `chain_drafts` reads them: [k, S] positions, [k - 1, S] slots (the
        spare slot for none)."""
        spare = self.dummy_block * self.block_size
        positions = chain_pos[None, :] + torch.arange(self.k, device=self.device)[:, None]
        return positions, torch.where(chain_slots < 0, spare, chain_slots).t().contiguous()

    def _advance(self, v: dict[str, torch.Tensor], result: torch.Tensor) -> None:
        """Step N + 1's device-dependent inputs from step N's `result`, for the same slots, in
        one kernel (`pd_kernels.advance_inputs`): each live slot moves past the tokens it kept, its
        newest token and its drafts (as many as its length budget leaves, as the scheduler cuts
        them) become the next rows; a slot that stopped in N, or was invalid in it, becomes
        invalid and padding. The host has already written the known part (`Layout.tail`)."""
        advance_inputs(result, *(v[name] for name in ADVANCED), block_size=self.block_size,
                       spare_slot=self.dummy_block * self.block_size)

    def get(self, key: tuple[int, int]) -> StepGraphs:
        if key not in self.graphs:
            self.graphs[key] = StepGraphs(self, key, capture=self.pool_owner is not None)
            if self.pool_owner is not None:
                log.info("captured MTP CUDA graphs (k=%d): %d slots, %d KV blocks per sequence",
                         self.k, *key)
        return self.graphs[key]
