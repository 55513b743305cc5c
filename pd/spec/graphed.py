"""The graphed MTP step of `SpecDecoder` (`pd.spec.verify`): a step of verify slots only, with
the MTP drafter, run by the CUDA graphs of `pd.spec.graphs` (on CPU, with `PD_SPEC_LAYOUT=1`, the
same layout without capture). `launch_graphed` queues a step from the host, `launch_chained`
the step after a launched one from its result on the device (the overlap loop's MTP step,
`pd.engine.decode_loop`), `collect` waits for a step and reads its results (`SpecFlight`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from pd.engine.decode_inputs import write_new_blocks
from pd.engine.host_ring import EventRing, copy_async
from pd.engine.request import Req
from pd.engine.sampler import GREEDY_EPS
from pd.engine.scheduler import ScheduledBatch
from pd.spec.graphs import STOP_WIDTH
from pd.spec.step_graphs import lp0_columns
from pd.spec.mtp import MTPDrafter

if TYPE_CHECKING:
    from pd.spec.verify import SpecResult


def stop_ids_of(req: Req) -> list[int]:
    p = req.params
    eos = () if p.ignore_eos else tuple(req.eos_token_ids) + p.extra_eos_token_ids
    return list(dict.fromkeys(p.stop_token_ids + eos))


class GraphedSteps:
    """`SpecDecoder`'s graphed steps (a mix-in: it reads the decoder's `graphs`, `runner`, `k`,
    `drafter`, `device`, `max_model_len` and calls its `sampling_rows`, `_targets`,
    `_uniforms`, `results`)."""

    def graph_key(self, batch: ScheduledBatch) -> tuple[int, int] | None:
        """The graphs' (slots, width) for a batch of verify slots only, else None (eager)."""
        if self.graphs is None or not isinstance(self.drafter, MTPDrafter):
            return None  # the graphs run the MTP layer; another drafter runs eagerly
        for req, n in zip(batch.reqs, batch.num_new_tokens):
            if (req.num_computed_tokens != req.num_tokens - 1 or n != 1 + len(req.spec_token_ids)
                    or len(stop_ids_of(req)) > STOP_WIDTH):
                return None
        return self.graphs.key(len(batch.reqs), max(len(r.block_ids) for r in batch.reqs))

    @staticmethod
    def plain_greedy(req: Req) -> bool:
        """Greedy with nothing between the logits and the argmax at any of its positions."""
        p = req.params
        return (p.temperature < GREEDY_EPS and not p.processes_logits
                and req.num_output_tokens >= p.min_tokens)

    def run_graphed(self, batch: ScheduledBatch, key: tuple[int, int]) -> dict[int, SpecResult]:
        return self.collect(self.launch_graphed(batch, key))

    def _host_inputs(self, reqs: list[Req], key: tuple[int, int], rows: list[int]):
        """The host buffer of a step over `reqs` with the known part (`Layout.tail` on) filled;
        `rows[b]` < 0 marks slot b invalid."""
        num_slots = len(reqs)
        host, v = self.graphs.host_inputs(key)
        for b, r in enumerate(reqs):
            v["block_tables"][b, :len(r.block_ids)] = r.block_ids
            stops = stop_ids_of(r)
            v["stop_ids"][b, :len(stops)] = stops
        v["greedy"][:num_slots] = [r.params.temperature < GREEDY_EPS for r in reqs]
        v["max_seq_lens"][:num_slots] = [min(r.num_prompt_tokens + r.params.max_tokens, self.max_model_len)
                                         for r in reqs]
        v["min_tokens"][:num_slots] = [r.params.min_tokens for r in reqs]
        v["slot_index"][:num_slots] = [b if i >= 0 else -1 for b, i in enumerate(rows)]
        return host, v

    @torch.inference_mode()
    def launch_graphed(self, batch: ScheduledBatch, key: tuple[int, int]) -> "SpecFlight":
        """Queue a step of verify slots (`graph_key`) on the device; `collect` waits for it."""
        k, bs, reqs = self.k, self.runner.block_size, batch.reqs
        num_slots, width = len(reqs), key[1]
        g = self.graphs.get(key)
        host, v = self._host_inputs(reqs, key, list(range(num_slots)))
        nd = np.fromiter((len(r.spec_token_ids) for r in reqs), np.int64, num_slots)
        for b, r in enumerate(reqs):
            v["input_ids"][b, 0] = r.token_ids[-1]
            v["input_ids"][b, 1:1 + nd[b]] = v["draft_ids"][b, :nd[b]] = r.spec_token_ids
        start = np.fromiter((r.num_computed_tokens for r in reqs), np.int64, num_slots)
        pos = start[:, None] + np.arange(k + 1)[None, :]
        valid = np.arange(k + 1)[None, :] <= nd[:, None]
        table_of = np.take_along_axis(v["block_tables"][:num_slots], np.minimum(pos // bs, width - 1), 1)
        v["positions"][:num_slots] = np.where(valid, pos, 0)
        v["slot_mapping"][:num_slots] = np.where(valid, table_of * bs + pos % bs,
                                                 self.graphs.dummy_block * bs)
        v["context_lens"][:num_slots] = np.where(valid, pos + 1, 1)
        v["num_drafts"][:num_slots] = nd
        v["seq_lens"][:num_slots] = [r.num_tokens for r in reqs]
        v["num_outputs"][:num_slots] = [r.num_output_tokens for r in reqs]
        start_event = self._event()
        g.inputs.copy_(host, non_blocking=True)
        g.known = KnownPart(list(range(num_slots)), reqs, host.numpy(), g.layout)
        g.verify()
        plain = [self.plain_greedy(r) for r in reqs]
        if not all(plain):
            rows = [row for r in reqs for row in self.sampling_rows(r)]
            target, p_draft = self._targets(g.verified.logits[:num_slots * (k + 1)].float(), rows,
                                            g.views["draft_ids"][:num_slots],
                                            g.views["num_drafts"][:num_slots],
                                            g.views["greedy"][:num_slots])
            g.verified.target[:num_slots].copy_(target)
            g.p_draft[:num_slots].copy_(p_draft)
            g.uniforms[:num_slots].copy_(self._uniforms(reqs))
        top = self._top_asked(reqs)
        packed = g.draft(lp0=top == 0)
        return self._finish_launch(batch, key, g, start_event, list(range(num_slots)), all(plain),
                                   top, packed)

    @torch.inference_mode()
    def launch_chained(self, prev: "SpecFlight") -> "SpecFlight":
        """Queue the step after `prev` (not yet collected) for the same slots: its inputs are
        computed on the device from prev's result (`SpecGraphs._advance`). The caller has made
        sure it may (`DecodeLoop`): every slot greedy without logit processing, blocks for
        prev's k + 1 tokens and this step's k + 1 and k draft positions reserved, no width change."""
        reqs = prev.batch.reqs
        g = prev.graphs
        # NOTE: the known part changes only when a slot stopped or a request got a block: the
        # blocks got are patched into the host copy, a stopped slot builds it again
        changed = None if g.known is None else g.known.patch(reqs, prev.rows)
        if changed is None:
            tail = g.layout.tail
            host, _ = self._host_inputs(reqs, prev.key, prev.rows)
            g.inputs[tail:].copy_(host[tail:], non_blocking=True)
            g.known = KnownPart(list(prev.rows), reqs, host.numpy(), g.layout)
        elif changed:
            host = g.rings.get(g.known_inputs.shape, name="known")
            host.numpy()[:] = g.known.flat[g.layout.tail:]
            copy_async(g.known_inputs, host)
        # NOTE: after the host's patch: where the device idles for it, that is a gap, not the
        # step's busy time (`DecodeLoop.process_spec`)
        start_event = self._event()
        top = prev.top  # the same requests
        if top is None or top == 0:
            packed = g.chain(lp0=top == 0)
        else:
            g.advance()
            g.verify()
            packed = g.draft()
        batch = ScheduledBatch(list(reqs), [0] * len(reqs))  # counts: set from the drafts on update
        return self._finish_launch(batch, prev.key, g, start_event,
                                   [b if i >= 0 else -1 for b, i in enumerate(prev.rows)], True,
                                   top, packed, prev.members)

    def _event(self):
        events = self._events
        if events is None:
            if self.device.type != "cuda":
                return None
            # NOTE: the decode loop's thread, whose stream never changes
            self._stream = torch.cuda.current_stream(self.device)
            events = self._events = EventRing()
        event = events.take()
        event.record(self._stream)
        return event

    def _top_asked(self, reqs: list[Req]) -> int | None:
        """The widest top_logprobs the step's requests ask (None: no logprobs at all)."""
        asked = [r.params.logprobs for r in reqs if r.params.logprobs is not None]
        return min(max(asked), self.runner.model_config.vocab_size) if asked else None

    def _finish_launch(self, batch, key, g, start_event, rows: list[int], chainable: bool,
                       top: int | None, packed_lp0: torch.Tensor | None = None,
                       members: dict | None = None) -> "SpecFlight":
        """Queue the result's copy to the host (and the logprobs of the accepted tokens; with
        top_logprobs 0 they came packed after the result, `packed_lp0`: one copy). Every slot
        of the graph is copied, padding too: no slicing on the host, a few bytes more.
        `members`: the step's request -> slot, where the step before's holds (a chained step)."""
        lp = None
        if packed_lp0 is not None:
            out = g.host_buffer(packed_lp0)
            copy_async(out, packed_lp0)
        else:
            out = g.host_buffer(g.result)
            copy_async(out, g.result)
            if top is not None:
                packed = g.logprobs(top)
                lp = g.host_buffer(packed)
                copy_async(lp, packed)
        end_event = self._event()
        if members is None:
            members = {r: b for b, r in enumerate(batch.reqs)}
        return SpecFlight(batch, key, g, out, lp, start_event, end_event, rows, members, [],
                          chainable, top)

    def collect(self, f: "SpecFlight") -> dict[int, SpecResult]:
        """Wait for a launched step and read its results; slots made invalid since (`rows`
        -1) are dropped."""
        if f.end is not None:
            f.end.synchronize()
        width = 2 * self.k + 4
        a = f.out.numpy()[:len(f.rows)]
        rows = a[:, :width].tolist()
        cols = lp0_columns(a[:, width:]) if a.shape[1] > width else None  # top_logprobs 0
        if -1 not in f.rows:  # NOTE: every slot live, as in most steps: no lists to filter
            return self.results(f.rows, f.batch.reqs, rows, f.lp, None, cols)
        live = [b for b, i in enumerate(f.rows) if i >= 0]
        return self.results([f.rows[b] for b in live], [f.batch.reqs[b] for b in live],
                            [rows[b] for b in live], f.lp, live, cols)


class KnownPart:
    """The known part of a `StepGraphs`' inputs (`Layout.tail` on) as last written: the slot
    rows and the block lists it was built for (their lengths then) and a host copy of it."""

    __slots__ = ("rows", "blocks", "lengths", "flat", "tables")

    def __init__(self, rows: list[int], reqs: list[Req], flat: np.ndarray, layout) -> None:
        self.rows, self.flat = rows, flat.copy()
        self.blocks = [r.block_ids for r in reqs]
        self.lengths = list(map(len, self.blocks))
        self.tables = layout.views(self.flat)["block_tables"]

    def patch(self, reqs: list[Req], rows: list[int]) -> bool | None:
        """Write the blocks `reqs` got since into the host copy (`write_new_blocks`): whether
        some did; None where it cannot stand for them (another slot set, a request's block
        list replaced or shorter: build it again)."""
        if rows != self.rows:
            return None
        lengths = write_new_blocks(self.tables, [r.block_ids for r in reqs], self.blocks,
                                   self.lengths)
        if lengths is None:
            return None
        changed, self.lengths = lengths != self.lengths, lengths
        return changed


class SpecFlight(NamedTuple):
    """A graphed MTP step launched and not yet collected (`pd.engine.decode_loop` holds it)."""

    batch: ScheduledBatch
    key: tuple[int, int]
    graphs: object  # pd.spec.step_graphs.StepGraphs
    out: torch.Tensor  # host copy of the result [S', 2k + 4] (S' the graph's slots), with
    # top_logprobs 0 followed by its rows' pairs [S', 3k + 5] (`lp0_columns`)
    lp: torch.Tensor | None  # host copy of the verified rows' packed logprobs (`pack_logprobs`)
    start: object  # CUDA events (None on CPU)
    end: object
    rows: list[int]  # batch index of each slot; -1: invalid, its result dropped
    members: dict  # request -> slot
    free_after: list[Req]  # finished while in flight: blocks freed once this step is done
    chainable: bool  # the next step may be computed from this one on the device
    top: int | None  # the widest top_logprobs its requests ask (`SpecDecoder._top_asked`)
