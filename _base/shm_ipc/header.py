"""The header word that opens every ring record and every ZMQ data message (DESIGN §3).

One little-endian uint32: flag in bits 0-7, top-k count in bits 8-23, reserved bits 24-31 zero.
`pack` refuses out-of-range fields instead of masking them; `unpack` refuses a nonzero reserved
byte, an unknown flag and a count above the reader's maximum. Counting and logging a refusal is
left to the reader (see `metrics.refuse`), which then skips the record.
"""

from __future__ import annotations

import enum
import struct

WORD = struct.Struct("<I")
MAX_TOPK_LIMIT = 0xFFFF
DEFAULT_MAX_TOPK = 64


class Flag(enum.IntEnum):
    PAD = 0  # skip to the ring's start
    KV = 1  # a chunk of KV cache
    FIRST_TOKEN = 2  # the prefill step's token with its logprobs
    TARGET_TOKENS = 3  # tokens accepted from the target model
    DRAFT_TOKENS = 4  # MTP draft tokens
    ABORT = 5


PAD, KV, FIRST_TOKEN, TARGET_TOKENS, DRAFT_TOKENS, ABORT = (
    Flag.PAD, Flag.KV, Flag.FIRST_TOKEN, Flag.TARGET_TOKENS, Flag.DRAFT_TOKENS, Flag.ABORT)
_KNOWN = frozenset(int(f) for f in Flag)


class HeaderError(ValueError):
    """A header word that packing or unpacking refuses; `reason` is a short metric label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def pack(flag: int, topk: int = 0) -> int:
    """Build the word; a flag outside 0..255 or a count outside 0..65535 raises."""
    if not isinstance(flag, int) or not 0 <= flag <= 0xFF:
        raise HeaderError("flag", f"flag {flag!r} outside 0..255")
    if not isinstance(topk, int) or not 0 <= topk <= MAX_TOPK_LIMIT:
        raise HeaderError("topk", f"top-k count {topk!r} outside 0..65535")
    return int(flag) | (int(topk) << 8)


def unpack(word: int, max_topk: int = DEFAULT_MAX_TOPK) -> tuple[Flag, int]:
    """Split the word into (flag, top-k count), refusing what DESIGN §3 refuses."""
    if not 0 <= word <= 0xFFFFFFFF:
        raise HeaderError("word", f"header word {word!r} is not a uint32")
    if word >> 24:
        raise HeaderError("reserved", f"header word {word:#010x}: reserved byte is nonzero")
    flag = word & 0xFF
    if flag not in _KNOWN:
        raise HeaderError("unknown_flag", f"header word {word:#010x}: unknown flag {flag}")
    topk = (word >> 8) & 0xFFFF
    if topk > max_topk:
        raise HeaderError("topk", f"header word {word:#010x}: top-k count {topk} above the "
                                  f"configured maximum {max_topk}")
    return Flag(flag), topk


def to_bytes(word: int) -> bytes:
    return WORD.pack(word)


def from_bytes(buf) -> int:
    """Read the word from the first 4 bytes of `buf` (a frame or a ring slice)."""
    if len(buf) < 4:
        raise HeaderError("short", f"header frame of {len(buf)} bytes, need 4")
    return WORD.unpack_from(buf, 0)[0]
