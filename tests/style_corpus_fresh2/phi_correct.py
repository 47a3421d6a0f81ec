"""Causal self-attention with partial rotary, written the way Hugging Face's Phi / Phi-2 (modeling_phi.py) writes it.

Style: ``PhiAttention(config, layer_idx=0)``; the file defines its own ``PhiConfig`` dataclass with defaults
(hidden_size, num_attention_heads, partial_rotary_factor, rope_theta, attention_dropout,
max_position_embeddings). Separate ``q_proj``, ``k_proj``, ``v_proj`` (with bias) and a ``dense`` output. A
``PhiRotaryEmbedding`` computes cos/sin (halves layout, ``rotate_half``) for rotary_ndims = D *
partial_rotary_factor features; q and k are split into a rotated part and a pass-through part, rotated, and
concatenated back. Scores are upcast to float32 (kept in float64 when given float64), divided by sqrt(D), an
additive causal mask (B, 1, T, T) of finfo.min is added (built from ``attention_mask``, the HF 2D padding mask,
when none is given), softmax over keys, times V. ``forward(hidden_states, attention_mask=None,
position_ids=None)``; returns (output, weights).

Mistake: none.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

EXPECTED = "pass"
TARGET = "PhiAttention"
STYLE = "phi"
CALL = "forward(hidden_states, attention_mask=None, position_ids=None): always causal; attention_mask HF 2D (B,T) 1 keep / 0 padding; rotary (rotate_half) on the first D*partial_rotary_factor features of q and k; returns (output, weights)"


@dataclass
class PhiConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    partial_rotary_factor: float = 0.5
    rope_theta: float = 10000.0
    attention_dropout: float = 0.0
    max_position_embeddings: int = 64


def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class PhiRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


class PhiAttention(nn.Module):
    def __init__(self, config, layer_idx: Optional[int] = None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.rotary_ndims = int(config.partial_rotary_factor * self.head_dim)
        self.attention_dropout = config.attention_dropout

        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.dense = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=True)
        self.rotary_emb = PhiRotaryEmbedding(self.rotary_ndims, base=config.rope_theta)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
    ):
        bsz, q_len, _ = hidden_states.size()

        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)

        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)

        if position_ids is None:
            position_ids = torch.arange(q_len, device=hidden_states.device)[None].expand(bsz, -1)
        cos, sin = self.rotary_emb(value_states, position_ids)

        # Partial rotary embedding
        query_rot, query_pass = query_states[..., : self.rotary_ndims], query_states[..., self.rotary_ndims :]
        key_rot, key_pass = key_states[..., : self.rotary_ndims], key_states[..., self.rotary_ndims :]
        query_rot, key_rot = apply_rotary_pos_emb(query_rot, key_rot, cos, sin)
        query_states = torch.cat((query_rot, query_pass), dim=-1)
        key_states = torch.cat((key_rot, key_pass), dim=-1)

        # Queries and keys upcast to fp32 to avoid overflow
        upcast = torch.float64 if query_states.dtype == torch.float64 else torch.float32
        attn_weights = torch.matmul(query_states.to(upcast), key_states.to(upcast).transpose(2, 3)) / math.sqrt(
            self.head_dim
        )

        min_value = torch.finfo(attn_weights.dtype).min
        causal = torch.full((q_len, q_len), min_value, dtype=attn_weights.dtype, device=attn_weights.device)
        causal_mask = torch.triu(causal, diagonal=1)[None, None].expand(bsz, 1, q_len, q_len)
        if attention_mask is not None:
            padding = (1.0 - attention_mask[:, None, None, :].to(attn_weights.dtype)) * min_value
            causal_mask = torch.maximum(causal_mask + padding, torch.tensor(min_value, dtype=attn_weights.dtype))
        attn_weights = attn_weights + causal_mask

        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=upcast).to(value_states.dtype)
        attn_weights = nn.functional.dropout(attn_weights, p=self.attention_dropout, training=self.training)

        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(bsz, q_len, self.hidden_size)
        attn_output = self.dense(attn_output)
        return attn_output, attn_weights
