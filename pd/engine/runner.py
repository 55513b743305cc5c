"""The model runner: owns the model, the node's KV cache and the sampler, and builds a plain
step's tensors (`prepare`, from `pd.engine.step_inputs`). The MTP verify step (`pd.spec.verify`), the MTP drafter
(`pd.spec.mtp`) and the decode CUDA graphs (`pd.engine.cuda_graph`, static buffers) build their
own from the same batch.

It runs a `ScheduledBatch` (any mix of prefill chunks and decode tokens) and returns the sampled
tokens with their logprobs for the requests that caught up. Which requests run, and what happens
to their state afterwards, is the scheduler's business.

For the decode overlap loop (`pd.engine.decode_loop`) the runner also splits a step in two: `prepare`
(host) and `execute` (device work only, no host wait), which writes the sampled tokens into a
device tensor the next step reads (future-token slots: an input id `-(j + 1)` stands for row
j of the previous step's tokens) and copies the results into host buffers (`alloc_output`,
pinned on CUDA). Where `execute` runs (a CUDA stream, a worker thread) and how its completion
is awaited is the executor's business (`pd.engine.executor`).
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import torch

from pd_kernels.masked_argmax import ITEM, masked_argmax
from pd.config import EngineConfig, ModelConfig, dtype_name
from pd.model import parallel
from pd.model.context import ForwardContext, forward_context
from pd.engine.device_check import may_check_products
from pd.engine.host_ring import HostRing, copy_async
from pd.engine.kv_cache import KVCache, num_blocks_for
from pd.engine.logprobs import MAX_PACKED_VOCAB, record_prompt_logprobs
from pd.model.loader import load_model
from pd.engine.request import Req
from pd.engine.sampler import Sampler, SamplerOutput, SamplingRow
from pd.engine.scheduler import ScheduledBatch
from pd.engine.grammar_steps import LateWork
from pd.engine.step_inputs import ForwardInput, StepInputs
from pd.engine.tp import Workers

log = logging.getLogger(__name__)

ROPE_MARGIN = 64  # rotary table rows past max_model_len (`RotaryEmbedding.cache_positions`)

# PD_SPEC_LAYOUT=1: on CPU, run MTP steps through the layout of their CUDA graphs without
# capture (`pd.spec.graphs`; how the tests check chained MTP steps through real processes;
# slower than the eager step on CPU). The runner keeps the spare block that layout pads into.
SPEC_LAYOUT_ENV = "PD_SPEC_LAYOUT"
# the most keys (summed over a step's sequences) a step of prompt chunks gathers in a CUDA graph
VARLEN_MAX_KEYS = 1 << 16


def spec_layout_requested() -> bool:
    return os.environ.get(SPEC_LAYOUT_ENV) == "1"


# (token_id, logprob, rank, top-k pairs); the last three are None without logprobs.
SampledToken = tuple[int, float | None, int | None, list[tuple[int, float]] | None]


class ForwardOutput(NamedTuple):
    """One launched step. Tokens are [S] (one per sampled row); a verify step of 1 + k tokens
    per row would make them [S, 1 + k] with the accepted counts beside them."""

    next_tokens_gpu: torch.Tensor  # [S] int64 on the device: what the next step's future ids read
    next_tokens_cpu: torch.Tensor  # [S] int64 on the host (pinned on CUDA); valid after copy_done
    logprobs_cpu: torch.Tensor | None  # host copy of the packed logprobs (`pack_logprobs`), likewise
    copy_done: object  # the executor's completion: .wait() returns once the host copies landed


class ModelRunner(StepInputs):
    def __init__(self, cfg: EngineConfig) -> None:
        self.config = cfg
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and self.device.index is not None:
            # Triton launches and graph captures use the current device: a node on cuda:1
            # failed its first Triton kernel while the current device was cuda:0
            torch.cuda.set_device(self.device)
        self.dtype = cfg.torch_dtype
        may_check_products(self.device, self.dtype)  # before any worker or weight
        # tensor parallelism: the worker ranks load their slices while this one loads its own
        self.tp = None
        if cfg.tensor_parallel_size > 1:
            parallel.check_layout(ModelConfig.from_dir(cfg.model), cfg.tensor_parallel_size)
            self.tp = Workers(cfg)
        try:
            self.model = load_model(cfg.model, self.dtype, self.device)
            self.model_config = mc = self.model.config
            if mc.vocab_size >= MAX_PACKED_VOCAB:
                raise ValueError(f"a vocabulary of {mc.vocab_size} tokens: logprobs travel as "
                                 f"float32 ids (`pack_logprobs`), exact below {MAX_PACKED_VOCAB}")
            self.max_model_len = min(cfg.max_model_len or mc.max_context_len,
                                     mc.max_context_len)
            # NOTE: the margin covers the MTP chain's positions past a sequence's last (k <= 4)
            self.model.rotary.cache_positions(self.max_model_len + ROPE_MARGIN, self.device,
                                              self.dtype)
            num_blocks = num_blocks_for(mc, cfg, self.dtype)
            use_graphs = self.device.type == "cuda" and not cfg.enforce_eager
            # the spare block takes graphs' padding writes (and the MTP layout's on CPU)
            spare = use_graphs or spec_layout_requested()
            kv_heads = self.model.attention_layers()[0].num_kv_heads  # this rank's
            self.kv_cache = KVCache(mc, num_blocks, cfg.block_size, self.dtype, self.device,
                                    spare_blocks=1 if spare else 0, kv_heads=kv_heads)
            self.kv_cache.bind(self.model.attention_layers())
            if self.tp is not None:
                self.model.mirror = self.tp.setup(num_blocks, 1 if spare else 0,
                                                  self.max_model_len + ROPE_MARGIN)
        except BaseException:  # the workers wait for a setup that will not come
            if self.tp is not None:
                self.tp.close()
            raise
        self.graphs = self.prefill_graphs = self.varlen_graphs = None
        if use_graphs:
            from pd.engine.cuda_graph import DecodeGraphs
            from pd.engine.prefill_graphs import PrefillGraphs, VarlenPrefillGraphs

            self.graphs = DecodeGraphs(self.model, self.kv_cache.dummy_block, cfg.block_size,
                                       cfg.max_num_seqs, self.max_model_len, self.device)
            self.prefill_graphs = PrefillGraphs(self.model, self.graphs,
                                                min(cfg.max_num_batched_tokens, self.max_model_len),
                                                self.device)
            self.varlen_graphs = VarlenPrefillGraphs(
                self.model, self.graphs, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                VARLEN_MAX_KEYS, self.dtype, self.device)
        self.sampler = Sampler()
        self.host_buffers = HostRing(pin=self.device.type == "cuda")  # `alloc_output`'s
        # the last graphed decode step's requests and inputs, whose rows the next may reuse
        self.graphed_rows: tuple[list[Req], ForwardInput | None] = ([], None)
        # `resample`'s rows of work and masks on the device (CUDA), grown as a step needs
        self._late: torch.Tensor | None = None
        self._late_views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._kept: list[torch.Tensor | None] = [None, None]  # `kept_logits`' two buffers
        log.info("model %s (%s, %d layers%s) on %s/%s, KV cache %d blocks x %d tokens (%.1f MiB)",
                 mc.model_id, mc.architecture, mc.num_layers, " + MTP" if mc.has_mtp else "",
                 cfg.device, dtype_name(self.dtype), num_blocks, cfg.block_size,
                 self.kv_cache.nbytes / 2**20)

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def close(self) -> None:
        """Stop the tensor-parallel worker ranks, if any."""
        if self.tp is not None:
            self.tp.close()

    @property
    def mirror(self):
        """With tensor parallelism, rank 0's `pd.engine.tp.mirror.Mirror` (what a node's KV
        moves go through); None on one rank."""
        return self.model.mirror

    @property
    def rank_failed(self) -> bool:
        """Whether a tensor-parallel worker rank ended and took this node down."""
        return self.tp is not None and self.tp.failed is not None

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size


    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """Run the target model on a step that is not a graphed decode step (`sample` replays
        those, LM head and argmax included); returns the pre-norm hidden states of every token
        [T, H]. On CUDA, unless --enforce-eager, a step of prompt chunks up to `VARLEN_MAX_KEYS`
        keys (in 16 bits) replays a CUDA graph (`pd.engine.cuda_graph`); a prompt's first chunk
        prefilled alone was built for its own graph (`prefill_graph_inputs`), which
        `forward_rows` replays. The MTP step's target forward (`pd.spec.verify`) runs here too."""
        if self.varlen_graphs is not None and self.varlen_graphs.can_run(ctx):
            return self.varlen_graphs.run(input_ids, positions, ctx)
        with forward_context(ctx):
            return self.model(input_ids, positions)

    @torch.inference_mode()
    def forward_rows(self, inp: ForwardInput, prev_tokens: torch.Tensor | None = None
                     ) -> torch.Tensor | SamplerOutput | None:
        """The step's device work up to the logits [S, V] of its sampled rows (`prev_tokens`
        fills the future ids; a graphed decode step reads them from `DecodeGraphs.tokens`);
        for a graphed step whose rows are all plain greedy, its tokens (the graph took the
        argmax); None when no row samples."""
        graphs = self.graphs
        if inp.decode_graph is not None:
            graphs.launch(inp.decode_graph[1], inp.decode_graph[0])
            n = len(inp.rows)
            # NOTE: a decode step samples every row, and its graph ran the LM head and the
            # greedy argmax of them already (and, where asked, a graph of their logprobs)
            if inp.argmax_only:
                if not inp.wants_logprobs:
                    return SamplerOutput(graphs.tokens_of(n))
                packed = graphs.logprobs(inp.decode_graph[0][0], inp.num_top)
                return SamplerOutput(graphs.tokens_of(n), packed[:n])
            return graphs.logits[:n].float()
        if inp.prefill_graph is not None:
            hidden, last = self.prefill_graphs.launch(inp.prefill_graph[1], inp.prefill_graph[0])
            inp = inp._replace(logits_index=last)
        else:
            if inp.future_index is not None:
                if prev_tokens is None:
                    raise ValueError("the batch has future token ids but no previous step's "
                                     "tokens")
                ids = inp.input_ids.index_put((inp.future_index,), prev_tokens[inp.future_slots])
                inp = inp._replace(input_ids=ids)
            hidden = self.forward(inp.input_ids, inp.positions, inp.context)
        if inp.prompt_spans:
            record_prompt_logprobs(self.model.compute_logits, hidden, inp.prompt_spans)
        if not inp.rows:
            return None
        return self.model.compute_logits(hidden[inp.logits_index])

    @torch.inference_mode()
    def sample(self, inp: ForwardInput, prev_tokens: torch.Tensor | None = None) -> SamplerOutput | None:
        """Forward + sampler on the device (`forward_rows`, then `sample_rows`)."""
        return self.sample_rows(self.forward_rows(inp, prev_tokens), inp.rows)

    @torch.inference_mode()
    def sample_rows(self, forwarded: torch.Tensor | SamplerOutput | None,
                    rows: list[SamplingRow]) -> SamplerOutput | None:
        """The sampler over `forward_rows`' logits for `rows`; its tokens or None as they are."""
        return self.sampler(forwarded, rows) if isinstance(forwarded, torch.Tensor) else forwarded

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, before_wait=None) -> dict[int, SampledToken]:
        """One step, run to its end: {batch index: its sampled token}. `before_wait()` is
        called once the step is queued, before the host waits for its tokens (work queued there
        on the current stream has completed when this returns)."""
        inp = self.prepare(batch)
        out = self.sample(inp)
        if before_wait is not None:
            before_wait()
        return {} if out is None else unpack_sampled(out.token_ids, out.packed, inp.sample_reqs,
                                                     inp.rows)

    # -- the split step of the overlap loop ----------------------------------------------------
    def alloc_output(self, inp: ForwardInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Buffers `execute` writes: next tokens on the device (with CUDA graphs, the graphs'
        `tokens`, where the next decode graph reads its future ids), and host copies (pinned on
        CUDA, from a `HostRing`): tokens, and the packed logprobs where asked."""
        num_rows, host = len(inp.rows), self.host_buffers.get
        tokens_cpu, logprobs = host((num_rows,), name="tokens"), None
        if inp.wants_logprobs:
            logprobs = host((num_rows, 2 + 2 * inp.num_top), torch.float32, "logprobs")
        if self.graphs is not None:
            return self.graphs.tokens_of(num_rows), tokens_cpu, logprobs
        return torch.empty(num_rows, dtype=torch.int64, device=self.device), tokens_cpu, logprobs

    @torch.inference_mode()
    def execute(self, inp: ForwardInput, prev_tokens: torch.Tensor | None,
                next_tokens: torch.Tensor, tokens_cpu: torch.Tensor,
                logprobs_cpu: torch.Tensor | None, keep_logits: bool = False
                ) -> torch.Tensor | None:
        """The device part of a step: forward, sample, write `next_tokens` (read by the next
        step in stream order) and start the copies to the host buffers. Never waits. With
        `keep_logits`, returns the logits [S, V] of its sampled rows, for `resample`."""
        forwarded = self.forward_rows(inp, prev_tokens)
        logits = self.kept_logits(forwarded, len(inp.rows)) if keep_logits else None
        self.emit(self.sample_rows(forwarded, inp.rows), next_tokens, tokens_cpu, logprobs_cpu)
        return logits

    def kept_logits(self, forwarded: torch.Tensor | SamplerOutput, num_rows: int) -> torch.Tensor:
        """A step's logits [S, V] as `execute` keeps them, its own (a graph's are copied: the
        next replay writes them): a graph that took every row's argmax leaves them in the
        model's dtype, copied raw into one of two kept buffers in turn (a step's resampling,
        queued before the step after next, reads them and the step before's); otherwise
        float32, as the sampler had them."""
        graphs = self.graphs
        if isinstance(forwarded, torch.Tensor):
            if forwarded.dtype == torch.float32 and (
                    graphs is None or forwarded.untyped_storage().data_ptr()
                    != graphs.logits.untyped_storage().data_ptr()):
                return forwarded
            return forwarded.to(torch.float32, copy=True)
        # NOTE: a raw copy into a kept buffer: a torch copy into a new tensor cost 68-93 us of
        # host a step on the H100 machine
        self._kept = kept = self._kept[1:] + self._kept[:1]
        if kept[0] is None or kept[0].shape[0] < num_rows:
            kept[0] = torch.empty(1 << max(3, (num_rows - 1).bit_length()), graphs.logits.shape[1],
                                  dtype=graphs.logits.dtype, device=self.device)
        copy_async(kept[0][:num_rows], graphs.logits[:num_rows])
        return kept[0][:num_rows]

    @torch.inference_mode()
    def resample(self, work: LateWork, num: int, logits: torch.Tensor,
                 prev: torch.Tensor | None, next_tokens: torch.Tensor,
                 tokens_cpu: torch.Tensor) -> None:
        """Greedy rows of a step `execute` ran taken again under their masks, in place in its
        `next_tokens` (`pd_kernels.masked_argmax`, one launch), and the step's tokens copied to
        the host again: the first `num` rows of work of `work` (filled since: rows of the
        logits `execute` kept of this step, `logits`, or of the step before, `prev`), with the
        masks there, copied to the device in one copy. Never waits."""
        if not num:
            return
        if prev is not None and prev.dtype != logits.dtype:  # a graph's step beside an eager one
            logits, prev = logits.float(), prev.float()
        if not next_tokens.is_cuda:
            masked_argmax(logits, work.masks, work.work(num), next_tokens, prev)
            tokens_cpu.copy_(next_tokens)
            return
        # NOTE: one raw copy into a kept device buffer: a torch copy or a new tensor each cost
        # tens of us of host per step on the H100 machine
        buf, dev = work.buf, self._late
        if dev is None or dev.shape[0] < buf.shape[0] or dev.shape[1] != buf.shape[1]:
            dev = self._late = torch.empty(buf.shape, dtype=torch.int32, device=self.device)
            self._late_views.clear()
        views = self._late_views.get((work.header, num))
        if views is None:  # (views made once: 9 us of host a step on the H100 machine)
            views = self._late_views[work.header, num] = (
                dev[work.header:], dev[:work.header].view(-1)[:num * ITEM].view(num, ITEM))
        copy_async(dev, buf[:work.used_rows])
        masked_argmax(logits, views[0], views[1], next_tokens, prev)
        copy_async(tokens_cpu, next_tokens)

    @torch.inference_mode()
    def emit(self, out: SamplerOutput | None, next_tokens: torch.Tensor, tokens_cpu: torch.Tensor,
             logprobs_cpu: torch.Tensor | None) -> None:
        """A step's sampled tokens into `next_tokens`, and the copies to the host buffers."""
        if out is None:
            return
        if out.token_ids.data_ptr() != next_tokens.data_ptr():  # else the graph wrote them
            next_tokens.copy_(out.token_ids)
        if out.token_ids.is_cuda:  # into a pinned `HostRing` buffer (`alloc_output`)
            copy_async(tokens_cpu, out.token_ids)
        else:
            tokens_cpu.copy_(out.token_ids, non_blocking=True)
        if logprobs_cpu is not None:
            logprobs_cpu.copy_(out.packed, non_blocking=True)


def unpack_sampled(token_ids: torch.Tensor, logprobs: torch.Tensor | None, sample_reqs: list[int],
                   rows: list[SamplingRow]) -> dict[int, SampledToken]:
    """A step's tokens [S] and packed logprobs ([S, 2 + 2K], `pack_logprobs`; None: none asked),
    on the host -> {batch index: (token, logprob, rank, top)}, logprobs only where asked."""
    ids = token_ids.tolist()
    if logprobs is None:
        return {i: (t, None, None, None) for i, t in zip(sample_reqs, ids)}
    width = (logprobs.shape[1] - 2) // 2
    packed = logprobs.tolist()  # NOTE: one conversion; a row's columns are sliced as lists
    top_ids = logprobs[:, 2:2 + width].int().tolist() if width else None
    result: dict[int, SampledToken] = {}
    for j, (i, row) in enumerate(zip(sample_reqs, rows)):
        k = row.params.logprobs
        if k is None:
            result[i] = (ids[j], None, None, None)
        else:
            p = packed[j]
            top = list(zip(top_ids[j][:k], p[2 + width:2 + width + k])) if k else []
            result[i] = (ids[j], p[0], int(p[1]), top)
    return result
