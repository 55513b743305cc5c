"""The model runner: owns the model, the node's KV cache and the sampler, and is the one place
where a step's tensors are built (`prepare`).

It runs a `ScheduledBatch` (any mix of prefill chunks and decode tokens) and returns the sampled
tokens with their logprobs for the requests that caught up. Which requests run, and what happens
to their state afterwards, is the scheduler's business.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pd.config import EngineConfig, dtype_name
from pd.context import ForwardContext, build_context, forward_context
from pd.kv_cache import KVCache, num_blocks_for
from pd.loader import load_model
from pd.request import Req
from pd.sampler import Sampler, SamplerOutput, SamplingRow
from pd.scheduler import ScheduledBatch

log = logging.getLogger(__name__)

# (token_id, logprob, rank, top-k pairs); the last three are None without logprobs.
SampledToken = tuple[int, float | None, int | None, list[tuple[int, float]] | None]


@dataclass
class ForwardInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    context: ForwardContext
    logits_index: torch.Tensor  # [S] rows of the hidden states to sample from
    sample_reqs: list[int]  # batch index of each sampled row
    rows: list[SamplingRow]


class ModelRunner:
    def __init__(self, cfg: EngineConfig) -> None:
        self.config = cfg
        self.device = torch.device(cfg.device)
        self.dtype = cfg.torch_dtype
        self.model = load_model(cfg.model, self.dtype, self.device)
        self.model_config = mc = self.model.config
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        num_blocks = num_blocks_for(mc, cfg, self.dtype)
        self.kv_cache = KVCache(mc, num_blocks, cfg.block_size, self.dtype, self.device)
        self.kv_cache.bind(self.model.attention_layers())
        self.sampler = Sampler()
        log.info("model %s (%s, %d layers%s) on %s/%s, KV cache %d blocks x %d tokens (%.1f MiB)",
                 mc.model_id, mc.architecture, mc.num_layers, " + MTP" if mc.has_mtp else "",
                 cfg.device, dtype_name(self.dtype), num_blocks, cfg.block_size,
                 self.kv_cache.nbytes / 2**20)

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    def prepare(self, batch: ScheduledBatch) -> ForwardInput:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        logits_index: list[int] = []
        sample_reqs: list[int] = []
        rows: list[SamplingRow] = []
        for i, (req, n) in enumerate(zip(batch.reqs, batch.num_new_tokens)):
            start = req.num_computed_tokens
            input_ids += req.token_ids[start:start + n]
            pos = range(start, start + n)
            positions += pos
            table = req.block_ids
            slots += [table[p // bs] * bs + p % bs for p in pos]
            context_lens.append(start + n)
            if batch.samples(i):
                logits_index.append(len(input_ids) - 1)
                sample_reqs.append(i)
                rows.append(self.sampling_row(req))
        ctx = build_context(batch.num_new_tokens, context_lens,
                            [req.block_ids for req in batch.reqs], slots, self.device)
        return ForwardInput(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            context=ctx,
            logits_index=torch.tensor(logits_index, dtype=torch.int64, device=self.device),
            sample_reqs=sample_reqs,
            rows=rows,
        )

    @staticmethod
    def sampling_row(req: Req) -> SamplingRow:
        return SamplingRow(
            params=req.params,
            output_token_ids=req.output_token_ids if req.params.has_penalties else [],
            prompt_token_ids=req.prompt_token_ids if req.params.has_penalties else [],
            step=req.num_output_tokens,
            eos_token_ids=req.eos_token_ids,
        )

    @torch.inference_mode()
    def forward(self, inp: ForwardInput) -> torch.Tensor:
        """Run the target model; returns the pre-norm hidden states of every token [T, H]."""
        with forward_context(inp.context):
            return self.model(inp.input_ids, inp.positions)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> dict[int, SampledToken]:
        inp = self.prepare(batch)
        hidden = self.forward(inp)
        if not inp.rows:
            return {}
        logits = self.model.compute_logits(hidden[inp.logits_index])
        out = self.sampler(logits, inp.rows)
        return unpack_sampled(out, inp.sample_reqs, inp.rows)


def unpack_sampled(out: SamplerOutput, sample_reqs: list[int],
                   rows: list[SamplingRow]) -> dict[int, SampledToken]:
    """Sampler tensors -> {batch index: (token, logprob, rank, top)}, logprobs only where asked."""
    token_ids = out.token_ids.tolist()
    if out.logprobs is None:
        return {i: (t, None, None, None) for i, t in zip(sample_reqs, token_ids)}
    logprobs, ranks = out.logprobs.tolist(), out.ranks.tolist()
    top_ids, top_lps = out.topk_ids.tolist(), out.topk_logprobs.tolist()
    result: dict[int, SampledToken] = {}
    for j, (i, row) in enumerate(zip(sample_reqs, rows)):
        k = row.params.logprobs
        if k is None:
            result[i] = (token_ids[j], None, None, None)
        else:
            result[i] = (token_ids[j], logprobs[j], ranks[j], list(zip(top_ids[j][:k], top_lps[j][:k])))
    return result
