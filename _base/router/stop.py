"""Stop strings over a stream of text chunks.

Text goes in chunk by chunk (as the detokenizer releases it); what comes out is the text that
can be shown now. A stop string may span chunks, so the tail of the text that is still a
prefix of some stop string is held back (and only that much); once a stop string appears,
the text before it is released, the stop string and everything after it are dropped, and
`hit` names the string. Ending the request (closing the backend stream) is left to the caller.
"""

from __future__ import annotations

from typing import Sequence


class StopStrings:
    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in dict.fromkeys(stops) if s]
        self._held = ""
        self.hit: str | None = None

    def push(self, text: str) -> str:
        """Feed new text; return what may be shown. After a hit, everything is dropped."""
        if self.hit is not None:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        first = -1
        for s in self._stops:
            i = buf.find(s)
            if i >= 0 and (first < 0 or i < first):
                first, self.hit = i, s
        if first >= 0:
            self._held = ""
            return buf[:first]
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """The held-back tail, released when the stream ends without a hit."""
        out, self._held = self._held, ""
        return out if self.hit is None else ""

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
