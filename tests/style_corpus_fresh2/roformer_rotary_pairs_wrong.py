"""Self-attention with interleaved rotary on every head feature, written the way Hugging Face's RoFormer (modeling_roformer.py) writes it (the style: see roformer_correct.py).

Mistake: q and k are turned by halves (``chunk(2)``: feature i against i + D/2) while sin and cos are doubled per
adjacent pair: each feature turns against a partner of another angle.
Line: rotate_half_query_layer = torch.cat([-q2, q1], dim=-1)
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

EXPECTED = "rotary_pairs_wrong"
TARGET = "RoFormerSelfAttention"
STYLE = "roformer"
CALL = "forward(hidden_states, attention_mask=None): not causal; attention_mask HF extended additive (B,1,1,T) 0 keep / finfo.min padding; rotary on adjacent pairs of every head feature (sin and cos halves of a fixed sinusoidal embedding, each doubled by stack+reshape); returns (context, probs)"


@dataclass
class RoFormerConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    max_position_embeddings: int = 64
    attention_probs_dropout_prob: float = 0.0
    rotary_value: bool = False


class RoFormerSinusoidalPositionalEmbedding(nn.Embedding):
    """A fixed table: row ``pos`` holds sin(pos * w_i) for every pair i, then cos(pos * w_i) for every pair i."""

    def __init__(self, num_positions: int, embedding_dim: int) -> None:
        super().__init__(num_positions, embedding_dim)
        self.weight = self._init_weight(self.weight)

    @staticmethod
    def _init_weight(out: nn.Parameter) -> nn.Parameter:
        n_pos, dim = out.shape
        pos = torch.arange(n_pos, dtype=torch.float64)[:, None]
        inv = 1.0 / torch.pow(10000.0, torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # one per pair
        angle = pos * inv[None, :]  # (n_pos, dim // 2)
        out.requires_grad = False
        sentinel = dim // 2
        out[:, 0:sentinel] = torch.sin(angle).to(out.dtype)
        out[:, sentinel:] = torch.cos(angle).to(out.dtype)
        out.detach_()
        return out

    @torch.no_grad()
    def forward(self, seq_len: int, past_key_values_length: int = 0) -> torch.Tensor:
        positions = torch.arange(
            past_key_values_length, past_key_values_length + seq_len, dtype=torch.long, device=self.weight.device
        )
        return super().forward(positions)


class RoFormerSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size

        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.output_dense = nn.Linear(self.all_head_size, config.hidden_size)

        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.rotary_value = config.rotary_value
        self.embed_positions = RoFormerSinusoidalPositionalEmbedding(
            config.max_position_embeddings, self.attention_head_size
        )

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.view(*new_x_shape)
        return x.permute(0, 2, 1, 3)

    @staticmethod
    def apply_rotary_position_embeddings(sinusoidal_pos, query_layer, key_layer, value_layer=None):
        # sin [batch_size, num_heads, sequence_length, embed_size_per_head//2]
        # cos [batch_size, num_heads, sequence_length, embed_size_per_head//2]
        sin, cos = sinusoidal_pos.chunk(2, dim=-1)
        # sin [θ0,θ1,θ2......θd/2-1] -> sin_pos [θ0,θ0,θ1,θ1,θ2,θ2......θd/2-1,θd/2-1]
        sin_pos = torch.stack([sin, sin], dim=-1).reshape_as(sinusoidal_pos)
        cos_pos = torch.stack([cos, cos], dim=-1).reshape_as(sinusoidal_pos)
        # rotate_half_query_layer [-q1,q0,-q3,q2......,-qd-1,qd-2]
        q1, q2 = query_layer.chunk(2, dim=-1)
        rotate_half_query_layer = torch.cat([-q2, q1], dim=-1)
        query_layer = query_layer * cos_pos + rotate_half_query_layer * sin_pos
        k1, k2 = key_layer.chunk(2, dim=-1)
        rotate_half_key_layer = torch.cat([-k2, k1], dim=-1)
        key_layer = key_layer * cos_pos + rotate_half_key_layer * sin_pos
        if value_layer is not None:
            rotate_half_value_layer = torch.stack([-value_layer[..., 1::2], value_layer[..., ::2]], dim=-1).reshape_as(
                value_layer
            )
            value_layer = value_layer * cos_pos + rotate_half_value_layer * sin_pos
            return query_layer, key_layer, value_layer
        return query_layer, key_layer

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None):
        mixed_query_layer = self.query(hidden_states)
        query_layer = self.transpose_for_scores(mixed_query_layer)
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))

        # [sequence_length, embed_size_per_head] -> [1, 1, sequence_length, embed_size_per_head]
        sinusoidal_pos = self.embed_positions(hidden_states.shape[1])[None, None, :, :].to(query_layer.dtype)
        if self.rotary_value:
            query_layer, key_layer, value_layer = self.apply_rotary_position_embeddings(
                sinusoidal_pos, query_layer, key_layer, value_layer
            )
        else:
            query_layer, key_layer = self.apply_rotary_position_embeddings(sinusoidal_pos, query_layer, key_layer)

        # Take the dot product between "query" and "key" to get the raw attention scores.
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            # the extended mask (precomputed for all layers in the model's forward)
            attention_scores = attention_scores + attention_mask

        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = self.dropout(attention_probs)

        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        context_layer = context_layer.view(*new_context_layer_shape)
        return self.output_dense(context_layer), attention_probs
