"""Model and cache geometry that a prefill node and a decode node must share to pair.

Exchanged in the `Hello` handshake; `mismatch()` names the first field that differs. Block
counts may differ between nodes (each has its own cache); block size may not (the transport
does not re-block). Tensor parallel sizes may differ: KV crosses with every KV head, joined
from the sender's ranks and split among the receiver's (`pd.engine.tp`); a size that does not
divide the KV heads is refused by name.
"""

from __future__ import annotations

from pd.config import ModelConfig, dtype_name

FIELDS = ("model_id", "architecture", "num_layers", "num_kv_heads", "head_dim", "vocab_size",
          "dtype", "block_size", "mtp")


def geometry(model: ModelConfig, dtype, block_size: int, mtp_enabled: bool) -> dict:
    return {
        "model_id": model.model_id,
        "architecture": model.architecture,
        "num_layers": model.num_layers,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "vocab_size": model.vocab_size,
        "dtype": dtype_name(dtype),
        "block_size": block_size,
        "mtp": bool(mtp_enabled),
    }


def mismatch(ours: dict, theirs: dict) -> str | None:
    """A sentence naming the first differing field, or None when the two can pair."""
    for name in FIELDS:
        if ours.get(name) != theirs.get(name):
            return f"{name} differs: this node has {ours.get(name)!r}, the peer has {theirs.get(name)!r}"
    size = theirs.get("tensor_parallel_size", 1)
    if not isinstance(size, int) or size < 1 or ours["num_kv_heads"] % size:
        return (f"tensor_parallel_size {size!r} of the peer does not split the model's "
                f"{ours['num_kv_heads']} KV heads")
    return None
