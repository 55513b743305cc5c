"""One output choice: backend token events in, visible text deltas out.

A `Choice` owns the per-choice state between the backend and the response formatter: the
incremental detokenizer, the stop strings, the token count for `usage`, and the logprob
entries (token text, logprob, top alternatives, text offset). `process(event)` returns a
`Delta`; when a stop string is hit the delta finishes with "stop" and `done` turns True, and
closing the backend stream is left to the caller. Formatting deltas into the OpenAI shapes of
each endpoint is left to `responses.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from router.backend import TokenEvent
from pd.text.detokenizer import IncrementalDetokenizer, token_text
from router.stop import StopStrings


class TextTokenizer(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass
class TokenLogprob:
    token: str
    token_id: int
    logprob: float
    top: list[tuple[str, int, float]]  # (text, id, logprob), best first as the node sent them
    text_offset: int  # where this token's text starts in the choice's output


@dataclass
class Delta:
    index: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Choice:
    def __init__(self, index: int, tokenizer: TextTokenizer, prompt_ids: Sequence[int],
                 stop: Sequence[str], want_logprobs: bool,
                 stop_token_ids: Sequence[int] = ()) -> None:
        self.index = index
        self.num_prompt_tokens = len(prompt_ids)
        self.num_generated = 0
        self.done = False
        self.stop_reason: str | int | None = None  # the stop string hit, or the stop token id
        self._stop_token_ids = frozenset(stop_token_ids)
        self._tok = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stop = StopStrings(stop)
        self._want_logprobs = want_logprobs
        self._offset = 0

    def process(self, ev: TokenEvent) -> Delta:
        if self.done:
            raise RuntimeError(f"choice {self.index} got an event after it finished")
        d = Delta(self.index, num_tokens=len(ev.token_ids))
        self.num_generated += len(ev.token_ids)
        shown = ev.token_ids
        if ev.finish_reason == "stop" and shown:
            # NOTE: the EOS / stop token id closes the stream: counted, never shown.
            if shown[-1] in self._stop_token_ids:
                self.stop_reason = shown[-1]
            shown = shown[:-1]
        if self._want_logprobs and ev.logprobs is not None:
            d.logprobs = self._entries(shown, ev)
        text = self._detok.push(shown) if shown else ""
        last = ev.finish_reason is not None or ev.error is not None
        if last:
            text += self._detok.flush()
        d.text = self._stop.push(text)
        if self._stop.hit is not None:
            self.stop_reason = self._stop.hit
            d.finish_reason = "stop"
        elif last:
            d.text += self._stop.flush()
            d.finish_reason = ev.finish_reason if ev.error is None else None
            d.error = ev.error
        self.done = d.is_last
        return d

    def _entries(self, ids: Sequence[int], ev: TokenEvent) -> list[TokenLogprob]:
        out = []
        tops = ev.top_logprobs or [[] for _ in ids]
        for tid, lp, top in zip(ids, ev.logprobs, tops):
            text = token_text(self._tok, tid)
            alts = [(token_text(self._tok, t), t, float(v)) for t, v in top]
            out.append(TokenLogprob(text, tid, float(lp), alts, self._offset))
            self._offset += len(text)
        return out
