"""Control messages between a prefill and a decode node: msgpack maps with `type` and `version`.

Encoding checks the two keys; decoding enforces a size limit, refuses anything but a map with a
string `type` and an integer `version`, and never unpickles. What each type means (geometry
handshake, acks, refusals) is the node services' business; the transport itself uses only the
`shm_*` types below.
"""

from __future__ import annotations

import msgpack

MAX_CONTROL_BYTES = 1 << 20

SHM_ATTACH = "shm_attach"  # P -> D: attach this ring (segment, capacity)
SHM_ATTACHED = "shm_attached"  # D -> P: attached
SHM_REFUSED = "shm_refused"  # D -> P: cannot attach (reason)
SHM_DETACH = "shm_detach"  # P -> D: the ring closes after the records before this message
INTERNAL = frozenset({SHM_ATTACH, SHM_ATTACHED, SHM_REFUSED, SHM_DETACH})


class ControlError(ValueError):
    pass


def encode(msg: dict) -> bytes:
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str) \
            or not isinstance(msg.get("version"), int):
        raise ControlError(f"control message needs a str 'type' and an int 'version': {msg!r}")
    data = msgpack.packb(msg, use_bin_type=True)
    if len(data) > MAX_CONTROL_BYTES:
        raise ControlError(f"control message {msg['type']!r} of {len(data)} bytes exceeds "
                           f"{MAX_CONTROL_BYTES}")
    return data


def decode(data) -> dict:
    if len(data) > MAX_CONTROL_BYTES:
        raise ControlError(f"control message of {len(data)} bytes exceeds {MAX_CONTROL_BYTES}")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise ControlError(f"control message is not valid msgpack: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str) \
            or not isinstance(msg.get("version"), int):
        raise ControlError("control message is not a map with a str 'type' and an int 'version'")
    return msg
