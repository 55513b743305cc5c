"""The MTP step of prompt chunks as two CUDA graph replays.

Eager, that step (the target's forward, the first tokens, their stop checks, the MTP layer's
pass over the prompts and its k - 1 chained passes) launches its ~150 small kernels from
Python: on the H100's host 5.8 ms for one 5-token prompt of the embedded model (a fifth of a
256-token request's time at batch 1, and the prefill node's time to first token), 7.4 ms for
16 prompts. Here the target's forward replays a prefill graph and everything after it one graph
captured here per shape, which reads that graph's hidden states and staged inputs where they
lie:
- one prompt's first chunk alone (`fits`, `run`): the plain prefill graph of its padded size
  (`pd.engine.prefill_graphs.PrefillGraphs`); the padding rows after the prompt are a slot of
  their own for `draft_preprocess` (skipped) and write the spare block;
- chunks of several prompts, each ending its prompt (`fits_chunks`, `run_chunks`): the varlen
  prefill graph of the step (`VarlenPrefillGraphs`, 16-bit models), its context reused for the
  MTP layer's pass; a graph per varlen key and block-table width.
After the target's forward: the first token of each slot (the LM head and argmax of its last
row, as a plain prefill's greedy sampler), accepted and stop-checked by the verify step's
kernels as a slot with no drafts (`SpecGraphs.accept`); the MTP layer's inputs
(`pd_kernels.draft_preprocess`), its pass over every row with the prefill graph's context, and
the chained passes (`SpecGraphs.chain_drafts`) over each slot's block table; one packed result
[S, 2k + 4] in the verify step's format, followed by each first token's logprobs where asked
(a graph per top-k width), copied to the host at once. The slots' own values (block tables,
lengths, stop ids) travel in one small int64 buffer (`Inputs`). It serves greedy requests
without logit processing or prompt logprobs, whose step needs nothing from the host between
the two replays; other steps run eagerly (`SpecDecoder.prepare` / `execute`). On CPU the lone
prompt's layout runs without capture (`PD_SPEC_LAYOUT=1`), which is how the tests check it;
the chunks' path needs the varlen graphs, so CUDA.
"""

from __future__ import annotations

import logging

import torch

from pd_kernels import draft_preprocess
from pd_kernels.argmax import argmax
from pd_kernels.draft_preprocess import CHUNK, PREFILL
from pd_kernels.launch import use_kernels
from pd.engine.prefill_graphs import PrefillGraphs
from pd.engine.graph import Graph, capture
from pd.engine.host_ring import HostRing
from pd.engine.logprobs import packed_logprobs
from pd.engine.request import Req
from pd.engine.scheduler import ScheduledBatch
from pd.model.context import forward_context
from pd.spec.graphed import GraphedSteps, stop_ids_of
from pd.spec.graphs import STOP_WIDTH, FlatLayout, SpecGraphs

log = logging.getLogger(__name__)


class Inputs(FlatLayout):
    """The slots' values in one int64 buffer, in the names of the verify step's `Layout`
    (slots of no drafts): block_tables [S, W], seq_lens, num_outputs, max_seq_lens,
    min_tokens, stop_ids [S, STOP_WIDTH], slot_index (-1: padding), and the constants
    num_drafts 0, greedy 1, draft_ids [S, k] 0."""

    def __init__(self, num_slots: int, width: int, k: int) -> None:
        super().__init__({"block_tables": (num_slots, width), "seq_lens": (num_slots,),
                          "num_outputs": (num_slots,), "max_seq_lens": (num_slots,),
                          "min_tokens": (num_slots,), "stop_ids": (num_slots, STOP_WIDTH),
                          "slot_index": (num_slots,), "num_drafts": (num_slots,),
                          "greedy": (num_slots,), "draft_ids": (num_slots, k)})


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
        self.varlen = runner.varlen_graphs if self.captured else None
        dev = self.device
        # a lone prompt's two slots of `draft_preprocess`: the prompt, then the padding after it
        self.lone_slots = torch.tensor([0, -1], dtype=torch.int64, device=dev)
        self.lone_kinds = torch.tensor([PREFILL, CHUNK], dtype=torch.int32, device=dev)
        # per shape (a prefill size, or a varlen key): the slots' inputs, their device buffer
        # and views of it; per (shape, top-logprob columns): the graph and its result
        self.buffers: dict[object, tuple[Inputs, torch.Tensor, dict]] = {}
        self.steps: dict[tuple, tuple[Graph, torch.Tensor]] = {}
        self.host = HostRing(pin=self.device.type == "cuda")

    # -- which steps ---------------------------------------------------------------------------
    def _usable(self) -> bool:
        """No benchmark drafter, and captured graphs only with the kernels' bookkeeping (the
        torch twins wait on the host: PD_KERNELS=torch runs these steps eagerly)."""
        return self.graphs.oracle is None and (
            not self.captured or use_kernels(self.graphs.pool_owner.staging))

    def _plain(self, req: Req) -> bool:
        return (GraphedSteps.plain_greedy(req) and req.params.prompt_logprobs is None
                and len(stop_ids_of(req)) <= STOP_WIDTH)

    def fits(self, batch: ScheduledBatch) -> bool:
        """Whether the step is one prompt's first chunk alone, ending the prompt, of a greedy
        request without logit processing or prompt logprobs and with no more stop ids than a
        graph holds (the prefill graph's step, `run`)."""
        if len(batch.reqs) != 1 or not self._usable():
            return False
        req, n = batch.reqs[0], batch.num_new_tokens[0]
        return (req.num_computed_tokens == 0 and n == req.num_tokens and self.prefill.fits(n)
                and self._plain(req))

    def fits_chunks(self, batch: ScheduledBatch) -> bool:
        """Whether the step is prompt chunks that each end their prompt (two tokens at least),
        of such requests, in CUDA graphs (`run_chunks`, whose target forward is a varlen
        prefill graph if its context allows)."""
        if self.varlen is None or not self.varlen.enabled or not self._usable():
            return False
        return all(n >= 2 and req.num_computed_tokens + n == req.num_tokens and self._plain(req)
                   for req, n in zip(batch.reqs, batch.num_new_tokens))

    # -- the host's part -----------------------------------------------------------------------
    def _width(self, tokens: int) -> int:
        """Block-table width for sequences of up to `tokens` tokens, their first token and
        the k - 1 chained positions."""
        blocks = -(-(tokens + self.k) // self.block_size)
        return next((w for w in self.graphs.block_widths if w >= blocks), blocks)

    def _buffers(self, shape, num_slots: int, width: int) -> tuple[Inputs, torch.Tensor, dict]:
        if shape not in self.buffers:
            layout = Inputs(num_slots, width, self.k)
            buf = torch.zeros(layout.size, dtype=torch.int64, device=self.device)
            self.buffers[shape] = (layout, buf, layout.views(buf))
        return self.buffers[shape]

    def _fill(self, layout: Inputs, reqs: list[Req], max_model_len: int) -> torch.Tensor:
        """A page-locked buffer of `layout` with the requests' slots (and padding after them)."""
        host = self.host.get((layout.size,))
        v = layout.views(host.numpy())
        width = v["block_tables"].shape[1]
        v["block_tables"][...] = self.graphs.dummy_block
        v["stop_ids"][...] = -1
        v["slot_index"][...] = -1
        for name in ("seq_lens", "num_outputs", "min_tokens", "num_drafts", "draft_ids"):
            v[name][...] = 0
        v["max_seq_lens"][...] = 1 << 40
        v["greedy"][...] = 1
        for b, req in enumerate(reqs):
            blocks = req.block_ids[:width]
            v["block_tables"][b, :len(blocks)] = blocks
            stops = stop_ids_of(req)
            v["stop_ids"][b, :len(stops)] = stops
            v["seq_lens"][b], v["num_outputs"][b] = req.num_tokens, req.num_output_tokens
            v["max_seq_lens"][b] = min(req.num_prompt_tokens + req.params.max_tokens, max_model_len)
            v["min_tokens"][b], v["slot_index"][b] = req.params.min_tokens, b
        return host

    def _replay(self, key: tuple, step) -> torch.Tensor:
        if key not in self.steps:  # NOTE: its warm-up computes this very step: harmless
            self.steps[key] = capture(step, self.graphs.pool_owner, self.device)
            log.info("captured an MTP prefill CUDA graph: %s, logprobs %s", key[0], key[1])
        graph, result = self.steps[key]
        graph.replay()
        return result

    def _read(self, result: torch.Tensor, num_slots: int, top: int | None):
        """The result rows of the real slots and their logprobs, read on the host: packed as
        the verify step's, k + 1 rows per slot ([S * (k + 1), 2 + 2 top] float32, the first
        token's in each slot's rows)."""
        host = self.host.get(result.shape, result.dtype)
        host.copy_(result)
        width = 2 * self.k + 4
        lp = None
        if top is not None:
            lp = host[:num_slots, width:].view(torch.float32).repeat_interleave(self.k + 1, 0)
        return host[:num_slots, :width].tolist(), lp

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, max_model_len: int, top: int | None):
        """Run a lone prompt's step (`fits`); returns its packed result rows (`SpecGraphs._draft`'s
        format: accepted ids, kept, verified, stop flag, drafts) and, with `top` (the top-logprob
        columns asked; None: no logprobs), its first token's logprobs (`_read`)."""
        n, host = self.runner.prefill_graph_inputs(batch, self.prefill)
        size = (host.numel() - 1) // 3
        layout, buf, v = self._buffers(size, 1, self._width(size))
        mine = self._fill(layout, batch.reqs, max_model_len)
        hidden_all = self.prefill.forward(host)  # the target's forward: its prefill graph
        buf.copy_(mine, non_blocking=True)
        ids, positions, _, last = self.prefill.inputs(size)

        def step() -> torch.Tensor:
            cu = torch.cat([torch.zeros(1, dtype=torch.int64, device=self.device), last + 1,
                            torch.full((1,), size, dtype=torch.int64, device=self.device)])
            return self._step(v, hidden_all, hidden_all[last], ids, positions,
                              self.prefill.context(size), cu, self.lone_slots, self.lone_kinds, top)

        result = step() if not self.captured else self._replay((size, top), step)
        return self._read(result, 1, top)

    @torch.inference_mode()
    def run_chunks(self, batch: ScheduledBatch, max_model_len: int, top: int | None):
        """Run a step of prompt chunks (`fits_chunks`): the result rows of its slots and their
        first tokens' logprobs (as `run`), or None where its context does not fit a varlen
        prefill graph (the caller runs it eagerly)."""
        inp = self.runner.prepare(batch, masks=False)
        ctx, varlen = inp.context, self.varlen
        if ctx is None or not varlen.can_run(ctx):
            return None
        key = varlen.key(ctx)
        tokens, _, seqs = key
        width = self._width(max(len(r.block_ids) for r in batch.reqs) * self.block_size)
        layout, buf, v = self._buffers((key, width), seqs, width)
        mine = self._fill(layout, batch.reqs, max_model_len)
        varlen.run(inp.input_ids, inp.positions, ctx)  # the target's forward
        hidden_all = varlen.graphs[key][1]  # every row of it
        buf.copy_(mine, non_blocking=True)

        def step() -> torch.Tensor:
            cu = varlen.cu_q[:seqs + 1].long()
            last = (cu[1:] - 1).clamp(min=0)
            kinds = torch.full((seqs,), PREFILL, dtype=torch.int32, device=self.device)
            return self._step(v, hidden_all, hidden_all[last], varlen.input_ids[:tokens],
                              varlen.positions[:tokens], varlen.context(key), cu,
                              v["slot_index"], kinds, top)

        result = self._replay(((key, width), top), step)
        return self._read(result, len(batch.reqs), top)

    # -- the device's part ---------------------------------------------------------------------
    def _step(self, v: dict, hidden_all: torch.Tensor, last_hidden: torch.Tensor,
              ids: torch.Tensor, positions: torch.Tensor, ctx, cu: torch.Tensor,
              slot_index: torch.Tensor, kinds: torch.Tensor, top: int | None) -> torch.Tensor:
        """Everything after the target's forward (module docstring), from its hidden states of
        every row and of each slot's last row: [S, 2k + 4] int64, then with `top` each slot's
        first token's packed logprobs (float32 pairs as int64 columns). `cu`, `slot_index`,
        `kinds`: the rows' slots for `draft_preprocess` (for a lone prompt the padding rows
        after it are a slot of their own)."""
        k, graphs = self.k, self.graphs
        num_slots = v["slot_index"].shape[0]
        logits = self.model.compute_logits(last_hidden)  # [S, V]
        target = argmax(logits)  # [S]
        zeros = torch.zeros(num_slots, k, device=self.device)
        accepted, num_kept, num_verified, stop_flags = graphs.accept(
            v, target[:, None].expand(num_slots, k + 1).contiguous(), zeros, zeros)
        extra = slot_index.shape[0] - num_slots  # the lone prompt's padding slot
        tables = v["block_tables"]
        if extra:
            tables = torch.cat([tables, torch.full_like(tables[:extra], graphs.dummy_block)])
        mtp_ids, draft_rows, chain_pos, chain_slots = draft_preprocess(
            slot_index, cu, ids, positions,
            torch.cat([accepted, accepted.new_zeros(extra, k + 1)]),
            torch.cat([num_verified, num_verified.new_ones(extra)]), kinds, tables,
            self.block_size, k - 1)
        with forward_context(ctx):
            prev, draft_logits = self.model.mtp_logits(mtp_ids, positions, hidden_all,
                                                       rows=draft_rows[:num_slots])
        drafts = torch.empty(num_slots, k, dtype=torch.int64, device=self.device)
        graphs.chain_drafts(prev, draft_logits, *graphs.by_pass(chain_pos[:num_slots],
                                                          chain_slots[:num_slots]),
                            v["block_tables"], v["block_tables"].shape[1], drafts,
                            torch.arange(num_slots, device=self.device))
        counts = torch.stack([num_kept, num_verified, stop_flags], dim=1).long()
        result = torch.cat([accepted, counts, drafts], dim=1)
        if top is None:
            return result
        lp = packed_logprobs(logits, target, top)
        return torch.cat([result, lp.view(torch.int64)], dim=1)
