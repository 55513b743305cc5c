"""The interface between the router's HTTP layer and whatever runs the requests.

The HTTP layer (validation, tokenization, detokenization, stop strings, SSE) talks only to a
`Backend`: it hands over a tokenized `GenerateRequest` and reads `TokenEvent`s back. Picking
nodes, the ZMQ protocol to prefill and decode nodes, heartbeats and aborts on the nodes are the
backend's job (the ZMQ backend lives with the node services); the HTTP layer never sees a node.

Contract of `Backend.generate` (owned by the backend, relied on by the HTTP layer):
- It yields events of one request in order; every token id appears in exactly one event.
- The last event has `finish_reason` set ("stop", "length" or "abort") or `error` set; nothing
  follows it. With "stop" (EOS or a stop token id) the stop token is the last id of that event:
  it is counted in usage but its text is not shown.
- When `params.logprobs` is not None, `logprobs` holds one float per token id, and
  `top_logprobs` one list of exactly `params.logprobs` (token id, logprob) pairs per token id.
- Closing the iterator early (`aclose()`, or cancelling the task awaiting it) aborts the
  request on the nodes. The HTTP layer does so on a stop string and on a client disconnect.
- Before the first event it may raise `BackendUnavailable` (no healthy prefill or decode node:
  HTTP 503) or `BackendOverloaded` (the nodes refuse more work: HTTP 429).
- An error event with `first_token_sent=False` says no token of this request reached the
  router, so the router may retry it once under a new `req_id`; a backend that already retried
  internally sets it True.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import AsyncIterator

from pd.wire.sampling_params import SamplingParams


class BackendUnavailable(Exception):
    """No healthy prefill or decode node can take the request (HTTP 503)."""


class BackendOverloaded(Exception):
    """The nodes' queues are full (HTTP 429)."""


@dataclass
class GenerateRequest:
    req_id: str  # unguessable (uuid4 hex); a retry gets a new one
    prompt_ids: list[int]
    params: SamplingParams  # stop strings are not in here: the router owns them


@dataclass
class TokenEvent:
    """One or more new tokens of one request, in order."""

    token_ids: list[int]
    logprobs: list[float] | None = None  # sampled tokens' logprobs when params.logprobs is set
    top_logprobs: list[list[tuple[int, float]]] | None = None  # params.logprobs pairs per token
    finish_reason: str | None = None  # "stop" (EOS/stop id), "length", "abort"; None: running
    error: str | None = None  # a failure: the router ends the stream with an error event
    first_token_sent: bool = True
    # with the first token, when the request asked (SamplingParams.prompt_logprobs): per
    # prompt token after the first, (logprob, rank, [(id, logprob), ...])
    prompt_logprobs: list | None = None


class Backend(ABC):
    """What the router's HTTP layer needs from the serving side."""

    @abstractmethod
    def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Run `req`; see the module docstring for the event contract."""

    @abstractmethod
    def health(self) -> dict:
        """{"prefill": number of healthy prefill nodes, "decode": ..., plus anything else}."""

    @abstractmethod
    def max_model_len(self) -> int:
        """The longest prompt + completion, in tokens, that every node accepts."""

    def kv_blocks(self) -> list[tuple[int, int]] | None:
        """(KV blocks, block size) of each decode node taking requests, as they report them;
        None when unknown (a request is then not checked against them)."""
        return None

    async def start(self) -> None:
        """Called once on the server's event loop before the first request."""

    async def close(self) -> None:
        """Called once when the server stops."""
