"""Incremental detokenization for one output stream.

Text is produced from token ids as they arrive, without ever emitting a partial UTF-8
character: a byte-level tokenizer may split one character over several tokens, and decoding
such a tail yields U+FFFD, so that text is held back until the next token completes it. Two
offsets into the id list do the work (as vLLM does): `prefix` marks the ids decoded only as
context, `read` the ids whose text has already been emitted. A few prompt ids seed the context
so that tokenizers which drop a leading space on a lone token decode the first output right.

The router streams with it and `pd.LLM` decodes whole outputs with it (`detokenize`), so both
produce the same text. The tokenizer (anything with `decode(ids) -> str`) and stop strings are
left to others.
"""

from __future__ import annotations

from typing import Protocol, Sequence

REPLACEMENT_CHAR = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt ids kept as decoding context


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add ids; return the new text that is complete (possibly empty)."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back, as is (the stream is over)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if len(self._ids) == self._read:
            return ""
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        full_text = self._tok.decode(self._ids[self._prefix:])
        if not final and (full_text.endswith(REPLACEMENT_CHAR) or len(full_text) <= len(prefix_text)):
            return ""  # an incomplete character (or nothing visible yet): wait for more ids
        new_text = full_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        # NOTE: ids before `prefix` are never decoded again; drop them to keep slices short.
        del self._ids[:self._prefix]
        self._read -= self._prefix
        self._prefix = 0
        return new_text


def token_text(tokenizer: Decoder, token_id: int) -> str:
    """One token's own text, as shown in logprobs (U+FFFD where it is part of a character)."""
    return tokenizer.decode([token_id])


def detokenize(tokenizer: Decoder, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> str:
    """The whole text of `output_ids`, exactly as the router streams it."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    return detok.push(output_ids) + detok.flush()
