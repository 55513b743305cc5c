"""A request's state: one progress model for prefill, decode and speculation (the draft tokens
a step verifies are `spec_token_ids`).

`num_computed_tokens` (KV already in the cache) catches up with `num_tokens` (prompt + output).
A step computes `num_tokens - num_computed_tokens` tokens (or a chunk of them); when it catches
up, the step samples the next token. Nodes and the scheduler share this type; it holds no tensors.
A request with structured output carries its grammar's matcher (`pd.engine.grammar`), which
walks every appended token.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pd.wire.sampling_params import SamplingParams


if TYPE_CHECKING:
    from pd.engine.grammar import GrammarState


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # the client went away, a timeout, or a failure


@dataclass(eq=False)
class Req:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)  # prompt then output
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: FinishReason | None = None
    # Per output token, filled only when params.logprobs is not None.
    output_logprobs: list[float] = field(default_factory=list)
    output_ranks: list[int] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Per prompt token after the first, (logprob, rank, top) when params.prompt_logprobs is set.
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] = field(default_factory=list)
    num_preemptions: int = 0
    # MTP draft tokens to verify in the next step (after token_ids; not counted in num_tokens).
    spec_token_ids: list[int] = field(default_factory=list)
    # NOTE: a prefill node keeps a finished request's blocks until the decode node has the KV.
    hold_blocks_on_finish: bool = False
    # Prefix caching (`pd.engine.prefix`): the content hash of each full block so far, and how
    # many of `block_ids` are registered in the cache.
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    # structured output: the matcher of params.structured_output, given by the engine
    # (`Engine.bind_grammar`) before any output token is appended
    grammar: "GrammarState | None" = None
    # the prompt as int64 numpy (`prompt_array`): validation's own, or made on first use
    prompt_ids_np: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    def prompt_array(self) -> np.ndarray:
        """The prompt's ids as an int64 array, made once: a long prompt's chunks are sliced from
        it rather than converted from Python ints at every step (8k ids: ~0.4 ms on a GPU host)."""
        if self.prompt_ids_np is None:
            self.prompt_ids_np = np.asarray(self.prompt_token_ids, dtype=np.int64)
        return self.prompt_ids_np

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def append_token(self, token_id: int, logprob: float | None = None, rank: int | None = None,
                     top: list[tuple[int, float]] | None = None) -> None:
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if self.params.logprobs is not None:
            self.output_logprobs.append(logprob)
            self.output_ranks.append(rank)
            self.output_top_logprobs.append(top or [])

    def extend_tokens(self, token_ids: list[int], logprobs: tuple[list, list, list] | None = None
                      ) -> None:
        """`append_token` for several tokens at once (an MTP step's kept run): `logprobs` holds
        their logprobs, ranks and top pairs, one list each, where asked."""
        self.token_ids.extend(token_ids)
        if self.grammar is not None:
            for t in token_ids:
                self.grammar.accept(t)
        if self.params.logprobs is not None:
            lps, ranks, tops = logprobs
            self.output_logprobs.extend(lps)
            self.output_ranks.extend(ranks)
            self.output_top_logprobs.extend(tops)

    def check_stop(self, max_model_len: int) -> FinishReason | None:
        """The stop condition after the last appended token, or None to go on.
        NOTE: called per request every decode step: no property calls."""
        params, ids = self.params, self.token_ids
        num_tokens = len(ids)
        num_out = num_tokens - len(self.prompt_token_ids)
        if num_out >= params.min_tokens:
            last = ids[-1]
            if not params.ignore_eos and (last in self.eos_token_ids or last in params.extra_eos_token_ids):
                return FinishReason.STOP
            if last in params.stop_token_ids:
                return FinishReason.STOP
        if self.grammar is not None and self.grammar.terminated:
            return FinishReason.STOP  # the grammar took its stop token (even with ignore_eos)
        if num_out >= params.max_tokens or num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None
