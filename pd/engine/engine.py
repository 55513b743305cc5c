"""The single-process engine: scheduler + runner in one loop.

It is the reference the PD path must equal (`pd.LLM`, `pd generate`), and it builds the parts
each node runs: the model runner, the block allocator, the scheduler and, with
`num_speculative_tokens` k > 0, the MTP verify step (`pd.spec.verify`, `pd.spec.mtp`). Its
steps run through the decode loop (`pd.engine.decode_loop`), the one step pipeline a decode
node runs too: plain or MTP steps, one step ahead of the device with overlap (on CUDA by
default) or not. A prefill node runs its batches through the runner (or the verify step) itself
and hands requests off. Tokenization and output formatting are left to `llm.py` and the router.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os

import numpy as np

from pd.engine.allocator import BlockAllocator
from pd.engine.decode_loop import DecodeLoop
from pd.engine.checked_grammar import checked_grammars
from pd.engine.grammar import Grammars
from pd.engine.prefix import PrefixCache
from pd.config import EngineConfig
from pd.wire.geometry import geometry
from pd.spec.mtp import MTPDrafter
from pd.engine.request import Req
from pd.engine.runner import ModelRunner
from pd.engine.sampler import GREEDY_EPS
from pd.wire.sampling_params import SamplingParams
from pd.engine.scheduler import Scheduler
from pd.spec.verify import SpecDecoder

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, cfg: EngineConfig, eos_token_ids: tuple[int, ...] = (),
                 num_speculative_tokens: int = 0, overlap: bool | None = None,
                 spec_fallback: bool | None = None) -> None:
        self.config = cfg
        self.runner = ModelRunner(cfg)
        self.model_config = self.runner.model_config
        self.eos_token_ids = tuple(eos_token_ids)
        self.allocator = BlockAllocator(self.runner.num_blocks, caching=cfg.enable_prefix_caching)
        # With MTP the token after a block is hashed with it (see pd.engine.prefix).
        self.prefix = PrefixCache(
            self.allocator, cfg.block_size,
            repr(sorted(geometry(self.model_config, self.runner.dtype, cfg.block_size,
                                 bool(num_speculative_tokens)).items())),
            lookahead=int(bool(num_speculative_tokens))) if cfg.enable_prefix_caching else None
        self.scheduler = Scheduler(
            self.allocator,
            block_size=cfg.block_size,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=self.runner.max_model_len,
            num_lookahead_slots=num_speculative_tokens,
            prefix=self.prefix,
        )
        self.spec: SpecDecoder | None = None
        if num_speculative_tokens:
            self.spec = SpecDecoder(self.runner, num_speculative_tokens,
                                    MTPDrafter(self.runner, num_speculative_tokens),
                                    self.runner.max_model_len, seed=cfg.seed)
        # overlap: on CUDA by default (the device runs while the host prepares); on CPU the
        # plain loop, which keeps the engine single-threaded. spec_fallback (with MTP): plain
        # steps where they measure faster, by default on CUDA (on CPU timing would make which
        # kind runs vary from run to run; the tokens would not)
        cuda = self.runner.device.type == "cuda"
        self._loop_options = dict(overlap=cuda if overlap is None else overlap,
                                  spec_fallback=cuda if spec_fallback is None else spec_fallback)
        self.requests: dict[str, Req] = {}
        self._ids = itertools.count()

    @functools.cached_property
    def loop(self) -> DecodeLoop:
        """The engine's decode loop, made on first use: the nodes, which build the engine for
        its parts and run their own loop (or none), never make it."""
        return DecodeLoop(self.runner, self.scheduler, spec=self.spec, **self._loop_options)

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Structured output's compiler, made on first use (`pd.engine.grammar`)."""
        return Grammars(self.config.model, self.model_config.vocab_size, self.eos_token_ids)

    def bind_grammar(self, req: Req) -> None:
        """Give a request with structured output its grammar's matcher (before any output token
        is appended); `GrammarError` (a ValueError) for a spec that does not compile."""
        params = req.params
        if params.structured_output is not None:
            # greedy rows of the plain decode loop may be checked after sampling, not masked
            # (`pd.engine.checked_grammar.CheckedSampling`); MTP's steps mask their drafts'
            # positions
            checked = (self.spec is None and params.temperature < GREEDY_EPS
                       and params.logprobs is None and not params.has_penalties
                       and not params.logit_bias and checked_grammars(os.environ))
            req.grammar = self.grammars.matcher(params.structured_output, checked)

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def geometry(self, mtp_enabled: bool = False) -> dict:
        """What a peer must share to pair (`pd.wire.geometry`), and this node's tensor parallel
        size, which it need not share."""
        return dict(geometry(self.model_config, self.runner.dtype, self.config.block_size,
                             mtp_enabled), tensor_parallel_size=self.config.tensor_parallel_size)

    def prefix_stats(self) -> dict:
        """The prefix cache's counters, for a node's heartbeat (zero with caching off)."""
        stats = self.prefix.stats if self.prefix is not None else None
        return {"prefix_cache_queries": stats.queries if stats else 0,
                "prefix_cache_hits": stats.hits if stats else 0}

    def validate_prompt(self, prompt_token_ids: list[int]) -> np.ndarray:
        """Refuse a prompt the model cannot take (ValueError); returns its ids as an int64
        array (a request keeps it: `Req.prompt_array`)."""
        if not prompt_token_ids:
            raise ValueError("empty prompt: at least one token is needed")
        vocab = self.model_config.vocab_size
        try:
            ids = np.asarray(prompt_token_ids)
        except ValueError:  # ragged nesting
            ids = None
        if ids is not None and ids.dtype.kind == "i" and ids.ndim == 1 and (
                ids.min() >= 0 and ids.max() < vocab):
            bad = []  # the common case, checked without Python per token
        else:
            bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id(s) outside the vocabulary [0, {vocab}): {bad[:8]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_token_ids)} tokens does not fit the context of "
                f"{self.max_model_len} tokens (at least one must be generated)"
            )
        return ids.astype(np.int64, copy=False)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    req_id: str | None = None, validated: np.ndarray | None = None) -> Req:
        """Queue one request (`validated`: `validate_prompt`'s result, when the prompt passed
        it already)."""
        if validated is None:
            validated = self.validate_prompt(prompt_token_ids)
        req_id = req_id if req_id is not None else str(next(self._ids))
        if req_id in self.requests:
            raise ValueError(f"duplicate request id {req_id!r}")
        req = Req(req_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids,
                  prompt_ids_np=validated)
        self.bind_grammar(req)
        self.scheduler.add(req)
        self.requests[req_id] = req
        return req

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Req]:
        """Add one request per prompt and step until the engine is idle; returns the requests,
        finished, in order. Every prompt is validated before any request starts."""
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling parameter sets")
        arrays = [self.validate_prompt(ids) for ids in prompts]
        for sp in params:  # a spec that does not compile refuses the call before any request
            if sp.structured_output is not None:
                self.grammars.compile(sp.structured_output)
        reqs = [self.add_request(ids, sp, validated=arr)
                for ids, sp, arr in zip(prompts, params, arrays)]
        while self.has_unfinished():
            self.step()
        return reqs

    def abort(self, req_id: str) -> None:
        req = self.requests.pop(req_id, None)
        if req is not None:
            self.loop.abort(req)

    def has_unfinished(self) -> bool:
        return self.loop.has_work

    def step(self) -> list[Req]:
        """Run one step of the decode loop; returns the requests that finished in it."""
        emitted = self.loop.step()
        if not emitted and not self.loop.in_flight and self.scheduler.waiting and not self.scheduler.running:
            raise RuntimeError("no request can be scheduled: the KV cache is too small")
        finished = [r for r in dict.fromkeys(emitted) if r.is_finished]
        for req in finished:
            self.requests.pop(req.req_id, None)
        # NOTE: the allocator's full check walks every block (4 ms for 8,192 blocks): on going
        # idle an engine counts, and walks only under PD_CHECK_INTEGRITY=1 (the suite sets it)
        if not self.loop.has_work:
            self.allocator.check_integrity(full=os.environ.get("PD_CHECK_INTEGRITY") == "1")
        return finished

    def close(self) -> None:
        if "loop" in self.__dict__:  # made (cached_property)
            self.loop.close()
        self.runner.close()
