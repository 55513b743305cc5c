"""Speculative decoding's verify step: one target forward over each request's last token plus
its draft tokens, acceptance (greedy exact match, or rejection sampling), stop detection inside
the accepted run, and the next drafts from a drafter strategy (`pd.spec.mtp.MTPDrafter`, or any
object with its `propose`).

A request in the step is one slot. Its kind (see `pd_kernels.draft_preprocess`): a verify slot
(decode; q = 1 + n rows for n drafts), a prefill slot whose chunk ends the prompt (samples one
token: the same path with n = 0), or a chunk slot (samples nothing; the drafter still runs the
MTP layer over it so that the MTP layer's KV keeps pace with the target's). Sampled slots are
verified losslessly: draft j (drawn by the drafter with probability q = 1, its argmax) is kept
with probability min(1, p_j(d_j)); the first rejected position draws from normalize(max(p_j -
q_j, 0)), and a run with every draft kept draws its bonus token from p_n. p_j is the sampler's
final distribution for that position (`probs_after_processing`, with the step counter and the
output tokens of a request that had drafts 0..j-1 accepted), so the output distribution is the
target's. The per-slot bookkeeping runs in `kernels` (RawKernels on CUDA, their torch twins on
CPU). Two ways to run a step:
- eager (`prepare` + `execute`, read by `run`): any mix of slots, any drafter;
- graphed (`launch_graphed`, read by `collect`; `pd.spec.graphed`, whose methods `SpecDecoder`
  takes): verify slots only, with the MTP drafter, through `pd.spec.graphs` (CUDA graphs; on
  CPU the same layout without capture). `launch_chained` queues the step after a launched one
  from its result on the device (the overlap loop's MTP step, `pd.engine.decode_loop`).
Which requests run is the scheduler's; the wire format of drafts is the nodes'.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple

import torch

from pd_kernels import update_status, verify_accept
from pd_kernels.draft_preprocess import CHUNK, DECODE, PREFILL
from pd_kernels.update_status import LENGTH, STOP
from pd.model.context import ForwardContext, build_context
from pd.engine.logprobs import packed_logprobs, prompt_spans, record_prompt_logprobs
from pd.engine.request import FinishReason, Req
from pd.engine.runner import ModelRunner, spec_layout_requested
from pd.engine.sampler import SamplingRow, probs_after_processing, process_logits, step_seed
from pd.engine.scheduler import ScheduledBatch
from pd.spec.graphed import GraphedSteps, stop_ids_of
from pd.spec.graphs import SpecGraphs
from pd.spec.mtp import MTPDrafter
from pd.spec.prefill import SpecPrefill

_UNIFORM_SALT = 0x5BD1E995  # seeded rows draw acceptance uniforms apart from their tokens
_REASONS = {STOP: FinishReason.STOP, LENGTH: FinishReason.LENGTH}


class SpecStep(NamedTuple):
    """Everything one verify step needs on the device, built on the host by `prepare`."""

    input_ids: torch.Tensor  # [T] last verified token then drafts, or prompt chunks
    positions: torch.Tensor  # [T]
    context: ForwardContext
    cu_seqlens: torch.Tensor  # [B + 1]
    slot_kind: torch.Tensor  # [B] int32: DECODE / PREFILL / CHUNK
    next_ids: torch.Tensor  # [B] the token after a chunk (0 elsewhere)
    sample_slots: torch.Tensor  # [S] batch index of each sampled slot
    logits_index: torch.Tensor  # [S * (k + 1)] row of each verified position (padded: repeats)
    draft_ids: torch.Tensor  # [S, k] (0 padded)
    num_drafts: torch.Tensor  # [S] int32
    greedy: torch.Tensor  # [S] int32
    seq_lens: torch.Tensor  # [S] tokens before this step's output
    num_outputs: torch.Tensor  # [S]
    max_seq_lens: torch.Tensor  # [S] min(prompt + max_tokens, max_model_len)
    min_tokens: torch.Tensor  # [S]
    stop_ids: torch.Tensor  # [S, max stop ids] (-1 padded)
    rows: list[SamplingRow]  # S * (k + 1): one per verified position
    reqs: list[Req]  # the sampled slots' requests
    sample_batch_index: list[int]  # batch index of each sampled slot
    max_position: int  # the largest position in the step
    num_top: int  # top-logprob columns: the most any sampled slot asked for
    prompt_spans: tuple = ()  # prompt positions whose logprobs are asked (`prompt_spans`)
    # a prompt's first chunk alone: (n, its inputs in a prefill graph's layout), the target's
    # forward replayed from that graph (`ModelRunner.prefill_graph_inputs`); None: another way
    prefill_graph: tuple[int, torch.Tensor] | None = None


_NO_TOP: tuple = ()  # a token's top pairs where none were asked (shared: never written)


class SpecResult(NamedTuple):
    token_ids: list[int]  # the kept tokens
    # where asked, their logprobs, ranks and top pairs, one list each (`Req.extend_tokens`)
    logprobs: tuple[list[float], list[int], list[list[tuple[int, float]]]] | None
    finish_reason: FinishReason | None
    drafts: list[int]  # the next step's drafts (empty once finished)
    num_drafts: int  # drafts verified this step
    num_accepted_drafts: int  # of which accepted


@dataclass
class SpecStats:
    """Counters in vLLM's meaning: mean acceptance length = 1 + accepted / drafts."""

    num_drafts: int = 0  # verify steps that had at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # runs[n]: the verify steps (with drafts) that accepted exactly n drafts, n = 0 .. k
    runs: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def accepted_per_pos(self) -> list[int]:
        """Per draft position (0 .. k - 1), the verify steps that accepted the draft there."""
        out, total = [], 0
        for n in reversed(self.runs[1:]):
            total += n
            out.append(total)
        return out[::-1]

    def export(self, metrics, seen: "SpecStats") -> "SpecStats":
        """Add what was counted since `seen` to a node's Prometheus counters
        (`pd.service.metrics`); returns the new snapshot."""
        metrics.spec_drafts.inc(self.num_drafts - seen.num_drafts)
        metrics.spec_draft_tokens.inc(self.num_draft_tokens - seen.num_draft_tokens)
        metrics.spec_accepted_tokens.inc(self.num_accepted_tokens - seen.num_accepted_tokens)
        was = seen.accepted_per_pos
        for pos, n in enumerate(self.accepted_per_pos):
            before = was[pos] if pos < len(was) else 0
            if n > before:
                metrics.spec_accepted_at(pos).inc(n - before)
        return SpecStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                         list(self.runs))

    def count(self, k: int, steps: list[tuple[int, int]]) -> None:
        """Count a step's (drafts, accepted) of each request that had drafts (at most k)."""
        runs = self.runs
        if len(runs) <= k:
            runs.extend([0] * (k + 1 - len(runs)))
        for num_drafts, num_accepted in steps:
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += num_accepted
            runs[num_accepted] += 1
        self.num_drafts += len(steps)


class SpecDecoder(GraphedSteps):
    def __init__(self, runner: ModelRunner, num_speculative_tokens: int, drafter,
                 max_model_len: int, seed: int = 0) -> None:
        if not 1 <= num_speculative_tokens <= 4:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be in 1..4")
        self.runner, self.k, self.drafter = runner, num_speculative_tokens, drafter
        self.max_model_len = max_model_len
        self.device = runner.device
        self.stats = SpecStats()
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(seed)
        self._seeded = torch.Generator(device=self.device)
        self._stream = None  # the stream steps are launched on (`_event`), looked up once
        self._events = None  # their timing events (`EventRing`), made with it
        self.graphs = None  # CUDA graphs of verify + draft steps, unless --enforce-eager
        if runner.graphs is not None:
            self.graphs = SpecGraphs.for_decode_graphs(runner.model, num_speculative_tokens,
                                                       runner.graphs, self.device)
        elif spec_layout_requested() and runner.kv_cache.dummy_block is not None:
            self.graphs = SpecGraphs.uncaptured(runner.model, num_speculative_tokens, runner)
        # steps of greedy prompt chunks in two replays (`pd.spec.prefill`)
        self.prefill = (SpecPrefill(self.graphs, runner)
                        if self.graphs is not None and isinstance(drafter, MTPDrafter) else None)

    # -- host: the step's tensors --------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch) -> SpecStep:
        k, bs, dev = self.k, self.runner.block_size, self.runner.to_device
        input_ids, positions, slots, context_lens = [], [], [], []
        cu, kinds, next_ids = [0], [], []
        sample_batch_index, logits_index, draft_rows, num_drafts, rows, reqs = [], [], [], [], [], []
        for i, (req, n) in enumerate(zip(batch.reqs, batch.num_new_tokens)):
            start = req.num_computed_tokens
            seq = req.token_ids + req.spec_token_ids
            input_ids += seq[start:start + n]
            positions += range(start, start + n)
            slots += [req.block_ids[p // bs] * bs + p % bs for p in range(start, start + n)]
            context_lens.append(start + n)
            cu.append(cu[-1] + n)
            if not batch.samples(i):
                kinds.append(CHUNK)
                next_ids.append(req.token_ids[start + n])
                continue
            nd = len(req.spec_token_ids)
            # a verify slot is the newest token plus its drafts; anything longer is a prefill
            # (a prompt, or prompt + output again after preemption)
            kinds.append(DECODE if start == req.num_tokens - 1 else PREFILL)
            next_ids.append(0)
            sample_batch_index.append(i)
            reqs.append(req)
            last = cu[-1] - 1
            logits_index += [last - nd + j if j <= nd else last for j in range(k + 1)]
            draft_rows.append(req.spec_token_ids + [0] * (k - nd))
            num_drafts.append(nd)
            rows += self.sampling_rows(req)
        ctx = build_context(batch.num_new_tokens, context_lens, [r.block_ids for r in batch.reqs],
                            slots, torch.device("cpu"),
                            self.runner.block_size if self.runner.device.type == "cuda" else None)
        ctx = replace(ctx, **{f.name: dev(getattr(ctx, f.name)) for f in fields(ctx)
                              if isinstance(getattr(ctx, f.name), torch.Tensor)})
        stops = [stop_ids_of(r) for r in reqs]
        width = max((len(s) for s in stops), default=0)
        asked = [r.params.logprobs for r in reqs if r.params.logprobs is not None]

        def t(data, dtype=torch.int64):
            return dev(torch.tensor(data, dtype=dtype))

        return SpecStep(
            input_ids=t(input_ids), positions=t(positions), context=ctx, cu_seqlens=t(cu),
            slot_kind=t(kinds, torch.int32), next_ids=t(next_ids),
            sample_slots=t(sample_batch_index), logits_index=t(logits_index),
            draft_ids=t(draft_rows).view(len(reqs), k), num_drafts=t(num_drafts, torch.int32),
            greedy=t([int(r.is_greedy) for r in rows[::k + 1]], torch.int32),
            seq_lens=t([r.num_tokens for r in reqs]),
            num_outputs=t([r.num_output_tokens for r in reqs]),
            max_seq_lens=t([min(r.num_prompt_tokens + r.params.max_tokens, self.max_model_len)
                            for r in reqs]),
            min_tokens=t([r.params.min_tokens for r in reqs]),
            stop_ids=t([s + [-1] * (width - len(s)) for s in stops]).view(len(reqs), width),
            rows=rows, reqs=reqs, sample_batch_index=sample_batch_index,
            max_position=max(positions), num_top=min(max(asked, default=0), self.runner.model_config.vocab_size),
            prompt_spans=tuple(prompt_spans(batch.reqs, batch.num_new_tokens)),
            prefill_graph=self.runner.prefill_graph_inputs(batch),
        )

    def sampling_rows(self, req: Req) -> list[SamplingRow]:
        """The k + 1 sampler rows of a slot: position j sees the drafts before it as output (a
        grammar's mask there takes them as accepted)."""
        # NOTE: the base row without a mask: masks_along fills position 0's with the others
        base, nd = self.runner.sampling_row(req, mask=False), len(req.spec_token_ids)
        masks = (req.grammar.masks_along(req.spec_token_ids, self.k + 1)
                 if req.grammar is not None else [None] * (self.k + 1))
        rows = []
        for j in range(self.k + 1):
            jj = min(j, nd)
            out = base.output_token_ids + req.spec_token_ids[:jj] if req.params.has_penalties else []
            rows.append(replace(base, output_token_ids=out, step=base.step + jj, allowed=masks[j]))
        return rows

    # -- device: verify, accept, stop, draft -----------------------------------------------------
    def _uniforms(self, reqs: list[Req]) -> torch.Tensor:
        k = self.k
        u = torch.empty(len(reqs), k, device=self.device)
        u.uniform_(generator=self._gen)
        for b, r in enumerate(reqs):
            if r.params.seed is not None:
                self._seeded.manual_seed(step_seed(r.params.seed ^ _UNIFORM_SALT, r.num_output_tokens))
                u[b].uniform_(generator=self._seeded)
        return u

    def _targets(self, logits: torch.Tensor, rows: list[SamplingRow], draft_ids: torch.Tensor,
                 num_drafts: torch.Tensor, greedy: torch.Tensor):
        """(target_ids [S, k+1], p(d_j) [S, k]): the greedy argmax, or for sampled slots the
        residual draw at each position (the bonus draw at n), and the target's probability of
        each draft. `logits` [S * (k+1), V], `rows` their sampler rows."""
        k, num_slots = self.k, draft_ids.shape[0]
        greedy_rows = all(r.is_greedy for r in rows)
        x = process_logits(logits, rows)
        if greedy_rows:
            target = x.argmax(dim=-1).view(num_slots, k + 1)
            return target, torch.zeros(num_slots, k, device=self.device)
        probs = probs_after_processing(logits, rows).view(num_slots, k + 1, -1)
        drafts = torch.cat([draft_ids, draft_ids[:, :1]], dim=1)  # [S, k+1]
        p_draft = probs.gather(2, drafts[:, :, None]).squeeze(2)  # [S, k+1]
        has_draft = torch.arange(k + 1, device=self.device)[None, :] < num_drafts[:, None]
        residual = probs.clone()
        # NOTE: the drafter's q is one-hot on its draft, so max(p - q, 0) is p without the draft.
        residual.scatter_(2, drafts[:, :, None], torch.where(has_draft, 0.0, p_draft)[:, :, None])
        drawn = self.runner.sampler.draw(residual.view(num_slots * (k + 1), -1), rows)
        target = torch.where(greedy[:, None].bool(), x.argmax(dim=-1).view(num_slots, k + 1),
                             drawn.view(num_slots, k + 1))
        return target, p_draft[:, :k].contiguous()

    @torch.inference_mode()
    def execute(self, step: SpecStep):
        model, k = self.runner.model, self.k
        # NOTE: the target's forward from the plain prefill graphs where they run the step (the
        # same layers as a plain prefill, no Python launch per kernel); the MTP layer's pass
        # (`drafter.propose`) stays eager
        if step.prefill_graph is not None:
            n, host = step.prefill_graph
            hidden = self.runner.prefill_graphs.launch(host, n)[0]
        else:
            hidden = self.runner.forward(step.input_ids, step.positions, step.context)
        if step.prompt_spans:
            record_prompt_logprobs(model.compute_logits, hidden, step.prompt_spans)
        num_slots = len(step.reqs)
        if num_slots:
            logits = model.compute_logits(hidden[step.logits_index])  # [S * (k+1), V]
            target, p_draft = self._targets(logits, step.rows, step.draft_ids, step.num_drafts,
                                            step.greedy)
            slot_index = torch.arange(num_slots, device=self.device)
            accepted, num_accepted = verify_accept(
                slot_index, step.num_drafts, step.draft_ids, target, torch.ones_like(p_draft),
                p_draft, self._uniforms(step.reqs), step.greedy)
            num_verified = num_accepted.clone()
            stop_flags = torch.zeros(num_slots, dtype=torch.int32, device=self.device)
            update_status(slot_index, accepted, num_accepted, step.seq_lens.clone(),
                          step.num_outputs.clone(), step.max_seq_lens, step.min_tokens,
                          step.stop_ids, stop_flags)
            lp = None
            if step.num_top or any(r.params.logprobs is not None for r in step.reqs):
                lp = packed_logprobs(logits, accepted.clamp(min=0).view(-1), step.num_top)
        else:
            accepted = torch.zeros(0, k + 1, dtype=torch.int64, device=self.device)
            num_accepted = num_verified = stop_flags = torch.zeros(0, dtype=torch.int32, device=self.device)
            lp = None
        drafts = self.drafter.propose(step, hidden, accepted, num_verified)
        return accepted, num_accepted, num_verified, stop_flags, drafts, lp

    def run(self, batch: ScheduledBatch) -> dict[int, SpecResult]:
        key = self.graph_key(batch)
        if key is not None:
            return self.run_graphed(batch, key)
        done = None  # prompt chunks in CUDA graphs (`pd.spec.prefill`): result rows, logprobs
        if self.prefill is not None:
            top = self._top_asked(batch.reqs)
            if self.prefill.fits(batch):
                done = self.prefill.run(batch, self.max_model_len, top)
            elif self.prefill.fits_chunks(batch):
                done = self.prefill.run_chunks(batch, self.max_model_len, top)
        if done is not None:
            rows, lp = done
            return self.results(list(range(len(rows))), batch.reqs, rows, lp)
        step = self.prepare(batch)
        accepted, num_kept, num_verified, flags, drafts, lp = self.execute(step)
        columns = (num_kept, num_verified, flags)
        rows = torch.cat([accepted, *(c.view(-1, 1).long() for c in columns), drafts], 1)
        return self.results(step.sample_batch_index, step.reqs, rows.tolist(), lp)

    def results(self, batch_index: list[int], reqs: list[Req], rows: list[list[int]], lp,
                lp_slots: list[int] | None = None,
                lp_cols: tuple[list, list] | None = None) -> dict[int, SpecResult]:
        """Host rows of a step's outputs, one per sampled slot in the draft step's packed format
        (`SpecGraphs._draft`: k + 1 accepted ids, kept, verified, stop flag, k drafts) ->
        {batch index: result}. `lp` (`pack_logprobs`) holds k + 1 rows per slot; `lp_slots[b]`
        is entry b's slot there (default b). `lp_cols` instead (a step whose rows ask
        top_logprobs 0 at most, `lp0_columns`): per slot its rows' logprobs, and per slot their
        ranks."""
        if lp is not None:  # NOTE: by column, each converted once for the whole step
            width = (lp.shape[1] - 2) // 2
            lps, ranks = lp[:, 0].tolist(), lp[:, 1].int().tolist()
            top_ids = top_lps = None
        k1 = self.k + 1
        results, counted = {}, []
        # NOTE: per slot every step: one row read in place, no slices but the kept ids and drafts
        for b, (i, req, row) in enumerate(zip(batch_index, reqs, rows)):
            want, n = req.params.logprobs, row[k1]
            kept = row[:n]
            logprobs = None
            if want is not None:
                slot = b if lp_slots is None else lp_slots[b]
                if lp_cols is not None:
                    logprobs = (lp_cols[0][slot][:n], lp_cols[1][slot][:n], [_NO_TOP] * n)
                else:
                    first = slot * k1
                    if want == 0:
                        tops = [_NO_TOP] * n
                    else:
                        if top_ids is None:
                            top_ids = lp[:, 2:2 + width].int().tolist()
                            top_lps = lp[:, 2 + width:].tolist()
                        tops = [list(zip(top_ids[r][:want], top_lps[r][:want]))
                                for r in range(first, first + n)]
                    logprobs = (lps[first:first + n], ranks[first:first + n], tops)
            reason = _REASONS.get(row[k1 + 2])
            nd, na = len(req.spec_token_ids), row[k1 + 1] - 1
            if nd:
                counted.append((nd, na))
            results[i] = SpecResult(kept, logprobs, reason, [] if reason else row[k1 + 3:], nd, na)
        self.stats.count(self.k, counted)
        return results
