"""The model runner: owns the model, the node's KV cache and the sampler, and builds a plain
step's tensors (`prepare`). The MTP verify step (`pd.spec.verify`), the MTP drafter
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
from dataclasses import fields, replace
from operator import is_
from typing import NamedTuple

import numpy as np
import torch

from pd.config import EngineConfig, ModelConfig, dtype_name
from pd.model import parallel
from pd.model.context import ForwardContext, forward_context, host_context, run_slots
from pd.engine.host_ring import HostRing, copy_async, to_device
from pd.engine.grammar import fill_masks
from pd.engine.kv_cache import KVCache, num_blocks_for
from pd.engine.logprobs import MAX_PACKED_VOCAB, prompt_spans, record_prompt_logprobs
from pd.model.loader import load_model
from pd.engine.request import Req
from pd.engine.sampler import Sampler, SamplerOutput, SamplingRow
from pd.engine.scheduler import ScheduledBatch
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


class ForwardInput(NamedTuple):
    input_ids: torch.Tensor  # [T]; negative ids are future tokens, see future_index
    positions: torch.Tensor  # [T]
    context: ForwardContext
    logits_index: torch.Tensor  # [S] rows of the hidden states to sample from
    sample_reqs: list[int]  # batch index of each sampled row
    rows: list[SamplingRow]
    # NOTE: tokens whose id the host does not know yet (sampled by the step still in flight)
    # are read on the device from that step's next tokens: input_ids[future_index] =
    # prev_tokens[future_slots]. None when every id is known.
    future_index: torch.Tensor | None = None  # [F] positions in input_ids
    future_slots: torch.Tensor | None = None  # [F] rows of the previous step's next tokens
    num_top: int = 0  # top-logprob columns: the most any row asked for
    # a decode step run as a CUDA graph: its key and its inputs in the graph's layout (pinned,
    # `DecodeGraphs.host_inputs`); input_ids, positions, context and logits_index are then None
    decode_graph: tuple[tuple[int, int], torch.Tensor] | None = None
    # a prompt's first chunk run as a prefill CUDA graph: its token count and its inputs in the
    # graph's layout (pinned, `PrefillGraphs.host_inputs`); input_ids, positions, context and
    # logits_index are then None
    prefill_graph: tuple[int, torch.Tensor] | None = None
    prompt_spans: tuple = ()  # prompt positions whose logprobs are asked (`prompt_spans`)
    wants_logprobs: bool = False  # a row asks for logprobs
    # a graphed decode step's rows all take the argmax its graph took (`SamplingRow.takes_argmax`)
    argmax_only: bool = False


class ForwardOutput(NamedTuple):
    """One launched step. Tokens are [S] (one per sampled row); a verify step of 1 + k tokens
    per row would make them [S, 1 + k] with the accepted counts beside them."""

    next_tokens_gpu: torch.Tensor  # [S] int64 on the device: what the next step's future ids read
    next_tokens_cpu: torch.Tensor  # [S] int64 on the host (pinned on CUDA); valid after copy_done
    logprobs_cpu: torch.Tensor | None  # host copy of the packed logprobs (`pack_logprobs`), likewise
    copy_done: object  # the executor's completion: .wait() returns once the host copies landed


class ModelRunner:
    def __init__(self, cfg: EngineConfig) -> None:
        self.config = cfg
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and self.device.index is not None:
            # Triton launches and graph captures use the current device: a node on cuda:1
            # failed its first Triton kernel while the current device was cuda:0
            torch.cuda.set_device(self.device)
        self.dtype = cfg.torch_dtype
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
            from pd.engine.cuda_graph import DecodeGraphs, PrefillGraphs, VarlenPrefillGraphs

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

    def prepare(self, batch: ScheduledBatch, masks: bool = True) -> ForwardInput:
        """The step's inputs on the device and its sampler rows; `masks` False leaves the
        grammars' masks out of the rows (a deferred sampling rebuilds them, `sampling_rows`)."""
        # NOTE: a decode step of one token per request, each sampling (`ScheduledBatch.samples`),
        # checked without a call per request
        counts = batch.num_new_tokens
        if (self.graphs is not None and max(counts) == 1 and sum(counts) == len(counts)
                and all(r.num_computed_tokens + 1 >= len(r.token_ids) for r in batch.reqs)):
            key = self.graphs.key(len(batch.reqs), max(len(r.block_ids) for r in batch.reqs))
            if key is not None:
                return self.prepare_graphed(batch, key, masks)
        graph_inputs = self.prefill_graph_inputs(batch)
        if graph_inputs is not None:
            return self.prepare_prefill_graphed(batch, graph_inputs, masks)
        bs = self.block_size
        id_parts: list = []  # per request: a list (short runs) or an array (long ones)
        pos_parts: list = []
        slot_parts: list = []
        context_lens: list[int] = []
        logits_index: list[int] = []
        sample_reqs: list[int] = []
        num_tokens = 0
        for i, (req, n) in enumerate(zip(batch.reqs, batch.num_new_tokens)):
            start = req.num_computed_tokens
            table = req.block_ids
            if n > LONG_RUN:  # a prompt chunk: numpy (Python per token costs ~0.4 us)
                in_prompt = start + n <= req.num_prompt_tokens
                id_parts.append(req.prompt_array()[start:start + n] if in_prompt
                                else req.token_ids[start:start + n])
                pos_parts.append(np.arange(start, start + n, dtype=np.int64))
                slot_parts.append(run_slots(table, start, n, bs))
            else:
                id_parts.append(req.token_ids[start:start + n])
                pos_parts.append(range(start, start + n))
                slot_parts.append([table[p // bs] * bs + p % bs for p in range(start, start + n)])
            context_lens.append(start + n)
            num_tokens += n
            if batch.samples(i):
                logits_index.append(num_tokens - 1)
                sample_reqs.append(i)
        rows = self.sampling_rows([batch.reqs[i] for i in sample_reqs], masks)
        asked = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        flat = _concat if any(n > LONG_RUN for n in batch.num_new_tokens) else _chain
        ids, positions, slots = flat(id_parts), flat(pos_parts), flat(slot_parts)
        ctx = host_context(batch.num_new_tokens, context_lens,
                           [req.block_ids for req in batch.reqs], slots,
                           bs if self.device.type == "cuda" else None)  # kv_slots: CUDA's
        future = np.nonzero(ids < 0)[0]
        host = {"input_ids": torch.from_numpy(ids), "positions": torch.from_numpy(positions),
                "logits_index": torch.from_numpy(np.asarray(logits_index, dtype=np.int64))}
        if len(future):
            host["future_index"] = torch.from_numpy(future.astype(np.int64))
            host["future_slots"] = torch.from_numpy(-ids[future] - 1)
        for f in fields(ctx):
            if isinstance(getattr(ctx, f.name), torch.Tensor):
                host["ctx." + f.name] = getattr(ctx, f.name)
        dev = self.to_device_all(host)
        return ForwardInput(
            input_ids=dev["input_ids"],
            positions=dev["positions"],
            context=replace(ctx, **{k[4:]: v for k, v in dev.items() if k.startswith("ctx.")}),
            logits_index=dev["logits_index"],
            sample_reqs=sample_reqs,
            rows=rows,
            future_index=dev.get("future_index"),
            future_slots=dev.get("future_slots"),
            num_top=min(max(asked, default=0), self.model_config.vocab_size),
            prompt_spans=tuple(prompt_spans(batch.reqs, batch.num_new_tokens)),
            wants_logprobs=bool(asked),
        )

    def prepare_graphed(self, batch: ScheduledBatch, key: tuple[int, int],
                        masks: bool = True) -> ForwardInput:
        """A decode step for a CUDA graph: its inputs built on the host in the graph's layout,
        copied and replayed by `sample` (nothing else per step touches the device). The rows
        of a step whose requests, in the same order, all took the argmax in the last graphed
        step are that step's: such a row stays one (greedy, unprocessed, past min_tokens), and
        nothing reads its count then (a steady greedy batch's every step)."""
        last_reqs, last = self.graphed_rows
        graph = (key, self.graphs.host_inputs(batch.reqs, key))
        if (last is not None and last.argmax_only and len(batch.reqs) == len(last_reqs)
                and all(map(is_, batch.reqs, last_reqs))):
            inp = last._replace(decode_graph=graph)
        else:
            rows = self.sampling_rows(batch.reqs, masks)
            asked = [r.params.logprobs for r in rows if r.params.logprobs is not None]
            inp = ForwardInput(None, None, None, None, list(range(len(rows))), rows,
                               num_top=min(max(asked, default=0), self.model_config.vocab_size),
                               decode_graph=graph, wants_logprobs=bool(asked),
                               argmax_only=all(r.takes_argmax for r in rows))
        self.graphed_rows = (list(batch.reqs), inp)
        return inp

    def prefill_graph_inputs(self, batch: ScheduledBatch,
                             graphs=None) -> tuple[int, torch.Tensor] | None:
        """A step that is one prompt's first chunk alone, where a prefill CUDA graph runs it:
        (its token count, its inputs built on the host in the graph's layout,
        `PrefillGraphs.host_inputs`); None otherwise. No context is built. `graphs`: other
        prefill graphs than the runner's (`pd.spec.prefill`'s uncaptured ones)."""
        graphs = graphs or self.prefill_graphs
        if (graphs is None or len(batch.reqs) != 1 or batch.reqs[0].num_computed_tokens != 0
                or not graphs.fits(batch.num_new_tokens[0])):
            return None
        req, n = batch.reqs[0], batch.num_new_tokens[0]
        # NOTE: a chunk past the prompt is a recompute after a preemption (no future ids)
        ids = (req.prompt_array()[:n] if n <= req.num_prompt_tokens
               else np.asarray(req.token_ids[:n], dtype=np.int64))
        return n, graphs.host_inputs(ids, run_slots(req.block_ids, 0, n, self.block_size))

    def prepare_prefill_graphed(self, batch: ScheduledBatch, graph_inputs: tuple[int, torch.Tensor],
                                masks: bool = True) -> ForwardInput:
        """A prompt's first chunk alone (`prefill_graph_inputs`), copied and replayed by
        `forward_rows`."""
        req = batch.reqs[0]
        sample_reqs = [0] if batch.samples(0) else []
        rows = self.sampling_rows([req] if sample_reqs else [], masks)
        asked = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        return ForwardInput(None, None, None, None, sample_reqs, rows,
                            num_top=min(max(asked, default=0), self.model_config.vocab_size),
                            prefill_graph=graph_inputs,
                            prompt_spans=tuple(prompt_spans(batch.reqs, batch.num_new_tokens)),
                            wants_logprobs=bool(asked))

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the runner's device; on CUDA through pinned memory without blocking,
        on the current stream, so building a step never waits for the one in flight."""
        return to_device(t, self.device)

    def to_device_all(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`to_device` for a step's host tensors at once: they travel packed in one page-locked
        buffer of the host ring (its size rounded up to a power of two, so a few sizes serve
        every step: no page-locked allocation per step, which cost a long prompt's step a
        millisecond of host time) and one copy, as views of it (each at an 8-byte offset).
        NOTE: packed with numpy: a torch copy of over 32k elements on the host wakes torch's
        thread pool, which took 2 ms for 40,960 ints on the H100 host (13 us on one thread)."""
        if self.device.type != "cuda":
            return tensors
        offsets, total = {}, 0
        for k, t in tensors.items():
            offsets[k] = total
            total += -(-t.numel() * t.element_size() // 8) * 8
        staging = self.host_buffers.get((1 << max(13, (total - 1).bit_length()),), torch.uint8,
                                        "inputs")
        raw = staging.numpy()
        for k, t in tensors.items():
            arr = t.numpy().reshape(-1).view(np.uint8)
            raw[offsets[k]:offsets[k] + arr.size] = arr
        flat = staging[:total].to(self.device, non_blocking=True)
        return {k: flat[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                for (k, t), o in zip(tensors.items(), offsets.values())}

    @staticmethod
    def sampling_row(req: Req, allowed: torch.Tensor | None = None, mask: bool = True) -> SamplingRow:
        """The sampler's row of a request's next token; `allowed`: its grammar's mask when the
        caller filled it (`sampling_rows`), else filled here unless `mask` is False."""
        if allowed is None and mask and req.grammar is not None:
            allowed = req.grammar.mask()
        # NOTE: positional, each property read once: a decode step builds one per request
        # (256 rows: 183 -> 91 us on the CPU)
        params = req.params
        penalties = params.has_penalties
        return SamplingRow(params, req.output_token_ids if penalties else [],
                           req.prompt_token_ids if penalties else [],
                           len(req.token_ids) - len(req.prompt_token_ids), req.eos_token_ids,
                           allowed)

    def sampling_rows(self, reqs: list[Req], masks: bool = True,
                      filled: torch.Tensor | None = None) -> list[SamplingRow]:
        """`sampling_row` of each request, the grammars' masks filled together (`fill_masks`)
        into one buffer of `mask_buffer`, or left out (`masks` False), or already in `filled`
        (row j: reqs[j]'s, as `DecodeLoop.process` fills them)."""
        if not masks or not any(r.grammar is not None for r in reqs):
            return [self.sampling_row(r, mask=False) for r in reqs]
        if filled is None:
            filled = self.mask_buffer(len(reqs))
            fill_masks([r.grammar for r in reqs], filled)
        return [self.sampling_row(r, filled[j] if r.grammar is not None else None)
                for j, r in enumerate(reqs)]

    def mask_buffer(self, num_rows: int) -> torch.Tensor:
        """[num_rows, ceil(V / 32)] int32 for a step's grammar masks: a `HostRing` buffer
        (page-locked on CUDA; rows in powers of two, so a few shapes serve every batch)."""
        words = -(-self.model_config.vocab_size // 32)
        rows = 1 << max(3, (num_rows - 1).bit_length())
        return self.host_buffers.get((rows, words), torch.int32, name="masks")[:num_rows]

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
                logprobs_cpu: torch.Tensor | None) -> None:
        """The device part of a step: forward, sample, write `next_tokens` (read by the next
        step in stream order) and start the copies to the host buffers. Never waits."""
        self.emit(self.sample(inp, prev_tokens), next_tokens, tokens_cpu, logprobs_cpu)

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


LONG_RUN = 64  # tokens of one request in a step past which its inputs are built with numpy


def _chain(parts: list) -> np.ndarray:
    """Short runs (lists, ranges) -> one int64 array."""
    out: list[int] = []
    for part in parts:
        out += part
    return np.asarray(out, dtype=np.int64)


def _concat(parts: list) -> np.ndarray:
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])


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
