"""The compact training model behind `tools/train_tiny.py`: a Llama decoder with tied embeddings
and a DeepSeek-V3 style MTP layer, whose parameter names and semantics are those of the
project's checkpoint format (`model.*`, `mtp.*`), so `state_dict()` is the checkpoint.

Plain causal attention through `F.scaled_dot_product_attention`, no KV cache: this model is for
training and for the full-recompute evaluation in `tools/tiny_eval.py`; serving is the engine's.

MTP levels. Level 1 at origin i (the target position) is the checkpoint's MTP entry: it reads the
target hidden state h_i and the token t_{i+1}, sits at RoPE position i and predicts t_{i+2}.
Level m > 1 is the chained use at inference: it reads the previous level's output o_i and the
token t_{i+m} (ground truth in training, the previous draft at inference), sits at position
i+m-1 and predicts t_{i+m+1}. Its attention sees what the MTP cache holds at inference: level-1
entries of origins <= i and the earlier chained entries of its own origin.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 6
    num_heads: int = 8
    num_kv_heads: int = 4
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    dropout: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def rope_tables(cfg: TinyConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [len(positions), head_dim] in the Hugging Face Llama (rotate-half) layout."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32,
                                                      device=positions.device) / d))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rot * sin).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, hd
        self.q_proj = nn.Linear(h, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, h, bias=False)

    def forward(self, x, cos, sin, past_kv=None, mask=None):
        """x [B,T,H]; past_kv: keys/values [B,nkv,S,hd] placed before this call's; mask [T,S+T]
        (True = may attend) or None for plain causal. Returns (out, (k, v) of this call)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        new_kv = (k, v)
        if past_kv is not None:
            k, v = torch.cat([past_kv[0], k], dim=2), torch.cat([past_kv[1], v], dim=2)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), new_kv


class MLP(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, cos, sin, past_kv=None, mask=None):
        a, kv = self.self_attn(self.input_layernorm(x), cos, sin, past_kv, mask)
        x = x + self.drop(a)
        return x + self.drop(self.mlp(self.post_attention_layernorm(x))), kv


class Backbone(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTP(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = DecoderLayer(cfg)


def chain_mask(t: int, level: int, device) -> torch.Tensor:
    """[t, level*t] bool: a level-`level` entry of origin i sees level-1 entries of origins <= i
    and entries of levels 2..level of origin i (keys laid out level by level)."""
    idx = torch.arange(t, device=device)
    blocks = [idx[None, :] <= idx[:, None]] + [idx[None, :] == idx[:, None]] * (level - 1)
    return torch.cat(blocks, dim=1)


class TinyLM(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.mtp = MTP(cfg)
        self.apply(self._init)
        scale = 0.02 / math.sqrt(2 * (cfg.num_layers + 1))
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=scale)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Shared final norm and tied LM head, on pre-norm hidden states."""
        return F.linear(self.model.norm(x), self.model.embed_tokens.weight)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """Target's last-layer residual stream (before the final norm) for ids [B,T]."""
        cos, sin = rope_tables(self.cfg, torch.arange(ids.shape[1], device=ids.device))
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x, _ = layer(x, cos, sin)
        return x

    def mtp_levels(self, h: torch.Tensor, level_ids, depth: int) -> list[torch.Tensor]:
        """MTP outputs o (pre-norm, [B,T,H]) for levels 1..depth over origins 0..T-1.

        `level_ids(m, prev_o)` gives the [B,T] token ids that level m reads at each origin
        (t_{i+m} when teacher-forced; the argmax of `prev_o`'s logits when drafting)."""
        mtp, t = self.mtp, h.shape[1]
        outs, kvs, prev = [], None, h
        for m in range(1, depth + 1):
            pos = torch.arange(m - 1, m - 1 + t, device=h.device)
            cos, sin = rope_tables(self.cfg, pos)
            e = mtp.enorm(self.model.embed_tokens(level_ids(m, prev)))
            x = mtp.eh_proj(torch.cat([e, mtp.hnorm(prev)], dim=-1))
            mask = None if m == 1 else chain_mask(t, m, h.device)
            o, kv = mtp.layer(x, cos, sin, past_kv=kvs, mask=mask)
            kvs = kv if kvs is None else (torch.cat([kvs[0], kv[0]], 2), torch.cat([kvs[1], kv[1]], 2))
            outs.append(o)
            prev = o
        return outs

    def forward(self, rows: torch.Tensor, seq_len: int, depth: int):
        """rows [B, seq_len+depth+1] token ids. Returns (LM loss, [MTP loss per level])."""
        ids = rows[:, :seq_len]
        h = self.hidden(ids)
        lm = F.cross_entropy(self.logits(h).flatten(0, 1).float(), rows[:, 1:seq_len + 1].flatten())
        outs = self.mtp_levels(h, lambda m, _: rows[:, m:m + seq_len], depth)
        mtp = [F.cross_entropy(self.logits(o).flatten(0, 1).float(),
                               rows[:, m + 1:m + 1 + seq_len].flatten())
               for m, o in enumerate(outs, start=1)]
        return lm, mtp
