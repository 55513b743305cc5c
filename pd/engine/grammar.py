"""Structured output: the grammar a request's tokens must follow, matched token by token.

A request's `SamplingParams.structured_output` is (kind, spec): a JSON schema ("json", or
"json_compact" without free whitespace: the router's forced tool calls), any JSON object
("json_object"), a regex ("regex"), one of a JSON list of strings ("choice") or an EBNF
grammar ("grammar"). xgrammar compiles it against the model's vocabulary and matches it; this
module keeps that behind two small types:

- `Grammars`, one per engine: xgrammar's view of the tokenizer, built on the first request that
  needs it (importing xgrammar and reading the vocabulary takes about two seconds, so an engine
  without such requests never pays it), and the compiler, whose cache keeps each compiled
  grammar: a schema is compiled once per process. `matcher(spec)` raises `GrammarError` for a
  spec that does not compile.
- `GrammarState`, one per request: `accept(token)` for every appended token (`Req.append_token`
  calls it), `mask()` the tokens allowed next as a bitmask (int32 words, bit t % 32 of word t // 32;
  `fill_masks` fills a step's masks, on several threads where they are costly),
  `masks_along(drafts)` the masks at each position of an MTP verify step, each taking the drafts
  before it as accepted (then rolled back), and `terminated` once the grammar took its stop
  token (or a token it refused was appended).

The sampler applies the masks on the logits' device (`pd.engine.sampler.apply_grammar`).
Across P and D each node binds its own state: the prefill node samples the first token under
the grammar, the decode node's state walks that token when it arrives, so both follow one
matcher's path.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import time
from pathlib import Path

import torch

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

    def __init__(self, matcher, vocab_size: int) -> None:
        self._m = matcher
        self.num_words = -(-vocab_size // 32)
        self.failed = False  # a token the grammar refused was appended: the request ends
        self.seconds = 0.0  # how long its last mask took alone (`fill_masks`)

    @property
    def terminated(self) -> bool:
        return self.failed or self._m.is_terminated()

    def accept(self, token: int) -> bool:
        """Walk one token; False if the grammar refuses it (which only a mask that allows no
        token at all lets happen): the state then stays as it was and `terminated` is set.
        One at a time: xgrammar's batch call took 2 ms for a step's 32 tokens of a JSON schema
        on the H100 host, against ~30 us each alone."""
        if self.terminated:
            return False
        ok = self._m.accept_token(token)
        if not ok:
            self.failed = True
            log.warning("structured output: the grammar refused token %d; the request ends", token)
        return ok

    def mask(self) -> torch.Tensor:
        """int32 [ceil(V / 32)]: the tokens allowed next (all, once terminated: the request
        ends on its own then)."""
        bits = torch.full((self.num_words,), -1, dtype=torch.int32)
        if not self.terminated:
            self._m.fill_next_token_bitmask(bits.view(1, -1))
        return bits

    def timed_mask(self) -> torch.Tensor:
        start = time.perf_counter()
        bits = self.mask()
        self.seconds = time.perf_counter() - start
        return bits

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
            masks.append(self.mask())
        if walked:
            self._m.rollback(walked)
        return masks + [masks[-1]] * (num - len(masks))


@functools.cache
def _batch_matcher():
    import xgrammar  # noqa: PLC0415

    # NOTE: xgrammar's "auto" took 4.5 ms for 32 regex masks over 128k tokens on the 16-core
    # H100 host, 8 threads 1.7 ms, 16 threads 1.4 ms
    return xgrammar.BatchGrammarMatcher(max_threads=min(8, os.cpu_count() or 1))


BATCH_FILL_SECONDS = 1e-3  # a step's masks expected to take longer are filled on threads
REMEASURE = 32  # every this many steps the masks are filled one by one, timing each


_FILLS = itertools.count(1)  # calls of `fill_masks`, for REMEASURE


def fill_masks(states: list[GrammarState | None]) -> list[torch.Tensor | None]:
    """`mask()` of each state (None for None). Each state keeps how long its mask took alone;
    when a step's masks together are expected to take over BATCH_FILL_SECONDS (a regex over a
    128k vocabulary: ~0.2 ms each), xgrammar's batch matcher fills them on several threads,
    rows of one tensor; cheaper ones (a JSON schema's: ~10 us) are filled one by one, where
    the threads' start-up would cost more (3 ms for 32 such masks against 0.3 ms)."""
    live = [i for i, st in enumerate(states) if st is not None and not st.terminated]
    expected = sum(states[i].seconds for i in live)
    if len(live) < 2 or expected < BATCH_FILL_SECONDS or next(_FILLS) % REMEASURE == 0:
        return [st.timed_mask() if st is not None else None for st in states]
    width = states[live[0]].num_words
    bits = torch.full((len(states), width), -1, dtype=torch.int32)
    _batch_matcher().batch_fill_next_token_bitmask([states[i]._m for i in live], bits, indices=live)
    return [bits[i] if st is not None else None for i, st in enumerate(states)]


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

    def matcher(self, spec: tuple[str, str]) -> GrammarState:
        import xgrammar  # noqa: PLC0415 (imported by `_compiler` already)

        compiled = self.compile(spec)
        return GrammarState(xgrammar.GrammarMatcher(compiled), self.vocab_size)
