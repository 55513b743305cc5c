"""Tensor parallelism of the model's layers: which part of each weight a rank holds, and the
collectives that join the parts.

A node with `--tensor-parallel-size N` runs N processes (ranks), each holding 1/N of the
attention heads (KV heads included, so 1/N of the KV cache), 1/N of the MLP's intermediate
columns and 1/N of the vocabulary:
- `qkv_proj` and `gate_up_proj` are split by output rows (column-parallel): each rank computes
  its heads and its intermediate columns, with no communication;
- `o_proj` and `down_proj` are split by input columns (row-parallel): each rank's product is a
  partial sum, joined by one all-reduce (`all_reduce`); their biases are added once, after it;
- the embedding and the LM head are split by vocabulary rows (`vocab_shard`): a rank looks up
  the ids it holds (zeros elsewhere) and the sum over ranks is the embedding; each rank's
  logits are its vocabulary slice, gathered in rank order (`gather_vocab`);
- norms, rotary tables and the MTP layer's `eh_proj` are whole on every rank.
After each all-reduce every rank holds the same hidden states (bit for bit: a collective
hands every rank one reduced copy), so every rank's next layer reads the same input.

Which process is which rank, how ranks are started and how they learn each step is
`pd.engine.tp`'s business; this module only holds the group (`init`, `group`) that the layers
reduce over. Size 1 (no group) is the plain model: every collective is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Group:
    rank: int
    size: int
    pg: object | None = None  # the torch.distributed process group of the layers' collectives

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` heads or columns; `what` names them in the error."""
        if total % self.size:
            raise ValueError(f"tensor parallel size {self.size} does not divide {what} ({total}): "
                             f"each rank must hold a whole share")
        return total // self.size


_GROUP = Group(0, 1)


def check_layout(cfg, size: int) -> None:
    """Refuse, naming the value, a size that does not split the model (before any rank starts):
    the heads, the KV heads and the MLP's intermediate columns must divide by it."""
    for what, total in (("num_attention_heads", cfg.num_heads),
                        ("num_key_value_heads", cfg.num_kv_heads),
                        ("intermediate_size", cfg.intermediate_size)):
        Group(0, size).split(total, f"the model's {what}")


def init(rank: int, size: int, pg) -> None:
    """Make this process rank `rank` of `size` (called before its model is built)."""
    global _GROUP
    _GROUP = Group(rank, size, pg)


def group() -> Group:
    return _GROUP


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks, in place (a row-parallel layer's partial products)."""
    if _GROUP.size > 1:
        dist.all_reduce(x, group=_GROUP.pg)
    return x


def vocab_shard(vocab_size: int) -> tuple[int, int]:
    """(first row, rows) of this rank's vocabulary slice: ceil(V / N) rows, the last rank's
    padded past V with zero rows, so every rank's slice has one shape."""
    rows = -(-vocab_size // _GROUP.size)
    return _GROUP.rank * rows, rows


def gather_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Each rank's logits [N, V / N] -> the whole vocabulary's [N, V] on every rank."""
    if _GROUP.size == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(_GROUP.size)]
    dist.all_gather(parts, logits.contiguous(), group=_GROUP.pg)
    return torch.cat(parts, dim=-1)[:, :vocab_size]


def embed(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Embedding lookup with the vocabulary split by rows: this rank's rows where it holds the
    id, zeros elsewhere, summed over the ranks."""
    if _GROUP.size == 1:
        return torch.nn.functional.embedding(ids, weight)
    rows = weight.shape[0]
    local = ids - _GROUP.rank * rows
    held = (local >= 0) & (local < rows)
    out = torch.nn.functional.embedding(local.clamp(0, rows - 1), weight)
    out.mul_(held[:, None].to(out.dtype))
    return all_reduce(out)
