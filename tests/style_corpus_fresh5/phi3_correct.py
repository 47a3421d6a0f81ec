"""Grouped-query self-attention written the way Microsoft's Phi-3 (transformers, modeling_phi3.py) writes it.

Style: ``Phi3Attention(hidden_size, num_heads, num_key_value_heads, attention_dropout=0.0)``; one bias-free ``qkv_proj`` of ``H * D + 2 * G * D`` rows, sliced by position: the H query heads first, then the G key heads, then the G value heads; ``repeat_kv`` by expand and reshape; an additive ``attention_mask``; the softmax in float32 (``dtype=torch.float32``); returns (output, weights).

Mistake: none.
"""

import math

import torch
from torch import nn

EXPECTED = "pass"
TARGET = "Phi3Attention"
STYLE = "phi3"
CALL = "forward(hidden_states, attention_mask=None): attention_mask additive (B,1,T,T); G = num_key_value_heads; returns (out, weights)"


def repeat_kv(x, n_rep):
    b, g, t, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, g, n_rep, t, d).reshape(b, g * n_rep, t, d)


class Phi3Attention(nn.Module):
    def __init__(self, hidden_size, num_heads, num_key_value_heads, attention_dropout=0.0):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.num_key_value_heads = num_key_value_heads
        self.num_key_value_groups = num_heads // num_key_value_heads
        self.attention_dropout = attention_dropout
        op_size = self.num_heads * self.head_dim + 2 * (self.num_key_value_heads * self.head_dim)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.qkv_proj = nn.Linear(self.hidden_size, op_size, bias=False)

    def forward(self, hidden_states, attention_mask=None):
        bsz, q_len, _ = hidden_states.size()
        qkv = self.qkv_proj(hidden_states)
        query_pos = self.num_heads * self.head_dim
        query_states = qkv[..., :query_pos]
        key_states = qkv[..., query_pos : query_pos + self.num_key_value_heads * self.head_dim]
        value_states = qkv[..., query_pos + self.num_key_value_heads * self.head_dim :]
        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(value_states.dtype)
        attn_weights = nn.functional.dropout(attn_weights, p=self.attention_dropout, training=self.training)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), attn_weights
