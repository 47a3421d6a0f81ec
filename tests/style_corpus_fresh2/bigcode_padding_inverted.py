"""Causal multi-query attention, written the way Hugging Face's GPTBigCode / StarCoder (modeling_gpt_bigcode.py) writes it (the style: see bigcode_correct.py).

Mistake: the 2D padding mask is read the other way round (0 taken as keep): real keys are hidden and padding is attended.
Line: causal = causal & (attention_mask[:, None, :] == 0)  # (B, T, S)
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

EXPECTED = "padding_inverted"
TARGET = "GPTBigCodeAttention"
STYLE = "bigcode"
CALL = "forward(hidden_states, attention_mask=None): always causal (tril bias buffer); attention_mask HF 2D (B,T) 1 keep / 0 padding; multi-query: c_attn gives H query heads, one key head and one value head; returns (output, weights)"


@dataclass
class GPTBigCodeConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    multi_query: bool = True
    max_position_embeddings: int = 64
    attn_pdrop: float = 0.0
    scale_attn_weights: bool = True


class GPTBigCodeAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.multi_query = config.multi_query
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.kv_heads = 1 if self.multi_query else self.num_heads
        self.kv_dim = self.kv_heads * self.head_dim
        self.scale_attn_weights = config.scale_attn_weights
        max_positions = config.max_position_embeddings
        self.register_buffer(
            "bias", torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)), persistent=False
        )
        self.c_attn = nn.Linear(self.embed_dim, self.embed_dim + 2 * self.kv_dim)
        self.c_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)

    def _attn(self, query, key, value, attention_mask=None):
        dtype = query.dtype
        softmax_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        mask_value = torch.finfo(softmax_dtype).min
        scale_factor = 1.0
        if self.scale_attn_weights:
            scale_factor /= self.head_dim**0.5

        # MQA models: (batch_size, query_length, num_heads * head_dim)
        # MHA models: (batch_size, num_heads, query_length, head_dim)
        query_shape = query.shape
        batch_size = query_shape[0]
        key_length = key.size(-1)
        if self.multi_query:
            # (batch_size, query_length, num_heads, head_dim) x (batch_size, head_dim, key_length)
            # -> (batch_size, query_length, num_heads, key_length)
            query_length = query_shape[1]
            attn_shape = (batch_size, query_length, self.num_heads, key_length)
            attn_view = (batch_size, query_length * self.num_heads, key_length)
            # No copy needed for MQA 2, or when layer_past is provided.
            query = query.reshape(batch_size, query_length * self.num_heads, self.head_dim)
        else:
            query_length = query_shape[2]
            attn_shape = (batch_size, self.num_heads, query_length, key_length)
            attn_view = (batch_size * self.num_heads, query_length, key_length)
            query = query.reshape(batch_size * self.num_heads, query_length, self.head_dim)
            key = key.reshape(batch_size * self.num_heads, self.head_dim, key_length)

        attn_weights = torch.empty(attn_view, device=query.device, dtype=query.dtype)
        attn_weights = torch.baddbmm(attn_weights, query, key, beta=0, alpha=scale_factor).view(attn_shape)

        causal = self.bias[None, key_length - query_length : key_length, :key_length]  # (1, T, S)
        if attention_mask is not None:
            causal = causal & (attention_mask[:, None, :] == 0)  # (B, T, S)
        mask = causal.unsqueeze(2) if self.multi_query else causal.unsqueeze(1)
        attn_weights = torch.where(mask, attn_weights, mask_value)

        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = self.attn_dropout(attn_weights)

        if self.multi_query:
            attn_output = torch.bmm(attn_weights.view(attn_view), value).view(query_shape)
        else:
            attn_output = torch.matmul(attn_weights, value)
        return attn_output, attn_weights

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None):
        if self.multi_query:
            query, key_value = self.c_attn(hidden_states).split((self.embed_dim, 2 * self.kv_dim), dim=2)
        else:
            query, key_value = (
                self.c_attn(hidden_states)
                .view(*hidden_states.shape[:2], self.num_heads, 3 * self.head_dim)
                .transpose(1, 2)
                .split((self.head_dim, 2 * self.head_dim), dim=3)
            )
        key, value = key_value.split((self.head_dim, self.head_dim), dim=-1)

        attn_output, attn_weights = self._attn(query, key.transpose(-1, -2), value, attention_mask)
        if not self.multi_query:
            attn_output = attn_output.transpose(1, 2)
        attn_output = attn_output.reshape(hidden_states.shape)
        attn_output = self.c_proj(attn_output)
        return attn_output, attn_weights
