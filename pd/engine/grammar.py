"""Structured output: the grammar a request's tokens must follow, matched token by token.

A request's `SamplingParams.structured_output` is (kind, spec): a JSON schema ("json", or
"json_compact" without free whitespace: the router's forced tool calls), any JSON object
("json_object"), a regex ("regex"), one of a JSON list of strings ("choice") or an EBNF
grammar ("grammar"). xgrammar compiles it against the model's vocabulary and matches it; this
module keeps that behind two small types:

- `Grammars`, one per engine: xgrammar's view of the tokenizer, built on the first request that
  needs it (importing xgrammar and reading the vocabulary takes about two seconds, so an engine
  without such requests never pays it), and the compiler, whose cache keeps each compiled
  grammar: a schema is compiled once per process (a regex as `pd.engine.regex_expansion`
  writes it, the same language in the form xgrammar matches fast). `matcher(spec)` raises
  `GrammarError` for a spec that does not compile.
- `GrammarState`, one per request: `accept(token)` for every appended token (`Req.append_token`
  calls it), `mask()` the tokens allowed next as a bitmask (int32 words, bit t % 32 of word t // 32;
  `fill_masks` fills a step's masks into the rows of one buffer),
  `masks_along(drafts)` the masks at each position of an MTP verify step, each taking the drafts
  before it as accepted (then rolled back), and `terminated` once the grammar took its stop
  token (or a token it refused was appended). `step_masks` does a step's walks and masks at
  once (the walks one call into xgrammar, the masks in parts on as many threads as they are
  worth, `_Filler`); the decode loop walks each request's new token there (`walk`) before
  appending it, whose `accept` then takes that walk's result. A greedy request's state may
  be checked after sampling rather than masked (`checked`, `pd.engine.checked_grammar`): a
  walk its grammar refuses then sets `checked.refused` for the loop to take the token back.

The sampler applies the masks on the logits' device (`pd.engine.sampler.apply_grammar`).
Across P and D each node binds its own state: the prefill node samples the first token under
the grammar, the decode node's state walks that token when it arrives, so both follow one
matcher's path.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pd.engine.checked_grammar import CheckedSampling
from pd.engine.regex_expansion import expand_plus

log = logging.getLogger(__name__)


class GrammarError(ValueError):
    """A structured-output spec that does not compile (the request is refused)."""


def _choice_grammar(spec: str) -> str:
    """EBNF of exactly one of the strings of a JSON list."""
    try:
        choices = json.loads(spec)
    except ValueError as e:
        raise GrammarError(f"choice: not a JSON list of strings: {e}") from None
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise GrammarError("choice: must be a non-empty list of non-empty strings")
    # NOTE: an EBNF string literal takes JSON's escapes
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarState:
    """One request's matcher (see the module docstring)."""

    def __init__(self, matcher, vocab_size: int, checked: bool = False) -> None:
        self._m = matcher
        self.num_words = -(-vocab_size // 32)
        self.failed = False  # a token the grammar refused was appended: the request ends
        # tokens walked by `walk` ahead of their `accept`, each with what the matcher said
        # (None: the state was terminated, nothing walked)
        self._walked: deque[tuple[int, bool | None]] = deque()
        # checked sampling (see `CheckedSampling`): None where every token is sampled masked
        self.checked = CheckedSampling() if checked else None
        self._position = 0  # tokens the matcher accepted (for `CheckedSampling.refuse`)
        # the matcher's `is_terminated`, kept: it ends once it accepts one of its stop tokens
        # (and a rollback may undo that: None, asked again). A call into xgrammar cost ~2 us, and
        # a step asked it of each request three times.
        self._stops = frozenset(matcher.stop_token_ids)
        self._ended: bool | None = False

    @property
    def terminated(self) -> bool:
        if self.failed:
            return True
        if self._ended is None:
            self._ended = self._m.is_terminated()
        return self._ended

    def accept(self, token: int) -> bool:
        """Walk one token; False if the grammar refuses it (which only a mask that allows no
        token at all lets happen): the state then stays as it was and `terminated` is set.
        A token `walk` walked already is not walked again: its result is taken."""
        if self._walked:
            walked, ok = self._walked.popleft()
            if walked == token:
                if ok is False:
                    log.warning("structured output: the grammar refused token %d; the request "
                                "ends", token)
                return bool(ok)
            self._unwalk([(walked, ok)])
        if self.terminated:
            return False
        ok = self._m.accept_token(token)
        self._position += ok
        if ok:
            self._ended = token in self._stops
        else:
            self.failed = True
            log.warning("structured output: the grammar refused token %d; the request ends", token)
        return ok

    def walk(self, token: int) -> None:
        """Walk `token` now, ahead of the `accept(token)` that will take its result
        (`step_masks` walks a step's tokens at once)."""
        self.walked(token, None if self.terminated else self._m.accept_token(token))

    def walked(self, token: int, ok: bool | None) -> None:
        """Record a walk of `token` the matcher made (`ok`: what it said; None: not made,
        the state was terminated). Under checked sampling a refused token is not recorded:
        `CheckedSampling.refused` is set, and the decode loop takes the token back."""
        if ok is False:
            if self.checked is not None and self.checked.refuse(self._position):
                return
            self.failed = True
        elif ok:
            self._position += 1
            self._ended = token in self._stops
            if self.checked is not None:
                self.checked.streak += 1
        self._walked.append((token, ok))

    @property
    def masks_now(self) -> bool:
        """Whether the step launched last samples this request under its mask at its launch
        (or its deferred sampler)."""
        return self.checked is None or (self.checked.masked and not self.checked.late)

    @property
    def masks_late(self) -> bool:
        """Whether the step launched last samples this request under its mask late, after
        sampling it without (`CheckedSampling.late`)."""
        return self.checked is not None and self.checked.late

    def _unwalk(self, popped: list) -> None:
        """Undo every walk not taken (an accept of another token: not what the decode loop
        does, but the state stays right)."""
        popped += self._walked
        self._walked.clear()
        walked = sum(ok is True for _, ok in popped)
        if walked:
            self._m.rollback(walked)
            self._position -= walked
            self._ended = None
        if any(ok is False for _, ok in popped):
            self.failed = False  # set by the refused walk, on a state that was not terminated

    def mask(self) -> torch.Tensor:
        """int32 [ceil(V / 32)]: the tokens allowed next (all, once terminated: the request
        ends on its own then)."""
        bits = torch.empty((1, self.num_words), dtype=torch.int32)
        self.fill(bits, 0)
        return bits[0]

    def fill(self, out: torch.Tensor, row: int) -> None:
        """`mask()` written into row `row` of `out` [rows, ceil(V / 32)] int32."""
        if self.terminated:
            out[row].fill_(-1)
        else:
            self._m.fill_next_token_bitmask(out, row)

    def masks_along(self, drafts: list[int], num: int) -> list[torch.Tensor]:
        """`num` masks: position j's with drafts[:j] accepted. Past a draft the grammar refuses
        the positions repeat the last mask (no token there can be kept: acceptance stops at
        the refused draft)."""
        masks = [self.mask()]
        walked = 0
        for d in drafts[:num - 1]:
            if self.terminated or not self._m.accept_token(d):
                break
            walked += 1
            self._ended = d in self._stops
            masks.append(self.mask())
        if walked:
            self._m.rollback(walked)
            self._ended = None
        return masks + [masks[-1]] * (num - len(masks))


# threads a step's masks may be filled on, at most (PD_GRAMMAR_THREADS overrides)
WORKERS = max(1, int(os.environ.get("PD_GRAMMAR_THREADS", 0)) or min(8, os.cpu_count() or 1))
# the mask filling (seconds) that pays for one more thread: a part of a step's masks handed
# to another thread costs ~10-20 us (xgrammar's own threads, started and joined on every
# call, cost more: 32 regex masks over 128k tokens on the H100's host took 143 us on one of
# them, 335 us on eight)
WORK_PER_THREAD = 200e-6
# the filling (seconds) below which masks started alone (`_Filler.start`) are filled at once
# rather than on a thread while the caller goes on: a hand-off costs ~10-20 us
HANDOFF = 30e-6


def _new_batch(threads: int):
    import xgrammar  # noqa: PLC0415 (imported by `Grammars._compiler` already)

    return xgrammar.BatchGrammarMatcher(max_threads=threads)


class _Filler:
    """A step's masks, filled in parts on up to `WORKERS` threads of our own (each part one
    call into xgrammar on one thread, which lets the GIL go), as many as the masks' recent cost
    pays for (`WORK_PER_THREAD`): a JSON string's masks over 128k tokens (~150 us each on the
    H100's host) on all, a regex's (~4 us) on this thread alone. The cost is each part's own
    time per mask, a moving average over the steps."""

    def __init__(self) -> None:
        self.per_mask = 0.0
        self.pool: ThreadPoolExecutor | None = None
        self.local = threading.local()  # each thread's one-thread matcher batch

    def parts(self, num_masks: int) -> int:
        return max(1, min(WORKERS, int(num_masks * self.per_mask / WORK_PER_THREAD)))

    def fill(self, matchers: list, out: torch.Tensor, rows: list[int]) -> None:
        parts = self.parts(len(matchers))
        if parts == 1:
            spent = self._fill(matchers, out, rows)
        else:
            # NOTE: dealt in turn, so that a run of costly states is spread over the parts
            cut = [(matchers[i::parts], rows[i::parts]) for i in range(parts)]
            futures = [self._pool().submit(self._fill, m, out, r) for m, r in cut[1:]]
            spent = self._fill(cut[0][0], out, cut[0][1])
            spent += sum(f.result() for f in futures)
        self.add(spent, len(matchers))

    def start(self, matchers: list, out: torch.Tensor, rows: list[int]) -> Callable[[], None]:
        """`fill` on the pool's threads alone, this thread going on meanwhile; returns what
        waits for it. Masks cheaper all together than a hand-off (`HANDOFF`) are filled here
        and now; one part's worth goes to one thread: a step's late rows in sparse JSON states
        (~5 us each on the 2-core CPU, 32 of them) would otherwise hold up the caller."""
        if WORKERS == 1 or len(matchers) * self.per_mask < HANDOFF:
            self.fill(matchers, out, rows)
            return _nothing
        parts = min(self.parts(len(matchers)), WORKERS - 1)
        futures = [self._pool().submit(self._fill, matchers[i::parts], out, rows[i::parts])
                   for i in range(parts)]

        def join() -> None:
            self.add(sum(f.result() for f in futures), len(matchers))

        return join

    def _pool(self) -> ThreadPoolExecutor:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(WORKERS - 1, thread_name_prefix="pd-grammar")
        return self.pool

    def add(self, seconds: float, num_masks: int) -> None:
        cost = seconds / num_masks
        self.per_mask = cost if not self.per_mask else 0.75 * self.per_mask + 0.25 * cost

    def _fill(self, matchers: list, out: torch.Tensor, rows: list[int]) -> float:
        batch = getattr(self.local, "batch", None)
        if batch is None:
            batch = self.local.batch = _new_batch(1)
        start = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, out, rows)
        return time.perf_counter() - start


_FILLER = _Filler()


def _nothing() -> None:
    pass


def step_masks(jobs: list[tuple[GrammarState, int | None, int | None]],
               out: torch.Tensor | None, wait: bool = True) -> Callable[[], None]:
    """A step's grammar work at once: each job (state, token, row) walks `token` (unless None;
    `GrammarState.walk`), then fills the state's next mask into out[row] (unless None). The
    walks are one `accept_token` each, on this thread (32 walks inside JSON values: 55-59 us
    against 76-81 through xgrammar's batch call on one thread, on the 2-core CPU:
    `benchmarks/bench_host_step.py --walks`; its threads, started and joined on every call, cost
    more still; but beside a busy Python thread, as the CPU's overlap loop's forward, each short
    call waits for the GIL), the masks are filled in parts on as many threads as their recent
    cost pays for (`_Filler`): a JSON string's mask over 128k tokens takes 60-150 us. One
    matcher's fill holds the GIL (two Python threads took 1.1-1.2x the time one took for two
    masks); a batch call lets it go. With `wait` False the masks are filled on the threads alone
    while this one goes on (`_Filler.start`): what is returned waits for them (the masks may not
    be read, nor their states walked, before)."""
    for state, token, _ in jobs:
        if token is not None:
            state.walk(token)
    if out is None:
        return _nothing
    fills = []
    for state, _, row in jobs:
        if row is not None:
            if state.terminated:
                out[row].fill_(-1)
            else:
                fills.append((state, row))
    if len(fills) == 1:
        fills[0][0].fill(out, fills[0][1])
    elif fills:
        matchers, rows = [state._m for state, _ in fills], [row for _, row in fills]
        if not wait:
            return _FILLER.start(matchers, out, rows)
        _FILLER.fill(matchers, out, rows)
    return _nothing


def fill_masks(states: list[GrammarState | None], out: torch.Tensor) -> list[torch.Tensor | None]:
    """`mask()` of each state (None for None), filled at once (`step_masks`) into the rows of
    `out` [len(states), ceil(V / 32)] int32 (page-locked on CUDA, so the sampler copies the rows
    to the device as one block): row j for states[j]."""
    step_masks([(st, None, j) for j, st in enumerate(states) if st is not None], out)
    return [out[j] if st is not None else None for j, st in enumerate(states)]


class Grammars:
    """An engine's compiler of structured-output specs (see the module docstring)."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.model_dir, self.vocab_size = Path(model_dir), vocab_size
        self.eos_token_ids = tuple(eos_token_ids)

    @functools.cached_property
    def _compiler(self):
        start = time.perf_counter()
        try:
            import transformers  # noqa: PLC0415 (deferred: ~2 s, only for structured output)
            import xgrammar  # noqa: PLC0415
        except ImportError as e:
            raise GrammarError(f"structured output needs xgrammar ({e})") from None
        tok = transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(self.model_dir / "tokenizer.json"))
        info = xgrammar.TokenizerInfo.from_huggingface(
            tok, vocab_size=self.vocab_size, stop_token_ids=list(self.eos_token_ids) or None)
        log.info("structured output: xgrammar %s over %d tokens ready in %.1f s",
                 info.vocab_type.name.lower(), self.vocab_size, time.perf_counter() - start)
        return xgrammar.GrammarCompiler(info)

    def compile(self, spec: tuple[str, str]):
        kind, text = spec
        c = self._compiler
        try:
            if kind == "json":
                return c.compile_json_schema(text)
            if kind == "json_compact":  # no free whitespace: a small model can loop on it
                return c.compile_json_schema(text, any_whitespace=False)
            if kind == "json_object":  # an object, as OpenAI's json_object mode promises
                return c.compile_json_schema('{"type": "object"}')
            if kind == "regex":
                try:
                    return c.compile_regex(expand_plus(text))
                except Exception:  # noqa: BLE001 (then the regex's own error, if any)
                    return c.compile_regex(text)
            if kind == "choice":
                return c.compile_grammar(_choice_grammar(text))
            if kind == "grammar":
                return c.compile_grammar(text)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError with the parser's message
            raise GrammarError(f"{kind}: {str(e).strip().splitlines()[-1][:300]}") from None
        raise GrammarError(f"unknown structured output kind {kind!r}")

    def matcher(self, spec: tuple[str, str], checked: bool = False) -> GrammarState:
        """A request's state; `checked`: its tokens sampled without the mask and checked
        after (`CheckedSampling`)."""
        import xgrammar  # noqa: PLC0415 (imported by `_compiler` already)

        compiled = self.compile(spec)
        return GrammarState(xgrammar.GrammarMatcher(compiled), self.vocab_size, checked)
