"""Tiny Hugging Face checkpoints with random weights, for tests and local runs.

`write_tiny_checkpoint` writes a complete model directory in the project's checkpoint format
(config.json, safetensors weights, optionally sharded with an index, tokenizer.json,
tokenizer_config.json with a ChatML template, generation_config.json) for the Llama, Qwen2
and Qwen3 families, with an optional DeepSeek-V3 style MTP layer under `mtp.*`. The tokenizer
is a byte-level BPE trained in-process on the source of a few standard-library modules, so
the output is deterministic for a given Python and seed. The building blocks
(`train_bpe_tokenizer`, `write_tokenizer_files`, `write_config_files`, `CHATML_TEMPLATE`) are
exported for whoever trains a real default model.

Loading these files back (the model loader, `pd.text.tokenizer`) is left to others.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import sysconfig
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


CORPUS_BYTES_PER_TOKEN = 3000  # source text read per token of a full vocabulary (400 MB at most)


def full_vocab_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE whose every one of `vocab_size` ids is a trained token, as a real
    checkpoint's (the tiny tokenizer padded to 128k ids is not: grammar matchers, for one, walk
    the 127k padding ids as special tokens on every token, 20 us instead of 1). Trained on the
    Python source installed on this machine (standard library, then site-packages; about 320 MB
    and 40 s on 2 cores for 128,256 ids), so it is deterministic per machine, not across them."""
    roots = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]]
    texts, size, limit = [], 0, min(400 << 20, vocab_size * CORPUS_BYTES_PER_TOKEN)
    for root in roots:
        for file in sorted(Path(root).rglob("*.py")):
            if size >= limit:
                break
            try:
                texts.append(file.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError):
                continue
            size += len(texts[-1])
    tok = train_bpe_tokenizer(texts, vocab_size)
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"{size >> 20} MB of source trained {tok.get_vocab_size()} of "
                           f"{vocab_size} tokens")
    return tok


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
    write_json(path / "tokenizer_config.json", config)
    write_json(path / "special_tokens_map.json",
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
    write_json(path / "config.json", config)
    gen = {"eos_token_id": eos_token_ids}
    if bos_token_id is not None:
        gen["bos_token_id"] = bos_token_id
    if pad_token_id is not None:
        gen["pad_token_id"] = pad_token_id
    write_json(path / "generation_config.json", gen)


def write_json(file: Path, obj: dict) -> None:
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
    write_json(path / "model.safetensors.index.json",
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
    full_vocab: bool = False,
) -> Path:
    """Write a complete tiny model directory at `path` and return it as a Path.

    `vocab_size` None means the tokenizer's (512); a larger value pads the embedding and LM
    head rows as real checkpoints do, or, with `full_vocab`, comes with a tokenizer trained to
    that many tokens (`full_vocab_tokenizer`). `sharded` True writes 2 shards, an int writes
    that many.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    head_dim = head_dim if head_dim is not None else hidden_size // num_heads
    tok = full_vocab_tokenizer(vocab_size) if full_vocab and vocab_size else tiny_tokenizer()
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


_INT_OPTIONS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "vocab_size", "max_position_embeddings", "seed")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pd.testing.tiny", description=__doc__.split("\n")[0])
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
