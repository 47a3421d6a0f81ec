"""Multi-query attention with rotary embeddings, written the way Hugging Face's Falcon-7B (modeling_falcon.py, eager path) writes it.

Style: ``FalconAttention(config)``; the file defines its own ``FalconConfig`` dataclass with defaults (hidden_size,
num_attention_heads, multi_query, bias, rope_theta, attention_dropout). With multi_query, one fused
``query_key_value`` Linear gives H query heads and a single key and value head, viewed (B, T, H + 2, D) and split
as [..., :-2, :], [..., [-2], :], [..., [-1], :]. The heads are folded into the batch, (B*H, T, D) and (B, T, D),
for the rotary map (rotate_half on the whole head, from an ``inv_freq`` float32 buffer), then unfolded; the one
K/V head broadcasts over the query heads. ``forward(hidden_states, attention_mask=None)``: attention_mask is bool
(B, 1, T, T) with True = masked, built by the caller (causal, padding), turned into an additive -1e9.

Mistake: none.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

EXPECTED = "pass"
TARGET = "FalconAttention"
STYLE = "falcon"
CALL = "forward(hidden_states, attention_mask=None): attention_mask bool (B,1,T,T) True = masked, built by the caller, made additive -1e9; multi-query fused query_key_value (B,T,H+2,D); rotary (rotate_half) inside on the folded (B*H,T,D) q and k"


@dataclass
class FalconConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    multi_query: bool = True
    bias: bool = False
    rope_theta: float = 10000.0
    attention_dropout: float = 0.0


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class FalconRotaryEmbedding(nn.Module):
    """Rotary positional embeddings for q and k laid out (batch * heads, seq_len, head_dim)."""

    def __init__(self, head_dim: int, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, seq_len: int, dtype: torch.dtype, device="cpu"):
        t = torch.arange(seq_len, device=device, dtype=self.inv_freq.dtype)
        freqs = torch.einsum("i,j->ij", t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # (seq_len, head_dim)
        return emb.cos()[None, :, :].to(dtype), emb.sin()[None, :, :].to(dtype)

    def forward(self, query, key):
        batch, seq_len, head_dim = query.shape
        cos, sin = self.cos_sin(seq_len, query.dtype, query.device)
        return (query * cos) + (rotate_half(query) * sin), (key * cos) + (rotate_half(key) * sin)


class FalconAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.multi_query = config.multi_query
        self.num_kv_heads = 1 if config.multi_query else self.num_heads

        self.maybe_rotary = FalconRotaryEmbedding(self.head_dim, base=config.rope_theta)
        qkv_out_dim = self.hidden_size + 2 * self.head_dim if config.multi_query else 3 * self.hidden_size
        self.query_key_value = nn.Linear(self.hidden_size, qkv_out_dim, bias=config.bias)
        self.dense = nn.Linear(self.hidden_size, self.hidden_size, bias=config.bias)
        self.attention_dropout = nn.Dropout(config.attention_dropout)

    def _split_heads(self, fused_qkv: torch.Tensor):
        """(batch, seq_length, (num_heads + 2) * head_dim) -> q (batch, seq_length, num_heads, head_dim), k and v
        (batch, seq_length, 1, head_dim)."""
        batch_size, seq_length, _ = fused_qkv.shape
        if not self.multi_query:
            fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads, 3, self.head_dim)
            return fused_qkv[..., 0, :], fused_qkv[..., 1, :], fused_qkv[..., 2, :]
        fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads + 2, self.head_dim)
        return fused_qkv[..., :-2, :], fused_qkv[..., [-2], :], fused_qkv[..., [-1], :]

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None):
        fused_qkv = self.query_key_value(hidden_states)  # [batch_size, seq_length, 3 x hidden_size]
        (query_layer, key_layer, value_layer) = self._split_heads(fused_qkv)
        batch_size, query_length, _, _ = query_layer.shape

        query_layer = query_layer.transpose(1, 2).reshape(batch_size * self.num_heads, query_length, self.head_dim)
        key_layer = key_layer.transpose(1, 2).reshape(batch_size * self.num_kv_heads, query_length, self.head_dim)
        value_layer = value_layer.transpose(1, 2).reshape(batch_size * self.num_kv_heads, query_length, self.head_dim)

        query_layer, key_layer = self.maybe_rotary(query_layer, key_layer)

        query_layer_ = query_layer.reshape(batch_size, self.num_heads, -1, self.head_dim)
        key_layer_ = key_layer.reshape(batch_size, self.num_kv_heads, -1, self.head_dim)
        value_layer_ = value_layer.reshape(batch_size, self.num_kv_heads, -1, self.head_dim)

        attention_scores = query_layer_ @ key_layer_.transpose(-1, -2)  # (B, H, T, S): one K head for all
        attention_scores /= math.sqrt(self.head_dim)
        if attention_mask is not None:
            attention_mask_float = (attention_mask * 1.0).masked_fill(attention_mask, float("-1e9"))
            attention_scores = attention_scores + attention_mask_float.to(attention_scores.dtype)

        attention_probs = F.softmax(attention_scores, dim=-1)
        attention_probs = self.attention_dropout(attention_probs)
        attn_output = attention_probs @ value_layer_  # (B, H, T, D)
        attn_output = attn_output.transpose(1, 2).reshape(batch_size, query_length, self.num_heads * self.head_dim)
        return self.dense(attn_output)
