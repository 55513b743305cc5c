"""Configuration: the model's geometry (read from a Hugging Face `config.json`) and the engine's
knobs (cache, batching, device).

Frozen dataclasses; derived values are properties; `__post_init__` validates and names the wrong
value. `ModelConfig.from_dict` refuses (`ModelConfigError`) every config.json value pd does not
model, so a checkpoint is either computed right or not served. torch is imported only to turn a
dtype name into a torch dtype, so torch-free processes (the router) can read configs. Loading
weights and tokenizers is left to `loader.py` and `tokenizer.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL_NAME = "pd-tiny-code"


def default_model_dir() -> Path:
    """The embedded default model shipped inside the package."""
    path = Path(__file__).parent / "assets" / DEFAULT_MODEL_NAME
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"no --model given and the embedded default model is missing at {path}; "
            "pass --model DIR (a Hugging Face model directory)"
        )
    return path


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu")
# RoPE type -> the keys of its parameters (besides rope_type/type and rope_theta) pd models
ROPE_TYPES = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
}
# config.json keys whose presence with a value other than these means a feature pd lacks
_NEUTRAL = {"attn_logit_softcapping": (None,), "final_logit_softcapping": (None,),
            "partial_rotary_factor": (None, 1, 1.0), "mrope_section": (None,),
            "attention_chunk_size": (None,), "no_rope_layers": (None,)}


class ModelConfigError(ValueError):
    """A checkpoint pd would compute wrongly: the message is one line naming the field and value."""


def _refuse(field_name: str, value, why: str) -> ModelConfigError:
    return ModelConfigError(f"config.json {field_name}={value!r}: {why}")


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either key style: transformers 5's `rope_parameters`, or
    `rope_theta` + `rope_scaling` (with `type` or `rope_type`). Scaling is None for plain RoPE,
    else a dict with `rope_type` and that type's parameters, as transformers reads them."""
    merged: dict = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, dict) or any(isinstance(v, dict) for v in value.values()):
            raise _refuse(key, value, "only one RoPE parameter dict for every layer is supported")
        merged.update(value)
    theta = merged.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    kind = merged.pop("rope_type", None) or merged.get("type") or "default"
    merged.pop("type", None)
    partial = merged.pop("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise _refuse("rope_parameters.partial_rotary_factor", partial,
                      "partial rotary embeddings are not supported")
    if kind not in ROPE_TYPES:
        raise _refuse("rope_parameters.rope_type", kind,
                      f"RoPE type not supported (supported: {', '.join(ROPE_TYPES)})")
    unknown = sorted(set(merged) - set(ROPE_TYPES[kind]))
    if unknown:
        raise _refuse(f"rope_parameters.{unknown[0]}", merged[unknown[0]],
                      f"not a parameter pd models for RoPE type {kind!r}")
    if not isinstance(theta, (int, float)) or theta <= 1:
        raise _refuse("rope_theta", theta, "must be a number > 1")
    if kind == "default":
        return float(theta), None
    factor = merged.get("factor")
    if kind != "yarn" or factor is not None:
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
            raise _refuse("rope_parameters.factor", factor, f"RoPE type {kind!r} needs a number > 0")
    if kind in ("yarn", "llama3"):
        # as transformers: a top-level original_max_position_embeddings wins, then the dict's,
        # then max_position_embeddings
        original = (cfg.get("original_max_position_embeddings")
                    or merged.get("original_max_position_embeddings")
                    or cfg.get("max_position_embeddings", 2048))
        merged["original_max_position_embeddings"] = original
    return float(theta), {"rope_type": kind, **merged}


def _sliding_layers(cfg: dict, arch: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(window, indices of the layers that use it) as transformers' Qwen2/Qwen3 decide them."""
    use = bool(cfg.get("use_sliding_window", False))
    window = cfg.get("sliding_window") if use else None
    types = cfg.get("layer_types")
    if arch == "LlamaForCausalLM":
        if use or cfg.get("sliding_window") is not None:
            raise _refuse("sliding_window", cfg.get("sliding_window"),
                          "sliding-window attention is not part of LlamaForCausalLM")
        return None, ()
    if types is not None:
        if (not isinstance(types, list) or len(types) != num_layers
                or any(t not in ("full_attention", "sliding_attention") for t in types)):
            raise _refuse("layer_types", types, f"must list {num_layers} entries of "
                          "'full_attention' or 'sliding_attention'")
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif window is not None:
        start = cfg.get("max_window_layers", 28)
        sliding = tuple(range(start, num_layers))
    else:
        sliding = ()
    if window is None or not sliding:
        return None, ()
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise _refuse("sliding_window", window, "must be a positive integer")
    return window, sliding


def _quantization(cfg: dict) -> tuple[int, int] | None:
    """The FP8 weight block ([out, in]) of a block-quantized checkpoint; None when unquantized."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method != "fp8":
        raise ModelConfigError(f"config.json quantization_config.quant_method={method!r}: "
                               f"quantized ({method}) checkpoints are not supported")
    block = q.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse("quantization_config.weight_block_size", block,
                      "only block-quantized fp8 checkpoints ([rows, cols] blocks) are supported")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse("quantization_config.fmt", fmt, "only e4m3 fp8 weights are supported")
    return block[0], block[1]


_DTYPES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


def env_flag(environ, name: str, default: bool) -> bool:
    """A PD_ switch from the environment: 1/true/yes/on or 0/false/no/off (any case), `default`
    when unset or empty; ValueError for anything else."""
    value = environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={environ[name]!r}: expected 1/0, true/false, yes/no or on/off")


def parse_dtype(name: "str | torch.dtype") -> "torch.dtype":
    import torch

    if isinstance(name, torch.dtype):
        return name
    try:
        return getattr(torch, _DTYPES[name.lower()])
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(set(_DTYPES))}") from None


def dtype_name(dtype: "torch.dtype") -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ModelConfig:
    """The model's geometry, as far as the engine needs it."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None  # keys per query in the layers of `sliding_layers`
    sliding_layers: tuple[int, ...] = ()
    fp8_block: tuple[int, int] | None = None  # block-quantized fp8 weights, dequantized at load
    num_mtp_layers: int = 0
    torch_dtype: str = "float32"
    model_id: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise _refuse("architectures", self.architecture,
                          f"not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"config value {name}={getattr(self, name)} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise _refuse("hidden_act", self.hidden_act,
                          f"activation not supported (supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
        if self.num_mtp_layers not in (0, 1):
            raise _refuse("num_nextn_predict_layers", self.num_mtp_layers, "only 0 or 1 supported")

    @property
    def has_mtp(self) -> bool:
        return self.num_mtp_layers > 0

    @property
    def max_context_len(self) -> int:
        """The longest context the model computes right: max_position_embeddings, stretched by
        the RoPE factor for linear/dynamic scaling and yarn (as vLLM derives it)."""
        scaling = self.rope_scaling or {}
        kind, factor = scaling.get("rope_type"), scaling.get("factor")
        if kind in ("linear", "dynamic") and factor and factor > 1:
            return int(self.max_position_embeddings * factor)
        if kind == "yarn" and factor:
            return max(self.max_position_embeddings,
                       int(scaling["original_max_position_embeddings"] * factor))
        return self.max_position_embeddings

    @property
    def num_cache_layers(self) -> int:
        """Layers holding KV: the target's, plus the MTP layer's at the end."""
        return self.num_layers + self.num_mtp_layers

    @classmethod
    def from_dict(cls, cfg: dict, model_id: str = "") -> "ModelConfig":
        """Read a Hugging Face config.json. A value pd does not model (see `ModelConfigError`)
        is refused here, so no node ever serves a checkpoint it would compute wrongly."""
        archs = cfg.get("architectures") or []
        if not archs:
            raise ModelConfigError("config.json has no 'architectures' entry")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise _refuse("architectures", arch,
                          f"not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        for key, neutral in _NEUTRAL.items():
            if cfg.get(key) not in neutral:
                raise _refuse(key, cfg[key], "not supported")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        num_layers = cfg["num_hidden_layers"]
        head_dim = cfg.get("head_dim") or hidden // num_heads
        attention_bias = bool(cfg.get("attention_bias", False))
        theta, scaling = _rope(cfg)
        window, sliding = _sliding_layers(cfg, arch, num_layers)
        is_llama = arch == "LlamaForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and none on o_proj; Llama and Qwen3 follow
            # `attention_bias` for all four projections.
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=attention_bias and arch != "Qwen2ForCausalLM",
            mlp_bias=is_llama and bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            hidden_act=cfg.get("hidden_act") or "silu",
            sliding_window=window,
            sliding_layers=sliding,
            fp8_block=_quantization(cfg),
            num_mtp_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            model_id=model_id,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise ModelConfigError(f"{cfg_path} is not valid JSON: {e}") from None
        return cls.from_dict(cfg, model_id=path.name)


@dataclass(frozen=True)
class EngineConfig:
    """How a node (or the single-process engine) runs the model."""

    model: str
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    block_size: int = 16
    num_blocks: int | None = None  # None: from kv_cache_memory (CPU) or gpu_memory_fraction (CUDA)
    kv_cache_memory: int = 256 * 2**20  # bytes, used on CPU when num_blocks is None
    gpu_memory_fraction: float = 0.85
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    enforce_eager: bool = False  # CUDA: no decode CUDA graphs
    enable_prefix_caching: bool = True  # full KV blocks kept and shared by content (pd.engine.prefix)
    tensor_parallel_size: int = 1  # ranks (processes, one GPU each on CUDA): pd.engine.tp
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a positive power of two")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks={self.num_blocks} must be at least 2")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory} must be positive")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction={self.gpu_memory_fraction} must be in (0, 1]")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be positive")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be positive")
        if self.dtype is not None:
            parse_dtype(self.dtype)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be at least 1")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device={self.device!r} must be 'cpu' or 'cuda[:N]'")

    @property
    def torch_dtype(self) -> "torch.dtype":
        return parse_dtype(self.dtype or ("float32" if self.device == "cpu" else "bfloat16"))
