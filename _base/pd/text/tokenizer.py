"""Tokenizer loading from a Hugging Face model directory, without transformers.

`Tokenizer.from_dir` reads `tokenizer.json` (the `tokenizers` library does the encoding and
decoding), `tokenizer_config.json` (special tokens, the chat template) and
`generation_config.json` (end-of-sequence ids; config.json's when it has none, as
transformers does). `apply_chat_template` renders the template
with Hugging Face's Jinja semantics: a sandboxed environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a no-op `{% generation %}` block,
`raise_exception`, `strftime_now`, `tojson`, and the special tokens as variables.

Whether encoding adds special tokens (a BOS, say) is decided by tokenizer.json's
post-processor alone; `add_special_tokens=True` applies it. A rendered chat prompt already
carries whatever the template put in it, so `encode_chat` encodes it with
`add_special_tokens=False`, as Hugging Face does.

Incremental detokenization, stop strings and request validation are left to the router.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models as _models


class TokenizerError(Exception):
    """A model directory whose tokenizer files are missing or malformed."""


class ChatTemplateError(TokenizerError):
    """A chat template that is missing, does not compile, or raised while rendering."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile (line {e.lineno}): {e.message}") from e


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, an AddedToken map, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"cannot read special token {value!r}")


def _read_json(file: Path, required: bool) -> dict:
    if not file.is_file():
        if required:
            raise TokenizerError(f"missing {file.name} in {file.parent}")
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{file} must hold a JSON object")
    return data


def _pick_template(config: dict, directory: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # a list of named templates: use the "default" one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"chat_template in {directory} must be a string")
    return template


_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
             (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class Tokenizer:
    """Encoding, decoding and chat templating for one model directory."""

    def __init__(self, tokenizer: _HFTokenizer, config: dict, generation_config: dict,
                 directory: Path, model_config: dict | None = None):
        model_config = model_config or {}
        self._tok = tokenizer
        self.directory = directory
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        self.unk_token = _token_content(config.get("unk_token"))
        # NOTE: as in transformers 5, the cleanup is never applied to BPE models, for which it
        # would delete real spaces before punctuation
        self.clean_up_tokenization_spaces = bool(
            config.get("clean_up_tokenization_spaces", False)
            and not isinstance(tokenizer.model, _models.BPE))
        self.model_max_length = config.get("model_max_length")
        self.chat_template = _pick_template(config, directory)
        self._template: jinja2.Template | None = None  # compiled on first use

        self.bos_token_id = self._special_id("bos_token", self.bos_token)
        self.eos_token_id = self._special_id("eos_token", self.eos_token)
        self.pad_token_id = self._special_id("pad_token", self.pad_token)
        gen_eos = generation_config.get("eos_token_id")
        if gen_eos is None:
            # as transformers: without generation_config.json, config.json's eos_token_id
            gen_eos = model_config.get("eos_token_id")
        gen_eos = [] if gen_eos is None else [gen_eos] if isinstance(gen_eos, int) else gen_eos
        if not all(isinstance(i, int) for i in gen_eos):
            raise TokenizerError(f"generation_config.json eos_token_id must be an int or a list "
                                 f"of ints, got {generation_config.get('eos_token_id')!r}")
        ids = list(gen_eos) + ([self.eos_token_id] if self.eos_token_id is not None else [])
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self.all_special_ids: frozenset[int] = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        # what the post-processor wraps around one sequence, e.g. [bos] for Llama 3
        probe = "a"
        bare = tokenizer.encode(probe, add_special_tokens=False).ids
        full = tokenizer.encode(probe, add_special_tokens=True).ids
        start = next(i for i in range(len(full) + 1) if full[i:i + len(bare)] == bare)
        self.prefix_special_ids: tuple[int, ...] = tuple(full[:start])
        self.suffix_special_ids: tuple[int, ...] = tuple(full[start + len(bare):])

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        directory = Path(path)
        if not directory.is_dir():
            raise TokenizerError(f"model directory {directory} does not exist")
        tok_file = directory / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"missing tokenizer.json in {directory}")
        try:
            tokenizer = _HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise TokenizerError(f"cannot load {tok_file}: {e}") from e
        config = _read_json(directory / "tokenizer_config.json", required=True)
        generation_config = _read_json(directory / "generation_config.json", required=False)
        model_config = _read_json(directory / "config.json", required=False)
        return cls(tokenizer, config, generation_config, directory, model_config)

    def _special_id(self, name: str, token: str | None) -> int | None:
        if token is None:
            return None
        tok_id = self._tok.token_to_id(token)
        if tok_id is None:
            raise TokenizerError(f"{name} {token!r} is not in the vocabulary of {self.directory}")
        return tok_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model may pad its vocab beyond it)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def adds_bos_on_encode(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` starts with the BOS token."""
        return self.bos_token_id is not None and self.prefix_special_ids[:1] == (self.bos_token_id,)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. An id past the tokenizer's vocabulary (a model's vocabulary padded
        beyond it, e.g. 152064 rows for 151665 tokens) decodes as empty text, as vLLM does."""
        ids = list(ids)
        if ids and min(ids) < 0:
            raise ValueError(f"negative token ids: {[i for i in ids if i < 0][:8]}")
        limit = self.vocab_size
        if ids and max(ids) >= limit:
            ids = [i for i in ids if i < limit]
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            for old, new in _CLEANUPS:
                text = text.replace(old, new)
        return text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render `messages` with the model's chat template; `extra` become template variables."""
        if self.chat_template is None:
            raise ChatTemplateError(f"{self.directory} has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        specials = (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                    ("pad_token", self.pad_token), ("unk_token", self.unk_token))
        # NOTE: an unset special token stays undefined in the template, so `is defined` works
        variables = {name: tok for name, tok in specials if tok is not None}
        variables.update(extra)
        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **extra: Any) -> list[int]:
        """Token ids of the rendered chat prompt (the template supplies any BOS itself)."""
        prompt = self.apply_chat_template(messages, add_generation_prompt, **extra)
        return self.encode(prompt, add_special_tokens=False)

    def __repr__(self) -> str:
        return (f"Tokenizer({str(self.directory)!r}, vocab_size={self.vocab_size}, "
                f"eos_token_ids={self.eos_token_ids}, bos_token_id={self.bos_token_id})")

