"""Attention with partial rotary embeddings, written the way Hugging Face's GPT-NeoX (modeling_gpt_neox.py) writes it (the style: see neox_correct.py).

Mistake: none. Repaired twin of neox_rotary_q_only.py: the same code with that one mistake fixed
(key = torch.cat((apply_rotary_pos_emb(key_rot, cos, sin), key_pass), dim=-1)).
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

EXPECTED = "pass"
TARGET = "GPTNeoXAttention"
STYLE = "neox"
CALL = "forward(hidden_states, attention_mask=None): always causal (tril buffer); attention_mask HF extended additive (B,1,1|T,T) 0 keep / finfo.min blocked; query_key_value per head (B,T,H,3*D); rotary (rotate_half) on the first D*rotary_pct features of q and k; returns (output, weights)"


@dataclass
class GPTNeoXConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    rotary_pct: float = 0.5
    rotary_emb_base: int = 10000
    max_position_embeddings: int = 64
    attention_dropout: float = 0.0
    attention_bias: bool = True


def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(x, cos, sin):
    """x (B, H, T, rotary_ndims); cos/sin (T, rotary_ndims)."""
    return (x * cos) + (rotate_half(x) * sin)


class GPTNeoXRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, seq_len):
        t = torch.arange(seq_len, device=x.device, dtype=self.inv_freq.dtype)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, rotary_ndims)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class GPTNeoXAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_attention_heads = config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.head_size = self.hidden_size // self.num_attention_heads
        self.rotary_ndims = int(self.head_size * config.rotary_pct)
        max_positions = config.max_position_embeddings
        self.register_buffer(
            "bias",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(
                1, 1, max_positions, max_positions
            ),
            persistent=False,
        )
        self.rotary_emb = GPTNeoXRotaryEmbedding(self.rotary_ndims, base=config.rotary_emb_base)
        self.norm_factor = math.sqrt(self.head_size)
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.attention_bias)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)
        self.attention_dropout = nn.Dropout(config.attention_dropout)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None):
        # Compute QKV: [batch, seq_len, (np * 3 * head_size)] -> [batch, seq_len, np, 3 * head_size]
        qkv = self.query_key_value(hidden_states)
        new_qkv_shape = qkv.size()[:-1] + (self.num_attention_heads, 3 * self.head_size)
        qkv = qkv.view(*new_qkv_shape)

        # [batch, seq_len, num_attention_heads, 3 * head_size] -> 3 [batch, num_attention_heads, seq_len, head_size]
        query = qkv[..., : self.head_size].permute(0, 2, 1, 3)
        key = qkv[..., self.head_size : 2 * self.head_size].permute(0, 2, 1, 3)
        value = qkv[..., 2 * self.head_size :].permute(0, 2, 1, 3)

        # Compute rotary embeddings on rotary_ndims
        query_rot = query[..., : self.rotary_ndims]
        query_pass = query[..., self.rotary_ndims :]
        key_rot = key[..., : self.rotary_ndims]
        key_pass = key[..., self.rotary_ndims :]

        cos, sin = self.rotary_emb(value, seq_len=key.shape[-2])
        query = torch.cat((apply_rotary_pos_emb(query_rot, cos, sin), query_pass), dim=-1)
        key = torch.cat((apply_rotary_pos_emb(key_rot, cos, sin), key_pass), dim=-1)

        attn_output, attn_weights = self._attn(query, key, value, attention_mask)

        # [batch, num_attention_heads, seq_len, head_size] -> [batch, seq_len, hidden_size]
        attn_output = attn_output.permute(0, 2, 1, 3).contiguous()
        attn_output = attn_output.view(attn_output.size(0), attn_output.size(1), self.hidden_size)
        attn_output = self.dense(attn_output)
        return attn_output, attn_weights

    def _attn(self, query, key, value, attention_mask=None):
        batch_size, num_attention_heads, query_length, attn_head_size = query.size()
        key_length = key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]

        attn_scores = torch.matmul(query, key.transpose(-1, -2)) / self.norm_factor
        mask_value = torch.finfo(attn_scores.dtype).min
        mask_value = torch.tensor(mask_value, dtype=attn_scores.dtype, device=attn_scores.device)
        attn_scores = torch.where(causal_mask, attn_scores, mask_value)

        if attention_mask is not None:
            attn_scores = attn_scores + attention_mask

        attn_weights = F.softmax(attn_scores, dim=-1)
        attn_weights = self.attention_dropout(attn_weights)
        attn_output = torch.matmul(attn_weights, value)
        return attn_output, attn_weights
