"""CUDA graphs of prompt steps: one prompt's first chunk alone (`PrefillGraphs`, per token count)
and any step of prompt chunks in 16 bits (`VarlenPrefillGraphs`, per tokens, keys and
sequences), sharing the decode graphs' memory pool (`pd.engine.cuda_graph.DecodeGraphs`). A
prefill node captures the short ones before it serves (`capture_up_to`).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pd.engine.cuda_graph import DecodeGraphs, round_up
from pd.engine.graph import Graph, capture
from pd.engine.host_ring import HostRing
from pd.model.context import ForwardContext, forward_context

log = logging.getLogger(__name__)


PREFILL_SIZES = (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)


class PrefillGraphs:
    """CUDA graphs of one prompt prefilled from position 0 (the common first chunk), per token
    count rounded up to `PREFILL_SIZES`: eager, such a prefill is bound by the host launching
    its few hundred kernels (a 1k-token prompt of a 1B model: 5.6 ms on the GPU, 16 ms of wall
    time). Padding rows sit after the prompt, write the spare block, and are causally invisible
    to it (`ForwardContext.causal_self`); the graph returns the hidden states of every row.
    As a decode step's, a prefill's inputs are built on the host straight into a pinned buffer
    in the graph's layout (`host_inputs`: ids, positions and KV slots of `size` rows each, then
    the index of the prompt's last row) and reach the device in one copy (`launch`).
    Captured on first use of a size; they share the decode graphs' memory pool."""

    def __init__(self, model: torch.nn.Module, decode: DecodeGraphs | None, max_tokens: int,
                 device: torch.device, spare_block: int | None = None,
                 block_size: int | None = None) -> None:
        """`decode` None: the same layout computed eagerly by `launch`, padding written to
        `spare_block` (on CPU, MTP's prefill step under PD_SPEC_LAYOUT=1, `pd.spec.prefill`)."""
        self.model, self.decode, self.device = model, decode, device
        if decode is not None:
            spare_block, block_size = decode.dummy_block, decode.block_size
        self.spare_slot = spare_block * block_size
        self.table = torch.full((1, 1), spare_block, dtype=torch.int64, device=device)
        self.sizes = tuple(s for s in PREFILL_SIZES if s < max_tokens) + (
            round_up(max_tokens, PREFILL_SIZES + (max_tokens,)),)
        self.staging = torch.zeros(3 * self.sizes[-1] + 1, dtype=torch.int64, device=device)
        self.host = HostRing(pin=device.type == "cuda")
        self.graphs: dict[int, tuple[Graph, torch.Tensor]] = {}
        self.enabled = not any(getattr(m, "sliding_window", None) for m in model.modules())

    def fits(self, num_tokens: int) -> bool:
        """Whether a graph runs a prompt's first chunk of `num_tokens` tokens prefilled alone."""
        return self.enabled and 1 < num_tokens <= self.sizes[-1]

    def host_inputs(self, ids: np.ndarray, slots: np.ndarray) -> torch.Tensor:
        """A pinned buffer (`HostRing`) with a first chunk's inputs in its graph's layout."""
        n = len(ids)
        size = round_up(n, self.sizes)
        buf = self.host.get((3 * size + 1,))
        flat = buf.numpy()
        flat[:n], flat[n:size] = ids, 0
        flat[size:size + n], flat[size + n:2 * size] = np.arange(n), n
        flat[2 * size:2 * size + n] = slots
        flat[2 * size + n:3 * size] = self.spare_slot
        flat[3 * size] = n - 1
        return buf

    def inputs(self, size: int) -> tuple[torch.Tensor, ...]:
        """The staged (ids, positions, KV slots) [size] each and the last row's index [1]."""
        return (*(self.staging[i * size:(i + 1) * size] for i in range(3)),
                self.staging[3 * size:3 * size + 1])

    def context(self, size: int) -> ForwardContext:
        """The rows of `size` as one causal sequence over their own keys (the spare block's
        padding after the prompt is invisible to it)."""
        return ForwardContext(
            slot_mapping=self.inputs(size)[2], block_tables=self.table,
            context_lens=torch.full((1,), size, dtype=torch.int64, device=self.device),
            padded_index=torch.arange(size, device=self.device), attn_mask=None,
            max_q_len=size, max_kv_len=size, causal_self=True)

    def _forward(self, size: int) -> torch.Tensor:
        ids, positions = self.inputs(size)[:2]
        with forward_context(self.context(size)):
            return self.model(ids, positions)

    @torch.inference_mode()
    def capture_up_to(self, max_tokens: int) -> int:
        """Capture the graphs of every size up to the one holding `max_tokens` now (captured on
        first use instead, each stalls the node's requests); returns how many were new."""
        if not self.enabled or self.decode is None:
            return 0
        top = round_up(min(max_tokens, self.sizes[-1]), self.sizes)
        new = [s for s in self.sizes if s <= top and s not in self.graphs]
        for size in new:
            self.graphs[size] = self._capture(size, level=logging.DEBUG)
        return len(new)

    def _capture(self, size: int, level: int = logging.INFO) -> tuple[Graph, torch.Tensor]:
        self.staging[:size].zero_()
        self.staging[size:2 * size].copy_(torch.arange(size, device=self.device))
        self.staging[2 * size:3 * size].fill_(self.spare_slot)
        graph, out = capture(lambda: self._forward(size), self.decode, self.device)
        log.log(level, "captured a prefill CUDA graph: %d tokens", size)
        return graph, out

    @torch.inference_mode()
    def launch(self, host: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy a first chunk's inputs (`host_inputs`) and replay its graph on the current
        stream; returns the hidden states [n, H] of its rows and the index [1] of the last one
        on the device (views of static buffers, valid until the next replay of that size)."""
        size = (host.numel() - 1) // 3
        return self.forward(host)[:n], self.inputs(size)[3]

    def forward(self, host: torch.Tensor) -> torch.Tensor:
        """`launch`'s replay; returns the hidden states of every row of the size [size, H]
        (the graph's static output; computed eagerly without decode graphs)."""
        size = (host.numel() - 1) // 3
        if self.decode is None:  # the layout without capture
            self.staging[:host.numel()].copy_(host)
            return self._forward(size)
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, out = self.graphs[size]
        self.staging[:host.numel()].copy_(host, non_blocking=True)
        graph.replay()
        return out


VARLEN_TOKENS = (16, 32, 64, 128) + PREFILL_SIZES
VARLEN_SEQS = (1, 4, 16, 64, 256)


def _pow2(n: int, least: int = 256) -> int:
    return max(least, 1 << (n - 1).bit_length())


class VarlenPrefillGraphs:
    """CUDA graphs of any prompt-chunk step in 16 bits (several prompts, chunks continuing a
    cached prefix or earlier chunks, decode rows mixed in): the attention is one
    variable-length flash call over gathered keys (`pd.model.attention.prefill_varlen`), so a
    step is fixed by three sizes, each rounded up: its tokens (`VARLEN_TOKENS`), its keys (a
    power of two) and its sequences (`VARLEN_SEQS`). Padding rows write the spare block and
    belong to no sequence; padding sequences are empty. Eager, such a step of 8 x 128 tokens
    after 2k cached ones spends ~14 ms of host time on ~5 ms of GPU work (the 1B shape).
    Captured on first use; they share the decode graphs' memory pool."""

    def __init__(self, model: torch.nn.Module, decode: DecodeGraphs, max_tokens: int,
                 max_seqs: int, max_keys: int, dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.decode, self.device = model, decode, device
        self.tokens = tuple(s for s in VARLEN_TOKENS if s < max_tokens) + (
            round_up(max_tokens, VARLEN_TOKENS + (max_tokens,)),)
        self.seqs = tuple(s for s in VARLEN_SEQS if s < max_seqs) + (
            round_up(max_seqs, VARLEN_SEQS + (max_seqs,)),)
        self.max_keys = _pow2(max_keys)
        long = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(self.tokens[-1], **long)
        self.positions = torch.zeros(self.tokens[-1], **long)
        self.slot_mapping = torch.zeros(self.tokens[-1], **long)
        self.kv_slots = torch.zeros(self.max_keys, **long)
        self.cu_q = torch.zeros(self.seqs[-1] + 1, dtype=torch.int32, device=device)
        self.cu_k = torch.zeros(self.seqs[-1] + 1, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int, int], tuple[Graph, torch.Tensor]] = {}
        self.enabled = dtype in (torch.float16, torch.bfloat16) and not any(
            getattr(m, "sliding_window", None) for m in model.modules())

    def can_run(self, ctx: ForwardContext) -> bool:
        if not self.enabled or ctx.is_decode or ctx.kv_slots is None or ctx.write_index is not None:
            return False
        return (ctx.slot_mapping.shape[0] <= self.tokens[-1] and ctx.num_seqs <= self.seqs[-1]
                and ctx.kv_slots.shape[0] <= self.max_keys)

    def context(self, key: tuple[int, int, int]) -> ForwardContext:
        """The context of a step of `key` over the staged inputs (`run` copies them in)."""
        tokens, keys, seqs = key
        return ForwardContext(
            slot_mapping=self.slot_mapping[:tokens], block_tables=self.decode.block_tables[:1, :1],
            context_lens=self.cu_k[1:seqs + 1], padded_index=self.positions[:tokens],
            attn_mask=None, max_q_len=tokens, max_kv_len=keys, kv_slots=self.kv_slots[:keys],
            cu_seqlens_q=self.cu_q[:seqs + 1], cu_seqlens_k=self.cu_k[:seqs + 1])

    def _forward(self, key: tuple[int, int, int]) -> torch.Tensor:
        tokens = key[0]
        with forward_context(self.context(key)):
            return self.model(self.input_ids[:tokens], self.positions[:tokens])

    def key(self, ctx: ForwardContext) -> tuple[int, int, int]:
        """(tokens, keys, sequences) of a step (`can_run`), each rounded up."""
        n, k, b = ctx.slot_mapping.shape[0], ctx.kv_slots.shape[0], ctx.num_seqs
        return round_up(n, self.tokens), _pow2(k), round_up(b, self.seqs)

    @torch.inference_mode()
    def capture_up_to(self, max_tokens: int) -> int:
        """Capture now the graphs of steps of up to `max_tokens` tokens (rounded up) with no
        cached prefix beyond them: each token size with the least keys that hold it and every
        sequence count up to its tokens. Returns how many were new (none where the steps run
        eagerly: 32 bits, a sliding window)."""
        if not self.enabled:
            return 0
        top = round_up(min(max_tokens, self.tokens[-1]), self.tokens)
        keys = [(t, _pow2(t), s) for t in self.tokens if t <= top and _pow2(t) <= self.max_keys
                for s in self.seqs if s <= t]
        new = [key for key in keys if key not in self.graphs]
        for key in new:
            self.graphs[key] = self._capture(key, level=logging.DEBUG)
        return len(new)

    def _capture(self, key: tuple[int, int, int], level: int = logging.INFO) -> tuple[Graph, torch.Tensor]:
        tokens, keys, seqs = key
        self._fill(0, 0, tokens, keys, seqs, 0)
        graph, out = capture(lambda: self._forward(key), self.decode, self.device)
        log.log(level, "captured a varlen prefill CUDA graph: %d tokens, %d keys, %d sequences", *key)
        return graph, out

    def _fill(self, n: int, k: int, tokens: int, keys: int, seqs: int, b: int) -> None:
        """Padding: rows n..tokens write the spare block, keys k..keys read it, sequences
        b..seqs are empty."""
        spare = self.decode.dummy_block * self.decode.block_size
        self.input_ids[n:tokens].zero_()
        self.positions[n:tokens].zero_()
        self.slot_mapping[n:tokens].fill_(spare)
        self.kv_slots[k:keys].fill_(spare)
        if b == 0:
            self.cu_q[:seqs + 1].zero_()
            self.cu_k[:seqs + 1].zero_()
        else:
            self.cu_q[b + 1:seqs + 1].copy_(self.cu_q[b].expand(seqs - b))
            self.cu_k[b + 1:seqs + 1].copy_(self.cu_k[b].expand(seqs - b))

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states [T, H] of the step's tokens (a view of the graph's output, valid until
        the next replay of that graph)."""
        n, k, b = ctx.slot_mapping.shape[0], ctx.kv_slots.shape[0], ctx.num_seqs
        key = self.key(ctx)
        if key not in self.graphs:
            self.graphs[key] = self._capture(key)
        graph, out = self.graphs[key]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(ctx.slot_mapping, non_blocking=True)
        self.kv_slots[:k].copy_(ctx.kv_slots, non_blocking=True)
        self.cu_q[:b + 1].copy_(ctx.cu_seqlens_q, non_blocking=True)
        self.cu_k[:b + 1].copy_(ctx.cu_seqlens_k, non_blocking=True)
        self._fill(n, k, *key, b)
        graph.replay()
        return out[:n]
