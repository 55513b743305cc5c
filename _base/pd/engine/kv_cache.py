"""The paged KV cache: one allocation per node, with per-layer views bound to the model.

Layout: `kv[num_cache_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` (K at index 0,
V at 1 of dim 1; the MTP layer, when present, is the last cache layer). The transport copies
`kv[l0:l1, :, block_ids]` in and out. Under tensor parallelism each rank's cache holds its
1/N of the KV heads (same blocks, same block ids). Block bookkeeping is `allocator.py`'s.
"""

from __future__ import annotations

import torch

from pd.config import EngineConfig, ModelConfig


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype,
                    kv_heads: int | None = None) -> int:
    """One block's bytes in a cache of `kv_heads` KV heads (default: the model's; a tensor
    parallel rank holds 1/N of them)."""
    elem = torch.empty((), dtype=dtype).element_size()
    heads = model.num_kv_heads if kv_heads is None else kv_heads
    return model.num_cache_layers * 2 * block_size * heads * model.head_dim * elem


def num_blocks_for(model: ModelConfig, engine: EngineConfig, dtype: torch.dtype) -> int:
    if engine.num_blocks is not None:
        return engine.num_blocks
    per_block = bytes_per_block(model, engine.block_size, dtype,
                                model.num_kv_heads // engine.tensor_parallel_size)
    if engine.device == "cpu":
        budget = engine.kv_cache_memory
    else:
        free, _total = torch.cuda.mem_get_info(torch.device(engine.device))
        budget = int(free * engine.gpu_memory_fraction)
    num = budget // per_block
    if num < 2:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds fewer than 2 blocks of {per_block} bytes"
        )
    return num


class KVCache:
    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: str | torch.device, spare_blocks: int = 0,
                 kv_heads: int | None = None) -> None:
        # NOTE: blocks num_blocks.. are spare: never handed out by the allocator; the first is
        # the dummy block that CUDA graphs' padding rows write into.
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dummy_block = num_blocks if spare_blocks else None
        self.kv = torch.zeros(
            model.num_cache_layers, 2, num_blocks + spare_blocks, block_size,
            model.num_kv_heads if kv_heads is None else kv_heads, model.head_dim,
            dtype=dtype, device=device,
        )

    def bind(self, attention_layers: list) -> None:
        """Point each attention module at its layer's K and V views."""
        if len(attention_layers) != self.kv.shape[0]:
            raise ValueError(f"{len(attention_layers)} attention layers for {self.kv.shape[0]} cache layers")
        for i, attn in enumerate(attention_layers):
            attn.k_cache, attn.v_cache = self.kv[i, 0], self.kv[i, 1]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
