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
from router.tool_calls import ToolCallParser


class TextTokenizer(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass
class TokenLogprob:
    token: str
    token_id: int
    logprob: float | None  # None: an echoed prompt's first token (nothing before it)
    top: list[tuple[str, int, float]] | None  # (text, id, logprob), best first as sent
    text_offset: int  # where this token's text starts in the choice's output


@dataclass
class Delta:
    index: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    tool_calls: list[dict] = field(default_factory=list)  # chat: calls the reply completed
    first_tool_call: int = 0  # the index of tool_calls[0] among the choice's calls

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Choice:
    def __init__(self, index: int, tokenizer: TextTokenizer, prompt_ids: Sequence[int],
                 stop: Sequence[str], want_logprobs: bool,
                 stop_token_ids: Sequence[int] = (), echo: str | None = None,
                 prompt_only: bool = False, tool_parser: ToolCallParser | None = None) -> None:
        """`echo`: the prompt's text, sent before the completion (with the prompt's logprobs
        when asked); `prompt_only` (max_tokens 0 with echo): the token the nodes sample is
        neither shown nor counted; `tool_parser`: tool calls taken out of the reply's text."""
        self._tool_parser = tool_parser
        self.index = index
        self._prompt_ids = list(prompt_ids)
        self._echo = echo
        self._prompt_only = prompt_only
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
        d = Delta(self.index, num_tokens=0 if self._prompt_only else len(ev.token_ids))
        self.num_generated += d.num_tokens
        shown = [] if self._prompt_only else ev.token_ids
        if ev.finish_reason == "stop" and shown:
            # NOTE: the EOS / stop token id closes the stream: counted, never shown.
            if shown[-1] in self._stop_token_ids:
                self.stop_reason = shown[-1]
            shown = shown[:-1]
        echoed = self._echo_prompt(ev) if self._echo is not None else None
        if self._want_logprobs and ev.logprobs is not None:
            d.logprobs += self._entries(shown, ev)
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
            if self._prompt_only and d.finish_reason is not None:
                d.finish_reason = "length"  # max_tokens 0: nothing was generated
            d.error = ev.error
        if echoed is not None:
            d.text = echoed[0] + d.text
            d.logprobs = echoed[1] + d.logprobs
        if self._tool_parser is not None:
            self._take_calls(d)
        self.done = d.is_last
        return d

    def _take_calls(self, d: Delta) -> None:
        """Move the tool calls of the reply's text into `d.tool_calls` (held text is shown
        once it is known not to be a call); a reply that made calls finishes "tool_calls"."""
        parser = self._tool_parser
        d.first_tool_call = parser.num_calls
        d.text, d.tool_calls = parser.push(d.text)
        if d.is_last:
            rest, calls = parser.finish()
            d.text += rest
            d.tool_calls += calls
            if parser.num_calls and d.finish_reason == "stop":
                d.finish_reason = "tool_calls"

    def _echo_prompt(self, ev: TokenEvent) -> tuple[str, list[TokenLogprob]]:
        """The prompt's text and, when logprobs are asked, its tokens' entries; called on the
        first event only. Stop strings are not looked for in it, as OpenAI's echo."""
        text, self._echo = self._echo, None
        entries = []
        if self._want_logprobs:
            given = ev.prompt_logprobs or []
            offset = 0
            for i, tid in enumerate(self._prompt_ids):
                token = token_text(self._tok, tid)
                lp = given[i - 1] if 0 < i <= len(given) else None
                top = None if lp is None else [(token_text(self._tok, t), t, float(v))
                                               for t, v in lp[2]]
                entries.append(TokenLogprob(token, tid, None if lp is None else float(lp[0]),
                                            top, offset))
                offset += len(token)
        self._offset = len(text)  # the completion's offsets follow the echoed prompt
        return text, entries

    def _entries(self, ids: Sequence[int], ev: TokenEvent) -> list[TokenLogprob]:
        # NOTE: a prompt-only choice shows no token, so `ids` is empty and so are its entries
        out = []
        tops = ev.top_logprobs or [[] for _ in ids]
        for tid, lp, top in zip(ids, ev.logprobs, tops):
            text = token_text(self._tok, tid)
            alts = [(token_text(self._tok, t), t, float(v)) for t, v in top]
            out.append(TokenLogprob(text, tid, float(lp), alts, self._offset))
            self._offset += len(text)
        return out
