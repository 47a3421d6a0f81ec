"""Causal self-attention with ALiBi, written the way Hugging Face's BLOOM (modeling_bloom.py) writes it.

Style: ``BloomAttention(config)``; the file defines its own ``BloomConfig`` dataclass with defaults (hidden_size,
n_head, attention_dropout). One fused ``query_key_value`` Linear laid out per head: (B, T, H, 3, D), split by
``_split_heads``. No rotary: ALiBi biases the scores instead. The module builds the bias itself from its 2D
padding mask (BLOOM's model builds it once and hands it in): per head a slope from the geometric sequence
2^(-8/H), 2^(-16/H), ..., times each key's position (cumsum of the mask - 1), shape (B * H, 1, T), so that with
softmax's shift invariance each query sees -slope * distance. ``torch.baddbmm(alibi, q, k^T, beta=1.0,
alpha=1/sqrt(D))`` adds the bias to the scaled scores in one call. Always causal: the (B, 1, T, T) bool mask
(True = blocked: future keys and padded keys) is filled with finfo.min. ``forward(hidden_states,
attention_mask=None)`` takes the HF 2D padding mask (B, T), 1 = keep, 0 = padding. Returns (output, weights).

Mistake: none.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

EXPECTED = "pass"
TARGET = "BloomAttention"
STYLE = "bloom"
CALL = "forward(hidden_states, attention_mask=None): always causal; attention_mask HF 2D (B,T) 1 keep / 0 padding; ALiBi bias by key position through baddbmm(beta=1, alpha=1/sqrt(D)); query_key_value per head (B,T,H,3,D); returns (output, weights)"
POSITIONS = "alibi"


@dataclass
class BloomConfig:
    hidden_size: int = 32
    n_head: int = 4
    attention_dropout: float = 0.0


def build_alibi_tensor(attention_mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    batch_size, seq_length = attention_mask.shape
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), dtype=torch.float32)
    powers = torch.arange(1, 1 + closest_power_of_2, dtype=torch.int32)
    slopes = torch.pow(base, powers)
    if closest_power_of_2 != num_heads:
        extra_base = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest_power_of_2) - 3))), dtype=torch.float32)
        num_remaining_heads = min(closest_power_of_2, num_heads - closest_power_of_2)
        extra_powers = torch.arange(1, 1 + 2 * num_remaining_heads, 2, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra_base, extra_powers)], dim=0)
    # each key's position among the real tokens (padding keys get 0: they are masked anyway)
    arange_tensor = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None].to(attention_mask.device) * arange_tensor
    return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)


class BloomAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.n_head
        self.head_dim = self.hidden_size // self.num_heads
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.beta = 1.0
        self.query_key_value = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=True)
        self.dense = nn.Linear(self.hidden_size, self.hidden_size)
        self.attention_dropout = nn.Dropout(config.attention_dropout)

    def _split_heads(self, fused_qkv: torch.Tensor):
        batch_size, seq_length, three_times_hidden_size = fused_qkv.shape
        fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads, 3, self.head_dim)
        return fused_qkv[..., 0, :], fused_qkv[..., 1, :], fused_qkv[..., 2, :]

    def _merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        # batch_size * num_heads, seq_length, head_dim -> batch_size, seq_length, num_heads * head_dim
        batch_size_and_num_heads, seq_length, _ = x.shape
        batch_size = batch_size_and_num_heads // self.num_heads
        x = x.view(batch_size, self.num_heads, seq_length, self.head_dim)
        x = x.permute(0, 2, 1, 3)
        return x.reshape(batch_size, seq_length, self.num_heads * self.head_dim)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None):
        batch_size, q_length, _ = hidden_states.shape
        if attention_mask is None:
            attention_mask = torch.ones(batch_size, q_length, dtype=torch.long, device=hidden_states.device)
        alibi = build_alibi_tensor(attention_mask, self.num_heads, hidden_states.dtype)
        causal_mask = torch.triu(torch.ones(q_length, q_length, dtype=torch.bool, device=hidden_states.device), 1)
        blocked = causal_mask[None, None] | (attention_mask[:, None, None, :] == 0)

        fused_qkv = self.query_key_value(hidden_states)  # [batch_size, seq_length, 3 x hidden_size]
        query_layer, key_layer, value_layer = self._split_heads(fused_qkv)
        query_layer = query_layer.transpose(1, 2).reshape(batch_size * self.num_heads, q_length, self.head_dim)
        key_layer = key_layer.permute(0, 2, 3, 1).reshape(batch_size * self.num_heads, self.head_dim, q_length)
        value_layer = value_layer.transpose(1, 2).reshape(batch_size * self.num_heads, q_length, self.head_dim)

        # [batch_size * num_heads, q_length, kv_length]
        matmul_result = alibi.baddbmm(
            batch1=query_layer,
            batch2=key_layer,
            beta=self.beta,
            alpha=self.inv_norm_factor,
        )
        attention_scores = matmul_result.view(batch_size, self.num_heads, q_length, -1)
        attn_weights = torch.masked_fill(attention_scores, blocked, torch.finfo(attention_scores.dtype).min)
        attention_probs = F.softmax(attn_weights, dim=-1).to(value_layer.dtype)
        attention_probs = self.attention_dropout(attention_probs)

        attention_probs_reshaped = attention_probs.view(batch_size * self.num_heads, q_length, -1)
        context_layer = torch.bmm(attention_probs_reshaped, value_layer)
        context_layer = self._merge_heads(context_layer)
        output_tensor = self.dense(context_layer)
        return output_tensor, attention_probs
