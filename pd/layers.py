"""Small building blocks of a Llama-family decoder: RMSNorm, rotary embedding (with Llama-3
scaling), the gated MLP.

Numerics follow the Hugging Face reference (norm statistics in float32, RoPE tables from a
float32 `inv_freq`) so that greedy outputs match it token for token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Non-interleaved (rotate-half) RoPE applied to q and k at given positions.

    A plain object, not a module: its float32 `inv_freq` must not follow the model's dtype. The
    cos/sin tables are computed once per forward (every layer sees the same positions tensor).
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None) -> None:
        # NOTE: device="cpu" explicitly, so building the model under a meta-device context
        # still yields real frequencies.
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        inv_freq = 1.0 / (theta**exponent)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, scaling)
            elif kind not in (None, "default"):
                raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3)")
        self.inv_freq = inv_freq
        self._cached: tuple | None = None

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype):
        cached = self._cached
        if cached is not None and cached[0] is positions and cached[1] == dtype:
            return cached[2], cached[3]
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
        self._cached = (positions, dtype, cos, sin)
        return cos, sin

    def reset(self) -> None:
        """Forget the tables; called at the start of every forward, since a positions tensor
        may be a static buffer refilled between forwards."""
        self._cached = None

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q: [T, Hq, D], k: [T, Hkv, D], positions: [T]
        cos, sin = self._tables(positions, q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
