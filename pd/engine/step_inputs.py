"""A plain step's tensors from a `ScheduledBatch`: the model runner's host side (`StepInputs`,
a mix-in of `pd.engine.runner.ModelRunner`) and what it builds (`ForwardInput`). A decode step
of one token per request becomes its CUDA graph's inputs in the graph's layout
(`prepare_graphed`), a prompt's first chunk alone a prefill graph's (`prepare_prefill_graphed`),
anything else the eager step's ids, positions, KV slots and attention context, copied to the
device in one page-locked buffer (`to_device_all`); the sampler's rows come with them
(`sampling_rows`, the grammars' masks filled together).
"""

from __future__ import annotations

from dataclasses import fields, replace
from operator import is_
from typing import NamedTuple

import numpy as np
import torch

from pd_kernels.masked_argmax import ITEM
from pd.engine.decode_inputs import DecodeLayout, write_bans
from pd.engine.grammar import fill_masks
from pd.engine.grammar_steps import LateWork
from pd.engine.host_ring import to_device
from pd.engine.logprobs import prompt_spans
from pd.engine.request import Req
from pd.engine.sampler import SamplingRow
from pd.engine.scheduler import ScheduledBatch
from pd.model.context import ForwardContext, host_context, run_slots

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
    # a row of it passes over banned ids (written in the graph's inputs, `write_bans`)
    bans: bool = False


class StepInputs:
    """`ModelRunner`'s building of a step (a mix-in: it reads the runner's `graphs`,
    `prefill_graphs`, `block_size`, `device`, `host_buffers`, `model_config` and
    `graphed_rows`)."""

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
        step with no banned id are that step's: such a row stays one (greedy, unprocessed, past
        min_tokens), and nothing reads its count then (a steady greedy batch's every step). A
        row under min_tokens takes the graph's argmax too, its banned ids written in the
        inputs (rows built each step while any has them)."""
        last_reqs, last = self.graphed_rows
        graph = (key, self.graphs.host_inputs(batch.reqs, key))
        if (last is not None and last.argmax_only and not last.bans
                and len(batch.reqs) == len(last_reqs) and all(map(is_, batch.reqs, last_reqs))):
            inp = last._replace(decode_graph=graph)
        else:
            rows = self.sampling_rows(batch.reqs, masks)
            asked = [r.params.logprobs for r in rows if r.params.logprobs is not None]
            argmax_only = all(r.takes_argmax for r in rows)
            bans = argmax_only and [r.banned_token_ids for r in rows]
            if bans and any(bans):
                write_bans(graph[1].numpy(), DecodeLayout(*key), bans)
            inp = ForwardInput(None, None, None, None, list(range(len(rows))), rows,
                               num_top=min(max(asked, default=0), self.model_config.vocab_size),
                               decode_graph=graph, wants_logprobs=bool(asked),
                               argmax_only=argmax_only, bans=bool(bans) and any(bans))
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
        grammar = req.grammar
        checked = grammar is not None and not grammar.masks_now  # `CheckedSampling`
        if allowed is None and mask and grammar is not None and not checked:
            allowed = grammar.mask()
        # NOTE: positional, each property read once: a decode step builds one per request
        # (256 rows: 183 -> 91 us on the CPU)
        params = req.params
        penalties = params.has_penalties
        return SamplingRow(params, req.output_token_ids if penalties else [],
                           req.prompt_token_ids if penalties else [],
                           len(req.token_ids) - len(req.prompt_token_ids), req.eos_token_ids,
                           allowed, checked)

    def sampling_rows(self, reqs: list[Req], masks: bool = True,
                      filled: torch.Tensor | None = None) -> list[SamplingRow]:
        """`sampling_row` of each request, the grammars' masks filled together (`fill_masks`)
        into one buffer of `mask_buffer`, or left out (`masks` False), or already in `filled`
        (row j: reqs[j]'s, as `DecodeLoop.process` fills them). A row whose grammar is checked
        after sampling this step (`CheckedSampling`) has none."""
        if not masks or not any(r.grammar is not None for r in reqs):
            return [self.sampling_row(r, mask=False) for r in reqs]
        masked = [r.grammar if r.grammar is not None and r.grammar.masks_now else None
                  for r in reqs]
        if not any(masked):
            return [self.sampling_row(r, mask=False) for r in reqs]
        if filled is None:
            filled = self.mask_buffer(len(reqs))
            fill_masks(masked, filled)
        return [self.sampling_row(r, filled[j] if g is not None else None)
                for j, (r, g) in enumerate(zip(reqs, masked))]

    def mask_buffer(self, num_rows: int) -> torch.Tensor:
        """[num_rows, ceil(V / 32)] int32 for a step's grammar masks: a `HostRing` buffer
        (page-locked on CUDA; rows in powers of two, so a few shapes serve every batch)."""
        words = -(-self.model_config.vocab_size // 32)
        rows = 1 << max(3, (num_rows - 1).bit_length())
        return self.host_buffers.get((rows, words), torch.int32, name="masks")[:num_rows]

    def late_work(self, num_rows: int) -> LateWork:
        """A `LateWork` for a step of `num_rows` sampled rows (a `HostRing` buffer, as
        `mask_buffer`'s)."""
        words = -(-self.model_config.vocab_size // 32)
        rows = 1 << max(3, (num_rows - 1).bit_length())
        header = -(-rows * ITEM // words)
        return LateWork(self.host_buffers.get((header + rows, words), torch.int32, name="late"),
                        header)


LONG_RUN = 64  # tokens of one request in a step past which its inputs are built with numpy


def _chain(parts: list) -> np.ndarray:
    """Short runs (lists, ranges) -> one int64 array."""
    out: list[int] = []
    for part in parts:
        out += part
    return np.asarray(out, dtype=np.int64)


def _concat(parts: list) -> np.ndarray:
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
