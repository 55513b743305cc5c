"""Control messages between router, prefill node (P) and decode node (D).

Each message is a typed frozen dataclass with a `TYPE` and a `VERSION`, encoded as a msgpack map
`{"type", "version", ...fields}`. Bulk data (KV, token records) never rides in here: it goes as
ring records or raw frames through `shm_ipc`. `decode()` enforces a size limit and refuses
unknown types, other versions, unknown or missing fields, with `MessageError` naming the
problem. Fields that name an endpoint to connect to (`reply_to`, `decode_addr`, `kv_addr`)
must be one (`is_endpoint`), and a deadline must be a finite number of seconds > 0, so that
a well-typed message cannot make a node connect to nonsense or wait forever. Nothing is pickled.

Who sends what:
  router -> P     PrefillRequest, Abort, Ping          (P's control socket)
  router -> D     Abort, Ping                          (D's control socket)
  P, D -> router  Pong (reply to Ping)                 (same socket)
  P, D -> router  TokenStream, TokenStreams (D: a step's streams of one router in one message)
                                                       (the router's event socket, `reply_to`)
  P -> D          Hello, RequestMeta, KVDone, KVReleased, Abort
                                                       (D's KV ingest, in order with records)
  D -> P          HelloOk, HelloRefused, KVAccept, KVAck, KVRefuse
"""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, dataclass, fields
from typing import ClassVar

import msgpack

MAX_MESSAGE_BYTES = 16 * 2**20
_ENDPOINT = re.compile(
    r"tcp://(?:[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]|\*):([0-9]{1,5})|ipc://[^\0]{1,200}")
_ENDPOINT_FIELDS = ("reply_to", "decode_addr", "kv_addr")


class MessageError(ValueError):
    """A message that cannot be accepted (malformed, too large, unknown type or version)."""


_REGISTRY: dict[str, type] = {}


def message(cls):
    """Register a message dataclass by its TYPE."""
    cls = dataclass(frozen=True)(cls)
    _REGISTRY[cls.TYPE] = cls
    cls._field_order = tuple(f.name for f in fields(cls))
    cls._field_names = frozenset(cls._field_order)
    cls._required = frozenset(f.name for f in fields(cls) if f.default is MISSING)
    cls._types = {f.name: _accepted_types(f.type) for f in fields(cls)}
    cls._endpoint_fields = tuple(n for n in _ENDPOINT_FIELDS if n in cls._field_names)
    # from_dict builds messages without the frozen __init__ (its setattr per field is most of
    # the cost); a default factory or __post_init__ would need it
    assert not hasattr(cls, "__post_init__") and all(f.default_factory is MISSING for f in fields(cls))
    cls._defaults = {f.name: f.default for f in fields(cls) if f.default is not MISSING}
    return cls


_TYPE_NAMES = {"str": str, "int": int, "float": (int, float), "bool": bool, "list": list,
               "dict": dict, "None": type(None)}


def _accepted_types(annotation: str) -> tuple:
    out: tuple = ()
    for name in annotation.split("|"):
        t = _TYPE_NAMES[name.strip()]
        out += t if isinstance(t, tuple) else (t,)
    return out


@message
class PrefillRequest:
    TYPE: ClassVar[str] = "prefill_request"
    VERSION: ClassVar[int] = 1
    req_id: str
    prompt_ids: list
    params: dict  # SamplingParams.to_dict()
    decode_addr: str  # the decode node's KV ingest endpoint, tcp://HOST:PORT
    reply_to: str  # the router's event endpoint for TokenStream messages
    deadline_s: float = 60.0  # the request fails if not handed to D within this time


@message
class Abort:
    TYPE: ClassVar[str] = "abort"
    VERSION: ClassVar[int] = 1
    req_id: str
    reason: str = "client"


@message
class Ping:
    TYPE: ClassVar[str] = "ping"
    VERSION: ClassVar[int] = 1
    seq: int = 0


@message
class Pong:
    TYPE: ClassVar[str] = "pong"
    VERSION: ClassVar[int] = 1
    seq: int
    role: str  # "prefill" | "decode"
    node_id: str
    stats: dict  # load figures: queue length, running, free/total blocks, ...
    kv_addr: str = ""  # a decode node's KV ingest endpoint


# NOTE: a node's error for a request that waited too long (in its queue, for a decode node's
# blocks, for the KV) starts with this: the router answers 504 and does not retry it elsewhere
TIMEOUT_PREFIX = "timed out"


def is_timeout(error: str | None) -> bool:
    return bool(error) and error.startswith(TIMEOUT_PREFIX)


# NOTE: a node's error for a request whose own content is wrong (a structured-output spec that
# does not compile) starts with this: the router answers 400 and does not retry it elsewhere
INVALID_PREFIX = "invalid request"


def is_invalid(error: str | None) -> bool:
    return bool(error) and error.startswith(INVALID_PREFIX)


@message
class TokenStream:
    TYPE: ClassVar[str] = "tokens"
    VERSION: ClassVar[int] = 1
    req_id: str
    token_ids: list
    logprobs: list | None = None  # per token, when the request asked
    top_logprobs: list | None = None  # per token, a list of [id, logprob] pairs
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # with the first token when asked (SamplingParams.prompt_logprobs): per prompt token after
    # the first, [logprob, rank, [[id, logprob], ...]]
    prompt_logprobs: list | None = None


@message
class TokenStreams:
    """D -> router: one step's tokens for every request of one router, in columns (one encode
    and one send per step, and no map per request): request i got `counts[i]` tokens, the next
    `counts[i]` of `token_ids`; `ended` pairs [i, finish_reason]; `logprobs` triples [i, the
    tokens' logprobs, their top lists] for the requests that asked. `unpack_streams` checks the
    columns and gives one TokenStream per request."""

    TYPE: ClassVar[str] = "token_streams"
    VERSION: ClassVar[int] = 2
    req_ids: list
    counts: list
    token_ids: list
    num_prompt_tokens: list
    num_output_tokens: list
    ended: list
    logprobs: list


def unpack_streams(msg) -> list:
    """The TokenStreams of an event message (a TokenStream, or a step's TokenStreams)."""
    if isinstance(msg, TokenStream):
        return [msg]
    if not isinstance(msg, TokenStreams):
        raise MessageError(f"{type(msg).__name__} on the event socket")
    n, ids, counts = len(msg.req_ids), msg.token_ids, msg.counts
    cols = (msg.counts, msg.num_prompt_tokens, msg.num_output_tokens)
    if any(len(c) != n for c in cols) or not all(type(r) is str for r in msg.req_ids) or not all(
            type(x) is int and x >= 0 for c in cols for x in c) or sum(counts) != len(ids) or not all(
            type(t) is int for t in ids):
        raise MessageError("token_streams: columns of unequal length or of the wrong types")
    extra: dict[int, dict] = {}
    for item in msg.ended:
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int
                and 0 <= item[0] < n and isinstance(item[1], str)):
            raise MessageError(f"token_streams: bad ended entry {item!r:.100}")
        extra.setdefault(item[0], {})["finish_reason"] = item[1]
    for item in msg.logprobs:
        if not (isinstance(item, list) and len(item) == 3 and type(item[0]) is int
                and 0 <= item[0] < n and isinstance(item[1], list) and isinstance(item[2], list)
                and len(item[1]) == len(item[2]) == counts[item[0]]):
            raise MessageError(f"token_streams: bad logprobs entry {item!r:.100}")
        extra.setdefault(item[0], {}).update(logprobs=item[1], top_logprobs=item[2])
    out, start, defaults = [], 0, TokenStream._defaults
    for i in range(n):
        # NOTE: built like from_dict builds them (no frozen __init__): the columns are checked
        ts = object.__new__(TokenStream)
        ts.__dict__.update(defaults)
        ts.__dict__.update(req_id=msg.req_ids[i], token_ids=ids[start:start + counts[i]],
                           num_prompt_tokens=msg.num_prompt_tokens[i],
                           num_output_tokens=msg.num_output_tokens[i], **extra.get(i, {}))
        start += counts[i]
        out.append(ts)
    return out


@message
class Hello:
    TYPE: ClassVar[str] = "hello"
    VERSION: ClassVar[int] = 1
    node_id: str
    geometry: dict  # see pd.wire.geometry


@message
class HelloOk:
    TYPE: ClassVar[str] = "hello_ok"
    VERSION: ClassVar[int] = 1
    node_id: str
    kv_ipc: dict | None = None  # D's KV cache by CUDA IPC (shm_ipc.cuda_ipc.export), same host


@message
class HelloRefused:
    TYPE: ClassVar[str] = "hello_refused"
    VERSION: ClassVar[int] = 1
    node_id: str
    reason: str


@message
class RequestMeta:
    """P -> D, as the request's prefill starts (D reserves its blocks meanwhile), or just before
    its FIRST_TOKEN record (a request asking for prompt logprobs, which this carries, or for one
    token)."""

    TYPE: ClassVar[str] = "request_meta"
    VERSION: ClassVar[int] = 1
    req_id: str
    prompt_ids: list
    params: dict
    reply_to: str
    num_blocks: int  # KV blocks P will send (the prompt's)
    deadline_s: float = 60.0  # how long D may hold it (the rest of its prefill, then the hand-off)
    direct: bool = False  # P writes the KV into D's blocks itself (CUDA IPC): KVAccept names them
    prompt_logprobs: list | None = None  # as TokenStream's, for D to send with the first token


@message
class KVAccept:
    """D has reserved blocks for the request: P may send its KV, all but the first
    `num_cached_blocks` prompt blocks, which D holds in its prefix cache."""

    TYPE: ClassVar[str] = "kv_accept"
    VERSION: ClassVar[int] = 1
    req_id: str
    num_cached_blocks: int = 0
    block_ids: list | None = None  # direct requests: D's blocks for P's uncached prompt blocks


@message
class KVDone:
    TYPE: ClassVar[str] = "kv_done"
    VERSION: ClassVar[int] = 1
    req_id: str
    num_records: int


@message
class KVReleased:
    """P -> D, the answer to a direct KVAccept for a request P no longer sends: P will not write
    the blocks named there (D keeps a dropped direct request's blocks until this or KVDone)."""

    TYPE: ClassVar[str] = "kv_released"
    VERSION: ClassVar[int] = 1
    req_id: str


@message
class KVAck:
    """D has installed the KV: P frees its blocks."""

    TYPE: ClassVar[str] = "kv_ack"
    VERSION: ClassVar[int] = 1
    req_id: str


@message
class KVRefuse:
    """D will not take the request (timeout, abort, bad record): P frees its blocks."""

    TYPE: ClassVar[str] = "kv_refuse"
    VERSION: ClassVar[int] = 1
    req_id: str
    reason: str


def is_endpoint(addr: str) -> bool:
    """True for tcp://HOST:PORT (a name, an address, [IPv6] or *) and ipc://PATH."""
    found = _ENDPOINT.fullmatch(addr)
    return found is not None and (found.group(1) is None or 0 < int(found.group(1)) < 65536)


def to_dict(msg) -> dict:
    """The message as a msgpack map. Shallow: a message's fields hold plain values only (the
    registry's type check refuses anything else), and a step's streams are packed per step."""
    d = {name: getattr(msg, name) for name in msg._field_order}
    d["type"], d["version"] = msg.TYPE, msg.VERSION
    return d


def encode(msg) -> bytes:
    return msgpack.packb(to_dict(msg), use_bin_type=True)


def decode(data: bytes | memoryview, max_bytes: int = MAX_MESSAGE_BYTES):
    if len(data) > max_bytes:
        raise MessageError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise MessageError(f"malformed msgpack: {e.__class__.__name__}: {e}") from None
    return from_dict(d)


def from_dict(d) -> object:
    """A decoded msgpack map -> its typed message, with every check `decode` promises."""
    if not isinstance(d, dict):
        raise MessageError(f"message is a {type(d).__name__}, not a map")
    kind, version = d.get("type"), d.get("version")
    cls = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MessageError(f"unknown message type {kind!r}")
    if version != cls.VERSION:
        raise MessageError(f"{kind} version {version!r} not supported (expected {cls.VERSION})")
    # NOTE: one pass over the fields (a router takes apart a TokenStream per token); the
    # checks and which one is reported first are those of the field sets
    types, values, unknown, wrong = cls._types, {}, [], None
    for name, value in d.items():
        accepted = types.get(name)
        if accepted is None:
            if name != "type" and name != "version":
                unknown.append(name)
        else:
            if wrong is None and (not isinstance(value, accepted) or (
                    value.__class__ is bool and bool not in accepted)):
                wrong = name
            values[name] = value
    if unknown:
        raise MessageError(f"{kind}: unknown field(s) {sorted(unknown, key=str)}")
    if len(values) < len(cls._required) or not cls._required <= values.keys():
        raise MessageError(f"{kind}: missing field(s) {sorted(cls._required - values.keys())}")
    if wrong is not None:
        raise MessageError(f"{kind}: field {wrong} has type {type(values[wrong]).__name__}")
    for name in cls._endpoint_fields:
        value = values.get(name)
        if value is not None and not is_endpoint(value) and not (name == "kv_addr" and value == ""):
            raise MessageError(f"{kind}: field {name} is not a ZMQ endpoint: {value[:100]!r}")
    deadline = values.get("deadline_s")
    if deadline is not None and not (math.isfinite(deadline) and deadline > 0):
        raise MessageError(f"{kind}: deadline_s must be a finite number > 0, got {deadline!r}")
    msg = object.__new__(cls)
    msg.__dict__.update(cls._defaults)
    msg.__dict__.update(values)
    return msg
