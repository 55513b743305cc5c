"""Checked sampling: a greedy request's grammar checked after its token is sampled rather than
masked before (`CheckedSampling`, one per such request's `pd.engine.grammar.GrammarState`),
where a step has many such requests (`pd.engine.grammar_steps.GrammarSteps.grammar_modes`
decides, the decode loop takes refused tokens back). `checked_grammars` reads the switch
(PD_CHECKED_GRAMMAR) that `pd.engine.engine.Engine.bind_grammar` consults."""

from __future__ import annotations

import numpy as np

from pd.config import env_flag

ENV_CHECKED = "PD_CHECKED_GRAMMAR"


def checked_grammars(environ) -> bool:
    """PD_CHECKED_GRAMMAR: 0/false/no/off samples every grammar row under its mask; 1/true/
    yes/on or unset lets the decode loop check greedy rows after sampling (`CheckedSampling`)."""
    return env_flag(environ, ENV_CHECKED, True)


class CheckedSampling:
    """A greedy request's grammar checked after sampling rather than masked before, where a
    step has many such requests (`pd.engine.grammar_steps.GrammarSteps.grammar_modes`): the
    decode loop samples its row without the mask (the step is then a plain one: graphed, the
    argmax in the graph, nothing for the host to wait for) and walks the token; the grammar
    refusing it, the loop takes it back (`GrammarSteps.take_back`: the token is dropped, and
    the row's slot in the step launched after it, which read that token, gets the position's
    masked token from the refused step's kept logits; where those steps were not launched
    late, that slot is discarded and the position computed again) and the row's next steps
    sample masked. Lossless: where the grammar allows the argmax of the
    logits, that is the argmax of the masked logits too (ties: the lowest id, either way).
    Worth it where masks cost more than the rare step lost: inside a JSON string nearly
    every token is allowed, and a mask over 128k tokens takes 60-150 us of host against 2-30
    us elsewhere. After a refusal `masked_left` steps sample masked: `FIRST_MASKED`, doubled by
    each refusal up to `MAX_MASKED`, back to `FIRST_MASKED` after `CALM` tokens past the masked
    run without one (a model that keeps leaving the grammar pays a masked step, not a
    taken-back one, for most tokens). A refusal tends to come where the grammar allows few
    tokens for a while (the keys and punctuation between a JSON object's values), so the first
    run covers a few: on the H100's 1B shape with random weights (JSON, batch 32, 128 tokens)
    a first run of 4 took 120 refusals and 134 steps against 168 and 136 for a run of 1, with
    as many rows sampled masked (~2150). And a run goes on while the row's late masks are narrow
    (`masked_narrow`, `narrow_masks`: tokens in under half of the vocabulary's 64-token
    stretches: sparse), ending at the first wide one: the same shape on the CPU (float32, the
    same benchmark) took 40 refusals and 130 steps against 120 and 134 without it (128 with no
    grammar), 2136 rows sampled masked either way; a model that follows its grammar is refused
    rarely and never gets there. A masked step of a checking loop launched ahead of its inputs'
    tokens samples the row late (`late`): the step runs as a plain one, and once the host has
    walked the token before, the row is sampled again from the step's kept logits under its mask
    (`GrammarSteps.resample_late`), so the other rows never wait for it."""

    FIRST_MASKED = 4
    MAX_MASKED = 32
    CALM = 16
    # a masked run goes on while the row's last late mask was narrow (`narrow_masks`): tokens
    # allowed in fewer than this share of its 64-token pairs of words, every `WIDTH_STRIDE`th
    # pair counted
    NARROW = 0.5
    WIDTH_STRIDE = 32

    __slots__ = ("masked", "late", "masked_left", "backoff", "streak", "last_run", "refused",
                 "_refused_at", "taken_back")

    def __init__(self) -> None:
        self.masked = True  # how the row was sampled in the step launched last (`launch`)
        self.late = False  # and, masked, whether after that step's launch (`launch`)
        self.masked_left = 0  # steps still to sample masked
        self.backoff = self.FIRST_MASKED  # masked steps the next refusal asks for
        self.streak = 0  # tokens accepted since the last refusal
        self.last_run = 0  # the masked steps the last refusal asked for
        self.refused = False  # a refused token the loop has not taken back yet
        self._refused_at = -1  # the matcher's position at the last refusal
        self.taken_back = 0  # refusals, for tests and benchmarks

    def launch(self, checking: bool, late: bool = False) -> bool:
        """The row's mode in a step being launched, masked or checked after: masked unless the
        loop is `checking` its grammars and no refusal asks for masked steps; a masked step of
        a checking loop samples the row late where the loop can (`late`). True: masked at the
        launch."""
        self.masked = not checking or self.masked_left > 0
        self.late = checking and self.masked and late
        if checking and self.masked:
            self.masked_left -= 1
        return self.masked and not self.late

    def refuse(self, position: int) -> bool:
        """A walk refused at the matcher's `position` (tokens it accepted): True where the
        loop takes the token back; False at a position refused before (the masked step after
        it sampled a token the grammar refuses too: its mask allowed none), which ends the
        request as a refusal without checking does."""
        if position == self._refused_at:
            return False
        self._refused_at = position
        self.refused = True
        return True

    def masked_narrow(self) -> None:
        """The row's late mask was narrow (`narrow_masks`): its next step samples masked too,
        since where the grammar allows few tokens the model's argmax is often not one of them
        (a refusal costs the row a step; a late mask costs none)."""
        if self.masked_left < 1:
            self.masked_left = 1

    def take_back(self) -> None:
        """The loop took the refused token back: the next steps sample masked."""
        self.refused = False
        self.taken_back += 1
        if self.streak - self.last_run >= self.CALM:
            self.backoff = self.FIRST_MASKED
        self.masked_left = self.last_run = self.backoff
        self.backoff = min(2 * self.backoff, self.MAX_MASKED)
        self.streak = 0


def narrow_masks(masks: np.ndarray) -> np.ndarray:
    """Which rows of `masks` [rows, words] (a numpy int32 view; an odd last word left out) allow
    tokens in fewer than `CheckedSampling.NARROW` of their pairs of words, every
    `WIDTH_STRIDE`th pair counted: ~8 us for 32 rows of 128k tokens, where counting their bits
    would cost ~100."""
    even = masks[:, :masks.shape[1] // 2 * 2]
    sample = even.view(np.int64)[:, ::CheckedSampling.WIDTH_STRIDE]
    return np.count_nonzero(sample, axis=1) < CheckedSampling.NARROW * sample.shape[1]
