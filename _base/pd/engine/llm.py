"""`pd.LLM`: single-process generation, the reference the PD path must equal.

Tokenizes text prompts (token-id prompts pass through), runs the engine to completion, and
returns one `RequestOutput` per prompt in input order. Streaming and HTTP are the router's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pd.config import EngineConfig, default_model_dir
from pd.text.detokenizer import detokenize
from pd.engine.engine import Engine
from pd.engine.request import Req
from pd.wire.sampling_params import SamplingParams, generation_defaults
from pd.text.tokenizer import Tokenizer


@dataclass
class RequestOutput:
    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None = None
    ranks: list[int] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = field(default=None)
    # per prompt token after the first: (logprob, rank, top list), when prompt_logprobs asked
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None

    def to_dict(self) -> dict:
        return {
            "req_id": self.req_id,
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "logprobs": self.logprobs,
            "ranks": self.ranks,
            "top_logprobs": [[list(p) for p in step] for step in self.top_logprobs]
            if self.top_logprobs is not None else None,
            "prompt_logprobs": [[v, r, [list(p) for p in top]] for v, r, top in self.prompt_logprobs]
            if self.prompt_logprobs is not None else None,
        }


Prompt = str | list[int]


class LLM:
    """`generation_config` ("auto", "vllm" or a directory, as the router's flag) gives the
    sampling defaults `generate` uses when it is given no parameters."""

    def __init__(self, model: str | Path | None = None, num_speculative_tokens: int = 0,
                 generation_config: str = "auto", overlap: bool | None = None,
                 spec_fallback: bool | None = None, **engine_kwargs) -> None:
        model = Path(model) if model is not None else default_model_dir()
        self.tokenizer = Tokenizer.from_dir(model)
        self.sampling_defaults = generation_defaults(model, generation_config)
        self.engine = Engine(EngineConfig(model=str(model), **engine_kwargs),
                             eos_token_ids=tuple(self.tokenizer.eos_token_ids),
                             num_speculative_tokens=num_speculative_tokens, overlap=overlap,
                             spec_fallback=spec_fallback)

    def close(self) -> None:
        """Stop the engine's decode loop and its tensor-parallel worker ranks, if any."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompts: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None:
            params = self.default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        reqs = self.engine.generate([self.encode(p) for p in prompts], params)
        return [self._output(r) for r in reqs]

    def default_sampling_params(self, **overrides) -> SamplingParams:
        """SamplingParams with the checkpoint's generation-config defaults, then `overrides`."""
        return SamplingParams(**{**self.sampling_defaults, **overrides})

    def _output(self, req: Req) -> RequestOutput:
        asked = req.params.logprobs is not None
        return RequestOutput(
            req_id=req.req_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=req.output_token_ids,
            text=detokenize(self.tokenizer, req.prompt_token_ids, req.output_token_ids),
            finish_reason=req.finish_reason.value,
            logprobs=req.output_logprobs if asked else None,
            ranks=req.output_ranks if asked else None,
            top_logprobs=req.output_top_logprobs if asked else None,
            prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
        )
