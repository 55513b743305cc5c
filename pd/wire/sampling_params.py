"""Per-request sampling parameters and stop conditions.

A frozen dataclass validated on construction: every wrong value raises `ValueError` naming the
field. It is plain data (msgpack-friendly through `to_dict`/`from_dict`) so the router can put it
in a `PrefillRequest` and the nodes can rebuild it. The sampler reads it; the scheduler reads the
stop conditions.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from pd.config import ModelConfigError

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
# structured output: (kind, spec) with spec a JSON schema text ("json"; "json_compact": the
# same without free whitespace, for forced tool calls), empty ("json_object": any JSON object),
# a regex ("regex"), a JSON list of strings ("choice") or an EBNF grammar ("grammar");
# compiled and matched by `pd.engine.grammar`
STRUCTURED_KINDS = ("json", "json_compact", "json_object", "regex", "choice", "grammar")
MAX_STRUCTURED_SPEC = 256 * 1024  # characters of a schema, regex or grammar
# generation_config.json fields a request inherits when it omits them (vLLM's set)
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GENERATION_CONFIG_MODES = ("auto", "vllm")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # None: no logprobs at all. 0: the sampled token's logprob and rank only. k: plus top-k.
    logprobs: int | None = None
    # The same for each prompt token after the first (computed where the prompt is prefilled;
    # such a prompt is computed whole, not from the prefix cache). None: none.
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # (kind, spec): every token is sampled from those the grammar allows (STRUCTURED_KINDS)
    structured_output: tuple[str, str] | None = None
    extra_eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be -1, 0 (off) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            bad("logprobs", f"must be None or an integer in [0, {MAX_TOP_LOGPROBS}]")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        ):
            bad("prompt_logprobs", f"must be None or an integer in [0, {MAX_TOP_LOGPROBS}]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", "must be an integer in [0, max_tokens]")
        for tid in self.stop_token_ids:
            if not isinstance(tid, int) or tid < 0:
                bad("stop_token_ids", "must be non-negative integers")
        bias = tuple((pair[0], float(pair[1])) for pair in self.logit_bias
                     if isinstance(pair, (list, tuple)) and len(pair) == 2)
        if len(bias) != len(self.logit_bias) or len(bias) > MAX_LOGIT_BIAS or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 or not -100.0 <= b <= 100.0
                for t, b in bias) or len({t for t, _ in bias}) != len(bias):
            bad("logit_bias", f"must be at most {MAX_LOGIT_BIAS} distinct (token id >= 0, bias "
                              f"in [-100, 100]) pairs")
        so = self.structured_output
        if so is not None:
            if (not isinstance(so, (list, tuple)) or len(so) != 2 or so[0] not in STRUCTURED_KINDS
                    or not isinstance(so[1], str) or len(so[1]) > MAX_STRUCTURED_SPEC):
                bad("structured_output", f"must be (kind, spec) with kind one of "
                                         f"{', '.join(STRUCTURED_KINDS)} and a spec of at most "
                                         f"{MAX_STRUCTURED_SPEC} characters")
            object.__setattr__(self, "structured_output", (so[0], so[1]))
        # Normalise sequences given as lists so the dataclass stays hashable.
        object.__setattr__(self, "logit_bias", bias)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "extra_eos_token_ids", tuple(self.extra_eos_token_ids))
        # NOTE: derived once, not properties: a decode step reads them per request
        penalties = (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                     or self.repetition_penalty != 1.0)
        grammar = self.structured_output is not None
        object.__setattr__(self, "has_penalties", penalties)
        # whether anything but temperature and truncation changes the logits (penalties,
        # logit_bias, a grammar's mask) at every position
        object.__setattr__(self, "processes_logits", penalties or bool(bias) or grammar)
        # whether a position's logits processing needs the tokens before it on the host
        # (penalties count them, a grammar's matcher walks them)
        object.__setattr__(self, "needs_host_tokens", penalties or grammar)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_top_logprobs(self) -> int:
        """Logprob columns per token on the wire (the header word's top-k count)."""
        return self.logprobs or 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["extra_eos_token_ids"] = list(self.extra_eos_token_ids)
        d["logit_bias"] = [list(pair) for pair in self.logit_bias]
        if self.structured_output is not None:
            d["structured_output"] = list(self.structured_output)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        return cls(**d)


def generation_defaults(model_dir: str | Path, mode: str = "auto") -> dict:
    """Sampling defaults for requests that omit them, as vLLM's `--generation-config`: "auto"
    reads the model directory's generation_config.json, "vllm" uses none (temperature 1, no
    top-p/top-k/min-p, no repetition penalty), any other value is a directory whose
    generation_config.json is read. A value the checkpoint sets wrongly is a ModelConfigError naming it.
    """
    if mode == "vllm":
        return {}
    directory = Path(model_dir) if mode == "auto" else Path(mode)
    if mode != "auto" and not directory.is_dir():
        raise ModelConfigError(f"--generation-config {mode!r} is neither auto, vllm nor a directory")
    file = directory / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        gen = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{file} is not valid JSON: {e}") from None
    defaults = {k: gen[k] for k in GENERATION_DEFAULT_FIELDS if gen.get(k) is not None}
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as e:
        raise ModelConfigError(f"{file}: {e}") from None
    return defaults
