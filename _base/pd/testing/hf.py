"""Model directories written the way real ones are made: transformers builds the model from its
config class (`AutoModelForCausalLM.from_config`) and writes it (`save_pretrained`), so
config.json carries what real directories carry (transformers 5 writes `rope_parameters`).

`write_hf_checkpoint` writes one; `transformers_greedy` is the reference the parity checks hold
pd's greedy tokens and logprobs against; `PARITY_MATRIX` names the cases the parity tests
(`tests/model/test_checkpoints.py`) and `benchmarks/gpu/check_checkpoints.py` run. Needs
transformers (a test dependency); the tokenizer files come from `pd.testing.tiny`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from pd.testing.tiny import (ARCHS, DTYPES, ENDOFTEXT, IM_END, write_json, tiny_tokenizer,
                             write_tokenizer_files)

MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def transformers_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """transformers' own `generate`: `steps` greedy tokens after `prompt` and their logprobs.
    `model` is a loaded model, or a directory to load in float32 (a fresh model, since dynamic
    RoPE keeps state from one call to the next)."""
    import transformers

    if isinstance(model, (str, Path)):
        model = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None,
            pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def write_hf_checkpoint(
    path: str | Path,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int | None = None,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    rope: dict | None = None,
    rope_key: str = "rope_parameters",
    tie_word_embeddings: bool = False,
    attention_bias: bool = False,
    mlp_bias: bool = False,
    sliding_window: int | None = None,
    max_window_layers: int = 0,
    hidden_act: str = "silu",
    dtype: str = "float32",
    max_shard_size: str | None = None,
    generation: dict | None = None,
    tokenizer: Tokenizer | None = None,
    std: float = 0.5,
    seed: int = 0,
) -> Path:
    """Write a model directory the way real ones are made: transformers builds the model from
    its config class (`AutoModelForCausalLM.from_config`) and writes it (`save_pretrained`).

    Weights are N(0, std) (norm weights 1 + N(0, 0.1)), large enough that greedy decoding has
    clear top-2 margins. `rope` is the RoPE type's parameters with `rope_type`, e.g.
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}; transformers 5
    writes it as `rope_parameters`. `rope_key` "rope_scaling" or "rope_scaling:type" rewrites
    config.json afterwards as transformers 4 wrote it (`rope_theta` beside `rope_scaling`, the
    type under `rope_type` or `type`), the form most published checkpoints still carry.
    `sliding_window` turns on Qwen's sliding-window layers from `max_window_layers` on.
    `generation` adds sampling defaults to generation_config.json. Needs transformers.
    """
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    tok = tokenizer or tiny_tokenizer()
    tok_vocab = tok.get_vocab_size(with_added_tokens=True)
    eot = tok.token_to_id(ENDOFTEXT)
    im_end = tok.token_to_id(IM_END)
    rope_parameters = {"rope_type": "default", **(rope or {}), "rope_theta": rope_theta}
    kwargs = dict(
        vocab_size=vocab_size or tok_vocab, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads, hidden_act=hidden_act,
        max_position_embeddings=max_position_embeddings, rope_parameters=rope_parameters,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=eot, eos_token_id=eot,
        pad_token_id=eot,
    )
    if arch == "llama":
        kwargs.update(attention_bias=attention_bias, mlp_bias=mlp_bias)
    if arch == "qwen3":
        kwargs.update(attention_bias=attention_bias)
    if arch in ("qwen2", "qwen3") and sliding_window is not None:
        kwargs.update(use_sliding_window=True, sliding_window=sliding_window,
                      max_window_layers=max_window_layers)
    config = transformers.AutoConfig.for_model(MODEL_TYPES[arch], **kwargs)
    config.architectures = [ARCHS[arch]]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, std)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=eot, eos_token_id=[eot, im_end], pad_token_id=eot, **(generation or {}))
    path = Path(path)
    model.to(DTYPES[dtype]).save_pretrained(path, **(
        {"max_shard_size": max_shard_size} if max_shard_size else {}))
    if rope_key != "rope_parameters":
        cfg = json.loads((path / "config.json").read_text())
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params.pop("rope_theta")
        kind = params.pop("rope_type")
        type_key = "type" if rope_key == "rope_scaling:type" else "rope_type"
        cfg["rope_scaling"] = None if kind == "default" else {type_key: kind, **params}
        write_json(path / "config.json", cfg)
    write_tokenizer_files(path, tok, model_max_length=max_position_embeddings)
    return path


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16}
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}

# The parity matrix (`tests/model/test_checkpoints.py`, `benchmarks/gpu/check_checkpoints.py`):
# name -> write_hf_checkpoint arguments. Each RoPE type in both key styles, tied and untied
# heads, 1 to 8 KV heads, biases, sliding windows, a padded vocabulary, shards, bf16 on disk.
# Contexts are short (16-64 positions) so that scaled RoPE and windows act within the ~42
# tokens a parity run reaches.
PARITY_MATRIX = {
    "llama": dict(arch="llama"),
    "llama-llama3-tied-mqa": dict(arch="llama", rope=_LLAMA3, tie_word_embeddings=True,
                                  num_kv_heads=1),
    "llama-llama3-legacy-bias": dict(arch="llama", rope=_LLAMA3, rope_key="rope_scaling",
                                     attention_bias=True, mlp_bias=True),
    "llama-linear-legacy-type": dict(arch="llama", rope={"rope_type": "linear", "factor": 4.0},
                                     rope_key="rope_scaling:type", rope_theta=500000.0),
    "qwen2-linear-tied": dict(arch="qwen2", rope={"rope_type": "linear", "factor": 2.0},
                              tie_word_embeddings=True, max_position_embeddings=32),
    "llama-dynamic": dict(arch="llama", rope={"rope_type": "dynamic", "factor": 4.0},
                          max_position_embeddings=16),
    "qwen2-yarn-legacy-sliding": dict(arch="qwen2", rope=_YARN, rope_key="rope_scaling:type",
                                      sliding_window=6, max_window_layers=1,
                                      max_position_embeddings=64, num_heads=8, num_kv_heads=8),
    "qwen2-padded-vocab-tied-sharded": dict(arch="qwen2", vocab_size=640,
                                            tie_word_embeddings=True, max_shard_size="100KB"),
    "qwen3-bias-bf16-gelu": dict(arch="qwen3", attention_bias=True, dtype="bfloat16",
                                 hidden_act="gelu_pytorch_tanh", num_kv_heads=4),
    "qwen3-yarn-sliding-all": dict(arch="qwen3", rope=_YARN, sliding_window=8,
                                   max_position_embeddings=64),
    "qwen3-dynamic-legacy": dict(arch="qwen3", rope={"rope_type": "dynamic", "factor": 2.0},
                                 rope_key="rope_scaling", max_position_embeddings=24,
                                 num_heads=8, num_kv_heads=1),
}

