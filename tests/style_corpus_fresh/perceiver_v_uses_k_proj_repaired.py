"""Cross-attention written the way Hugging Face's Perceiver (transformers/models/perceiver/modeling_perceiver.py) writes its PerceiverSelfAttention, with the output dense of PerceiverSelfOutput folded in (the style: see perceiver_correct.py).

Mistake: none. Repaired twin of perceiver_v_uses_k_proj.py: the same code with that one mistake fixed
(values = self.value(inputs)).
"""

import math
from typing import Optional

import torch
from torch import nn

EXPECTED = "pass"
TARGET = "PerceiverAttention"
STYLE = "perceiver"
CALL = "forward(hidden_states, inputs=None, inputs_mask=None): hidden_states (B,N,q_dim) latents as queries; inputs (B,M,kv_dim) keys and values, self-attention when None; inputs_mask (B,M) 1 = real input, made additive finfo.min"


def invert_attention_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, M) with 1 = keep -> (B, 1, 1, M) additive: 0 to keep, the dtype's minimum to drop."""
    extended = mask[:, None, None, :].to(dtype)
    return (1.0 - extended) * torch.finfo(dtype).min


class PerceiverAttention(nn.Module):
    def __init__(self, q_dim, kv_dim=None, qk_channels=None, v_channels=None, num_heads=1, dropout=0.0):
        super().__init__()
        kv_dim = q_dim if kv_dim is None else kv_dim
        # Q and K must have the same number of channels; V defaults to the same
        if qk_channels is None:
            qk_channels = q_dim
        if v_channels is None:
            v_channels = qk_channels
        if qk_channels % num_heads != 0:
            raise ValueError(f"qk_channels ({qk_channels}) must be divisible by num_heads ({num_heads}).")
        if v_channels % num_heads != 0:
            raise ValueError(f"v_channels ({v_channels}) must be divisible by num_heads ({num_heads}).")

        self.qk_channels = qk_channels
        self.v_channels = v_channels
        self.num_heads = num_heads
        self.qk_channels_per_head = self.qk_channels // num_heads
        self.v_channels_per_head = self.v_channels // num_heads

        self.query = nn.Linear(q_dim, qk_channels)
        self.key = nn.Linear(kv_dim, qk_channels)
        self.value = nn.Linear(kv_dim, v_channels)
        self.dropout = nn.Dropout(dropout)
        self.dense = nn.Linear(v_channels, q_dim)

    def transpose_for_scores(self, x, channels_per_head):
        new_x_shape = x.size()[:-1] + (self.num_heads, channels_per_head)
        x = x.view(*new_x_shape)
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states, inputs: Optional[torch.Tensor] = None, inputs_mask: Optional[torch.Tensor] = None):
        is_cross_attention = inputs is not None
        queries = self.query(hidden_states)

        if is_cross_attention:
            keys = self.key(inputs)
            values = self.value(inputs)
            attention_mask = inputs_mask
        else:
            keys = self.key(hidden_states)
            values = self.value(hidden_states)
            attention_mask = None

        queries = self.transpose_for_scores(queries, self.qk_channels_per_head)
        keys = self.transpose_for_scores(keys, self.qk_channels_per_head)
        values = self.transpose_for_scores(values, self.v_channels_per_head)

        # Take the dot product between the queries and keys to get the raw attention scores.
        attention_scores = torch.matmul(queries, keys.transpose(-1, -2))

        batch_size, num_heads, seq_len, q_head_dim = queries.shape
        attention_scores = attention_scores / math.sqrt(q_head_dim)

        if attention_mask is not None:
            attention_scores = attention_scores + invert_attention_mask(attention_mask, attention_scores.dtype)

        # Normalize the attention scores to probabilities.
        attention_probs = nn.Softmax(dim=-1)(attention_scores)
        attention_probs = self.dropout(attention_probs)

        context_layer = torch.matmul(attention_probs, values)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.v_channels,)
        context_layer = context_layer.view(*new_context_layer_shape)
        return self.dense(context_layer)
