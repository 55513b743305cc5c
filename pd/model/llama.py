"""The Llama-family decoder (Llama, Qwen2 with q/k/v biases and sliding-window layers, Qwen3
with q/k norms) and its MTP layer, with parameter names equal to the Hugging Face checkpoint
names.

Layers take `forward(positions, hidden)`; batch metadata comes from the forward context
(`pd.model.context`). `forward` returns the last layer's output before the final norm (what the MTP
layer consumes); `compute_logits` applies the final norm and the LM head (`head_logits`: the same
in the model's dtype).

MTP (DeepSeek-V3 style) weight names, present when config.json has
`"num_nextn_predict_layers": 1`:
  mtp.enorm.weight [H], mtp.hnorm.weight [H], mtp.eh_proj.weight [H, 2H],
  mtp.layer.* (one decoder layer, the same names as model.layers.N.*).
The final norm and LM head are shared. For target tokens t_0..t_n with pre-norm hidden states
h_i, the MTP entry at position i is eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)]) run through
mtp.layer at RoPE position i (its KV in cache layer `num_layers`, same slots as the target's);
its output o_i gives logits for t_{i+2}.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from pd_kernels.rms_norm import rms_norm
from pd_kernels.skinny_linear import skinny_linear
from pd.config import ModelConfig
from pd.model.attention import rope_cache_attention
from pd.model import parallel
from pd.model.layers import MLP, Linear, RMSNorm, RotaryEmbedding, RowLinear


class Attention(nn.Module):
    """Self-attention with one fused QKV projection (`qkv_proj`: the checkpoint's q/k/v_proj
    stacked by rows at load), rotary and the KV-cache write in one kernel, paged attention (in
    a plain decode step on CUDA, all three in one kernel: `rope_cache_attention`). Under tensor
    parallelism a rank holds 1/N of the query and KV heads (`pd.model.parallel`)."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        tp = parallel.group()
        self.num_heads = tp.split(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.split(cfg.num_kv_heads, "num_key_value_heads")
        self.head_dim = cfg.head_dim
        h = cfg.hidden_size
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = RowLinear(self.q_size, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rotary = rotary
        self.scale = cfg.head_dim**-0.5
        # Views into the node's one KV allocation, set by KVCache.bind().
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(x))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """The attention's output projected (`o_proj`) from the step's fused projection."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # [T, heads * D] -> [T, heads, D], views of qkv
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin, index = self.rotary.tables(positions, q.dtype)
        out = rope_cache_attention(q, k, v, cos, sin, self.k_cache, self.v_cache, self.scale,
                                   self.sliding_window, index)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer over a residual stream carried beside the hidden states, so each
    residual add is fused into the next norm, and each norm into the product after it where
    that is one kernel (`RMSNorm.into`): `forward(positions, x, residual)` returns (layer
    output, residual), whose sum is the stream after the layer; with `rows`, x is the embedding
    table and the layer's input those rows of it."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary, sliding_window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None = None,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = self.input_layernorm.into(attn.qkv_proj.weight, attn.qkv_proj.bias, x,
                                                  residual, rows)
        h = attn.attend(positions, qkv)
        gated = mlp.gated_silu  # silu(gate) * up from the product (in its kernel's epilogue)
        out, residual = self.post_attention_layernorm.into(
            mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, h, residual, gated=gated)
        return (mlp.down_proj(out) if gated else mlp.down(out)), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        # NOTE: under tensor parallelism, this rank's vocabulary rows (`parallel.vocab_shard`).
        # Made from a tensor, so it skips its random initialization (the checkpoint fills it),
        # whose meta-device path imports torch._dynamo: 1.5 s of every node's start on 2 cores
        rows = parallel.vocab_shard(cfg.vocab_size)[1]
        self.embed_tokens = nn.Embedding.from_pretrained(torch.empty(rows, cfg.hidden_size),
                                                         freeze=False)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, rotary, cfg.sliding_window if i in cfg.sliding_layers else None)
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The last layer's output before the final norm [T, H]."""
        x, residual = self.streams(input_ids, positions)
        return x + residual

    def streams(self, input_ids: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's (output, residual), whose sum `forward` returns. On one rank the
        embedding lookup is the first layer's (rows of the table)."""
        x, rows = self.embed_tokens.weight, input_ids.long()
        if parallel.group().size > 1:
            x, rows = parallel.embed(x, input_ids), None
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, rows)
            rows = None
        return x, residual


class MTPLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = DecoderLayer(cfg, rotary)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        x, residual = self.layer(positions, x)
        return x + residual


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                      cfg.max_position_embeddings)
        self.model = DecoderModel(cfg, self.rotary)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, parallel.vocab_shard(cfg.vocab_size)[1],
                                     bias=False)
        self.mtp = MTPLayer(cfg, self.rotary) if cfg.has_mtp else None
        # NOTE: under tensor parallelism, rank 0's model tells the other ranks each call
        # (`pd.engine.tp.Mirror`) so that they run the same one with it; None otherwise
        self.mirror = None

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def attention_layers(self) -> list[Attention]:
        """Every attention module in cache-layer order: the target's layers, then the MTP layer."""
        layers = [layer.self_attn for layer in self.model.layers]
        if self.mtp is not None:
            layers.append(self.mtp.layer.self_attn)
        return layers

    def _mirrored(self, op: str, *tensors: torch.Tensor):
        """Under tensor parallelism on rank 0: the other ranks are told this call first, and no
        other call is sent until its body is done; nothing otherwise."""
        return nullcontext() if self.mirror is None else self.mirror.mirrored(op, *tensors)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with self._mirrored("forward", input_ids, positions):
            self.rotary.reset()
            return self.model(input_ids, positions)

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` and `head_logits` of every row: (hidden [T, H], logits [T, V] in the
        model's dtype, into `out` when given); on one rank the last residual add and the final
        norm are the LM head's (`RMSNorm.into`)."""
        if parallel.group().size > 1:
            hidden = self.forward(input_ids, positions)
            return hidden, self.head_logits(hidden, out=out)
        self.rotary.reset()
        x, residual = self.model.streams(input_ids, positions)
        logits, hidden = self.model.norm.into(self.head_weight, None, x, residual, out=out)
        return hidden, logits

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden states [N, H] -> float32 logits [N, V]."""
        return self.head_logits(hidden).float()

    def head_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Pre-norm hidden states [N, H] -> logits [N, V] in the model's dtype (what
        `compute_logits` widens), written into `out` when given (a CUDA graph's static buffer).
        Enough for an argmax: widening to float32 keeps every value and its order."""
        if parallel.group().size == 1:
            return skinny_linear(self.model.norm(hidden), self.head_weight, out=out)
        with self._mirrored("head_logits", hidden):
            logits = parallel.gather_vocab(skinny_linear(self.model.norm(hidden), self.head_weight),
                                           self.config.vocab_size)
        return logits if out is None else out.copy_(logits)

    def mtp_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                   rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`mtp_forward` and the LM head at its output's `rows` (every row when None): (those
        rows' pre-norm output [R, H], what a chained pass reads; their logits [R, V] in the
        model's dtype, enough for an argmax). One rank: the embedding lookup is `enorm`'s
        gather, the two norms write the halves of `eh_proj`'s input, and the layer's last
        residual add, the final norm and the LM head are one kernel over `rows` only (where
        `RMSNorm.into` fuses them): the same values in fewer kernels.
        Under tensor parallelism, `mtp_forward` then `head_logits`."""
        if parallel.group().size > 1:
            out = self.mtp_forward(input_ids, positions, hidden)
            out = out if rows is None else out[rows]
            return out, self.head_logits(out)
        mtp, h = self.mtp, hidden.shape[1]
        self.rotary.reset()
        x = torch.empty(input_ids.shape[0], 2 * h, dtype=hidden.dtype, device=hidden.device)
        rms_norm(self.model.embed_tokens.weight, mtp.enorm.weight, mtp.enorm.eps, rows=input_ids,
                 out=x[:, :h])
        rms_norm(hidden, mtp.hnorm.weight, mtp.hnorm.eps, out=x[:, h:])
        x, residual = mtp.layer(positions, mtp.eh_proj(x))
        logits, out = self.model.norm.into(self.head_weight, None, x, residual, rows)
        return out, logits

    def mtp_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """One MTP entry per token: input_ids are the *next* tokens, hidden the states they follow."""
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP layer (num_nextn_predict_layers is 0)")
        with self._mirrored("mtp_forward", input_ids, positions, hidden):
            self.rotary.reset()
            return self.mtp(positions, parallel.embed(self.model.embed_tokens.weight, input_ids),
                            hidden)
