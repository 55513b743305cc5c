"""Typed records carried from a prefill node to a decode node, and their byte encodings.

Each record is a header word (`header.py`: flag + top-k count) and a body. The same body bytes
travel as one ring record (`ring.py`) or as ZMQ frames (`zmq_transport.py`: word, meta, raw
buffers). Bodies, little-endian, after a request-id prefix (u8 length + up to 64 bytes utf-8):

    FIRST_TOKEN      i32 token_id, f32 logprob, i32 rank, i32[k] top ids, f32[k] top logprobs
    TARGET/DRAFT     u32 n, u8 has_logprobs, i32[n] ids, and when has_logprobs:
                     f32[n] logprobs, i32[n] ranks, i32[n*k] top ids, f32[n*k] top logprobs
    ABORT            utf-8 reason (the rest, up to 4096 bytes)
    KV               fixed KV_META (layer range, block range, dtype), padded to KV_DATA_OFFSET,
                     then the raw bytes of kv[layer_start:layer_end, :, blocks]

k is the header's top-k count: exactly k columns are written, never padded. Decoding checks the
exact length and every range, and raises `RecordError` (a ValueError with a metric `reason`);
the reader counts it and drops the record. Moving KV between the cache and a KV body is left
to `kv.py`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from . import header
from .header import Flag, HeaderError

MAX_REQ_ID = 64
MAX_REASON = 4096
_FT = struct.Struct("<ifi")
_TOK = struct.Struct("<IB")
KV_META = struct.Struct("<B64sHHIIB")  # req-id len, req id, layer start/end, block start/count, dtype
KV_DATA_OFFSET = 120  # 8-byte record header + 120 puts the KV bytes on a 64-byte boundary
DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float16": 3}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}


class RecordError(ValueError):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class FirstTokenRecord:
    req_id: str
    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class TokensRecord:
    req_id: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    ranks: list[int] | None = None
    top: list[list[tuple[int, float]]] | None = None
    flag: Flag = Flag.TARGET_TOKENS  # or Flag.DRAFT_TOKENS


@dataclass
class KVRecord:
    """`payload` views the raw KV bytes in place (ring memory or a ZMQ frame)."""

    req_id: str
    layer_start: int
    layer_end: int
    num_blocks: int
    payload: memoryview
    block_start: int = 0  # index into the request's block list of the first block carried
    dtype: str = "float32"
    ring_pos: int | None = None  # where its record starts in a ring (`KVReceiver.hold`)


@dataclass
class AbortRecord:
    req_id: str
    reason: str = ""


Record = FirstTokenRecord | TokensRecord | KVRecord | AbortRecord


def _req_prefix(req_id: str) -> bytes:
    raw = req_id.encode()
    if not 0 < len(raw) <= MAX_REQ_ID:
        raise ValueError(f"request id {req_id!r} must be 1..{MAX_REQ_ID} bytes")
    return bytes([len(raw)]) + raw


def encode(rec: Record) -> tuple[int, bytes]:
    """(header word, body) of a small record; KV goes through `kv_meta` instead."""
    pre = _req_prefix(rec.req_id)
    if isinstance(rec, FirstTokenRecord):
        k = len(rec.top)
        ids = [int(t[0]) for t in rec.top]
        lps = [float(t[1]) for t in rec.top]
        body = pre + _FT.pack(rec.token_id, rec.logprob, rec.rank) + struct.pack(f"<{k}i{k}f", *ids, *lps)
        return header.pack(Flag.FIRST_TOKEN, k), body
    if isinstance(rec, TokensRecord):
        return _encode_tokens(rec, pre)
    if isinstance(rec, AbortRecord):
        reason = rec.reason.encode()[:MAX_REASON]
        return header.pack(Flag.ABORT, 0), pre + reason
    raise TypeError(f"cannot encode {type(rec).__name__} here")


def _encode_tokens(rec: TokensRecord, pre: bytes) -> tuple[int, bytes]:
    n = len(rec.token_ids)
    if rec.flag not in (Flag.TARGET_TOKENS, Flag.DRAFT_TOKENS):
        raise ValueError(f"TokensRecord flag must be TARGET_TOKENS or DRAFT_TOKENS, not {rec.flag!r}")
    parts = [pre, _TOK.pack(n, rec.logprobs is not None), np.asarray(rec.token_ids, "<i4").tobytes()]
    k = 0
    if rec.logprobs is not None:
        ranks = rec.ranks if rec.ranks is not None else [0] * n
        top = rec.top if rec.top is not None else [[] for _ in range(n)]
        k = len(top[0]) if top else 0
        if len(rec.logprobs) != n or len(ranks) != n or len(top) != n or any(len(t) != k for t in top):
            raise ValueError(f"request {rec.req_id}: logprobs, ranks and top must have one entry "
                             f"per token and the same top-k count")
        parts += [np.asarray(rec.logprobs, "<f4").tobytes(), np.asarray(ranks, "<i4").tobytes(),
                  np.asarray([p[0] for t in top for p in t], "<i4").tobytes(),
                  np.asarray([p[1] for t in top for p in t], "<f4").tobytes()]
    elif rec.top:
        raise ValueError(f"request {rec.req_id}: top logprobs without logprobs")
    return header.pack(rec.flag, k), b"".join(parts)


def kv_meta(req_id: str, layer_start: int, layer_end: int, block_start: int, num_blocks: int,
            dtype: str) -> bytes:
    """The KV_DATA_OFFSET-byte meta that precedes KV bytes (ring) or forms the meta frame (ZMQ)."""
    raw = req_id.encode()
    if not 0 < len(raw) <= MAX_REQ_ID:
        raise ValueError(f"request id {req_id!r} must be 1..{MAX_REQ_ID} bytes")
    meta = KV_META.pack(len(raw), raw, layer_start, layer_end, block_start, num_blocks,
                        DTYPE_CODES[dtype])
    return meta.ljust(KV_DATA_OFFSET, b"\0")


def decode(word: int, body, raw=None, max_topk: int = header.DEFAULT_MAX_TOPK) -> Record:
    """Parse one record; `raw` is the KV bytes when they came apart from the meta (ZMQ)."""
    try:
        flag, k = header.unpack(word, max_topk)
    except HeaderError as e:
        raise RecordError(e.reason, str(e)) from None
    body = memoryview(body).cast("B")
    if flag == Flag.KV:
        return _decode_kv(k, body, raw)
    if raw is not None:
        raise RecordError("frames", f"{flag.name} record with a raw buffer frame")
    if flag == Flag.PAD:
        raise RecordError("pad", "PAD outside a ring")
    req_id, at = _req_id(body)
    if flag == Flag.FIRST_TOKEN:
        _expect(body, at + _FT.size + 8 * k, flag)
        token_id, logprob, rank = _FT.unpack_from(body, at)
        at += _FT.size
        ids = np.frombuffer(body, "<i4", k, at).tolist()
        lps = np.frombuffer(body, "<f4", k, at + 4 * k).tolist()
        return FirstTokenRecord(req_id, token_id, logprob, rank, list(zip(ids, lps)))
    if flag == Flag.ABORT:
        if len(body) - at > MAX_REASON:
            raise RecordError("length", f"ABORT reason of {len(body) - at} bytes")
        return AbortRecord(req_id, bytes(body[at:]).decode(errors="replace"))
    return _decode_tokens(flag, k, body, req_id, at)


def _decode_tokens(flag: Flag, k: int, body, req_id: str, at: int) -> TokensRecord:
    if len(body) < at + _TOK.size:
        raise RecordError("length", f"{flag.name} record of {len(body)} bytes is truncated")
    n, has_lp = _TOK.unpack_from(body, at)
    at += _TOK.size
    if has_lp > 1 or (not has_lp and k):
        raise RecordError("malformed", f"{flag.name}: has_logprobs={has_lp} with top-k {k}")
    _expect(body, at + 4 * n + (8 * n + 8 * n * k if has_lp else 0), flag)
    ids = np.frombuffer(body, "<i4", n, at).tolist()
    rec = TokensRecord(req_id, ids, flag=flag)
    if has_lp:
        at += 4 * n
        rec.logprobs = np.frombuffer(body, "<f4", n, at).tolist()
        rec.ranks = np.frombuffer(body, "<i4", n, at + 4 * n).tolist()
        tids = np.frombuffer(body, "<i4", n * k, at + 8 * n).tolist()
        tlps = np.frombuffer(body, "<f4", n * k, at + 8 * n + 4 * n * k).tolist()
        rec.top = [list(zip(tids[i * k:(i + 1) * k], tlps[i * k:(i + 1) * k])) for i in range(n)]
    return rec


def _decode_kv(k: int, body, raw) -> KVRecord:
    if k:
        raise RecordError("malformed", f"KV record with top-k count {k}")
    if len(body) < KV_DATA_OFFSET:
        raise RecordError("length", f"KV record of {len(body)} bytes is shorter than its meta")
    n, rid, l0, l1, b0, nb, code = KV_META.unpack_from(body, 0)
    if not 0 < n <= MAX_REQ_ID or code not in DTYPE_NAMES or l1 <= l0 or nb == 0:
        raise RecordError("malformed", f"KV meta out of range (id len {n}, layers {l0}:{l1}, "
                                       f"blocks {nb}, dtype code {code})")
    try:
        req_id = rid[:n].decode()
    except UnicodeDecodeError:
        raise RecordError("malformed", "KV request id is not utf-8") from None
    if raw is None:
        payload = body[KV_DATA_OFFSET:]
    else:
        if len(body) != KV_DATA_OFFSET:
            raise RecordError("length", f"KV meta frame of {len(body)} bytes")
        payload = memoryview(raw).cast("B")
    if len(payload) == 0 or len(payload) % ((l1 - l0) * 2 * nb):
        raise RecordError("length", f"KV payload of {len(payload)} bytes does not divide into "
                                    f"{l1 - l0} layers x 2 x {nb} blocks")
    return KVRecord(req_id, l0, l1, nb, payload, b0, DTYPE_NAMES[code])


def _req_id(body) -> tuple[str, int]:
    if len(body) < 1 or not 0 < body[0] <= MAX_REQ_ID or len(body) < 1 + body[0]:
        raise RecordError("length", "request id missing or truncated")
    try:
        return bytes(body[1:1 + body[0]]).decode(), 1 + body[0]
    except UnicodeDecodeError:
        raise RecordError("malformed", "request id is not utf-8") from None


def _expect(body, size: int, flag: Flag) -> None:
    if len(body) != size:
        raise RecordError("length", f"{flag.name} record of {len(body)} bytes, expected {size}")
