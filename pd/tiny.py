"""Tiny Hugging Face checkpoints with random weights, for tests and local runs.

`write_hf_checkpoint` has transformers build and save the model (`from_config(...)
.save_pretrained`), so its config.json is what real directories carry; the parity tests use it.
`write_tiny_checkpoint` writes a complete model directory in the project's checkpoint format
(config.json, safetensors weights, optionally sharded with an index, tokenizer.json,
tokenizer_config.json with a ChatML template, generation_config.json) for the Llama, Qwen2
and Qwen3 families, with an optional DeepSeek-V3 style MTP layer under `mtp.*`. The tokenizer
is a byte-level BPE trained in-process on the source of a few standard-library modules, so
the output is deterministic for a given Python and seed. The building blocks
(`train_bpe_tokenizer`, `write_tokenizer_files`, `write_config_files`, `CHATML_TEMPLATE`) are
exported for whoever trains a real default model.

Loading these files back (the model loader, `pd.tokenizer`) is left to others.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TINY_VOCAB_SIZE = 512
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CORPUS_MODULES = ("string", "fnmatch")

CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if message['content'] is not string %}\n"
    "{{- raise_exception('message content must be a string') }}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE over `texts` whose first ids are SPECIAL_TOKENS (in that order)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


@functools.lru_cache(maxsize=4)
def _tiny_tokenizer_json(vocab_size: int) -> str:
    texts = []
    for name in _CORPUS_MODULES:
        origin = importlib.util.find_spec(name).origin
        texts.append(Path(origin).read_text(encoding="utf-8"))
    return train_bpe_tokenizer(texts, vocab_size).to_str()


def tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE) -> Tokenizer:
    """The tiny tokenizer, trained once per process and returned as a fresh copy."""
    return Tokenizer.from_str(_tiny_tokenizer_json(vocab_size))


def write_tokenizer_files(
    path: str | Path,
    tokenizer: Tokenizer,
    *,
    model_max_length: int,
    bos_token: str | None = None,
    eos_token: str = ENDOFTEXT,
    pad_token: str | None = ENDOFTEXT,
    chat_template: str | None = CHATML_TEMPLATE,
) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    specials = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token}
    for name, tok in specials.items():
        if tok is not None and tokenizer.token_to_id(tok) is None:
            raise ValueError(f"{name} {tok!r} is not in the tokenizer's vocabulary")
    added = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                      "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
             for i, t in sorted(tokenizer.get_added_tokens_decoder().items())}
    first_id = tokenizer.encode("a", add_special_tokens=True).ids[:1]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added,
        **specials, "unk_token": None,
        "add_bos_token": bos_token is not None and first_id == [tokenizer.token_to_id(bos_token)],
        "clean_up_tokenization_spaces": False, "model_max_length": model_max_length,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    _write_json(path / "tokenizer_config.json", config)
    _write_json(path / "special_tokens_map.json",
                {k: v for k, v in specials.items() if v is not None})


def write_config_files(
    path: str | Path,
    config: dict,
    eos_token_ids: int | list[int],
    *,
    bos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> None:
    """Write config.json (as given) and generation_config.json (eos, bos, pad ids) into `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_json(path / "config.json", config)
    gen = {"eos_token_id": eos_token_ids}
    if bos_token_id is not None:
        gen["bos_token_id"] = bos_token_id
    if pad_token_id is not None:
        gen["pad_token_id"] = pad_token_id
    _write_json(path / "generation_config.json", gen)


def _write_json(file: Path, obj: dict) -> None:
    file.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _layer_shapes(prefix: str, arch: str, h: int, inter: int, nh: int, nkv: int, hd: int):
    shapes = {
        f"{prefix}.self_attn.q_proj.weight": (nh * hd, h),
        f"{prefix}.self_attn.k_proj.weight": (nkv * hd, h),
        f"{prefix}.self_attn.v_proj.weight": (nkv * hd, h),
        f"{prefix}.self_attn.o_proj.weight": (h, nh * hd),
    }
    if arch == "qwen2":
        shapes[f"{prefix}.self_attn.q_proj.bias"] = (nh * hd,)
        shapes[f"{prefix}.self_attn.k_proj.bias"] = (nkv * hd,)
        shapes[f"{prefix}.self_attn.v_proj.bias"] = (nkv * hd,)
    if arch == "qwen3":
        shapes[f"{prefix}.self_attn.q_norm.weight"] = (hd,)
        shapes[f"{prefix}.self_attn.k_norm.weight"] = (hd,)
    shapes[f"{prefix}.input_layernorm.weight"] = (h,)
    shapes[f"{prefix}.post_attention_layernorm.weight"] = (h,)
    shapes[f"{prefix}.mlp.gate_proj.weight"] = (inter, h)
    shapes[f"{prefix}.mlp.up_proj.weight"] = (inter, h)
    shapes[f"{prefix}.mlp.down_proj.weight"] = (h, inter)
    return shapes


def _random_tensor(name: str, shape: tuple, gen: torch.Generator, tied: bool) -> torch.Tensor:
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * noise
    if name.endswith(".bias"):
        return 0.05 * noise
    if name == "model.embed_tokens.weight":
        # NOTE: a tied head scores h against the embeddings; with large embeddings the input
        # token's own row dominates the residual stream and greedy decoding repeats it forever.
        return 0.1 * noise if tied else noise
    return noise / math.sqrt(shape[1])


def _save_weights(path: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    meta = {"format": "pt"}
    if num_shards <= 1:
        save_file(tensors, str(path / "model.safetensors"), metadata=meta)
        return
    names = list(tensors)
    if num_shards > len(names):
        raise ValueError(f"{num_shards} shards for only {len(names)} tensors")
    # contiguous runs of names, as even in count as they can be
    groups = [names[k * len(names) // num_shards:(k + 1) * len(names) // num_shards]
              for k in range(num_shards)]
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    weight_map = {}
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(path / file), metadata=meta)
        weight_map.update({n: file for n in group})
    _write_json(path / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": weight_map})


def write_tiny_checkpoint(
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
    rope_scaling: dict | None = None,
    tie_word_embeddings: bool = False,
    mtp: bool = True,
    dtype: str = "float32",
    sharded: bool | int = False,
    seed: int = 0,
) -> Path:
    """Write a complete tiny model directory at `path` and return it as a Path.

    `vocab_size` None means the tokenizer's (512); a larger value pads the embedding and LM
    head rows as real checkpoints do. `sharded` True writes 2 shards, an int writes that many.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    head_dim = head_dim if head_dim is not None else hidden_size // num_heads
    tok = tiny_tokenizer()
    tok_vocab = tok.get_vocab_size(with_added_tokens=True)
    vocab_size = tok_vocab if vocab_size is None else vocab_size
    if vocab_size < tok_vocab:
        raise ValueError(f"vocab_size={vocab_size} is below the tokenizer's {tok_vocab}")
    num_shards = 0 if sharded is False else (2 if sharded is True else int(sharded))
    if sharded is not False and num_shards < 2:
        raise ValueError(f"sharded must be True or an int >= 2, got {sharded!r}")
    eot, im_end = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)

    h = hidden_size
    shapes = {"model.embed_tokens.weight": (vocab_size, h)}
    dims = (arch, h, intermediate_size, num_heads, num_kv_heads, head_dim)
    for i in range(num_layers):
        shapes.update(_layer_shapes(f"model.layers.{i}", *dims))
    shapes["model.norm.weight"] = (h,)
    if not tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab_size, h)
    if mtp:
        shapes["mtp.enorm.weight"] = (h,)
        shapes["mtp.hnorm.weight"] = (h,)
        shapes["mtp.eh_proj.weight"] = (h, 2 * h)
        shapes.update(_layer_shapes("mtp.layer", *dims))
    gen = torch.Generator().manual_seed(seed)
    tensors = {n: _random_tensor(n, s, gen, tie_word_embeddings).to(DTYPES[dtype]).contiguous()
               for n, s in shapes.items()}

    config = {
        "architectures": [ARCHS[arch]], "model_type": arch, "vocab_size": vocab_size,
        "hidden_size": h, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": rope_theta, "rope_scaling": rope_scaling,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings, "torch_dtype": dtype,
        "bos_token_id": eot, "eos_token_id": eot, "attention_dropout": 0.0,
    }
    if arch != "qwen2":
        config["attention_bias"] = False
    if arch == "llama":
        config["mlp_bias"] = False
    if mtp:
        config["num_nextn_predict_layers"] = 1

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _save_weights(path, tensors, num_shards)
    write_config_files(path, config, [eot, im_end], bos_token_id=eot, pad_token_id=eot)
    write_tokenizer_files(path, tok, model_max_length=max_position_embeddings)
    return path


MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


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
        _write_json(path / "config.json", cfg)
    write_tokenizer_files(path, tok, model_max_length=max_position_embeddings)
    return path


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16}
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}

# The parity matrix (`tests/pd/test_checkpoints.py`, `benchmarks/gpu/check_checkpoints.py`):
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

_INT_OPTIONS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "vocab_size", "max_position_embeddings", "seed")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pd.tiny", description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    for name in _INT_OPTIONS:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument("--no-mtp", action="store_true")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--shards", type=int, default=0, help="number of shards (0: one file)")
    a = p.parse_args(argv)
    ints = {name: getattr(a, name) for name in _INT_OPTIONS if getattr(a, name) is not None}
    out = write_tiny_checkpoint(
        a.out_dir, a.arch, rope_theta=a.rope_theta, tie_word_embeddings=a.tie_word_embeddings,
        mtp=not a.no_mtp, dtype=a.dtype, sharded=a.shards or False, **ints)
    print(out)


if __name__ == "__main__":
    main()
