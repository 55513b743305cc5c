"""Configuration: the model's geometry (read from a Hugging Face `config.json`) and the engine's
knobs (cache, batching, device).

Frozen dataclasses; derived values are properties; `__post_init__` validates and names the wrong
value. Loading weights and tokenizers is left to `loader.py` and `tokenizer.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

DEFAULT_MODEL_NAME = "pd-tiny-code"


def default_model_dir() -> Path:
    """The embedded default model shipped inside the package."""
    path = Path(__file__).parent / "models" / DEFAULT_MODEL_NAME
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"no --model given and the embedded default model is missing at {path}; "
            "pass --model DIR (a Hugging Face model directory)"
        )
    return path


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(set(_DTYPES))}") from None


def dtype_name(dtype: torch.dtype) -> str:
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
    num_mtp_layers: int = 0
    torch_dtype: str = "float32"
    model_id: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config value {name}={getattr(self, name)} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.num_mtp_layers not in (0, 1):
            raise ValueError(f"num_nextn_predict_layers={self.num_mtp_layers}: only 0 or 1 supported")

    @property
    def has_mtp(self) -> bool:
        return self.num_mtp_layers > 0

    @property
    def num_cache_layers(self) -> int:
        """Layers holding KV: the target's, plus the MTP layer's at the end."""
        return self.num_layers + self.num_mtp_layers

    @classmethod
    def from_dict(cls, cfg: dict, model_id: str = "") -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        arch = archs[0]
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // num_heads
        attention_bias = bool(cfg.get("attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama and Qwen3 follow `attention_bias`
            # (Llama's also covers o_proj).
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and arch == "LlamaForCausalLM",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
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
        with open(cfg_path) as f:
            return cls.from_dict(json.load(f), model_id=path.name)


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
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device={self.device!r} must be 'cpu' or 'cuda[:N]'")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return parse_dtype(self.dtype)
        return torch.float32 if self.device == "cpu" else torch.bfloat16
