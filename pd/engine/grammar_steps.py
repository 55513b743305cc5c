"""The decode loop's grammar work (`GrammarSteps`, a mix-in of
`pd.engine.decode_loop.DecodeLoop`): a step's tokens walked at once (`walk_grammars`) and the
next step's masks filled after (`fill_masks`), each greedy grammar's mode for a step being
launched, checked after sampling or masked, at its launch or late (`grammar_modes`,
`pd.engine.checked_grammar`), the late rows sampled again under their masks, whose filling
overlaps the next launch's preparation (`settle_late`, `resample_late`; their rows of work and
masks in one `LateWork`), and a refused token taken back (`take_back`)."""

from __future__ import annotations

import struct

import numpy as np
import torch

from pd_kernels.masked_argmax import BANS, ITEM
from pd.engine.checked_grammar import narrow_masks
from pd.engine.grammar import step_masks
from pd.engine.request import Req
from pd.engine.sampler import banned_token_ids
from pd.engine.scheduler import ScheduledBatch

# a step's decoding rows with grammars from which the next step checks greedy ones after
# sampling rather than masks them (`GrammarSteps.grammar_modes`)
CHECK_FROM_ROWS = 16


class LateWork:
    """A late step's sampling again (`GrammarSteps.resample_late`) in one buffer [header + rows,
    ceil(V / 32)] int32 (`ModelRunner.late_work`'s), copied to the device at once: its rows of
    work (`pd_kernels.masked_argmax.items`: out row, logits row, mask row, banned ids) in the
    first `header` rows, then the masks of the rows sampled again alone, in the order their
    fills were asked for (`mask_rows`: row of the step -> row of `masks`); a step's other rows'
    masks are neither filled nor copied."""

    __slots__ = ("buf", "header", "mask_rows")

    def __init__(self, buf: torch.Tensor, header: int) -> None:
        self.buf, self.header = buf, header
        self.mask_rows: dict[int, int] = {}

    @property
    def masks(self) -> torch.Tensor:
        return self.buf[self.header:]

    def work(self, num: int) -> torch.Tensor:
        """The first `num` rows of work [num, ITEM]."""
        return self.buf[:self.header].view(-1)[:num * ITEM].view(num, ITEM)

    @property
    def used_rows(self) -> int:
        """Rows of `buf` a copy to the device needs: the header and the masks filled."""
        return self.header + len(self.mask_rows)


class GrammarSteps:
    """`DecodeLoop`'s grammar work (a mix-in: it reads the loop's `runner` and `executor`, sets
    its `checking`, `pending_late` and `late_fills`, counts `num_taken_back`, `num_resampled`
    and `num_fixed` and calls its `discard_slot`; `f`, `nxt`, `last` and `cur` are the loop's
    `InFlight` steps)."""

    pending_late = None  # (last, cur, masks): cur launched late, not yet `settle_late`d
    late_fills = None  # what waits for the masks of `pending_late` (`fill_masks`)

    @staticmethod
    def walk_grammars(f, token_ids: list[int], nxt, masks) -> tuple[list[Req], dict]:
        """The grammar work of step f's tokens: each request's grammar walks its new token
        (which appending it then takes), at once (`step_masks`). Returns the requests whose
        token a grammar checked after sampling refused (`take_back`), and, with `masks`, the
        masks to fill for nxt's rows that nxt samples masked after this (its deferred sampler's
        rows, or its late ones: `resample_late`), {row of nxt: grammar}, for `fill_masks`."""
        tokens = {}
        for row, i in enumerate(f.rows):
            if i >= 0 and f.batch.reqs[i].grammar is not None:
                tokens[f.batch.reqs[i]] = token_ids[row]
        fills = {}
        if masks is not None:
            late = nxt.late is not None
            for j, i in enumerate(nxt.inp.sample_reqs):
                req = nxt.batch.reqs[i]
                if req.grammar is not None and (req.grammar.masks_late if late
                                                else req.grammar.masks_now):
                    fills[j] = req.grammar
        if not tokens:
            return [], fills
        step_masks([(req.grammar, token, None) for req, token in tokens.items()], None)
        refused = [r for r in tokens if r.grammar.checked is not None and r.grammar.checked.refused]
        return refused, fills

    def fill_masks(self, nxt, fills: dict, masks) -> None:
        """The masks `walk_grammars` and `take_back` asked for, of nxt's rows still valid, into
        `masks`: for a step launched late on xgrammar's threads while this one goes on (the
        appends are done; the next launch's preparation overlaps them), `settle_late` waits for
        them; otherwise at once (a deferred sampler reads them next)."""
        if nxt.late is None:
            step_masks([(grammar, None, j) for j, grammar in fills.items() if nxt.rows[j] >= 0],
                       masks)
            return
        # NOTE: a late step's masks (a `LateWork`'s) in the order asked, its rows' alone
        rows = masks.mask_rows
        for j in fills:
            if nxt.rows[j] >= 0:
                rows[j] = len(rows)
        self.late_fills = step_masks([(fills[j], None, masks.header + m) for j, m in rows.items()],
                                     masks.buf, wait=False)

    def settle_late(self) -> None:
        """The step launched late last (`pending_late`, from `DecodeLoop.step`), its late rows
        and fixes sampled (`resample_late`) once their masks are filled: before the next step
        is queued behind it (`executor.launch`'s `before`) and before anything waits for it.
        Its host time is its caller's phase (`launch`, or `wait` in `process`)."""
        pending, self.pending_late = self.pending_late, None
        if pending is not None:
            last, cur, masks = pending
            join, self.late_fills = self.late_fills, None
            if join is not None:
                join()
            self.resample_late(last, cur, masks)

    def grammar_modes(self, batch: ScheduledBatch, late: bool = False) -> list[Req]:
        """Each decoding row's grammar that may be checked after sampling
        (`pd.engine.checked_grammar.CheckedSampling`): checked this step or masked (its
        `launch`). The loop checks them where the step before had `CHECK_FROM_ROWS` or more:
        then their masks, on the host every step, do not fit beside the forward (inside JSON
        strings over a 128k vocabulary, 60-150 us each), while a few requests' masks do and
        cost nothing (on the H100, JSON at batch 8: 0.79-0.98x masked). The mode is the step
        before's so that `can_predict`, which runs before this step is scheduled, knew it: a
        row masked in a step launched ahead of its token needs that token on the host first,
        so with `late` (a step launched ahead, its sampler not deferred) a checking loop's
        masked rows are sampled late (`resample_late`), and otherwise the step's sampler is
        deferred. A row masked at launch makes the runner build the step's rows anew (not the
        last graphed step's). Returns the requests sampled late where the step is launched
        late (a checking loop's step launched ahead: it keeps its logits), else None."""
        checking, masked, rows, late_reqs = self.checking, False, 0, []
        for i, req in enumerate(batch.reqs):
            grammar = req.grammar
            if (grammar is not None and grammar.checked is not None and batch.samples(i)
                    and len(req.token_ids) > len(req.prompt_token_ids)):
                if grammar.checked.launch(checking, late):
                    masked = True
                elif grammar.checked.late:
                    late_reqs.append(req)
                rows += 1
        self.checking = rows >= CHECK_FROM_ROWS
        if masked:
            # NOTE: the step's rows fill masks now: none of another step still filling
            self.settle_late()
            self.runner.graphed_rows = ([], None)
        return late_reqs if checking and late else None

    def resample_late(self, last, cur, work) -> None:
        """Step cur's late rows (`grammar_modes`), whose masks `fill_masks` filled in `work` (a
        `LateWork`), taken again from cur's logits under them, and the rows of cur whose input
        the step before (`last`) sampled and its grammar refused (`fixes`, `take_back`) from
        last's logits (a late row whose mask was narrow stays masked: `masked_narrow`); less
        the tokens min_tokens bans there (greedy rows: `Engine.bind_grammar` checks no other),
        which the rows of work carry (more than `BANS` cleared from the mask here). Their
        tokens replace the ones cur sampled without, before any later step reads them
        (`executor.resample`). Called once for each step launched late, whatever is left of its
        rows (a row whose request ended stays as it was: its slot is discarded)."""
        members, valid, mask_rows = cur.members, cur.rows, work.mask_rows
        late = [j for j in (members.get(req, -1) for req in cur.late) if j >= 0 and valid[j] >= 0]
        fixes = [(i, j) for i, j in cur.fixes if valid[j] >= 0]
        if late and mask_rows:
            narrow = narrow_masks(work.masks[:len(mask_rows)].numpy())
            for j in late:
                m = mask_rows.get(j)
                if m is not None and narrow[m]:
                    cur.batch.reqs[valid[j]].grammar.checked.masked_narrow()
        items = []
        for j, src in zip(late + [j for _, j in fixes], late + [-i - 1 for i, _ in fixes]):
            m = mask_rows.get(j)
            if m is None:  # (every late row and fix asked for its mask: `fill_masks`)
                continue
            req = cur.batch.reqs[valid[j]]
            banned = banned_token_ids(req.params, len(req.token_ids) - len(req.prompt_token_ids),
                                      req.eos_token_ids)
            if len(banned) > BANS:
                words = work.masks[m].numpy().view(np.uint32)
                for tok in banned:
                    if tok >> 5 < len(words):
                        words[tok >> 5] &= np.uint32(~(1 << (tok & 31)) & 0xFFFFFFFF)
                banned = ()
            items.append((j, src, m, *banned) + (-1,) * (BANS - len(banned)))
        if items:
            # NOTE: packed in one call: numpy's assignment of the tuples cost 27 us for 32 rows
            # on the 2-core development machine against 7
            flat = []
            for item in items:
                flat += item
            struct.pack_into(f"{len(flat)}i", work.buf.numpy(), 0, *flat)
        self.executor.resample(self.runner, cur.out, last.out if fixes else None, work,
                               len(items))
        self.num_resampled += len(late) + len(fixes)
        self.num_fixed += len(fixes)

    def take_back(self, req: Req, row: int, f, nxt, fills: dict) -> None:
        """A token the request's grammar refused (checked after sampling, in row `row` of step
        f): it is dropped and its position sampled again under the mask
        (`CheckedSampling.take_back`). Where f and `nxt` (launched with that token as the
        request's input) were launched late, nxt's slot is given the masked argmax of f's
        logits (`resample_late`, its mask to fill listed in `fills`), and the request's next
        step reads it: one step lost. Otherwise nxt's slot is discarded and the position
        computed again: two."""
        req.grammar.checked.take_back()
        self.num_taken_back += 1
        j = -1
        if nxt is not None and nxt.late is not None and f.late is not None:
            j = nxt.members.get(req, -1)
        if j >= 0 and nxt.rows[j] >= 0:
            nxt.fixes.append((row, j))
            fills[j] = req.grammar
            req.num_computed_tokens = len(req.token_ids)
            return
        if nxt is not None:
            self.discard_slot(nxt, req)
        req.num_computed_tokens = len(req.token_ids) - 1
