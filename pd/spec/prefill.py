"""The MTP step of one prompt's first chunk prefilled alone, as two CUDA graph replays.

Eager, that step (the target's forward, the first token, its stop check, the MTP layer's pass
over the prompt and its k - 1 chained passes) launches its ~150 small kernels from Python: on
the H100's host 5.8 ms for a 5-token prompt of the embedded model, a fifth of a 256-token
request's time at batch 1, and the prefill node's time to first token. Here the target's
forward replays the plain prefill graph of the prompt's padded size
(`pd.engine.cuda_graph.PrefillGraphs`) and everything after it one graph per size captured
here, which reads that graph's hidden states and staged inputs where they lie:
- the first token: the LM head and argmax of the prompt's last row (as a plain prefill's
  greedy sampler), accepted and stop-checked by the verify step's kernels as a slot with no
  drafts (`SpecGraphs.accept`);
- the MTP layer's inputs (`kernels.draft_preprocess`, the prompt as a prefill slot and the
  padding rows after it as an invalid one), its pass over every row with the prefill graph's
  causal context (padding rows write the spare block), and the chained passes
  (`SpecGraphs.chain_drafts`) over the request's block table;
- one packed result [1, 2k + 4] in the verify step's format, followed by the first token's
  logprobs where the request asks for them (a graph per top-k width), copied to the host at
  once.
The request's own values (block table, lengths, stop ids) travel in one small int64 buffer
(`Inputs`). It serves greedy requests without logit processing or prompt logprobs, whose step
needs nothing from the host between the two replays (`fits`); others run eagerly. On CPU the
same layout runs without capture (`PD_SPEC_LAYOUT=1`), which is how the tests check it.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kernels import draft_preprocess
from kernels.argmax import argmax
from kernels.draft_preprocess import CHUNK, PREFILL
from kernels.token_logprob import token_logprob
from pd.engine.cuda_graph import PrefillGraphs, capture
from pd.engine.host_ring import HostRing
from pd.engine.logprobs import compute_logprobs
from pd.engine.scheduler import ScheduledBatch
from pd.model.context import forward_context
from pd.spec.graphed import GraphedSteps, stop_ids_of
from pd.spec.graphs import STOP_WIDTH, Layout, SpecGraphs, pack_logprobs

log = logging.getLogger(__name__)


class Inputs:
    """The request's values in one int64 buffer, in the names of the verify step's `Layout`
    (one slot of no drafts): block_tables [1, W], seq_lens, num_outputs, max_seq_lens,
    min_tokens, stop_ids [1, STOP_WIDTH], and the constants slot_index 0, num_drafts 0,
    draft_ids 0, greedy 1."""

    SHAPES = {"block_tables": None, "seq_lens": (1,), "num_outputs": (1,), "max_seq_lens": (1,),
              "min_tokens": (1,), "stop_ids": (1, STOP_WIDTH), "slot_index": (1,),
              "num_drafts": (1,), "greedy": (1,), "draft_ids": None}

    def __init__(self, width: int, k: int) -> None:
        self.fields, total = [], 0
        for name, shape in self.SHAPES.items():
            shape = shape or ((1, width) if name == "block_tables" else (1, k))
            size = int(np.prod(shape))
            self.fields.append((name, total, total + size, shape))
            total += size
        self.size = total

    views = Layout.views


class SpecPrefill:
    """`graphs`: the MTP step graphs (`pd.spec.graphs.SpecGraphs`; `pool_owner` None: no
    capture, and the runner's prefill layout computed eagerly)."""

    def __init__(self, graphs: SpecGraphs, runner) -> None:
        self.graphs, self.k, self.device = graphs, graphs.k, graphs.device
        self.model, self.block_size, self.runner = graphs.model, graphs.block_size, runner
        self.captured = graphs.pool_owner is not None
        self.prefill = runner.prefill_graphs if self.captured else PrefillGraphs(
            graphs.model, None, min(runner.config.max_num_batched_tokens, runner.max_model_len),
            graphs.device, graphs.dummy_block, graphs.block_size)
        dev = self.device
        # the two slots of `draft_preprocess`: the prompt, then the padding rows after it
        self.slots = torch.tensor([0, -1], dtype=torch.int64, device=dev)
        self.kinds = torch.tensor([PREFILL, CHUNK], dtype=torch.int32, device=dev)
        # per prefill size: its block-table width (the prompt, its first token and the chained
        # positions), the request's inputs there and views of them, and its graph and result
        self.buffers: dict[int, tuple[Inputs, torch.Tensor, dict]] = {}
        self.steps: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.host = HostRing(pin=self.device.type == "cuda")

    def fits(self, batch: ScheduledBatch) -> bool:
        """Whether the step is one prompt's first chunk alone, ending the prompt, of a greedy
        request without logit processing, logprobs, or more stop ids than a graph holds."""
        if len(batch.reqs) != 1 or self.graphs.oracle is not None:
            return False
        req, n = batch.reqs[0], batch.num_new_tokens[0]
        return (req.num_computed_tokens == 0 and n == req.num_tokens and self.prefill.fits(n)
                and GraphedSteps.plain_greedy(req) and req.params.prompt_logprobs is None
                and len(stop_ids_of(req)) <= STOP_WIDTH)

    def _width(self, size: int) -> int:
        """Block-table width of a size: the prompt, its token and the k - 1 chained positions."""
        blocks = -(-(size + self.k) // self.block_size)
        return next((w for w in self.graphs.block_widths if w >= blocks), blocks)

    def _buffers(self, size: int) -> tuple[Inputs, torch.Tensor, dict]:
        if size not in self.buffers:
            layout = Inputs(self._width(size), self.k)
            buf = torch.zeros(layout.size, dtype=torch.int64, device=self.device)
            self.buffers[size] = (layout, buf, layout.views(buf))
        return self.buffers[size]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, max_model_len: int,
            top: int | None) -> tuple[list[int], torch.Tensor | None]:
        """Run the step (`fits`); returns its packed result row (`SpecGraphs._draft`'s format:
        accepted ids, kept, verified, stop flag, drafts) and, with `top` (the top-logprob
        columns asked; None: no logprobs), the first token's logprobs packed as the verify
        step's (`pack_logprobs`, [1, 2 + 2 top]), both read on the host."""
        req = batch.reqs[0]
        n, host = self.runner.prefill_graph_inputs(batch, self.prefill)
        size = (host.numel() - 1) // 3
        layout, buf, _ = self._buffers(size)
        mine = self.host.get((layout.size,))
        v = layout.views(mine.numpy())
        v["block_tables"][0] = self.graphs.dummy_block
        blocks = req.block_ids[:v["block_tables"].shape[1]]
        v["block_tables"][0, :len(blocks)] = blocks
        stops = stop_ids_of(req)
        v["stop_ids"][0] = -1
        v["stop_ids"][0, :len(stops)] = stops
        v["seq_lens"][0], v["num_outputs"][0] = req.num_tokens, req.num_output_tokens
        v["max_seq_lens"][0] = min(req.num_prompt_tokens + req.params.max_tokens, max_model_len)
        v["min_tokens"][0], v["slot_index"][0], v["num_drafts"][0] = req.params.min_tokens, 0, 0
        v["greedy"][0], v["draft_ids"][0] = 1, 0
        hidden_all = self.prefill.forward(host)  # the target's forward: its prefill graph
        buf.copy_(mine, non_blocking=True)
        if not self.captured:
            result = self._step(size, hidden_all, top)
        else:
            if (size, top) not in self.steps:  # NOTE: its warm-up computes this very step
                self.steps[size, top] = capture(lambda: self._step(size, hidden_all, top),
                                                self.graphs.pool_owner, self.device)
                log.info("captured an MTP prefill CUDA graph: %d tokens, logprobs %s", size, top)
            graph, result = self.steps[size, top]
            graph.replay()
        host = self.host.get(result.shape, result.dtype)
        host.copy_(result)
        width = 2 * self.k + 4
        lp = host[:, width:].view(torch.float32) if top is not None else None
        return host[0, :width].tolist(), lp

    def _step(self, size: int, hidden_all: torch.Tensor, top: int | None) -> torch.Tensor:
        """Everything after the target's forward (module docstring), from its hidden states of
        every row: [1, 2k + 4] int64, then with `top` the first token's packed logprobs
        (float32 pairs as int64 columns)."""
        k, dev, model, graphs = self.k, self.device, self.model, self.graphs
        ids, positions, _, last = self.prefill.inputs(size)
        layout, _, v = self._buffers(size)
        logits = model.compute_logits(hidden_all[last])  # [1, V]
        target = argmax(logits)  # [1]
        zeros = torch.zeros(1, k, device=dev)
        accepted, num_kept, num_verified, stop_flags = graphs.accept(
            v, target[:, None].expand(1, k + 1).contiguous(), zeros, zeros)
        # the prompt's rows a prefill slot, the padding after it an invalid one
        cu = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), last + 1,
                        torch.full((1,), size, dtype=torch.int64, device=dev)])
        tables = torch.cat([v["block_tables"], torch.full_like(v["block_tables"], graphs.dummy_block)])
        mtp_ids, draft_rows, chain_pos, chain_slots = draft_preprocess(
            self.slots, cu, ids, positions,
            torch.cat([accepted, torch.zeros_like(accepted)]),
            torch.cat([num_verified, torch.ones_like(num_verified)]),
            self.kinds, tables,
            self.block_size, k - 1)
        with forward_context(self.prefill.context(size)):
            out = model.mtp_forward(mtp_ids, positions, hidden_all)
        drafts = graphs.chain_drafts(out[draft_rows[:1]], chain_pos[:1], chain_slots[:1],
                                     v["block_tables"], v["block_tables"].shape[1])
        counts = torch.stack([num_kept, num_verified, stop_flags], dim=1).long()
        result = torch.cat([accepted, counts, drafts], dim=1)
        if top is None:
            return result
        lp = (token_logprob(logits, target) if top == 0
              else pack_logprobs(compute_logprobs(logits, target, top)))
        return torch.cat([result, lp.view(torch.int64)], dim=1)

