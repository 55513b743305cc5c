"""CUDA graphs of the target model's decode forward (one query token per sequence).

A graph is captured per (padded batch, padded KV blocks) on first use: the batch is rounded up
to the next size of `BATCH_SIZES`, the block-table width to the next power of two. Padding rows
point at the cache's spare block (`KVCache.dummy_block`, never handed out by the allocator), so
their K/V writes land there and their outputs are dropped. The attention mask is computed inside
the graph from the context lengths, so one graph serves every length up to its width. All
graphs share one memory pool and one staging buffer for their inputs, which the host builds in
the graph's layout and copies in one transfer on the current stream before the replay, so a
step composes with the overlap loop's compute stream and never waits on the host.

Each decode graph also runs the LM head into one static logits buffer (`logits`, in the model's
dtype, shared by every graph) and the greedy argmax of it into `tokens`, passing over each
row's banned ids (its inputs' last section: min_tokens' EOS and stop ids): a batch of plain
greedy rows needs nothing after the replay. Greedy rows that ask for logprobs replay one more
graph, of the tokens' logprobs packed for one host copy (`logprobs`, per padded batch and top
count); any other sampling runs eagerly on `logits`.

Which steps run as graphs (pure decode, no invalid slot, a batch no larger than the largest
size) is decided here (`can_run`); everything else, and everything with `--enforce-eager`, runs
eagerly. The graphs of prompt steps, in the same pool, are `pd.engine.prefill_graphs`.
"""

from __future__ import annotations

import logging

import torch

from pd_kernels.argmax import argmax
from pd.engine.decode_inputs import DecodeInputs, DecodeLayout, fill_decode_inputs
from pd.engine.graph import Graph, capture
from pd.engine.host_ring import HostRing, copy_async
from pd.engine.logprobs import packed_logprobs
from pd.model.context import ForwardContext, forward_context

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
LOGPROB_GRAPH_ELEMENTS = 1 << 25  # logits larger than this compute their top columns eagerly


def round_up(n: int, sizes) -> int:
    return next(s for s in sizes if s >= n)


class DecodeGraphs:
    """Decode graphs per (padded batch, padded width). A step's inputs are built on the host
    straight into a pinned buffer in the graph's layout (`pd.engine.decode_inputs`: whole, or
    advanced from the step before's for the same requests) and reach the device in one copy
    into a staging buffer shared by every graph, which the graph reads at its start (stream order keeps a step's copy behind the replay before it).
    The ids of future rows are gathered inside the graph from `tokens`, the previous step's
    tokens (its argmax, or what the sampler drew, copied there by `ModelRunner.execute`)."""

    def __init__(self, model: torch.nn.Module, dummy_block: int, block_size: int,
                 max_num_seqs: int, max_model_len: int, device: torch.device) -> None:
        self.model = model
        self.dummy_block = dummy_block
        self.block_size = block_size
        self.batch_sizes = tuple(s for s in BATCH_SIZES if s < max_num_seqs) + (
            round_up(max_num_seqs, BATCH_SIZES + (max_num_seqs,)),)
        max_blocks = -(-max_model_len // block_size)
        self.block_widths = tuple(1 << i for i in range((max_blocks - 1).bit_length() + 1))
        max_batch, width = self.batch_sizes[-1], self.block_widths[-1]
        long = dict(dtype=torch.int64, device=device)
        self.staging = torch.zeros(DecodeLayout(max_batch, width).size, **long)
        self.block_tables = torch.full((1, 1), dummy_block, **long)  # the prefill graphs' dummy
        # what the last replay's rows 0..batch-1 gave: logits [B, V] and their argmax [B]
        self.logits = self.tokens = None
        if model is not None:
            self.logits = torch.empty(max_batch, model.config.vocab_size,
                                      dtype=model.head_weight.dtype, device=device)
            self.tokens = torch.zeros(max_batch, **long)
        self.token_views: dict[int, torch.Tensor] = {}
        self.graphs: dict[tuple[int, int], tuple[Graph, torch.Tensor]] = {}
        # (padded batch, top columns) -> the graph of `logprobs` and its packed output
        self.logprob_graphs: dict[tuple[int, int], tuple[Graph, torch.Tensor]] = {}
        self.host = HostRing(pin=device.type == "cuda")
        self.inputs = DecodeInputs(block_size, dummy_block)
        self.pool = None
        self.device = device

    def tokens_of(self, n: int) -> torch.Tensor:
        """`tokens[:n]`, a view made once per n (a slice costs a step 3.5 us of host, twice)."""
        view = self.token_views.get(n)
        if view is None:
            view = self.token_views[n] = self.tokens[:n]
        return view

    def key(self, num_seqs: int, width: int) -> tuple[int, int] | None:
        """(padded batch, padded width) of a decode step, or None when it is too large."""
        if num_seqs > self.batch_sizes[-1] or width > self.block_widths[-1]:
            return None
        return round_up(num_seqs, self.batch_sizes), round_up(width, self.block_widths)

    def keys_up_to(self, max_tokens: int) -> list[tuple[int, int]]:
        """Every (batch, width) key whose sequences hold at most `max_tokens` tokens (widths
        rounded up, so the first width that holds them is included)."""
        top = round_up(-(-max_tokens // self.block_size), self.block_widths)
        return [(b, w) for w in self.block_widths if w <= top for b in self.batch_sizes]

    @torch.inference_mode()
    def capture_all(self, keys: list[tuple[int, int]]) -> None:
        """Capture these keys now: a step that meets a new key captures it on the spot, tens
        of ms (and Triton compiling on a first use) in which every running stream waits."""
        for key in keys:
            if key not in self.graphs:
                self.graphs[key] = self._capture(*key, level=logging.DEBUG)

    def host_inputs(self, reqs, key: tuple[int, int]) -> torch.Tensor:
        """A pinned buffer (`HostRing`) holding the step's inputs in the graph's layout."""
        layout = DecodeLayout(*key)
        buf = self.host.get((layout.size,))
        self.inputs.fill(buf.numpy(), layout, reqs)
        return buf

    def _forward(self, batch: int, width: int) -> torch.Tensor:
        layout = DecodeLayout(batch, width)
        ids, positions, slots, lens, future, tables = layout.views(self.staging)
        bans = layout.bans(self.staging)
        ids = torch.where(future >= 0, self.tokens[future.clamp(min=0)], ids)
        keys = torch.arange(width * self.block_size, device=self.device)
        mask = (keys[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, max_kv]
        ctx = ForwardContext(
            slot_mapping=slots, block_tables=tables, context_lens=lens,
            padded_index=torch.arange(batch, device=self.device), attn_mask=mask, max_q_len=1,
            max_kv_len=width * self.block_size, plain_decode=True)
        with forward_context(ctx):
            hidden, logits = self.model.forward_logits(ids, positions, out=self.logits[:batch])
        argmax(logits, out=self.tokens[:batch], bans=bans)
        return hidden

    def pad_inputs(self, key: tuple[int, int]) -> None:
        """Staging holds key's layout with every row padding (for a capture, or a benchmark
        that replays a graph alone: a graph replayed over another key's inputs reads nonsense)."""
        layout = DecodeLayout(*key)
        pad = torch.empty(layout.size, dtype=torch.int64)
        fill_decode_inputs(pad.numpy(), layout, [], self.block_size, self.dummy_block)
        self.staging[:layout.size].copy_(pad)

    def _capture(self, batch: int, width: int,
                 level: int = logging.INFO) -> tuple[Graph, torch.Tensor]:
        self.pad_inputs((batch, width))
        graph, out = capture(lambda: self._forward(batch, width), self, self.device)
        log.log(level, "captured a decode CUDA graph: batch %d, %d KV blocks per sequence",
                batch, width)
        return graph, out

    @torch.inference_mode()
    def launch(self, host: torch.Tensor, key: tuple[int, int]) -> None:
        """Copy a step's inputs (`host_inputs`) and replay its graph on the current stream;
        its logits and greedy tokens are then `logits[:n]` and `tokens[:n]`.

        NOTE: the results are views of static buffers; they are valid until the next replay,
        which stream order puts after everything queued behind this one."""
        if key not in self.graphs:
            saved = self.tokens.clone()  # the capture's warm-up writes them; the step reads them
            self.graphs[key] = self._capture(*key)
            self.tokens.copy_(saved)
        copy_async(self.staging, host)
        self.graphs[key][0].replay()

    @torch.inference_mode()
    def logprobs(self, batch: int, num_top: int) -> torch.Tensor:
        """After a replay of padded batch `batch`: the logprobs of its greedy tokens with
        `num_top` top columns, packed (`pack_logprobs`) [batch, 2 + 2 num_top], from a graph
        per (batch, num_top) captured on first use (eager where the top columns' [batch, V]
        temporaries would exceed `LOGPROB_GRAPH_ELEMENTS`). Valid until the next replay."""
        def packed() -> torch.Tensor:
            return packed_logprobs(self.logits[:batch], self.tokens[:batch], num_top)

        if num_top and batch * self.logits.shape[1] > LOGPROB_GRAPH_ELEMENTS:
            return packed()
        key = (batch, num_top)
        if key not in self.logprob_graphs:  # reads logits and tokens only: safe mid-step
            self.logprob_graphs[key] = capture(packed, self, self.device)
        graph, out = self.logprob_graphs[key]
        graph.replay()
        return out
