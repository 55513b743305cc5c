"""Small building blocks of a Llama-family decoder: the linear layer, RMSNorm, rotary embedding
(plain, linear, dynamic NTK, YaRN and Llama-3 scaling), the gated MLP.

Numerics follow the Hugging Face reference (norm statistics in float32, RoPE tables from a
float32 `inv_freq`) so that greedy outputs match it token for token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pd_kernels.activation import silu_and_mul
from pd_kernels.norm_linear import norm_linear
from pd_kernels.rms_norm import rms_norm
from pd_kernels.skinny_linear import skinny_linear
from pd.model import parallel
from pd.model.context import get_context


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose product goes through
    `pd_kernels.skinny_linear`: its kernel for a decode step's few rows where it measured faster
    than cuBLAS, `F.linear` everywhere else."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, self.weight, self.bias)


class RowLinear(Linear):
    """A row-parallel Linear (`pd.model.parallel`): its weight holds this rank's input columns,
    so each rank's product is a partial sum; the sum over ranks, then the bias (whole on every
    rank, added once)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if parallel.group().size == 1:
            return super().forward(x)
        out = parallel.all_reduce(skinny_linear(x, self.weight))
        return out if self.bias is None else out.add_(self.bias)


class RMSNorm(nn.Module):
    """`forward(x)` -> normed x; `forward(x, residual)` -> (normed x + residual, x + residual),
    the residual add fused into the norm (`pd_kernels.rms_norm`, a Triton kernel on CUDA);
    `into(linear weight, bias, x, residual, rows)`: the norm and the product after it,
    (product, residual stream), one kernel where `pd_kernels.norm_linear.norm_linear` fuses
    them."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.dim() != 2:  # per-head norms (Qwen3's q/k norms): [T, H, D] rows of D
            return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        return rms_norm(x, self.weight, self.eps, residual)

    def into(self, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor,
             residual: torch.Tensor | None = None, rows: torch.Tensor | None = None,
             out: torch.Tensor | None = None, gated: bool = False):
        """(linear(norm(h)), h) with h = x (+ residual), of x's rows or of `rows` (x a table);
        `gated`: silu_and_mul of the product in its place (a gated MLP's gate/up weight)."""
        return norm_linear(x, self.weight, self.eps, weight, bias, residual, rows, out=out,
                           gated=gated)


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


def _yarn_inv_freq(theta: float, head_dim: int, scaling: dict, max_position_embeddings: int):
    """YaRN frequencies and the cos/sin scale, as transformers computes them."""
    factor = scaling.get("factor")
    original = scaling["original_max_position_embeddings"]
    if factor is None:
        factor = max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """Non-interleaved (rotate-half) RoPE applied to q and k at given positions.

    RoPE types (`rope_scaling["rope_type"]`, see `pd.config`): default, linear, llama3 and yarn
    fix the frequencies at start; dynamic (NTK) recomputes them per token from its sequence's
    length in this forward (`context_lens`), which is what transformers does for one sequence
    (it takes the longest sequence of the batch). A plain object, not a module: its float32
    `inv_freq` must not follow the model's dtype. The cos/sin tables (`tables`) are computed
    once per forward (every layer sees the same positions tensor); applying them, fused with the
    KV-cache write, is `pd_kernels.rope_cache`'s (in a plain decode step on CUDA, the attention
    kernel's: `pd.model.attention.rope_cache_attention`).
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None,
                 max_position_embeddings: int = 2048) -> None:
        # NOTE: device="cpu" explicitly, so building the model under a meta-device context
        # still yields real frequencies.
        with torch.device("cpu"):
            self.exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            inv_freq = 1.0 / (theta**self.exponent)
            kind = (scaling or {}).get("rope_type", "default")
            self.attention_factor = 1.0
            self.dynamic: tuple[float, int] | None = None
            if kind == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, scaling)
            elif kind == "linear":
                inv_freq = inv_freq / scaling["factor"]
            elif kind == "yarn":
                inv_freq, self.attention_factor = _yarn_inv_freq(
                    theta, head_dim, scaling, max_position_embeddings)
            elif kind == "dynamic":
                self.dynamic = (float(scaling["factor"]), max_position_embeddings)
            elif kind != "default":
                raise ValueError(f"unsupported RoPE type {kind!r}")
        self.theta, self.head_dim = theta, head_dim
        self.inv_freq = inv_freq
        self._cached: tuple | None = None
        self.position_cache: torch.Tensor | None = None  # [P, 2D] (`cache_positions`)

    def _dynamic_inv_freq(self) -> torch.Tensor:
        """[T, D/2]: each token's frequencies from its sequence's length in this forward."""
        ctx = get_context()
        factor, max_len = self.dynamic
        seq_len = ctx.context_lens[ctx.padded_index // ctx.max_q_len].float()  # [T]
        dim = self.head_dim
        base = self.theta * ((factor * seq_len / max_len) - (factor - 1)) ** (dim / (dim - 2))
        scaled = 1.0 / (base[:, None] ** self.exponent[None, :])
        return torch.where((seq_len > max_len)[:, None], scaled, self.inv_freq[None, :])

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype):
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
            self.exponent = self.exponent.to(positions.device)
        inv_freq = self._dynamic_inv_freq() if self.dynamic else self.inv_freq[None, :]
        freqs = positions.float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def cache_positions(self, num_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        """Compute the tables of positions 0 .. num_positions - 1 once ([P, 2D], cos then sin,
        by the same operations as per forward, so the values are the same): each forward then
        gathers its rows in one kernel instead of computing them in seven. Dynamic RoPE, whose
        frequencies depend on the batch, keeps computing per forward. Every position a forward
        passes must be below num_positions."""
        if self.dynamic:
            return
        cos, sin = self._compute(torch.arange(num_positions, device=device), dtype)
        self.position_cache = torch.cat((cos, sin), dim=-1)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """(cos, sin, index) in `dtype` for this forward's positions (once per forward): on
        CUDA with a position cache (`cache_positions`), the cache's cos and sin halves [P, D]
        and the positions as the rows to read (the rotary kernels gather them); on CPU the
        cache's rows gathered (strided views of one gather), else computed, [T, D], index
        None."""
        cached = self._cached
        if cached is not None and cached[0] is positions and cached[1] == dtype:
            return cached[2]
        table = self.position_cache
        index = None
        if table is not None and table.dtype == dtype and table.device == positions.device:
            if table.is_cuda and positions.dtype == torch.int64:
                rows, index = table, positions
            else:
                rows = table.index_select(0, positions)
            cos, sin = rows[:, :self.head_dim], rows[:, self.head_dim:]
        else:
            cos, sin = self._compute(positions, dtype)
        self._cached = (positions, dtype, (cos, sin, index))
        return cos, sin, index

    def reset(self) -> None:
        """Forget the tables; called at the start of every forward, since a positions tensor
        may be a static buffer refilled between forwards."""
        self._cached = None


ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class MLP(nn.Module):
    """The gated MLP with one fused gate/up projection (`gate_up_proj`: the checkpoint's
    gate_proj and up_proj stacked by rows at load) and SiLU-and-multiply in one kernel, or in
    the product's own epilogue where the decoder layer asks for it (`gated_silu`). Under
    tensor parallelism each rank holds 1/N of the intermediate columns (`pd.model.parallel`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 act: str = "silu") -> None:
        super().__init__()
        self.act_name, self.act = act, ACTIVATIONS[act]
        self.intermediate_size = intermediate_size = parallel.group().split(
            intermediate_size, "intermediate_size")
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = RowLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    @property
    def gated_silu(self) -> bool:
        """Whether the activation is SiLU-and-multiply: then the gate/up product may hand the
        down projection silu(gate) * up itself (`RMSNorm.into(gated=True)`, `down_proj`)."""
        return self.act is F.silu

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP's output from its gate/up projection: the activation, the down projection."""
        if self.gated_silu:
            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)
